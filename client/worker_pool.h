// Threads kept for a client's life, so that a call's uploaders, writer and download shares start
// at once rather than each being made (and joined) for every call or chunk: on an H100 host the
// four uploaders' start delayed a data-plane call's creation by ~0.2 ms (bench/RESULTS.md).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace lce::client {

class WorkerPool {
 public:
  WorkerPool() = default;
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;
  // Waits for running tasks, then stops the workers.
  ~WorkerPool();

  // Runs `task` on an idle worker, making one when none is idle: tasks never wait for each other,
  // so tasks that wait for one another (a writer for its uploaders) cannot deadlock.
  void Run(std::function<void()> task);

  // Workers made so far, and those waiting for a task (tests).
  int64_t workers() const;
  int64_t idle_workers() const;

 private:
  void Work();

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  int64_t idle_ = 0;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

// Counts tasks down to their end: Wait returns once Done has been called `count` times.
class TaskLatch {
 public:
  explicit TaskLatch(int64_t count) : left_(count) {}
  void Done();
  void Wait();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t left_;
};

}  // namespace lce::client
