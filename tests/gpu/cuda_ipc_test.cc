// CUDA IPC regions, end to end: this process (the client) allocates GPU memory, exports it with
// cudaIpcGetMemHandle and registers it with an lce_server --backend=cuda running as a second
// process; requests that name the region give the answers of the bytes-over-gRPC path, write
// d_hidden into the client's GPU memory in place, and every misuse gets its status.
// Skips (GTEST_SKIP, with a message) where no CUDA device is visible.
#include <cuda_runtime.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iostream>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "lce/client/lce_client.h"
#include "lce/engine.h"
#include "lce/numeric.h"

extern char** environ;

namespace lce {
namespace {

namespace fs = std::filesystem;
constexpr int64_t kVocab = 5003, kHidden = 256, kRows = 777;

std::string ServerPath() {
  const char* env = std::getenv("LCE_SERVER_BIN");
  return env != nullptr && *env != 0 ? env : LCE_SERVER_PATH;
}

// lce_server --backend=cuda as a child process: a second process, as CUDA IPC requires.
class ServerProcess {
 public:
  ServerProcess() : dir_(fs::temp_directory_path() / ("lce_ipc_" + std::to_string(::getpid()))) {
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    const std::string port_file = (dir_ / "port").string();
    std::vector<std::string> args = {ServerPath(), "--port=0", "--port-file=" + port_file, "--backend=cuda",
                                     "--seed-head=" + std::to_string(kVocab) + "x" + std::to_string(kHidden),
                                     "--seed=5", "--head-dtype=bf16", "--host=127.0.0.1", "--log-requests=false",
                                     "--data-port=0"};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    EXPECT_EQ(posix_spawn(&pid_, args[0].c_str(), nullptr, nullptr, argv.data(), environ), 0);
    for (int i = 0; i < 600 && !fs::exists(port_file); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::ifstream in(port_file);
    int port = 0;
    in >> port;
    EXPECT_GT(port, 0) << "lce_server never wrote its port";
    target_ = "127.0.0.1:" + std::to_string(port);
  }
  ~ServerProcess() {
    if (pid_ > 0) {
      ::kill(pid_, SIGTERM);  // never kill(-1)
      ::waitpid(pid_, nullptr, 0);
    }
    fs::remove_all(dir_);
  }
  const std::string& target() const { return target_; }

 private:
  fs::path dir_;
  pid_t pid_ = -1;
  std::string target_;
};

struct DeviceBuffer {
  void* p = nullptr;
  explicit DeviceBuffer(size_t bytes) { EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess); }
  ~DeviceBuffer() { cudaFree(p); }
  std::string Handle() const {
    cudaIpcMemHandle_t h;
    EXPECT_EQ(cudaIpcGetMemHandle(&h, p), cudaSuccess);
    return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
  }
};

TEST(CudaIpc, RegionsInTheClientsGpuMemoryGiveTheAnswersOfTheBytesPath) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA device visible: CUDA IPC test skipped";
  ServerProcess server;
  client::ClientOptions o;
  o.target = server.target();
  o.chunk_bytes = 100 * kHidden * 2;  // several chunks on the bytes path
  auto c = client::LceClient::Create(o);
  ASSERT_TRUE(c.ok()) << c.status();
  client::LceClient& cl = **c;

  // Fresh random bf16 hidden states and targets (some ignored).
  std::mt19937_64 rng(std::random_device{}());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int32_t> tok(0, kVocab - 1);
  std::vector<uint16_t> hidden(kRows * kHidden);
  for (auto& x : hidden) x = FloatToBf16(normal(rng));
  std::vector<int32_t> targets(kRows);
  for (int64_t i = 0; i < kRows; ++i) targets[i] = i % 11 == 3 ? -100 : tok(rng);
  const int64_t bytes = kRows * kHidden * 2;
  client::HiddenBatch wire{v1::DTYPE_BFLOAT16, kRows, kHidden,
                           absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(hidden.data()), bytes),
                           absl::MakeConstSpan(targets)};

  // The client's GPU memory: hidden at an offset inside its allocation, d_hidden in another one.
  const int64_t off = 4096 + 2 * kHidden;
  DeviceBuffer in(off + bytes), out(bytes);
  ASSERT_EQ(cudaMemcpy(static_cast<uint8_t*>(in.p) + off, hidden.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(out.p, 0, bytes), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  auto session = cl.OpenSession();
  ASSERT_TRUE(session.ok()) << session.status();
  auto in_id = (*session)->RegisterCudaIpc(in.Handle(), 0, off + bytes, "hidden");
  auto out_id = (*session)->RegisterCudaIpc(out.Handle(), 0, bytes, "d_hidden");
  ASSERT_TRUE(in_id.ok()) << in_id.status();
  ASSERT_TRUE(out_id.ok()) << out_id.status();
  const std::string sid = (*session)->id();
  client::HiddenBatch ipc = wire;
  ipc.hidden = {};
  ipc.hidden_region = client::RegionRef{sid, *in_id, off};

  v1::RequestHeader h;
  h.set_temperature(0.9f);
  auto want_s = cl.Score(wire, h);
  auto got_s = cl.Score(ipc, h);
  ASSERT_TRUE(want_s.ok()) << want_s.status();
  ASSERT_TRUE(got_s.ok()) << got_s.status();
  ASSERT_EQ(got_s->logprobs.size(), static_cast<size_t>(kRows));
  // One engine call over all rows against several chunked ones: where the server says a row's
  // logprob and entropy are the same bits in any batch (the epilogue GEMM), they must be; else the
  // same math to 1e-4.
  auto info = cl.GetInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  const auto& inv = info->invariance().across_batches();
  const bool same_bits = std::find(inv.begin(), inv.end(), "logprob") != inv.end() &&
                         std::find(inv.begin(), inv.end(), "entropy") != inv.end();
  for (int64_t i = 0; i < kRows; ++i) {
    if (same_bits) {
      ASSERT_EQ(std::memcmp(&got_s->logprobs[i], &want_s->logprobs[i], 4), 0) << i;
      ASSERT_EQ(std::memcmp(&got_s->entropy[i], &want_s->entropy[i], 4), 0) << i;
      continue;
    }
    ASSERT_NEAR(got_s->logprobs[i], want_s->logprobs[i], 1e-4 * (1 + std::fabs(want_s->logprobs[i]))) << i;
    ASSERT_NEAR(got_s->entropy[i], want_s->entropy[i], 1e-4 * (1 + want_s->entropy[i])) << i;
  }
  std::cout << "IPC vs bytes scores compared " << (same_bits ? "bit for bit" : "to 1e-4") << std::endl;

  v1::RequestHeader fb;
  fb.add_outputs(v1::OUTPUT_LOSS);
  auto want = cl.ForwardBackward(wire, fb);
  ipc.d_hidden_region = client::RegionRef{sid, *out_id, 0};
  auto got = cl.ForwardBackward(ipc, fb);
  ASSERT_TRUE(want.ok()) << want.status();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->d_hidden.empty()) << "d_hidden went to the region, not the wire";
  EXPECT_NEAR(got->reduced_loss, want->reduced_loss, 1e-5 * std::fabs(want->reduced_loss));
  EXPECT_EQ(got->valid_tokens, want->valid_tokens);
  std::vector<uint16_t> dh(kRows * kHidden);
  ASSERT_EQ(cudaMemcpy(dh.data(), out.p, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  const auto* want_dh = reinterpret_cast<const uint16_t*>(want->d_hidden.data());
  double max_err = 0, max_ref = 0;
  for (int64_t i = 0; i < kRows * kHidden; ++i) {
    max_err = std::max<double>(max_err, std::fabs(Bf16ToFloat(dh[i]) - Bf16ToFloat(want_dh[i])));
    max_ref = std::max<double>(max_ref, std::fabs(Bf16ToFloat(want_dh[i])));
  }
  EXPECT_GT(max_ref, 0.0);
  EXPECT_LE(max_err, 1e-2 * max_ref) << "d_hidden in the region differs from the bytes path";

  // d_hidden over the wire while hidden stays on the GPU.
  client::HiddenBatch half = ipc;
  half.d_hidden_region.reset();
  auto mixed = cl.ForwardBackward(half, fb);
  ASSERT_TRUE(mixed.ok()) << mixed.status();
  ASSERT_EQ(mixed->d_hidden.size(), want->d_hidden.size());
  EXPECT_EQ(mixed->d_hidden, std::vector<uint8_t>(reinterpret_cast<const uint8_t*>(dh.data()),
                                                  reinterpret_cast<const uint8_t*>(dh.data()) + bytes));

  // A second region over the same allocation (as two tensors of PyTorch's caching allocator share
  // one), here from the hidden states' first byte: CUDA opens a handle once per process, so the
  // server shares its mapping.
  auto again_id = (*session)->RegisterCudaIpc(in.Handle(), off, bytes, "hidden again");
  ASSERT_TRUE(again_id.ok()) << again_id.status();
  {
    client::HiddenBatch b2 = wire;
    b2.hidden = {};
    b2.hidden_region = client::RegionRef{sid, *again_id, 0};
    auto r2 = cl.Score(b2, h);
    ASSERT_TRUE(r2.ok()) << r2.status();
    EXPECT_EQ(r2->logprobs, got_s->logprobs);
  }
  // Issue 22: a foreign handle (one another session registered: leaked or copied) is refused to a
  // second session, and a forged one (random bytes) is refused by the driver; both clearly, and the
  // sessions go on.
  auto session2 = cl.OpenSession();
  ASSERT_TRUE(session2.ok()) << session2.status();
  auto foreign = (*session2)->RegisterCudaIpc(in.Handle(), 0, off + bytes, "hidden, session 2");
  EXPECT_EQ(foreign.status().code(), absl::StatusCode::kPermissionDenied) << foreign.status();
  EXPECT_NE(foreign.status().message().find("registered by another session"), std::string::npos) << foreign.status();
  std::mt19937_64 forge(22);
  std::string forged(64, '\0');
  for (char& c : forged) c = static_cast<char>(forge());
  auto forged_id = (*session2)->RegisterCudaIpc(forged, 0, 16, "forged");
  EXPECT_EQ(forged_id.status().code(), absl::StatusCode::kInvalidArgument) << forged_id.status();
  EXPECT_NE(forged_id.status().message().find("cudaIpcOpenMemHandle refused the handle"), std::string::npos)
      << forged_id.status();
  session2->reset();

  // Misuse: out of bounds, beyond the allocation, a handle that is not one; the server keeps serving.
  client::HiddenBatch oob = ipc;
  oob.hidden_region->offset = off + 2;
  auto r = cl.Score(oob, h);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  auto too_big = (*session)->RegisterCudaIpc(out.Handle(), 0, bytes + 1);
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kInvalidArgument) << too_big.status();
  auto junk = (*session)->RegisterCudaIpc(std::string(64, '\x5a'), 0, 16);
  EXPECT_EQ(junk.status().code(), absl::StatusCode::kInvalidArgument) << junk.status();
  auto again = cl.Score(ipc, h);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->logprobs, got_s->logprobs);

  // Unregistered: the id is gone.
  ASSERT_TRUE((*session)->Unregister(*in_id).ok());
  r = cl.Score(ipc, h);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
}

// The server's whole dW of the default head (GetGrad), after zeroing it and running `fb`.
std::vector<float> GradientOf(const std::string& target, const std::function<void()>& fb) {
  auto stub = v1::LceService::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  {
    grpc::ClientContext ctx;
    v1::ZeroGradResponse z;
    EXPECT_TRUE(stub->ZeroGrad(&ctx, v1::ZeroGradRequest{}, &z).ok());
  }
  fb();
  grpc::ClientContext ctx;
  auto reader = stub->GetGrad(&ctx, v1::GetGradRequest{});
  std::vector<float> g(kVocab * kHidden, std::nanf(""));
  v1::TensorChunk c;
  while (reader->Read(&c)) std::memcpy(g.data() + c.first_row() * kHidden, c.data().data(), c.data().size());
  EXPECT_TRUE(reader->Finish().ok());
  return g;
}

// dW accumulates on the GPU whichever road the hidden states took (bytes, the data plane's server
// memory, a CUDA IPC region), to the same gradient, and an optimizer step takes it.
TEST(CudaIpc, WeightGradientsAccumulateFromEveryRoad) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA device visible: CUDA IPC test skipped";
  ServerProcess server;
  client::ClientOptions o;
  o.target = server.target();
  o.chunk_bytes = 100 * kHidden * 2;
  auto wire_client = client::LceClient::Create(o);
  o.data_plane = true;
  auto dp_client = client::LceClient::Create(o);
  ASSERT_TRUE(wire_client.ok() && dp_client.ok());
  std::mt19937_64 rng(17);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> hidden(kRows * kHidden);
  for (auto& x : hidden) x = FloatToBf16(normal(rng));
  std::vector<int32_t> targets(kRows);
  for (int64_t i = 0; i < kRows; ++i) targets[i] = i % 7 == 3 ? -100 : static_cast<int32_t>((i * 613) % kVocab);
  const int64_t bytes = kRows * kHidden * 2;
  client::HiddenBatch wire{v1::DTYPE_BFLOAT16, kRows, kHidden,
                           absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(hidden.data()), bytes),
                           absl::MakeConstSpan(targets)};
  v1::RequestHeader fb;
  fb.set_reduction(v1::REDUCTION_SUM);
  fb.set_accumulate_weight_grad(true);
  auto run = [&](client::LceClient& c, const client::HiddenBatch& batch) {
    return [&c, batch, fb] {
      auto r = c.ForwardBackward(batch, fb);
      EXPECT_TRUE(r.ok()) << r.status();
    };
  };
  const std::vector<float> by_bytes = GradientOf(server.target(), run(**wire_client, wire));
  const std::vector<float> by_data_plane = GradientOf(server.target(), run(**dp_client, wire));
  DeviceBuffer in(bytes);
  ASSERT_EQ(cudaMemcpy(in.p, hidden.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // a pageable copy may return before its DMA lands
  auto session = (*wire_client)->OpenSession();
  ASSERT_TRUE(session.ok()) << session.status();
  auto in_id = (*session)->RegisterCudaIpc(in.Handle(), 0, bytes, "hidden");
  ASSERT_TRUE(in_id.ok()) << in_id.status();
  client::HiddenBatch ipc = wire;
  ipc.hidden = {};
  ipc.hidden_region = client::RegionRef{(*session)->id(), *in_id, 0};
  const std::vector<float> by_ipc = GradientOf(server.target(), run(**wire_client, ipc));
  double norm = 0, d_dp = 0, d_ipc = 0;
  for (size_t i = 0; i < by_bytes.size(); ++i) {
    norm += static_cast<double>(by_bytes[i]) * by_bytes[i];
    d_dp += std::pow(static_cast<double>(by_data_plane[i]) - by_bytes[i], 2);
    d_ipc += std::pow(static_cast<double>(by_ipc[i]) - by_bytes[i], 2);
  }
  ASSERT_GT(norm, 0.0);
  EXPECT_LE(std::sqrt(d_dp / norm), 1e-5) << "data plane vs bytes";
  EXPECT_LE(std::sqrt(d_ipc / norm), 1e-5) << "CUDA IPC vs bytes";

  auto stub = v1::LceService::NewStub(grpc::CreateChannel(server.target(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  v1::OptimizerStepRequest step;
  step.set_lr(1e-3f);
  v1::OptimizerStepResponse resp;
  grpc::Status st = stub->OptimizerStep(&ctx, step, &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_NEAR(resp.grad_norm(), std::sqrt(norm), 1e-3 * std::sqrt(norm));
  EXPECT_EQ(resp.head().version(), 2);
}

}  // namespace
}  // namespace lce
