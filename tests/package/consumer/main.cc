// The smallest program on the installed C++ client: connect to a server, ask GetInfo, score a few
// rows of the default head. Usage: lce_consumer HOST:PORT [ROWS]. Prints the client's and the
// server's versions and each row's logprob and entropy; exits 1 on any failure.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <random>
#include <vector>

#include "lce/client/lce_client.h"

namespace v1 = lce::v1;

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: lce_consumer HOST:PORT [ROWS]\n";
    return 2;
  }
  const int64_t rows = argc > 2 ? std::atoll(argv[2]) : 4;
  auto client = lce::client::LceClient::Create({.target = argv[1]});
  if (!client.ok()) {
    std::cerr << "connect: " << client.status() << "\n";
    return 1;
  }
  absl::StatusOr<v1::GetInfoResponse> info = (*client)->GetInfo();
  if (!info.ok()) {
    std::cerr << "GetInfo: " << info.status() << "\n";
    return 1;
  }
  const v1::HeadDescription& head = info->head();
  std::cout << "client " << lce::client::Version() << ", server " << info->server_version() << ", head '" << head.name()
            << "' " << head.vocab_size() << "x" << head.hidden_size() << "\n";

  // fp32 rows of N(0, 1), sent in the head's dtype: bf16 keeps an fp32's upper half.
  std::mt19937 gen(1);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(head.vocab_size() - 1));
  const bool bf16 = head.dtype() == v1::DTYPE_BFLOAT16;
  const size_t element = bf16 ? 2 : 4;
  if (!bf16 && head.dtype() != v1::DTYPE_FLOAT32) {
    std::cerr << "this example sends bf16 or fp32 rows; the head is " << v1::DType_Name(head.dtype()) << "\n";
    return 1;
  }
  std::vector<uint8_t> hidden(rows * head.hidden_size() * element);
  std::vector<int32_t> targets(rows);
  for (int64_t i = 0; i < rows * head.hidden_size(); ++i) {
    const float x = normal(gen);
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    if (bf16) bits >>= 16;
    std::memcpy(&hidden[i * element], &bits, element);
  }
  for (int32_t& t : targets) t = token(gen);

  lce::client::HiddenBatch batch{
      .dtype = head.dtype(), .rows = rows, .hidden_size = head.hidden_size(), .hidden = hidden, .targets = targets};
  v1::RequestHeader header;
  header.set_head(head.name());
  absl::StatusOr<lce::client::ScoreResult> scored = (*client)->Score(batch, header);
  if (!scored.ok()) {
    std::cerr << "Score: " << scored.status() << "\n";
    return 1;
  }
  if (static_cast<int64_t>(scored->logprobs.size()) != rows || static_cast<int64_t>(scored->entropy.size()) != rows) {
    std::cerr << "Score answered " << scored->logprobs.size() << " logprobs for " << rows << " rows\n";
    return 1;
  }
  for (int64_t i = 0; i < rows; ++i) {
    std::printf("row %lld target %d logprob %.5f entropy %.5f\n", static_cast<long long>(i), targets[i],
                scored->logprobs[i], scored->entropy[i]);
  }
  return 0;
}
