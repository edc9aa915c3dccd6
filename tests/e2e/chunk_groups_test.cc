// A pipelined stream's chunks merged into engine calls (--merge-chunk-rows, server/api/
// streamed_request_groups.cc): the answers are the unmerged server's (the same bits on the CPU engine,
// whose rows and dW do not depend on how rows are batched), every chunk is answered on its own, and
// calls do merge while the engine is busy; over the data plane too (on a GPU server its chunks are
// slices of device memory, merged where they are contiguous).
#include <cstring>

#include "gtest/gtest.h"
#include "lce/client/lce_client.h"
#include "nlohmann/json.hpp"
#include "test_server.h"

namespace lce::e2e {
namespace {

constexpr int64_t kRows = 600, kChunkRows = 16;  // 38 chunks

std::unique_ptr<TestServer> ServerMerging(int64_t merge_rows, bool log_requests, bool data_plane = false) {
  return StartTestServer(8 << 20, log_requests, data_plane,
                         [merge_rows](server::GrpcServerOptions& o) { o.service.merge_chunk_rows = merge_rows; });
}

struct Answers {
  std::vector<float> logprobs, entropy, loss, d_weight;
  std::vector<uint8_t> d_hidden, d_hidden_bw;
};

// A score, a ForwardBackward (per-row upstream gradients, label smoothing) and a Backward, both adding
// dW, in 16-row chunks; then dW.
Answers RunRequests(const TestServer& ts, const Batch& b, bool data_plane = false) {
  Answers a;
  auto c = ConnectClient(ts.target, kChunkRows * kHidden * 2, [data_plane](client::ClientOptions& o) {
    o.data_plane = data_plane;
    o.data_plane_sockets = 1;
  });
  EXPECT_TRUE(c->ZeroGrad().ok());
  v1::RequestHeader score;
  score.set_temperature(0.9f);
  auto s = c->Score(View(b), score);
  EXPECT_TRUE(s.ok()) << s.status();
  if (s.ok()) a.logprobs = s->logprobs, a.entropy = s->entropy;
  v1::RequestHeader fb;
  fb.set_reduction(v1::REDUCTION_NONE);
  fb.set_label_smoothing(0.1f);
  fb.set_accumulate_weight_grad(true);
  fb.add_outputs(v1::OUTPUT_LOSS);
  std::vector<float> g(b.rows), gl(b.rows), ge(b.rows);
  for (int64_t i = 0; i < b.rows; ++i) {
    g[i] = 0.01f * static_cast<float>(i % 11) - 0.03f;
    gl[i] = 0.5f - 0.001f * static_cast<float>(i);
    ge[i] = 0.02f * static_cast<float>(i % 5);
  }
  auto f = c->ForwardBackward(View(b), fb, g);
  EXPECT_TRUE(f.ok()) << f.status();
  if (f.ok()) a.loss = f->loss, a.d_hidden = f->d_hidden;
  v1::RequestHeader bw;
  bw.set_accumulate_weight_grad(true);
  auto w = c->Backward(View(b), bw, gl, ge);
  EXPECT_TRUE(w.ok()) << w.status();
  if (w.ok()) a.d_hidden_bw = w->d_hidden;
  auto dw = c->GetGrad();
  EXPECT_TRUE(dw.ok()) << dw.status();
  if (dw.ok()) a.d_weight = dw->values;
  return a;
}

void ExpectMergedCallsGiveTheUnmergedAnswers(bool data_plane) {
  const Batch b = MakeBatch(kRows, v1::DTYPE_BFLOAT16, 77);
  auto unmerged = ServerMerging(0, false, data_plane);
  const Answers want = RunRequests(*unmerged, b, data_plane);
  unmerged.reset();
  auto merged = ServerMerging(128, true, data_plane);
  ::testing::internal::CaptureStderr();
  const Answers got = RunRequests(*merged, b, data_plane);
  merged.reset();  // every handler done, its log line written
  const std::string log = ::testing::internal::GetCapturedStderr();

  const double tol = TransportTolerance();
  ExpectElementsNear(got.logprobs, want.logprobs, tol, "logprobs");
  ExpectElementsNear(got.entropy, want.entropy, tol, "entropy");
  ExpectElementsNear(got.loss, want.loss, tol, "loss");
  ASSERT_EQ(got.d_weight.size(), want.d_weight.size());
  if (tol == 0) {
    EXPECT_EQ(got.d_hidden, want.d_hidden);
    EXPECT_EQ(got.d_hidden_bw, want.d_hidden_bw);
    EXPECT_EQ(std::memcmp(got.d_weight.data(), want.d_weight.data(), 4 * got.d_weight.size()), 0) << "d_weight";
  } else {
    ExpectElementsNear(got.d_weight, want.d_weight, 1e-3, "d_weight");
  }

  // Each request's 38 chunks in fewer calls, each call at most 128 rows.
  int requests = 0;
  for (size_t at = 0; at < log.size();) {
    const size_t end = std::min(log.find('\n', at), log.size());
    const nlohmann::json j = nlohmann::json::parse(log.substr(at, end - at), nullptr, false);
    at = end + 1;
    if (j.is_discarded() || !j.is_object() || !j.contains("engine_calls")) continue;
    const std::string method = j.value("method", "");
    if (method != "Score" && method != "ForwardBackward" && method != "Backward") continue;
    ++requests;
    const int64_t calls = j["engine_calls"].get<int64_t>();
    EXPECT_GE(calls, (kRows + 127) / 128) << method;
    EXPECT_LT(calls, (kRows + kChunkRows - 1) / kChunkRows) << method << ": no chunks merged";
  }
  EXPECT_EQ(requests, 3) << log;
}

TEST(ChunkGroups, MergedCallsGiveTheUnmergedAnswers) { ExpectMergedCallsGiveTheUnmergedAnswers(false); }
TEST(ChunkGroups, MergedCallsOverTheDataPlaneGiveTheUnmergedAnswers) { ExpectMergedCallsGiveTheUnmergedAnswers(true); }

// A chunk that arrives while the engine is idle computes at once: a client that sends one chunk and
// waits (within the idle timeout) gets its answer before it sends the next.
TEST(ChunkGroups, AChunkToAnIdleEngineIsAnsweredAtOnce) {
  auto ts = ServerMerging(4096, false);
  auto stub = RawStub(ts->target);
  grpc::ClientContext ctx;
  auto stream = stub->Score(&ctx);
  v1::StreamRequest h;
  h.mutable_header()->set_hidden_size(kHidden);
  h.mutable_header()->set_dtype(v1::DTYPE_BFLOAT16);
  h.mutable_header()->set_sends_ahead(true);
  ASSERT_TRUE(stream->Write(h));
  for (int k = 0; k < 3; ++k) {
    const Batch b = MakeBatch(8, v1::DTYPE_BFLOAT16, 90 + k);
    v1::StreamRequest m;
    m.mutable_chunk()->set_hidden(std::string(b.hidden.begin(), b.hidden.end()));
    m.mutable_chunk()->mutable_targets()->Add(b.targets.begin(), b.targets.end());
    ASSERT_TRUE(stream->Write(m));
    v1::StreamResponse r;
    ASSERT_TRUE(stream->Read(&r)) << "chunk " << k;
    EXPECT_EQ(r.chunk().first_row(), 8 * k);
    EXPECT_EQ(r.chunk().logprobs_size(), 8);
  }
  stream->WritesDone();
  v1::StreamResponse r;
  while (stream->Read(&r)) {
  }
  EXPECT_TRUE(stream->Finish().ok());
}

}  // namespace
}  // namespace lce::e2e
