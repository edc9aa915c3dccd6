// Contributions to a head's weight gradient that wait for their upstream gradient (docs/MATH.md,
// "When dW is committed"). A request that accumulates dW fills a pending buffer of its own (the
// trainer's, HeadTrainer::AcquirePending), the parts of a split request (RequestHeader.split_id) one
// together; this book says which ids exist, which requests are filling which, on what head version,
// and until when a finished one waits for CommitGrad. Guarded by the head's training mutex
// (HeadTraining::mu), as the trainer is.
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
    int64_t version = 0;  // the head version the forward ran on
    absl::Time deadline = absl::InfiniteFuture();
    uint64_t split = 0;   // RequestHeader.split_id of the split request whose parts fill it (0: one request)
    int parts = 1;        // requests that fill it (a split request's parts)
    int running = 1;      // of them, filling it now
    int done = 0;         // of them, succeeded
    bool failed = false;  // one failed: nothing of it is ever added
    // A request (a part of a split one) is filling it now.
    bool filling() const { return running > 0; }
    // Every part succeeded (none is filling it then): it may be committed or read.
    bool complete() const { return done == parts; }
  };

  // Room for one more contribution on `version`: the ids to release now (waiting past their
  // deadline, of another version, or the oldest waiting ones over the cap), which leave the book.
  // RESOURCE_EXHAUSTED when the cap is reached by contributions still being filled.
  absl::StatusOr<std::vector<Dropped>> MakeRoom(int64_t version, absl::Time now, const PendingGradLimits& limits);
  // A new contribution being filled on `version`, by one request or by the first of split request
  // `split`'s `parts` parts; its id is random and non-zero (only its client knows it).
  uint64_t Begin(int64_t version, uint64_t split = 0, int parts = 1);
  // The contribution that split request `split`'s parts fill, taken up by one more of them; 0 when
  // none has begun it. ABORTED when a part of it failed, it was dropped, or this part does not match
  // it (another version or part count, or one part too many).
  absl::StatusOr<uint64_t> JoinSplit(uint64_t split, int parts, int64_t version);
  // What a request's end (a part's, of a split one) leaves to do with its contribution.
  enum class PartEnd {
    kComplete,   // every part succeeded: commit it, or Ready it for CommitGrad (still in the book)
    kWaiting,    // more parts are due: nothing yet (it waits until `deadline` for them)
    kAbandoned,  // a part failed and none is filling it now: Take and release it
    kFailed,     // a part failed; the ones still filling it release it when they end
    kGone,       // not in the book (dropped while it was filled)
  };
  PartEnd EndPart(uint64_t id, bool ok, absl::Time deadline);
  // A complete request's contribution waits for its commit until `deadline`.
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
  // Split requests whose contribution failed or was dropped, and why (for their late parts).
  std::map<uint64_t, std::string> gone_splits_;
  std::deque<uint64_t> gone_splits_order_;
  void RememberSplit(uint64_t split, std::string why);
  void Dropping(const Entry& e, Drop why) {
    if (e.split != 0) RememberSplit(e.split, DropName(why));
  }
};

}  // namespace lce::server
