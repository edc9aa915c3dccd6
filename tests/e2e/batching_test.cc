// Dynamic batching (ServiceConfig.batching): many concurrent Calls of mixed sizes, methods, heads and
// options, some of them failing, get from a batching server exactly the bits and errors an unbatched
// server gives each alone; requests of different options are never merged; the metrics count the
// merged calls.
#include <atomic>
#include <cmath>
#include <thread>

#include "absl/strings/str_cat.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "lce/numeric.h"
#include "test_server.h"

namespace lce::e2e {
namespace {

struct Answer {
  grpc::Status status;
  v1::CallResponse response;
};

Answer Call(v1::LceService::Stub& stub, const v1::CallRequest& req) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  Answer a;
  a.status = stub.Call(&ctx, req, &a.response);
  return a;
}

// Request k of the mix: its method, head, options and outputs follow from k; every 11th has a
// non-finite hidden state (an engine error) and every 13th a target outside the vocabulary (a
// validation error).
v1::CallRequest MixedRequest(int k) {
  static constexpr v1::CallMethod kMethods[] = {v1::CALL_SCORE, v1::CALL_SCORE, v1::CALL_FORWARD_BACKWARD,
                                                v1::CALL_BACKWARD};
  const v1::CallMethod method = kMethods[k % 4];
  const bool fp32 = k % 3 == 0;
  const Batch b = MakeBatch(1 + (k * 7) % 23, fp32 ? v1::DTYPE_FLOAT32 : v1::DTYPE_BFLOAT16, 900 + k);
  v1::CallRequest req;
  req.set_method(method);
  v1::RequestHeader& h = *req.mutable_header();
  h.set_head(fp32 ? "wide" : "default");
  h.set_hidden_size(kHidden);
  h.set_dtype(b.dtype);
  if (k % 5 == 1) h.set_temperature(0.7f);
  if (k % 7 == 2) h.set_softcap(3.0f);
  if (method == v1::CALL_SCORE && k % 2 == 0) h.add_outputs(v1::OUTPUT_LOGPROBS);
  v1::RowChunk& c = *req.mutable_chunk();
  c.set_hidden(b.hidden.data(), b.hidden.size());
  for (int32_t y : b.targets) c.add_targets(y);
  if (method == v1::CALL_FORWARD_BACKWARD) {
    const v1::Reduction r[] = {v1::REDUCTION_SUM, v1::REDUCTION_MEAN, v1::REDUCTION_NONE};
    h.set_reduction(r[(k / 4) % 3]);
    int64_t valid = 0;
    for (int32_t y : b.targets) valid += y != -100;
    if (h.reduction() == v1::REDUCTION_MEAN) h.set_num_valid_tokens(valid);
    if (h.reduction() == v1::REDUCTION_NONE && k % 8 == 2) {
      for (int64_t i = 0; i < b.rows; ++i) c.add_grad_loss(0.5f + 0.25f * static_cast<float>(i % 3));
    }
  }
  if (method == v1::CALL_BACKWARD) {
    for (int64_t i = 0; i < b.rows; ++i) {
      c.add_grad_logprob(0.25f * static_cast<float>(i % 5) - 0.5f);
      if (k % 8 != 3) c.add_grad_entropy(0.125f * static_cast<float>(i % 3));
    }
  }
  const int64_t bad_row = b.rows / 2;
  if (k % 11 == 5) {
    std::string& hidden = *c.mutable_hidden();
    if (fp32) {
      const float nan = std::nanf("");
      std::memcpy(&hidden[bad_row * kHidden * 4], &nan, 4);
    } else {
      const uint16_t nan = FloatToBf16(std::nanf(""));
      std::memcpy(&hidden[bad_row * kHidden * 2], &nan, 2);
    }
  }
  if (k % 13 == 6) c.set_targets(static_cast<int>(bad_row), static_cast<int32_t>(kVocab));
  return req;
}

// The value of a metric line `name` (with its labels) in a registry's text, or -1.
double MetricValue(const TestServer& ts, const std::string& name) {
  const std::string text = ts.registry->Render();
  const size_t at = text.find(name + " ");
  return at == std::string::npos ? -1 : std::stod(text.substr(at + name.size() + 1));
}

// Engines that give a row the same bits in every batch and in every server: the CPU engine is so by
// construction; a CUDA engine needs batch-invariant GEMMs (one algorithm, chosen without timing) for
// its fp32 head and for d_hidden.
EngineConfig ExactEngines() {
  EngineConfig c;
  c.batch_invariant = true;
  return c;
}

std::unique_ptr<TestServer> BatchingServer(int64_t max_rows, int64_t max_delay_us) {
  return StartTestServer(8 << 20, false, false, [&](server::GrpcServerOptions& o) {
    o.service.batching = {max_rows, max_delay_us};
  }, ExactEngines());
}

class BatchingBits : public testing::TestWithParam<int64_t> {};

// Sixteen clients at once, 128 requests; the same requests one at a time against a server that does
// not batch. Every answer the same bits (chunk and summary), every error the same status.
TEST_P(BatchingBits, ConcurrentCallsGetTheirUnbatchedBitsAndErrors) {
  constexpr int kRequests = 128, kClients = 16;
  std::vector<v1::CallRequest> reqs;
  for (int k = 0; k < kRequests; ++k) reqs.push_back(MixedRequest(k));
  std::vector<Answer> want(kRequests), got(kRequests);
  {
    auto plain = StartTestServer(8 << 20, false, false, {}, ExactEngines());
    auto stub = RawStub(plain->target);
    for (int k = 0; k < kRequests; ++k) want[k] = Call(*stub, reqs[k]);
  }
  auto ts = BatchingServer(256, GetParam());
  std::vector<std::thread> clients;
  for (int t = 0; t < kClients; ++t) {
    clients.emplace_back([&, t] {
      auto stub = RawStub(ts->target);
      for (int k = t; k < kRequests; k += kClients) got[k] = Call(*stub, reqs[k]);
    });
  }
  for (auto& c : clients) c.join();
  int failed = 0;
  for (int k = 0; k < kRequests; ++k) {
    const std::string what = absl::StrCat("request ", k, " (", v1::CallMethod_Name(reqs[k].method()), ", ",
                                          reqs[k].chunk().targets_size(), " rows)");
    EXPECT_EQ(got[k].status.error_code(), want[k].status.error_code()) << what << ": " << got[k].status.error_message();
    EXPECT_EQ(got[k].status.error_message(), want[k].status.error_message()) << what;
    EXPECT_EQ(got[k].response.SerializeAsString(), want[k].response.SerializeAsString()) << what;
    failed += !want[k].status.ok();
  }
  EXPECT_GE(failed, 15) << "the mix has requests that fail";
  EXPECT_LE(failed, 25);
  // Every request that reached the engine went through the batcher.
  EXPECT_GT(MetricValue(*ts, "lce_batch_requests_count{op=\"score\"}"), 0);
  EXPECT_GT(MetricValue(*ts, "lce_batch_requests_count{op=\"forward_backward\"}"), 0);
  EXPECT_GT(MetricValue(*ts, "lce_batch_requests_count{op=\"backward\"}"), 0);
}

// At once when the engine is free; with a window of 2 ms.
INSTANTIATE_TEST_SUITE_P(Delay, BatchingBits, testing::Values(0, 2000));

// Eight concurrent Scores of 4 rows and a window that closes when 32 rows are in: one engine call.
// Then two requests whose options differ and which would fill a batch of two with a batch-mate of
// their own options: two calls, one request each.
TEST(Batching, MergedCallsShowInTheMetricsAndDifferentOptionsAreNotMerged) {
  auto ts = BatchingServer(32, 60000000);
  std::vector<std::thread> clients;
  std::atomic<int> ok{0};
  for (int t = 0; t < 8; ++t) {
    clients.emplace_back([&, t] {
      v1::CallRequest req = MixedRequest(0);  // a Score on "wide"
      const Batch b = MakeBatch(4, v1::DTYPE_FLOAT32, 50 + t);
      req.mutable_chunk()->set_hidden(b.hidden.data(), b.hidden.size());
      req.mutable_chunk()->clear_targets();
      for (int32_t y : b.targets) req.mutable_chunk()->add_targets(y);
      ok += Call(*RawStub(ts->target), req).status.ok();
    });
  }
  for (auto& c : clients) c.join();
  EXPECT_EQ(ok.load(), 8);
  EXPECT_EQ(MetricValue(*ts, "lce_batch_requests_count{op=\"score\"}"), 1);
  EXPECT_EQ(MetricValue(*ts, "lce_batch_requests_sum{op=\"score\"}"), 8);
  EXPECT_EQ(MetricValue(*ts, "lce_batch_rows_sum{op=\"score\"}"), 32);

  auto two = BatchingServer(2, 200000);
  clients.clear();
  for (float temperature : {1.0f, 0.5f}) {
    clients.emplace_back([&, temperature] {
      v1::CallRequest req = MixedRequest(0);
      req.mutable_chunk()->mutable_hidden()->resize(kHidden * 4);
      req.mutable_chunk()->mutable_targets()->Truncate(1);
      req.mutable_header()->set_temperature(temperature);
      ok += Call(*RawStub(two->target), req).status.ok();
    });
  }
  for (auto& c : clients) c.join();
  EXPECT_EQ(ok.load(), 10);
  EXPECT_EQ(MetricValue(*two, "lce_batch_requests_count{op=\"score\"}"), 2);
  EXPECT_EQ(MetricValue(*two, "lce_batch_requests_sum{op=\"score\"}"), 2);
}

}  // namespace
}  // namespace lce::e2e
