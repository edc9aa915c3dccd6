#include "engine_call_pipeline.h"

#include <algorithm>
#include <utility>

#include "thread_start.h"

namespace lce::server {

absl::StatusOr<std::unique_ptr<EngineCallPipeline>> EngineCallPipeline::Start(RequestWork* work) {
  std::unique_ptr<EngineCallPipeline> p(new EngineCallPipeline(work));
  absl::StatusOr<std::thread> caller = StartThread("a stream's engine calls", [q = p.get()] { q->RunCalls(); });
  if (!caller.ok()) return caller.status();
  p->caller_ = *std::move(caller);
  // Without a finisher the caller ends at once (closed, nothing queued): the destructor joins it.
  absl::StatusOr<std::thread> finisher = StartThread("a stream's answers", [q = p.get()] { q->RunFinishes(); });
  if (!finisher.ok()) return finisher.status();
  p->finisher_ = *std::move(finisher);
  return p;
}

EngineCallPipeline::~EngineCallPipeline() {
  Close();
  if (caller_.joinable()) caller_.join();  // every call has run and handed its job on
  if (finisher_.joinable()) finisher_.join();
}

void EngineCallPipeline::Close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_calls_ = true;
  }
  cv_.notify_all();
}

void EngineCallPipeline::Submit(Step call, Step finish) {
  SubmitMergeable(
      0, 0, [call = std::move(call)](int64_t, int64_t) { return call(); }, std::move(finish));
}

void EngineCallPipeline::SubmitMergeable(int64_t group, int64_t rows, MergeableCall call, Step finish) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    to_call_.push_back(Job{std::move(call), std::move(finish), submitted_++, absl::OkStatus(), group, rows});
    ++outstanding_;
  }
  cv_.notify_all();
}

std::vector<EngineCallPipeline::Job> EngineCallPipeline::TakeCall() {
  std::vector<Job> jobs;
  jobs.push_back(std::move(to_call_.front()));
  to_call_.pop_front();
  const int64_t group = jobs.front().group;
  while (group > 0 && !to_call_.empty() && to_call_.front().group == group) {
    jobs.push_back(std::move(to_call_.front()));
    to_call_.pop_front();
  }
  return jobs;
}

absl::Status EngineCallPipeline::WaitOldest() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !done_.empty(); });
  absl::Status s = std::move(done_.front());
  done_.pop_front();
  --outstanding_;
  return s;
}

int64_t EngineCallPipeline::outstanding() const {
  std::lock_guard<std::mutex> lock(mu_);
  return outstanding_;
}

void EngineCallPipeline::RunCalls() {
  RequestWork::Scope scope(work_);
  for (;;) {
    std::vector<Job> jobs;
    bool skip = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return !to_call_.empty() || stop_calls_; });
      if (to_call_.empty()) {  // closed, and every call has run: the finisher ends after the last finish
        calls_done_ = true;
        cv_.notify_all();
        return;
      }
      jobs = TakeCall();
      skip = jobs.front().seq > first_failed_;
    }
    int64_t rows = 0;
    for (const Job& j : jobs) rows += j.rows;
    Job& first = jobs.front();
    const absl::Status status = skip ? absl::AbortedError("an earlier chunk of the stream failed")
                                     : first.call(rows, static_cast<int64_t>(jobs.size()));
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!status.ok()) first_failed_ = std::min(first_failed_, first.seq);
      for (Job& j : jobs) {
        j.status = status;
        to_finish_.push_back(std::move(j));
      }
    }
    cv_.notify_all();
  }
}

void EngineCallPipeline::RunFinishes() {
  RequestWork::Scope scope(work_);
  for (;;) {
    Job job;
    bool skip = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return !to_finish_.empty() || calls_done_; });
      if (to_finish_.empty()) return;
      job = std::move(to_finish_.front());
      to_finish_.pop_front();
      skip = job.status.ok() && job.seq > first_failed_;  // a later job of a failed stream
    }
    if (skip) job.status = absl::AbortedError("an earlier chunk of the stream failed");
    if (job.status.ok()) job.status = job.finish();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!job.status.ok()) first_failed_ = std::min(first_failed_, job.seq);
      done_.push_back(std::move(job.status));
    }
    cv_.notify_all();
  }
}

}  // namespace lce::server
