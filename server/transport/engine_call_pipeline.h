// Runs one stream's engine calls on a thread of their own, in the order submitted, and each call's
// finish (outputs back to the host, the answer queued) on a second thread, so that the stream's
// handler reads, checks and stages chunk k+1, and chunk k-1 is answered, while chunk k computes:
// the GPU goes from one chunk's call to the next without waiting for that host work (measured on
// an H100 before: ≈0.19 ms idle between a request's calls; bench/RESULTS.md).
#pragma once

#include <climits>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include <memory>

#include "absl/status/statusor.h"
#include "request_log.h"

namespace lce::server {

class EngineCallPipeline {
 public:
  using Step = std::function<absl::Status()>;
  // A call that may run for several jobs at once: `rows` in all, `jobs` of them (SubmitMergeable).
  using MergeableCall = std::function<absl::Status(int64_t rows, int64_t jobs)>;
  // Calls and finishes count in `work`'s accounting (null: none), as on the handler's thread.
  // RESOURCE_EXHAUSTED when its threads cannot start (a task limit): the caller runs serially.
  static absl::StatusOr<std::unique_ptr<EngineCallPipeline>> Start(RequestWork* work);
  EngineCallPipeline(const EngineCallPipeline&) = delete;
  EngineCallPipeline& operator=(const EngineCallPipeline&) = delete;
  // Runs what was submitted to its end (callers' buffers must outlive the steps), then stops.
  ~EngineCallPipeline();

  // Queues `call`, and `finish` to run once `call` has returned OK; returns at once. After a step
  // has failed, later submissions run neither step (their status: ABORTED). Not after Close.
  void Submit(Step call, Step finish);
  // As Submit, for a job of `rows` rows whose call may also compute the jobs of the same `group` (> 0)
  // queued right behind it when the caller thread takes it (they arrived while the engine was busy):
  // the first's `call(rows of them all, how many)` runs once, and each job's finish after it, with its
  // status. Group 0: alone. The caller must have laid a group's rows out one after the other.
  void SubmitMergeable(int64_t group, int64_t rows, MergeableCall call, Step finish);
  // Waits for the oldest submission not yet waited for to be done (both steps, or the failed one)
  // and returns its status. Only then may the caller touch that submission's buffers again. Must
  // not be called with nothing outstanding.
  absl::Status WaitOldest();
  // Submissions not yet waited for.
  int64_t outstanding() const;
  // No more submissions: the threads end on their own once the last job is done (the destructor
  // then has nothing left to wait for).
  void Close();

 private:
  struct Job {
    MergeableCall call;  // Submit's call: alone (group 0), its arguments unused
    Step finish;
    int64_t seq = 0;
    absl::Status status;
    int64_t group = 0, rows = 0;
  };
  // The job at the front, and those of its group queued right behind it; `mu_` held.
  std::vector<Job> TakeCall();
  explicit EngineCallPipeline(RequestWork* work) : work_(work) {}
  void RunCalls();
  void RunFinishes();

  RequestWork* const work_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> to_call_, to_finish_;
  std::deque<absl::Status> done_;
  int64_t outstanding_ = 0, submitted_ = 0;
  int64_t first_failed_ = INT64_MAX;  // the earliest job whose step failed: later ones are skipped
  bool stop_calls_ = false, calls_done_ = false;
  std::thread caller_, finisher_;
};

}  // namespace lce::server
