#include "test_server.h"

#include <algorithm>
#include <cmath>

#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "head_source.h"
#include "lce/numeric.h"

namespace lce::e2e {

Backend TestBackend() {
  const char* env = std::getenv("LCE_TEST_BACKEND");
  return env != nullptr && std::string(env) == "cuda" ? Backend::kCuda : Backend::kCpu;
}

std::unique_ptr<TestServer> StartTestServer(int64_t max_message_bytes, bool log_requests, bool data_plane,
                                            const std::function<void(server::GrpcServerOptions&)>& tune,
                                            EngineConfig engines) {
  auto ts = std::make_unique<TestServer>();
  ts->heads = std::make_shared<server::HeadStore>();
  for (DType dtype : {DType::kBFloat16, DType::kFloat32}) {
    server::HeadSource src;
    src.seed_vocab = kVocab;
    src.seed_hidden = kHidden;
    src.seed = 7;
    src.dtype = dtype;
    auto w = server::LoadHead(src, 0, 1);
    EXPECT_TRUE(w.ok()) << w.status();
    auto e = CreateEngine(TestBackend(), *w, engines);
    EXPECT_TRUE(e.ok()) << e.status();
    std::shared_ptr<LceEngine> engine = std::move(*e);
    (dtype == DType::kBFloat16 ? ts->bf16_engine : ts->fp32_engine) = engine;
    EXPECT_TRUE(ts->heads->Put(dtype == DType::kBFloat16 ? "default" : "wide", engine, *w).ok());
  }
  server::GrpcServerOptions options;
  options.address = "127.0.0.1:0";
  options.service.max_message_bytes = max_message_bytes;
  options.service.log_requests = log_requests;
  options.service.metrics = ts->metrics.get();
  // As lce_server does for a one-GPU engine: chunks go through device staging (and CUDA IPC works).
  if (TestBackend() == Backend::kCuda) options.service.cuda_device = 0;
  // Pipelined streams on the CPU engine too (servers pipeline GPU engines only): CI covers them.
  options.service.pipeline_chunks_on_cpu = true;
  options.service.limits.max_rows_per_request = 100000;
  options.data_port = data_plane ? 0 : -1;
  options.service.make_engine = [engines](std::shared_ptr<const HeadWeights> w) -> absl::StatusOr<std::shared_ptr<LceEngine>> {
    absl::StatusOr<std::unique_ptr<LceEngine>> e = CreateEngine(TestBackend(), std::move(w), engines);
    if (!e.ok()) return e.status();
    return std::shared_ptr<LceEngine>(std::move(*e));
  };
  if (tune) tune(options);
  auto server = server::GrpcServer::Start(ts->heads, options);
  EXPECT_TRUE(server.ok()) << server.status();
  ts->server = std::move(*server);
  ts->target = "127.0.0.1:" + std::to_string(ts->server->port());
  return ts;
}

Batch MakeBatch(int64_t rows, v1::DType dtype, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int32_t> tgt(0, kVocab - 1);
  std::uniform_real_distribution<float> unif;
  Batch b{dtype, rows, {}, {}};
  const int64_t n = rows * kHidden;
  if (dtype == v1::DTYPE_FLOAT32) {
    b.hidden.resize(n * 4);
    auto* p = reinterpret_cast<float*>(b.hidden.data());
    for (int64_t i = 0; i < n; ++i) p[i] = normal(rng);
  } else {
    b.hidden.resize(n * 2);
    auto* p = reinterpret_cast<uint16_t*>(b.hidden.data());
    for (int64_t i = 0; i < n; ++i) p[i] = dtype == v1::DTYPE_BFLOAT16 ? FloatToBf16(normal(rng)) : FloatToFp16(normal(rng));
  }
  for (int64_t i = 0; i < rows; ++i) b.targets.push_back(unif(rng) < 0.1f ? -100 : tgt(rng));
  return b;
}

std::unique_ptr<v1::LceService::Stub> RawStub(const std::string& target) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  return v1::LceService::NewStub(grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args));
}

std::unique_ptr<client::LceClient> ConnectClient(const std::string& target, int64_t chunk_bytes,
                                                 const std::function<void(client::ClientOptions&)>& tune) {
  client::ClientOptions o;
  o.target = target;
  o.chunk_bytes = chunk_bytes;
  if (tune) tune(o);
  auto c = client::LceClient::Create(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

void ExpectElementsNear(const std::vector<float>& got, const std::vector<float>& want, double rel,
                        const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], rel * std::max(1.0f, std::fabs(want[i]))) << what << "[" << i << "]";
  }
}

double TransportTolerance() { return TestBackend() == Backend::kCpu ? 0 : 1e-4; }

}  // namespace lce::e2e
