#include "engine_call_pipeline.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "thread_start.h"

namespace lce::server {
namespace {

using std::chrono::milliseconds;

// Records the order of the steps, from any thread.
struct Log {
  std::mutex mu;
  std::vector<std::string> events;
  void Add(std::string e) {
    std::lock_guard<std::mutex> l(mu);
    events.push_back(std::move(e));
  }
};

TEST(EngineCallPipelineTest, CallsAndFinishesRunInOrderOnTheirOwnThreads) {
  RequestWork work;
  Log log;
  const std::thread::id caller = std::this_thread::get_id();
  std::atomic<int> on_caller_thread{0}, without_work{0};
  {
    std::unique_ptr<EngineCallPipeline> owned = *EngineCallPipeline::Start(&work);
    EngineCallPipeline& p = *owned;
    for (int i = 0; i < 4; ++i) {
      p.Submit(
          [&, i] {
            std::this_thread::sleep_for(milliseconds(i == 0 ? 20 : 1));  // the first is slow
            log.Add(absl::StrCat("call ", i));
            on_caller_thread += std::this_thread::get_id() == caller;
            without_work += RequestWork::Current() != &work;
            return absl::OkStatus();
          },
          [&, i] {
            log.Add(absl::StrCat("finish ", i));
            on_caller_thread += std::this_thread::get_id() == caller;
            without_work += RequestWork::Current() != &work;
            return absl::OkStatus();
          });
    }
    EXPECT_EQ(p.outstanding(), 4);
    for (int i = 0; i < 4; ++i) EXPECT_TRUE(p.WaitOldest().ok());
    EXPECT_EQ(p.outstanding(), 0);
  }
  std::vector<std::string> calls, finishes;
  for (const auto& e : log.events) (e.rfind("call", 0) == 0 ? calls : finishes).push_back(e);
  EXPECT_EQ(calls, (std::vector<std::string>{"call 0", "call 1", "call 2", "call 3"}));
  EXPECT_EQ(finishes, (std::vector<std::string>{"finish 0", "finish 1", "finish 2", "finish 3"}));
  EXPECT_EQ(on_caller_thread.load(), 0);
  EXPECT_EQ(without_work.load(), 0);  // steps count in the request's accounting
}

TEST(EngineCallPipelineTest, ClosedItStillRunsWhatWasSubmitted) {
  // Close says no more will come (the stream's last chunk was read): the jobs already queued still
  // run, in order, and their statuses are there to wait for.
  Log log;
  {
    std::unique_ptr<EngineCallPipeline> owned = *EngineCallPipeline::Start(nullptr);
    EngineCallPipeline& p = *owned;
    for (int i = 0; i < 3; ++i) {
      p.Submit(
          [&, i] {
            std::this_thread::sleep_for(milliseconds(5));
            log.Add(absl::StrCat("call ", i));
            return absl::OkStatus();
          },
          [&, i] {
            log.Add(absl::StrCat("finish ", i));
            return i == 2 ? absl::InternalError("third") : absl::OkStatus();
          });
    }
    p.Close();
    EXPECT_TRUE(p.WaitOldest().ok());
    EXPECT_TRUE(p.WaitOldest().ok());
    EXPECT_EQ(p.WaitOldest().message(), "third");
    EXPECT_EQ(p.outstanding(), 0);
  }
  std::vector<std::string> calls, finishes;
  for (const auto& e : log.events) (e.rfind("call", 0) == 0 ? calls : finishes).push_back(e);
  EXPECT_EQ(calls, (std::vector<std::string>{"call 0", "call 1", "call 2"}));
  EXPECT_EQ(finishes, (std::vector<std::string>{"finish 0", "finish 1", "finish 2"}));
}

TEST(EngineCallPipelineTest, TheNextCallRunsWhileTheLastOneFinishes) {
  // A slow finish (outputs copied back, the answer queued) must not hold the next call back.
  std::unique_ptr<EngineCallPipeline> owned = *EngineCallPipeline::Start(nullptr);
  EngineCallPipeline& p = *owned;
  std::atomic<bool> second_call_ran{false}, first_finish_saw_it{false};
  p.Submit([] { return absl::OkStatus(); },
           [&] {
             for (int i = 0; i < 2000 && !second_call_ran; ++i) std::this_thread::sleep_for(milliseconds(1));
             first_finish_saw_it = second_call_ran.load();
             return absl::OkStatus();
           });
  p.Submit(
      [&] {
        second_call_ran = true;
        return absl::OkStatus();
      },
      [] { return absl::OkStatus(); });
  EXPECT_TRUE(p.WaitOldest().ok());
  EXPECT_TRUE(p.WaitOldest().ok());
  EXPECT_TRUE(first_finish_saw_it.load());
}

TEST(EngineCallPipelineTest, AFailedCallIsNotFinishedAndLaterOnesAreSkipped) {
  std::unique_ptr<EngineCallPipeline> owned = *EngineCallPipeline::Start(nullptr);
  EngineCallPipeline& p = *owned;
  std::atomic<int> calls{0}, finishes{0};
  auto ok_call = [&] {
    ++calls;
    return absl::OkStatus();
  };
  auto finish = [&] {
    ++finishes;
    return absl::OkStatus();
  };
  p.Submit(ok_call, finish);
  p.Submit(
      [&] {
        ++calls;
        return absl::InvalidArgumentError("row 7: non-finite logits");
      },
      finish);
  p.Submit(ok_call, finish);
  EXPECT_TRUE(p.WaitOldest().ok());  // the chunk before the failure is answered
  absl::Status failed = p.WaitOldest();
  EXPECT_EQ(failed.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(failed.message(), "row 7: non-finite logits");
  EXPECT_EQ(p.WaitOldest().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(calls.load(), 2);
  EXPECT_EQ(finishes.load(), 1);
}

TEST(EngineCallPipelineTest, AFailedFinishSkipsLaterFinishesButNotEarlierOnes) {
  // The client went away while chunk 1 was answered: chunk 0 still counts as answered, chunk 2 not.
  std::unique_ptr<EngineCallPipeline> owned = *EngineCallPipeline::Start(nullptr);
  EngineCallPipeline& p = *owned;
  std::atomic<int> finishes{0};
  auto call = [] { return absl::OkStatus(); };
  p.Submit(call, [&] {
    ++finishes;
    return absl::OkStatus();
  });
  p.Submit(call, [] { return absl::CancelledError("client went away"); });
  p.Submit(call, [&] {
    ++finishes;
    return absl::OkStatus();
  });
  EXPECT_TRUE(p.WaitOldest().ok());
  EXPECT_EQ(p.WaitOldest().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(p.WaitOldest().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(finishes.load(), 1);
}

TEST(EngineCallPipelineTest, SubmitReturnsWhileTheCallRuns) {
  std::unique_ptr<EngineCallPipeline> owned = *EngineCallPipeline::Start(nullptr);
  EngineCallPipeline& p = *owned;
  std::atomic<bool> release{false}, started{false};
  p.Submit(
      [&] {
        started = true;
        while (!release) std::this_thread::sleep_for(std::chrono::microseconds(100));
        return absl::OkStatus();
      },
      [] { return absl::OkStatus(); });
  // The handler goes on (reads and stages the next chunk) while the call runs.
  while (!started) std::this_thread::sleep_for(std::chrono::microseconds(100));
  EXPECT_EQ(p.outstanding(), 1);
  release = true;
  EXPECT_TRUE(p.WaitOldest().ok());
}

TEST(EngineCallPipelineTest, DestructionRunsWhatWasSubmittedBeforeItReturns) {
  // A stream that fails while chunks are queued leaves them to finish: their buffers live in the
  // handler's frame, so the pipeline must not return from its destructor with a step running.
  std::atomic<int> done{0};
  {
    std::unique_ptr<EngineCallPipeline> owned = *EngineCallPipeline::Start(nullptr);
    EngineCallPipeline& p = *owned;
    for (int i = 0; i < 3; ++i) {
      p.Submit(
          [&] {
            std::this_thread::sleep_for(milliseconds(5));
            return absl::OkStatus();
          },
          [&] {
            std::this_thread::sleep_for(milliseconds(2));
            ++done;
            return absl::OkStatus();
          });
    }
  }
  EXPECT_EQ(done.load(), 3);
}

// Issue 35, item 4: either thread failing to start (a task limit) is RESOURCE_EXHAUSTED for the
// caller, who then runs the stream serially; nothing aborts, nothing is left running.
TEST(EngineCallPipelineTest, AThreadThatCannotStartIsResourceExhausted) {
  for (int after : {0, 1}) {  // the caller's thread, the finisher's
    FailThreadStartsForTest(1, after);
    auto p = EngineCallPipeline::Start(nullptr);
    EXPECT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted) << after << ": " << p.status();
  }
  FailThreadStartsForTest(0);
  auto p = EngineCallPipeline::Start(nullptr);
  ASSERT_TRUE(p.ok()) << p.status();
  (*p)->Submit([] { return absl::OkStatus(); }, [] { return absl::OkStatus(); });
  EXPECT_TRUE((*p)->WaitOldest().ok());
}

// Mergeable jobs (SubmitMergeable): the jobs of one group queued behind a busy call run as one call —
// the first's, with all their rows — and each is finished after it with its status; other groups and
// group 0 run alone; a merged call's failure is each of its jobs', and later jobs are skipped.
TEST(EngineCallPipelineTest, AGroupsJobsQueuedBehindABusyCallRunAsOne) {
  for (const bool fail : {false, true}) {
    SCOPED_TRACE(fail);
    Log log;
    std::atomic<bool> started{false}, release{false};
    std::unique_ptr<EngineCallPipeline> p = *EngineCallPipeline::Start(nullptr);
    auto finish = [&](std::string name) {
      return [&log, name] {
        log.Add("finish " + name);
        return absl::OkStatus();
      };
    };
    auto call = [&](std::string name) {
      return [&log, &started, &release, name, fail](int64_t rows, int64_t jobs) {
        started = true;
        while (name == "A" && !release) std::this_thread::sleep_for(milliseconds(1));
        log.Add(absl::StrCat("call ", name, " ", rows, " ", jobs));
        return fail && name == "B" ? absl::InternalError("B's call failed") : absl::OkStatus();
      };
    };
    p->SubmitMergeable(1, 2, call("A"), finish("A"));  // group 1, running alone: the engine is busy with it
    while (!started) std::this_thread::sleep_for(milliseconds(1));
    p->SubmitMergeable(2, 3, call("B"), finish("B"));
    p->SubmitMergeable(2, 5, call("C"), finish("C"));
    p->SubmitMergeable(3, 7, call("D"), finish("D"));
    p->SubmitMergeable(0, 1, call("E"), finish("E"));
    p->SubmitMergeable(0, 4, call("F"), finish("F"));
    EXPECT_EQ(p->outstanding(), 6);
    release = true;
    std::vector<absl::Status> got;
    for (int i = 0; i < 6; ++i) got.push_back(p->WaitOldest());
    EXPECT_EQ(p->outstanding(), 0);
    EXPECT_TRUE(got[0].ok());
    std::vector<std::string> calls, finishes;  // each thread's order (the two interleave)
    for (const auto& e : log.events) (e.rfind("call", 0) == 0 ? calls : finishes).push_back(e);
    if (!fail) {
      for (const absl::Status& s : got) EXPECT_TRUE(s.ok()) << s;
      EXPECT_EQ(calls,
                (std::vector<std::string>{"call A 2 1", "call B 8 2", "call D 7 1", "call E 1 1", "call F 4 1"}));
      EXPECT_EQ(finishes,
                (std::vector<std::string>{"finish A", "finish B", "finish C", "finish D", "finish E", "finish F"}));
    } else {
      EXPECT_EQ(got[1].message(), "B's call failed");  // B's and C's, computed together
      EXPECT_EQ(got[2].message(), "B's call failed");
      for (int i = 3; i < 6; ++i) EXPECT_EQ(got[i].code(), absl::StatusCode::kAborted) << got[i];
      EXPECT_EQ(calls, (std::vector<std::string>{"call A 2 1", "call B 8 2"}));
      EXPECT_EQ(finishes, (std::vector<std::string>{"finish A"}));
    }
  }
}

}  // namespace
}  // namespace lce::server
