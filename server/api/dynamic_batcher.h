// Dynamic batching of small requests (Triton Inference Server's dynamic batcher is the model):
// concurrent requests for the same head version, the same options and the same kind of call are
// merged into one engine call, whose per-row outputs are then split back out to each request.
// Safe because of DESIGN.md's invariance guarantee: a row's outputs are the same bits whatever its
// batch-mates (the caller batches only where the engine says so, LceEngine::invariance()).
//
// No threads of its own: the first request of an idle queue leads, running the batch on its own
// thread (with its own engine runner: locks, device staging) and handing the lead to the oldest
// waiting request afterwards. While a batch runs, new requests of its key wait; the next batch
// takes as many of them, oldest first, as fit in max_rows. With max_delay_us > 0 a leader first
// waits up to that long after its oldest request arrived for max_rows to fill (a fixed window);
// with 0 it launches at once (requests queue only while the engine is busy with their key).
//
// Errors stay with their request: a merged call that fails is run again one request at a time, so
// each request gets its own status (and its batch-mates their answers: the same bits). A request
// cancelled while it waits is dropped from the queue (CANCELLED); once in a running batch, it
// waits for the batch (one engine call) before its buffers are released.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/status.h"
#include "lce/engine.h"
#include "service_metrics.h"

namespace lce::server {

// One request's rows and where their outputs go, all host memory; a null pointer: not present.
struct BatchRows {
  const void* hidden = nullptr;  // rows x row_bytes
  const int32_t* targets = nullptr;
  int64_t rows = 0;
  const float* grad_loss = nullptr;
  const float* grad_logprob = nullptr;
  const float* grad_entropy = nullptr;
  float* logprob = nullptr;
  float* entropy = nullptr;
  float* loss = nullptr;
  void* d_hidden = nullptr;  // rows x row_bytes
};

// What requests must share to be merged. Options compare by their bits (EncodeOptions: every field).
struct BatchKey {
  const void* head = nullptr;  // the head's version (ServedHead): a batch never mixes versions
  LceOptions options;
  GradMode mode = GradMode::kNone;
  int64_t row_bytes = 0;
  uint32_t present = 0;  // which of BatchRows' optional arrays are set (PresentArrays)

  bool operator<(const BatchKey& o) const;
};

// The bit set of BatchKey::present for `rows`.
uint32_t PresentArrays(const BatchRows& rows);

class DynamicBatcher {
 public:
  struct Options {
    int64_t max_rows = 0;      // rows of a merged call at most; <= 1: batching off
    int64_t max_delay_us = 0;  // a leader's wait for more rows (0: none)
  };
  // Runs one engine call over `rows` (merged or a single request's).
  using Runner = std::function<absl::Status(const BatchRows& rows)>;
  // When the request's rows went to the engine and came back (for its request log).
  struct Timing {
    std::chrono::steady_clock::time_point enqueued, launched, ended;
    int64_t batch_rows = 0;
  };

  // `metrics` (not owned, may be null): batch sizes, queue delay, fallbacks.
  DynamicBatcher(Options options, ServiceMetrics* metrics);
  ~DynamicBatcher();
  DynamicBatcher(const DynamicBatcher&) = delete;
  DynamicBatcher& operator=(const DynamicBatcher&) = delete;

  bool enabled() const { return options_.max_rows > 1; }
  const Options& options() const { return options_; }

  // Computes `rows` in a batch of key `key`, blocking until its outputs are written or it is
  // dropped. `run` is this request's engine runner (used if it leads; alone when batching is off or
  // the request has more than max_rows). `cancelled` is asked when a batch forms (a request that
  // waits is dropped then; one that led on arrival is not asked); `op` labels the metrics.
  absl::Status Run(const BatchKey& key, const BatchRows& rows, const Runner& run,
                   const std::function<bool()>& cancelled, const char* op, Timing* timing = nullptr);

 private:
  struct Item;
  struct Queue;
  // The leader's turn: one batch (with `self` in it) taken from `q`, run, and answered; then the
  // lead handed on. Called and returns with `lock` held.
  void Lead(std::unique_lock<std::mutex>& lock, const BatchKey& key, Queue& q, Item& self, const Runner& run,
            const char* op);
  // Takes out of `batch` (answered CANCELLED) the requests whose client left while they waited.
  // Called and returns with `lock` not held.
  void DropCancelled(std::unique_lock<std::mutex>& lock, std::vector<Item*>& batch);
  // The batch's rows through `run`; a failed merged call again one request at a time.
  void Execute(const BatchKey& key, Queue& q, const std::vector<Item*>& batch, const Runner& run, const char* op);
  // The batch's `n` rows gathered into `q`'s arrays, one call, the outputs scattered back.
  absl::Status RunMerged(const BatchKey& key, Queue& q, const std::vector<Item*>& batch, int64_t n, const Runner& run);

  const Options options_;
  ServiceMetrics* const metrics_;
  std::mutex mu_;
  std::map<BatchKey, std::unique_ptr<Queue>> queues_;  // only keys with requests waiting or running
};

}  // namespace lce::server
