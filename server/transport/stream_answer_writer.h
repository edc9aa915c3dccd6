// Writes a stream's answers. With a thread of its own (the default), so that the next chunk is
// computed while the previous answer is still being written to the wire; at most `depth` answers
// wait in the queue, and Push blocks beyond that (back-pressure from a slow client reaches the
// compute loop).
// Where its thread cannot start (a task limit: thread_start.h) it writes as one without.
// Without a thread of its own (`own_thread` false), Push writes on the caller's thread: for callers
// that are already off the compute path (a pipelined stream's finish thread), where the extra hop
// only delayed each answer and the thread's start and join lengthened the request's ends.
// The stream's last message can go with its status (PushLast: gRPC's WriteLast, one write for both
// once the handler returns, and no wait for the message on its own).
#pragma once

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>

#include "grpcpp/support/sync_stream.h"
#include "thread_start.h"

namespace lce::server {

template <typename Resp>
class StreamAnswerWriter {
 public:
  StreamAnswerWriter(grpc::internal::WriterInterface<Resp>* stream, size_t depth, bool own_thread = true)
      : stream_(stream), depth_(depth) {
    if (!own_thread) return;
    absl::StatusOr<std::thread> t = StartThread("a stream's answer writer", [this] { Run(); });
    if (t.ok()) thread_ = *std::move(t);  // else Push writes on the caller's thread
  }
  // Whether answers leave from a thread of their own.
  bool own_thread() const { return thread_.joinable(); }
  ~StreamAnswerWriter() { Finish(); }

  // Queues an answer (writes it, without a thread). False once a write has failed (the client went
  // away), after Finish, or after PushLast.
  bool Push(Resp&& resp) { return Enqueue(std::move(resp), false); }
  // The same for the stream's last message: gRPC holds it and sends it with the status when the
  // handler returns. Nothing may be pushed after it.
  bool PushLast(Resp&& resp) { return Enqueue(std::move(resp), true); }

  // Writes everything queued, stops the thread. True when every write succeeded. Idempotent.
  bool Finish() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed_ = true;
      ready_.notify_one();
    }
    if (thread_.joinable()) thread_.join();
    std::lock_guard<std::mutex> lock(mu_);
    return !failed_;
  }

 private:
  bool Enqueue(Resp&& resp, bool last) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!thread_.joinable()) {  // writes on this thread; the lock keeps writes one at a time
      if (failed_ || closed_ || last_pushed_) return false;
      last_pushed_ = last;
      if (!WriteOne(std::move(resp), last)) failed_ = true;
      return !failed_;
    }
    space_.wait(lock, [&] { return queue_.size() < depth_ || failed_; });
    if (failed_ || closed_ || last_pushed_) return false;
    last_pushed_ = last;
    queue_.emplace_back(std::move(resp), last);
    ready_.notify_one();
    return true;
  }

  bool WriteOne(Resp&& resp, bool last) {
    if (!last) return stream_->Write(resp);
    last_ = std::move(resp);  // kept until the stream ends, as gRPC holds it
    return stream_->Write(last_, grpc::WriteOptions().set_last_message());
  }

  void Run() {
    for (;;) {
      std::pair<Resp, bool> item;
      {
        std::unique_lock<std::mutex> lock(mu_);
        ready_.wait(lock, [&] { return !queue_.empty() || closed_; });
        if (queue_.empty()) return;
        item = std::move(queue_.front());
        queue_.pop_front();
        space_.notify_one();
      }
      if (!WriteOne(std::move(item.first), item.second)) {
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
  std::deque<std::pair<Resp, bool>> queue_;  // an answer, and whether it is the last
  Resp last_;
  bool closed_ = false;
  bool failed_ = false;
  bool last_pushed_ = false;
  std::thread thread_;  // last: starts after the members it uses; none without own_thread
};

}  // namespace lce::server
