// One request split over several streams on several connections (ClientOptions.streams, the
// server's RequestHeader.partial) gives the answers of one stream: per-row outputs, d_hidden, the
// reduced loss for every reduction, and the declared-count check the server skips for parts; a split
// request that accumulates dW fills one contribution (RequestHeader.split_id).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <set>
#include <sstream>
#include <thread>

#include "gtest/gtest.h"
#include "lce/client/lce_client.h"
#include "nlohmann/json.hpp"
#include "test_server.h"
#include "training_rpcs.h"

namespace lce::e2e {
namespace {

using client::ClientOptions;
using client::HiddenBatch;
using client::LceClient;

std::unique_ptr<LceClient> Connect(const TestServer& ts, int streams, int64_t chunk_bytes) {
  return ConnectClient(ts.target, chunk_bytes, [&](ClientOptions& o) {
    o.streams = streams;
    o.min_stream_bytes = 3 * chunk_bytes;  // small, so that a test-sized batch splits
  });
}

TEST(PlanStreams, SplitsIntoWholeChunksAndKeepsSmallBatchesWhole) {
  // 1000 rows of 64 bytes, chunks of 10 rows: 4 parts of 25 chunks.
  auto p = client::PlanStreams(1000, 64, 640, 4, 1000);
  ASSERT_EQ(p.size(), 4u);
  int64_t next = 0;
  for (auto [first, n] : p) {
    EXPECT_EQ(first, next);
    EXPECT_EQ(n % 10, 0);
    next += n;
  }
  EXPECT_EQ(next, 1000);
  // Parts of at least min_stream_bytes: 64000 bytes allow 2 parts of 32000, not 4.
  EXPECT_EQ(client::PlanStreams(1000, 64, 640, 4, 32000).size(), 2u);
  EXPECT_EQ(client::PlanStreams(1000, 64, 640, 4, 64001).size(), 1u);
  EXPECT_EQ(client::PlanStreams(1000, 64, 640, 1, 1).size(), 1u);
  // Fewer chunks than streams: rows are split evenly instead.
  auto q = client::PlanStreams(7, 64, 1 << 20, 3, 1);
  ASSERT_EQ(q.size(), 3u);
  EXPECT_EQ(q[0].second + q[1].second + q[2].second, 7);
}

TEST(MultiStream, AnswersEqualOneStreamOverSeveralConnections) {
  auto ts = StartTestServer(8 << 20, /*log_requests=*/true);
  const int64_t row_bytes = kHidden * 2;
  const int64_t chunk = 16 * row_bytes;
  auto one = Connect(*ts, 1, chunk);
  auto four = Connect(*ts, 4, chunk);
  const Batch b = MakeBatch(1000, v1::DTYPE_BFLOAT16, 21);

  v1::RequestHeader h;
  h.set_temperature(0.8f);
  auto s1 = one->Score(View(b), h);
  ::testing::internal::CaptureStderr();
  auto s4 = four->Score(View(b), h);
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(s1.ok() && s4.ok()) << s1.status() << s4.status();
  ExpectElementsNear(s4->logprobs, s1->logprobs, 1e-5, "logprobs");
  ExpectElementsNear(s4->entropy, s1->entropy, 1e-5, "entropy");
  // The request went out as four Score streams, from four client connections (peer ports).
  std::set<std::string> peers;
  int scores = 0;
  std::istringstream lines(log);
  for (std::string line; std::getline(lines, line);) {
    auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || j.value("method", "") != "Score") continue;
    ++scores;
    peers.insert(j.value("peer", ""));
  }
  EXPECT_EQ(scores, 4);
  EXPECT_EQ(peers.size(), 4u) << log;

  for (v1::Reduction red : {v1::REDUCTION_MEAN, v1::REDUCTION_SUM, v1::REDUCTION_NONE}) {
    SCOPED_TRACE(v1::Reduction_Name(red));
    v1::RequestHeader fb;
    fb.set_reduction(red);
    fb.set_label_smoothing(0.1f);
    fb.set_z_loss(1e-3f);
    fb.add_outputs(v1::OUTPUT_LOSS);
    fb.add_outputs(v1::OUTPUT_LOGPROBS);
    auto r1 = one->ForwardBackward(View(b), fb);
    auto r4 = four->ForwardBackward(View(b), fb);
    ASSERT_TRUE(r1.ok() && r4.ok()) << r1.status() << r4.status();
    ExpectElementsNear(r4->loss, r1->loss, 1e-5, "loss");
    ExpectElementsNear(r4->logprobs, r1->logprobs, 1e-5, "logprobs");
    EXPECT_NEAR(r4->reduced_loss, r1->reduced_loss, 1e-9 * std::fabs(r1->reduced_loss) + 1e-12);
    EXPECT_EQ(r4->valid_tokens, r1->valid_tokens);
    // Each row's d_hidden depends on that row alone: the bytes agree exactly.
    EXPECT_EQ(r4->d_hidden, r1->d_hidden);
    // Into the caller's buffer instead: the same bytes, and none in the result.
    std::vector<uint8_t> mine(r1->d_hidden.size(), 0xAB);
    HiddenBatch into = View(b);
    into.d_hidden_out = absl::MakeSpan(mine);
    auto r5 = four->ForwardBackward(into, fb);
    ASSERT_TRUE(r5.ok()) << r5.status();
    EXPECT_TRUE(r5->d_hidden.empty());
    EXPECT_EQ(mine, r1->d_hidden);
  }

  std::vector<float> glp(b.rows), gent(b.rows);
  for (int64_t i = 0; i < b.rows; ++i) {
    glp[i] = 0.01f * static_cast<float>(i % 7) - 0.03f;
    gent[i] = 0.002f * static_cast<float>(i % 5);
  }
  auto bw1 = one->Backward(View(b), v1::RequestHeader(), glp, gent);
  auto bw4 = four->Backward(View(b), v1::RequestHeader(), glp, gent);
  ASSERT_TRUE(bw1.ok() && bw4.ok()) << bw1.status() << bw4.status();
  EXPECT_EQ(bw4->d_hidden, bw1->d_hidden);
}

TEST(MultiStream, AWrongDeclaredCountIsCaughtAcrossParts) {
  auto ts = StartTestServer();
  auto four = Connect(*ts, 4, 16 * kHidden * 2);
  const Batch b = MakeBatch(1000, v1::DTYPE_BFLOAT16, 22);
  v1::RequestHeader fb;
  fb.set_reduction(v1::REDUCTION_MEAN);
  fb.set_num_valid_tokens(3);  // not the batch's count
  auto r = four->ForwardBackward(View(b), fb);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("num_valid_tokens declared 3"), std::string::npos) << r.status();
}

TEST(MultiStream, AnErrorInOnePartFailsTheRequestWithThatError) {
  auto ts = StartTestServer();
  auto four = Connect(*ts, 4, 16 * kHidden * 2);
  Batch b = MakeBatch(1000, v1::DTYPE_BFLOAT16, 23);
  b.targets[900] = static_cast<int32_t>(kVocab) + 5;  // in the last part
  auto r = four->Score(View(b), v1::RequestHeader());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find(std::to_string(kVocab + 5)), std::string::npos) << r.status();
  // The server keeps serving.
  auto ok = four->Score(View(MakeBatch(1000, v1::DTYPE_BFLOAT16, 24)), v1::RequestHeader());
  EXPECT_TRUE(ok.ok()) << ok.status();
}

void ZeroGrad(v1::LceService::Stub& stub, const std::string& head) {
  grpc::ClientContext ctx;
  v1::ZeroGradRequest req;
  req.set_head(head);
  v1::ZeroGradResponse resp;
  ASSERT_TRUE(stub.ZeroGrad(&ctx, req, &resp).ok());
}

// The parts of a split request that accumulates dW share one contribution: a server that holds one
// at a time takes all four parts (before split_id, each part was a contribution of its own: those
// past --max-pending-grads were refused), the head's dW is one stream's, and a deferred request
// reports one id.
TEST(MultiStream, ASplitTrainingRequestFillsOneContribution) {
  auto ts = StartTestServer(8 << 20, false, true,
                            [](server::GrpcServerOptions& o) { o.service.pending_grads.max_per_head = 1; });
  auto stub = RawStub(ts->target);
  const int64_t chunk = 16 * kHidden * 4;
  auto one = Connect(*ts, 1, chunk);
  auto four = Connect(*ts, 4, chunk);
  const Batch b = MakeBatch(1000, v1::DTYPE_FLOAT32, 25);
  v1::RequestHeader h;
  h.set_head("wide");
  h.set_reduction(v1::REDUCTION_SUM);
  h.set_accumulate_weight_grad(true);
  ZeroGrad(*stub, "wide");
  auto r1 = one->ForwardBackward(View(b), h);
  ASSERT_TRUE(r1.ok()) << r1.status();
  const std::vector<float> want = GradOf(*stub, "wide");
  ZeroGrad(*stub, "wide");
  auto r4 = four->ForwardBackward(View(b), h);
  ASSERT_TRUE(r4.ok()) << r4.status();
  EXPECT_TRUE(r4->pending_grads.empty());
  ExpectElementsNear(GradOf(*stub, "wide"), want, 1e-5, "dW of four parts");

  ZeroGrad(*stub, "wide");
  h.set_defer_weight_grad(true);
  auto d4 = four->ForwardBackward(View(b), h);
  ASSERT_TRUE(d4.ok()) << d4.status();
  ASSERT_EQ(d4->pending_grads.size(), 1u) << "one contribution, one id";
  for (float x : GradOf(*stub, "wide")) ASSERT_EQ(x, 0.0f) << "nothing before the commit";
  {
    grpc::ClientContext ctx;
    v1::CommitGradRequest commit;
    commit.set_head("wide");
    commit.set_pending_grad_id(d4->pending_grads[0]);
    v1::CommitGradResponse resp;
    ASSERT_TRUE(stub->CommitGrad(&ctx, commit, &resp).ok());
  }
  ExpectElementsNear(GradOf(*stub, "wide"), want, 1e-5, "the deferred parts' dW, committed");
}

// A part of a split training request that fails adds nothing of the other parts' dW (each part a
// contribution of its own added its own before split_id).
TEST(MultiStream, AFailedPartOfASplitTrainingRequestAddsNothing) {
  auto ts = StartTestServer();
  auto stub = RawStub(ts->target);
  auto four = Connect(*ts, 4, 16 * kHidden * 4);
  Batch b = MakeBatch(1000, v1::DTYPE_FLOAT32, 27);
  v1::RequestHeader h;
  h.set_head("wide");
  h.set_reduction(v1::REDUCTION_SUM);
  h.set_accumulate_weight_grad(true);
  auto r4 = four->ForwardBackward(View(b), h);
  ASSERT_TRUE(r4.ok()) << r4.status();
  const std::vector<float> want = GradOf(*stub, "wide");
  ZeroGrad(*stub, "wide");
  Batch bad = b;
  bad.targets[900] = static_cast<int32_t>(kVocab) + 5;  // in the last part
  auto f4 = four->ForwardBackward(View(bad), h);
  ASSERT_FALSE(f4.ok());
  EXPECT_EQ(f4.status().code(), absl::StatusCode::kInvalidArgument) << f4.status();
  // The other parts may still be ending on the server (the client stopped reading them).
  std::vector<float> got;
  for (int i = 0; i < 100; ++i) {
    got = GradOf(*stub, "wide");
    if (std::any_of(got.begin(), got.end(), [](float x) { return x != 0.0f; })) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (float x : got) ASSERT_EQ(x, 0.0f) << "a failed split request added dW";
  auto again = four->ForwardBackward(View(b), h);
  ASSERT_TRUE(again.ok()) << again.status();
  ExpectElementsNear(GradOf(*stub, "wide"), want, 1e-5, "dW after a failed split request: the next one's alone");
}

// A part whose split_id does not fit the request is refused with the reason.
TEST(MultiStream, SplitIdNeedsAnAccumulatingPart) {
  auto ts = StartTestServer();
  auto stub = RawStub(ts->target);
  const Batch b = MakeBatch(4, v1::DTYPE_FLOAT32, 26);
  struct Case {
    bool partial, accumulate;
    int parts;
    uint64_t split;
    const char* says;
  };
  for (const Case& c : {Case{false, true, 2, 7, "split_id"}, Case{true, false, 2, 7, "split_id"},
                        Case{true, true, 1, 7, "split_parts in [2, 64]"}, Case{true, true, 65, 7, "(got 65)"},
                        Case{true, true, 2, 0, "split_parts needs split_id"}}) {
    v1::RequestHeader h;
    h.set_head("wide");
    h.set_hidden_size(kHidden);
    h.set_dtype(v1::DTYPE_FLOAT32);
    h.set_reduction(v1::REDUCTION_SUM);
    h.set_partial(c.partial);
    h.set_accumulate_weight_grad(c.accumulate);
    h.set_split_id(c.split);
    h.set_split_parts(c.parts);
    std::vector<v1::StreamResponse> out;
    grpc::Status s = RunOneChunk(*stub, "fb", h, b, &out);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.says;
    EXPECT_NE(s.error_message().find(c.says), std::string::npos) << s.error_message();
  }
}

}  // namespace
}  // namespace lce::e2e
