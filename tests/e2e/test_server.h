// An in-process lce server on 127.0.0.1:0 with two seeded heads, and helpers to make batches.
#pragma once

#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "grpc_server.h"
#include "service_metrics.h"
#include "head_store.h"
#include "lce/client/lce_client.h"
#include "lce/engine.h"
#include "lce/v1/lce.grpc.pb.h"

namespace lce::e2e {

constexpr int64_t kVocab = 3001;  // not a multiple of any tile
constexpr int64_t kHidden = 32;

struct TestServer {
  // The service's metrics (declared first: they outlive the server that counts in them).
  std::unique_ptr<server::metrics::Registry> registry = std::make_unique<server::metrics::Registry>();
  std::unique_ptr<server::ServiceMetrics> metrics = std::make_unique<server::ServiceMetrics>(*registry);
  std::shared_ptr<server::HeadStore> heads;
  std::unique_ptr<server::GrpcServer> server;
  std::string target;
  // Heads: "default" (bf16) and "wide" (fp32, with the same seed).
  std::shared_ptr<LceEngine> bf16_engine, fp32_engine;
};

// The engines of the in-process server: LCE_TEST_BACKEND=cuda on a GPU machine, else the CPU engine.
Backend TestBackend();

// With `data_plane`, the server runs one (RegionDataPlane) on a free port. `tune` changes the
// options last (limits under test); `engines` configures every engine the server makes.
std::unique_ptr<TestServer> StartTestServer(int64_t max_message_bytes = 8 << 20, bool log_requests = false,
                                            bool data_plane = true,
                                            const std::function<void(server::GrpcServerOptions&)>& tune = {},
                                            EngineConfig engines = {});

struct Batch {
  v1::DType dtype;
  int64_t rows;
  std::vector<uint8_t> hidden;
  std::vector<int32_t> targets;
};

// hidden ~ N(0, 1) in `dtype`, targets uniform with ~10% ignore_index (-100).
Batch MakeBatch(int64_t rows, v1::DType dtype, uint64_t seed);

// The batch as the C++ client takes it (borrowed, no copy).
inline client::HiddenBatch View(const Batch& b) {
  return {b.dtype, b.rows, kHidden, absl::MakeConstSpan(b.hidden), absl::MakeConstSpan(b.targets)};
}

std::unique_ptr<v1::LceService::Stub> RawStub(const std::string& target);

// A client of `target` sending `chunk_bytes` chunks, with whatever `tune` sets on top of that;
// a failure to create it fails the test.
std::unique_ptr<client::LceClient> ConnectClient(const std::string& target, int64_t chunk_bytes,
                                                 const std::function<void(client::ClientOptions&)>& tune = {});

// Each element of `got` within rel·max(1, |want|) of `want`'s; a failure names `what` and the element.
void ExpectElementsNear(const std::vector<float>& got, const std::vector<float>& want, double rel,
                        const std::string& what = "");

// The tolerance between two transports' answers to one request: 0 (the same bits) on the CPU engine,
// 1e-4 relative on a GPU, whose cuBLAS may pick another algorithm for another chunking.
double TransportTolerance();

}  // namespace lce::e2e
