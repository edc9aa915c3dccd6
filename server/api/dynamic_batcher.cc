#include "dynamic_batcher.h"

#include <cstring>
#include <deque>
#include <tuple>

#include "engine_options.h"
#include "status_macros.h"

namespace lce::server {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// Appends `n` elements of `src` at element `at` of `dst` (nothing when `src` is null).
template <typename T>
void Gather(std::vector<T>& dst, const T* src, int64_t at, int64_t n) {
  if (src != nullptr) std::memcpy(dst.data() + at, src, static_cast<size_t>(n) * sizeof(T));
}

template <typename T>
void Scatter(T* dst, const std::vector<T>& src, int64_t at, int64_t n) {
  if (dst != nullptr) std::memcpy(dst, src.data() + at, static_cast<size_t>(n) * sizeof(T));
}

}  // namespace

bool BatchKey::operator<(const BatchKey& o) const {
  auto tied = [](const BatchKey& k) {
    return std::make_tuple(k.head, EncodeOptions(k.options), k.mode, k.row_bytes, k.present);
  };
  return tied(*this) < tied(o);
}

uint32_t PresentArrays(const BatchRows& r) {
  const void* arrays[] = {r.grad_loss, r.grad_logprob, r.grad_entropy, r.logprob, r.entropy, r.loss, r.d_hidden};
  uint32_t bits = 0;
  for (size_t k = 0; k < sizeof arrays / sizeof arrays[0]; ++k) bits |= arrays[k] != nullptr ? 1u << k : 0u;
  return bits;
}

struct DynamicBatcher::Item {
  const BatchRows* rows;
  const std::function<bool()>* cancelled;
  Timing timing;
  absl::Status status;
  bool done = false, lead = false;
  bool waited = false;  // it queued or held a window: its client may have left meanwhile
  std::condition_variable cv;
};

struct DynamicBatcher::Queue {
  std::deque<Item*> waiting;
  int64_t waiting_rows = 0;
  bool running = false;              // a leader holds the queue
  std::condition_variable window;    // the leader's wait for rows (max_delay_us)
  // The merged call's arrays, the leader's alone while it runs.
  std::vector<uint8_t> hidden, d_hidden;
  std::vector<int32_t> targets;
  std::vector<float> in[3], out[3];  // grad_loss, grad_logprob, grad_entropy; logprob, entropy, loss
};

DynamicBatcher::DynamicBatcher(Options options, ServiceMetrics* metrics) : options_(options), metrics_(metrics) {}
DynamicBatcher::~DynamicBatcher() = default;

absl::Status DynamicBatcher::Run(const BatchKey& key, const BatchRows& rows, const Runner& run,
                                 const std::function<bool()>& cancelled, const char* op, Timing* timing) {
  if (!enabled() || rows.rows > options_.max_rows) return run(rows);  // the caller sends only what fits
  Item item;
  item.rows = &rows;
  item.cancelled = &cancelled;
  item.timing.enqueued = Clock::now();
  {
    std::unique_lock<std::mutex> lock(mu_);
    std::unique_ptr<Queue>& slot = queues_[key];
    if (slot == nullptr) slot = std::make_unique<Queue>();
    Queue& q = *slot;
    q.waiting.push_back(&item);
    q.waiting_rows += rows.rows;
    if (!q.running) {
      q.running = true;
      item.lead = true;
    } else {
      item.waited = true;
      if (q.waiting_rows >= options_.max_rows) q.window.notify_one();  // a leader waiting for rows has enough
    }
    while (!item.done) {
      if (item.lead) {
        Lead(lock, key, q, item, run, op);  // may free `q`: the loop ends here (`item` is done)
      } else {
        item.cv.wait(lock);
      }
    }
  }
  if (metrics_ != nullptr && item.timing.launched != Clock::time_point{}) {
    metrics_->batch_queue_seconds.WithLabels({op}).Observe(Seconds(item.timing.launched - item.timing.enqueued));
  }
  if (timing != nullptr) *timing = item.timing;
  return item.status;
}

void DynamicBatcher::Lead(std::unique_lock<std::mutex>& lock, const BatchKey& key, Queue& q, Item& self,
                          const Runner& run, const char* op) {
  if (options_.max_delay_us > 0) {
    const Clock::time_point until = q.waiting.front()->timing.enqueued + std::chrono::microseconds(options_.max_delay_us);
    q.window.wait_until(lock, until, [&] { return q.waiting_rows >= options_.max_rows; });
    self.waited = true;
  }
  // Oldest first (the leader is the oldest), as many as fit.
  std::vector<Item*> batch;
  int64_t n = 0;
  while (!q.waiting.empty() && n + q.waiting.front()->rows->rows <= options_.max_rows) {
    Item* it = q.waiting.front();
    q.waiting.pop_front();
    q.waiting_rows -= it->rows->rows;
    batch.push_back(it);
    n += it->rows->rows;
  }
  lock.unlock();
  DropCancelled(lock, batch);
  if (!batch.empty()) Execute(key, q, batch, run, op);
  lock.lock();
  for (Item* it : batch) {
    it->done = true;
    if (it != &self) it->cv.notify_one();
  }
  // `self` was first, so it is done (answered or cancelled): the lead passes on, or the queue goes.
  self.lead = false;
  if (q.waiting.empty()) {
    queues_.erase(key);
  } else {
    q.waiting.front()->lead = true;
    q.waiting.front()->cv.notify_one();
  }
}

void DynamicBatcher::DropCancelled(std::unique_lock<std::mutex>& lock, std::vector<Item*>& batch) {
  // Asked without the lock: a sync server's IsCancelled polls the call's completion queue (~10 us).
  // A request that led at once on arrival waited for nothing, so it is not asked.
  std::vector<Item*> gone;
  std::erase_if(batch, [&gone](Item* it) {
    if (!it->waited || !(*it->cancelled)()) return false;
    gone.push_back(it);
    return true;
  });
  if (gone.empty()) return;
  lock.lock();
  for (Item* it : gone) {
    it->status = absl::CancelledError("client cancelled while its request waited for a batch");
    it->done = true;
    it->cv.notify_one();
  }
  lock.unlock();
}

void DynamicBatcher::Execute(const BatchKey& key, Queue& q, const std::vector<Item*>& batch, const Runner& run,
                             const char* op) {
  const Clock::time_point launched = Clock::now();
  int64_t n = 0;
  for (Item* it : batch) n += it->rows->rows;
  if (metrics_ != nullptr) {
    metrics_->batch_rows.WithLabels({op}).Observe(static_cast<double>(n));
    metrics_->batch_requests.WithLabels({op}).Observe(static_cast<double>(batch.size()));
  }
  if (batch.size() == 1) {
    batch[0]->status = run(*batch[0]->rows);
  } else if (absl::Status s = RunMerged(key, q, batch, n, run); !s.ok()) {
    // Whose rows failed is theirs to hear, with the row named as in an unbatched call.
    if (metrics_ != nullptr) metrics_->batch_fallbacks.WithLabels({op}).Increment();
    for (Item* it : batch) it->status = run(*it->rows);
  }
  const Clock::time_point ended = Clock::now();
  for (Item* it : batch) it->timing = {it->timing.enqueued, launched, ended, n};
}

absl::Status DynamicBatcher::RunMerged(const BatchKey& key, Queue& q, const std::vector<Item*>& batch, int64_t n,
                                       const Runner& run) {
  const BatchRows& first = *batch[0]->rows;  // every request of the batch has the same arrays (key.present)
  const int64_t rb = key.row_bytes;
  q.hidden.resize(static_cast<size_t>(n * rb));
  q.targets.resize(static_cast<size_t>(n));
  const float* const ins[3] = {first.grad_loss, first.grad_logprob, first.grad_entropy};
  float* const outs[3] = {first.logprob, first.entropy, first.loss};
  for (int k = 0; k < 3; ++k) {
    q.in[k].resize(ins[k] != nullptr ? static_cast<size_t>(n) : 0);
    q.out[k].resize(outs[k] != nullptr ? static_cast<size_t>(n) : 0);
  }
  q.d_hidden.resize(first.d_hidden != nullptr ? static_cast<size_t>(n * rb) : 0);
  int64_t at = 0;
  for (const Item* it : batch) {
    const BatchRows& r = *it->rows;
    std::memcpy(q.hidden.data() + at * rb, r.hidden, static_cast<size_t>(r.rows * rb));
    Gather(q.targets, r.targets, at, r.rows);
    Gather(q.in[0], r.grad_loss, at, r.rows);
    Gather(q.in[1], r.grad_logprob, at, r.rows);
    Gather(q.in[2], r.grad_entropy, at, r.rows);
    at += r.rows;
  }
  auto data = [](auto& v) { return v.empty() ? nullptr : v.data(); };
  const BatchRows merged{q.hidden.data(), q.targets.data(), n, data(q.in[0]), data(q.in[1]), data(q.in[2]),
                         data(q.out[0]), data(q.out[1]), data(q.out[2]), data(q.d_hidden)};
  LCE_RETURN_IF_ERROR(run(merged));
  at = 0;
  for (Item* it : batch) {
    const BatchRows& r = *it->rows;
    Scatter(r.logprob, q.out[0], at, r.rows);
    Scatter(r.entropy, q.out[1], at, r.rows);
    Scatter(r.loss, q.out[2], at, r.rows);
    if (r.d_hidden != nullptr) std::memcpy(r.d_hidden, q.d_hidden.data() + at * rb, static_cast<size_t>(r.rows * rb));
    it->status = absl::OkStatus();
    at += r.rows;
  }
  return absl::OkStatus();
}

}  // namespace lce::server
