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
  {
    std::lock_guard<std::mutex> lock(mu_);
    to_call_.push_back(Job{std::move(call), std::move(finish), submitted_++, absl::OkStatus()});
    ++outstanding_;
  }
  cv_.notify_all();
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
    Job job;
    bool skip = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return !to_call_.empty() || stop_calls_; });
      if (to_call_.empty()) {  // closed, and every call has run: the finisher ends after the last finish
        calls_done_ = true;
        cv_.notify_all();
        return;
      }
      job = std::move(to_call_.front());
      to_call_.pop_front();
      skip = job.seq > first_failed_;
    }
    job.status = skip ? absl::AbortedError("an earlier chunk of the stream failed") : job.call();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!job.status.ok()) first_failed_ = std::min(first_failed_, job.seq);
      to_finish_.push_back(std::move(job));
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
