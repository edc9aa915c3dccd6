// Sends a stream's answers from a thread of its own, so that the next chunk is computed while the
// previous answer is still being written to the wire. At most `depth` answers wait in the queue;
// Push blocks beyond that (back-pressure from a slow client reaches the compute loop).
#pragma once

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "grpcpp/support/sync_stream.h"

namespace lce::server {

template <typename Resp>
class AsyncStreamWriter {
 public:
  AsyncStreamWriter(grpc::internal::WriterInterface<Resp>* stream, size_t depth)
      : stream_(stream), depth_(depth), thread_([this] { Run(); }) {}
  ~AsyncStreamWriter() { Finish(); }

  // Queues an answer. False once a write has failed (the client went away).
  bool Push(Resp&& resp) {
    std::unique_lock<std::mutex> lock(mu_);
    space_.wait(lock, [&] { return queue_.size() < depth_ || failed_; });
    if (failed_) return false;
    queue_.push_back(std::move(resp));
    ready_.notify_one();
    return true;
  }

  // Writes everything queued, stops the thread. True when every write succeeded. Idempotent.
  bool Finish() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed_ = true;
      ready_.notify_one();
    }
    if (thread_.joinable()) thread_.join();
    return !failed_;
  }

 private:
  void Run() {
    for (;;) {
      Resp resp;
      {
        std::unique_lock<std::mutex> lock(mu_);
        ready_.wait(lock, [&] { return !queue_.empty() || closed_; });
        if (queue_.empty()) return;
        resp = std::move(queue_.front());
        queue_.pop_front();
        space_.notify_one();
      }
      if (!stream_->Write(resp)) {
        std::lock_guard<std::mutex> lock(mu_);
        failed_ = true;
        queue_.clear();
        space_.notify_all();
        return;
      }
    }
  }

  grpc::internal::WriterInterface<Resp>* stream_;
  const size_t depth_;
  std::mutex mu_;
  std::condition_variable ready_, space_;
  std::deque<Resp> queue_;
  bool closed_ = false;
  bool failed_ = false;
  std::thread thread_;  // last: starts after the members it uses
};

}  // namespace lce::server
