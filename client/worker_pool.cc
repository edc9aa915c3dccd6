#include "worker_pool.h"

#include <utility>

namespace lce::client {

WorkerPool::~WorkerPool() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void WorkerPool::Run(std::function<void()> task) {
  std::lock_guard<std::mutex> l(mu_);
  tasks_.push_back(std::move(task));
  // Tasks queued beyond the idle workers get a worker of their own.
  if (static_cast<int64_t>(tasks_.size()) > idle_) {
    threads_.emplace_back([this] { Work(); });
  } else {
    cv_.notify_one();
  }
}

int64_t WorkerPool::workers() const {
  std::lock_guard<std::mutex> l(mu_);
  return static_cast<int64_t>(threads_.size());
}

int64_t WorkerPool::idle_workers() const {
  std::lock_guard<std::mutex> l(mu_);
  return idle_;
}

void WorkerPool::Work() {
  std::unique_lock<std::mutex> l(mu_);
  for (;;) {
    ++idle_;
    cv_.wait(l, [&] { return !tasks_.empty() || stop_; });
    --idle_;
    if (tasks_.empty()) return;  // stopping
    std::function<void()> task = std::move(tasks_.front());
    tasks_.pop_front();
    l.unlock();
    task();
    l.lock();
  }
}

void TaskLatch::Done() {
  std::lock_guard<std::mutex> l(mu_);
  if (--left_ == 0) cv_.notify_all();
}

void TaskLatch::Wait() {
  std::unique_lock<std::mutex> l(mu_);
  cv_.wait(l, [&] { return left_ == 0; });
}

}  // namespace lce::client
