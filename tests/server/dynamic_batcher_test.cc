// DynamicBatcher over a fake engine (one float a row): merging, splitting, keys, errors that stay
// with their request, cancellation, and requests too large to batch.
#include "dynamic_batcher.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "metrics.h"

namespace lce::server {
namespace {

// One request: `rows` hidden values (one float each), its outputs, its answer.
struct Request {
  std::vector<float> hidden;
  std::vector<int32_t> targets;
  std::vector<float> logprob, d_hidden;
  absl::Status status;
  BatchRows View() {
    logprob.assign(hidden.size(), -1.0f);
    d_hidden.assign(hidden.size(), -1.0f);
    BatchRows r;
    r.hidden = hidden.data();
    r.targets = targets.data();
    r.rows = static_cast<int64_t>(hidden.size());
    r.logprob = logprob.data();
    r.d_hidden = d_hidden.data();
    return r;
  }
};

Request MakeRequest(int64_t rows, float first) {
  Request r;
  for (int64_t i = 0; i < rows; ++i) {
    r.hidden.push_back(first + static_cast<float>(i));
    r.targets.push_back(static_cast<int32_t>(i % 3));
  }
  return r;
}

// The fake engine: logprob = 2h + target, d_hidden = h + 1; a NaN row is an error naming it. Records
// the rows of each call.
struct FakeEngine {
  std::mutex mu;
  std::vector<int64_t> calls;
  absl::Status Run(const BatchRows& r) {
    {
      std::lock_guard<std::mutex> l(mu);
      calls.push_back(r.rows);
    }
    const float* h = static_cast<const float*>(r.hidden);
    for (int64_t i = 0; i < r.rows; ++i) {
      if (std::isnan(h[i])) return absl::InvalidArgumentError(absl::StrCat("row ", i, ": non-finite hidden state"));
    }
    for (int64_t i = 0; i < r.rows; ++i) {
      r.logprob[i] = 2 * h[i] + static_cast<float>(r.targets[i]);
      static_cast<float*>(r.d_hidden)[i] = h[i] + 1;
    }
    return absl::OkStatus();
  }
  std::vector<int64_t> Calls() {
    std::lock_guard<std::mutex> l(mu);
    return calls;
  }
};

void ExpectAnswered(const Request& r, const std::string& what) {
  ASSERT_TRUE(r.status.ok()) << what << ": " << r.status;
  for (size_t i = 0; i < r.hidden.size(); ++i) {
    EXPECT_EQ(r.logprob[i], 2 * r.hidden[i] + static_cast<float>(r.targets[i])) << what << " row " << i;
    EXPECT_EQ(r.d_hidden[i], r.hidden[i] + 1) << what << " row " << i;
  }
}

BatchKey KeyOf(Request& r, float temperature = 1.0f) {
  BatchKey k;
  static int head;  // any identity: the tests serve one head
  k.head = &head;
  k.options.temperature = temperature;
  k.row_bytes = sizeof(float);
  k.present = PresentArrays(r.View());
  return k;
}

// Runs each request on its own thread through `b`, all at once.
void RunAll(DynamicBatcher& b, FakeEngine& engine, std::vector<Request>& reqs, const std::vector<BatchKey>& keys,
            const std::vector<bool>& cancelled = {}) {
  std::vector<std::thread> threads;
  for (size_t i = 0; i < reqs.size(); ++i) {
    threads.emplace_back([&, i] {
      const BatchRows rows = reqs[i].View();
      const bool gone = i < cancelled.size() && cancelled[i];
      reqs[i].status = b.Run(keys[i], rows, [&](const BatchRows& r) { return engine.Run(r); },
                             [gone] { return gone; }, "score");
    });
  }
  for (auto& t : threads) t.join();
}

TEST(DynamicBatcher, MergesConcurrentRequestsIntoOneCallAndSplitsTheAnswers) {
  std::vector<Request> reqs;
  std::vector<BatchKey> keys;
  int64_t total = 0;
  for (int i = 0; i < 8; ++i) {
    reqs.push_back(MakeRequest(1 + i, 100.0f * static_cast<float>(i)));
    total += 1 + i;
  }
  for (auto& r : reqs) keys.push_back(KeyOf(r));
  metrics::Registry registry;
  ServiceMetrics m(registry);
  // A window that closes when the batch is full: all eight, in one call.
  DynamicBatcher b({.max_rows = total, .max_delay_us = 30000000}, &m);
  FakeEngine engine;
  RunAll(b, engine, reqs, keys);
  for (size_t i = 0; i < reqs.size(); ++i) ExpectAnswered(reqs[i], absl::StrCat("request ", i));
  EXPECT_EQ(engine.Calls(), std::vector<int64_t>{total});
  const std::string text = registry.Render();
  EXPECT_NE(text.find("lce_batch_requests_sum{op=\"score\"} 8\n"), std::string::npos) << text;
  EXPECT_NE(text.find(absl::StrCat("lce_batch_rows_sum{op=\"score\"} ", total, "\n")), std::string::npos) << text;
  EXPECT_NE(text.find("lce_batch_queue_seconds_count{op=\"score\"} 8\n"), std::string::npos) << text;
}

TEST(DynamicBatcher, RequestsOfDifferentKeysAreNeverMerged) {
  std::vector<Request> reqs = {MakeRequest(1, 1), MakeRequest(1, 2), MakeRequest(1, 3)};
  std::vector<BatchKey> keys = {KeyOf(reqs[0], 1.0f), KeyOf(reqs[1], 0.5f), KeyOf(reqs[2], 1.0f)};
  keys[2].present |= 1u << 2;  // the same options, but another output wanted
  // Each would fill a batch of two with a batch-mate of its own key; none has one.
  DynamicBatcher b({.max_rows = 2, .max_delay_us = 100000}, nullptr);
  FakeEngine engine;
  RunAll(b, engine, reqs, keys);
  for (size_t i = 0; i < reqs.size(); ++i) ExpectAnswered(reqs[i], absl::StrCat("request ", i));
  EXPECT_EQ(engine.Calls(), (std::vector<int64_t>{1, 1, 1}));
}

TEST(DynamicBatcher, AFailedMergedCallRunsEachRequestAloneSoTheErrorStaysWithItsRequest) {
  std::vector<Request> reqs = {MakeRequest(3, 0), MakeRequest(4, 10), MakeRequest(2, 20), MakeRequest(5, 30)};
  reqs[2].hidden[1] = std::nanf("");
  std::vector<BatchKey> keys;
  for (auto& r : reqs) keys.push_back(KeyOf(r));
  metrics::Registry registry;
  ServiceMetrics m(registry);
  DynamicBatcher b({.max_rows = 14, .max_delay_us = 30000000}, &m);
  FakeEngine engine;
  RunAll(b, engine, reqs, keys);
  for (size_t i : {0, 1, 3}) ExpectAnswered(reqs[i], absl::StrCat("request ", i));
  EXPECT_TRUE(absl::IsInvalidArgument(reqs[2].status)) << reqs[2].status;
  EXPECT_EQ(reqs[2].status.message(), "row 1: non-finite hidden state");  // its own row, as unbatched
  const std::vector<int64_t> calls = engine.Calls();
  ASSERT_EQ(calls.size(), 5u);
  EXPECT_EQ(calls[0], 14);
  EXPECT_NE(registry.Render().find("lce_batch_fallbacks_total{op=\"score\"} 1\n"), std::string::npos);
}

// A request whose client has gone is dropped when a batch forms, whether it would lead or follow;
// its rows never reach the engine and its batch-mates are answered.
TEST(DynamicBatcher, ACancelledRequestLeavesWithoutBreakingItsBatchMates) {
  std::vector<Request> reqs;
  for (int i = 0; i < 6; ++i) reqs.push_back(MakeRequest(2, 1000.0f * static_cast<float>(i)));
  std::vector<BatchKey> keys;
  for (auto& r : reqs) keys.push_back(KeyOf(r));
  DynamicBatcher b({.max_rows = 10, .max_delay_us = 20000}, nullptr);
  FakeEngine engine;
  RunAll(b, engine, reqs, keys, {true, false, false, true, false, false});
  int64_t rows = 0;
  for (int64_t n : engine.Calls()) rows += n;
  EXPECT_EQ(rows, 8);
  for (size_t i : {0, 3}) {
    EXPECT_TRUE(absl::IsCancelled(reqs[i].status)) << reqs[i].status;
    EXPECT_EQ(reqs[i].logprob[0], -1.0f) << "a cancelled request's outputs are not written";
  }
  for (size_t i : {1, 2, 4, 5}) ExpectAnswered(reqs[i], absl::StrCat("request ", i));
}

// Asking costs a poll of the call's completion queue on the sync server: a request that leads at once
// has waited for nothing and is not asked; one that waited for a window is.
TEST(DynamicBatcher, OnlyARequestThatWaitedIsAskedWhetherItWasCancelled) {
  for (int64_t window_us : {0, 1000}) {
    DynamicBatcher b({.max_rows = 64, .max_delay_us = window_us}, nullptr);
    FakeEngine engine;
    Request r = MakeRequest(3, 7.0f);
    int asked = 0;
    r.status = b.Run(KeyOf(r), r.View(), [&](const BatchRows& x) { return engine.Run(x); },
                     [&] { return ++asked, false; }, "score");
    ExpectAnswered(r, absl::StrCat("window ", window_us));
    EXPECT_EQ(asked, window_us > 0 ? 1 : 0) << "window " << window_us;
  }
}

TEST(DynamicBatcher, OffOrTooManyRowsRunsTheRequestAlone) {
  for (int64_t max_rows : {0, 1, 4}) {
    std::vector<Request> reqs = {MakeRequest(5, 0), MakeRequest(5, 50)};
    std::vector<BatchKey> keys = {KeyOf(reqs[0]), KeyOf(reqs[1])};
    DynamicBatcher b({.max_rows = max_rows, .max_delay_us = 1000000}, nullptr);
    FakeEngine engine;
    RunAll(b, engine, reqs, keys);
    for (size_t i = 0; i < reqs.size(); ++i) ExpectAnswered(reqs[i], absl::StrCat("max_rows ", max_rows));
    EXPECT_EQ(engine.Calls(), (std::vector<int64_t>{5, 5}));
  }
}

// Many clients at once, no window (launch when the engine is free): every answer right, whatever
// batches formed.
TEST(DynamicBatcher, ManyClientsWithoutAWindow) {
  DynamicBatcher b({.max_rows = 64, .max_delay_us = 0}, nullptr);
  FakeEngine engine;
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 16; ++t) {
    threads.emplace_back([&, t] {
      for (int k = 0; k < 40; ++k) {
        Request r = MakeRequest(1 + (t * 7 + k) % 17, static_cast<float>(t * 10000 + k * 100));
        const BatchKey key = KeyOf(r);
        const BatchRows rows = r.View();
        r.status = b.Run(key, rows, [&](const BatchRows& x) { return engine.Run(x); }, [] { return false; }, "score");
        for (size_t i = 0; i < r.hidden.size(); ++i) {
          wrong += !r.status.ok() || r.logprob[i] != 2 * r.hidden[i] + static_cast<float>(r.targets[i]) ||
                   r.d_hidden[i] != r.hidden[i] + 1;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
  int64_t rows = 0;
  for (int64_t n : engine.Calls()) rows += n;
  int64_t want = 0;
  for (int t = 0; t < 16; ++t) {
    for (int k = 0; k < 40; ++k) want += 1 + (t * 7 + k) % 17;
  }
  EXPECT_EQ(rows, want);
}

}  // namespace
}  // namespace lce::server
