// Contributions to a head's weight gradient that wait for their upstream gradient (docs/MATH.md,
// "When dW is committed"). A request that accumulates dW fills a pending buffer of its own (the
// trainer's, HeadTrainer::AcquirePending); this book says which ids exist, which request is filling
// which, on what head version, and until when a finished one waits for CommitGrad. Guarded by the
// head's training mutex (HeadTraining::mu), as the trainer is.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace lce::server {

struct PendingGradLimits {
  // Contributions a head holds at once (filling or waiting); a new one past this drops the oldest
  // waiting one, and fails when every one is still being filled.
  int64_t max_per_head = 4;
  // How long a finished contribution waits for its commit before it is dropped.
  absl::Duration ttl = absl::Minutes(10);
};

class PendingGrads {
 public:
  // Why a contribution left the book other than by its commit (a label of
  // lce_pending_grads_dropped_total).
  enum class Drop { kReleased, kExpired, kEvicted, kStale };
  struct Dropped {
    uint64_t id;
    Drop why;
  };
  struct Entry {
    int64_t version = 0;   // the head version the forward ran on
    bool filling = true;   // its request is still running
    absl::Time deadline = absl::InfiniteFuture();
  };

  // Room for one more contribution on `version`: the ids to release now (waiting past their
  // deadline, of another version, or the oldest waiting ones over the cap), which leave the book.
  // RESOURCE_EXHAUSTED when the cap is reached by contributions still being filled.
  absl::StatusOr<std::vector<Dropped>> MakeRoom(int64_t version, absl::Time now, const PendingGradLimits& limits);
  // A new contribution being filled on `version`; its id is random and non-zero (only its client
  // knows it).
  uint64_t Begin(int64_t version);
  // Its request succeeded: it waits for its commit until `deadline`.
  void Ready(uint64_t id, absl::Time deadline);
  // Takes `id` out of the book to commit or release it. NOT_FOUND (saying why, where it is known)
  // when it is not there.
  absl::StatusOr<Entry> Take(uint64_t id);
  // The contribution `id`, null when it is not in the book.
  const Entry* Find(uint64_t id) const {
    auto it = entries_.find(id);
    return it == entries_.end() ? nullptr : &it->second;
  }
  // Takes every contribution out (the head's weight changed: none can be committed any more).
  std::vector<Dropped> TakeAll(Drop why);
  // Notes why `id` left the book, for Take's message about it later.
  void Remember(uint64_t id, Drop why);
  int64_t size() const { return static_cast<int64_t>(entries_.size()); }

  static const char* DropName(Drop why);

 private:
  std::map<uint64_t, Entry> entries_;
  std::deque<uint64_t> order_;              // ids by age, oldest first (those gone since pruned at MakeRoom)
  std::map<uint64_t, Drop> gone_;           // recently dropped ids and why
  std::deque<uint64_t> gone_order_;
};

}  // namespace lce::server
