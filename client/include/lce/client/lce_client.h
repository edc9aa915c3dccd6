// C++ client of lce-serve (lce.v1.LceService): cuts a batch of hidden states into chunks, streams
// them, reads the answers concurrently and reassembles them in row order. Depends on the
// generated lce.v1 API and Abseil only.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "grpcpp/security/credentials.h"
#include "lce/v1/lce.grpc.pb.h"

namespace lce::client {

struct ClientOptions {
  std::string target;                      // host:port
  absl::Duration timeout = absl::Minutes(10);  // deadline of each call
  int64_t chunk_bytes = 4 << 20;           // hidden bytes per streamed chunk (at least one row)
  std::shared_ptr<grpc::ChannelCredentials> credentials;  // null: insecure
  std::string bearer_token;                // sent as "authorization: Bearer <token>" when set
  int64_t max_message_bytes = 64 << 20;
};

// A batch of rows, borrowed (not copied) for the duration of a call.
struct HiddenBatch {
  v1::DType dtype = v1::DTYPE_BFLOAT16;
  int64_t rows = 0;
  int64_t hidden_size = 0;
  absl::Span<const uint8_t> hidden;   // rows * hidden_size elements of dtype, little-endian
  absl::Span<const int32_t> targets;  // rows
};

struct ScoreResult {
  std::vector<float> logprobs, entropy;
};

struct ForwardBackwardResult {
  std::vector<float> loss, logprobs, entropy;  // per token, when selected in the header
  std::vector<uint8_t> d_hidden;               // rows * hidden_size elements of the batch's dtype
  double reduced_loss = 0;
  int64_t valid_tokens = 0;
  int64_t head_version = 0;
};

struct BackwardResult {
  std::vector<uint8_t> d_hidden;
};

class LceClient {
 public:
  static absl::StatusOr<std::unique_ptr<LceClient>> Create(const ClientOptions& options);

  absl::StatusOr<v1::GetInfoResponse> GetInfo(const std::string& head = "");
  // grpc.health.v1 Check of `service` ("" = the server as a whole): true when SERVING.
  absl::StatusOr<bool> Health(const std::string& service = "");

  // `header` carries the options; the client fills hidden_size and dtype from the batch.
  absl::StatusOr<ScoreResult> Score(const HiddenBatch& batch, v1::RequestHeader header);
  // For REDUCTION_MEAN (or unspecified) the client fills num_valid_tokens from the targets when
  // the caller left it unset. grad_loss (REDUCTION_NONE only) is one value per row, or empty.
  absl::StatusOr<ForwardBackwardResult> ForwardBackward(const HiddenBatch& batch, v1::RequestHeader header,
                                                        absl::Span<const float> grad_loss = {});
  absl::StatusOr<BackwardResult> Backward(const HiddenBatch& batch, v1::RequestHeader header,
                                          absl::Span<const float> grad_logprob, absl::Span<const float> grad_entropy);

  // Hidden bytes per streamed chunk (at least one row); changeable between calls, e.g. to cut the
  // same batch differently. Not thread-safe with calls in flight.
  int64_t chunk_bytes() const { return options_.chunk_bytes; }
  void set_chunk_bytes(int64_t bytes) { options_.chunk_bytes = bytes; }

 private:
  LceClient(ClientOptions options, std::shared_ptr<grpc::Channel> channel);
  absl::Status Stream(const char* rpc, const HiddenBatch& batch, const v1::RequestHeader& header,
                      absl::Span<const float> grad_loss, absl::Span<const float> grad_logprob,
                      absl::Span<const float> grad_entropy, ForwardBackwardResult* out);
  void Prepare(grpc::ClientContext* ctx) const;

  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::LceService::Stub> stub_;
};

// Plans the chunks of a batch: [first_row, rows) pairs of at most max(1, chunk_bytes / row_bytes) rows.
std::vector<std::pair<int64_t, int64_t>> PlanChunks(int64_t rows, int64_t row_bytes, int64_t chunk_bytes);

// Bytes per element of a wire dtype (0 for DTYPE_UNSPECIFIED).
int64_t WireDTypeSize(v1::DType dtype);

}  // namespace lce::client
