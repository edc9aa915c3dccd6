// The heads a server holds, by name and version, and how a version changes.
//
// A request takes a snapshot (shared_ptr) of its head when its header arrives and runs start to end on
// that version: a weight change (OptimizerStep, UpdateWeights, LoadHead over an existing name) waits,
// through BeginChange, until no request runs on the head, and requests that arrive meanwhile wait
// for the change (Enter). A GPU step rewrites the served weight in place, on every rank of a group,
// so no request may straddle it; waiting costs the step the requests in flight (bounded by the
// caller's deadline) and saves a second copy of every weight shard per version.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "lce/engine.h"
#include "lce/training.h"
#include "pending_grads.h"

namespace lce::server {

// Training state of one head, shared by all its versions: this rank's HeadTrainer (dW and the AdamW
// state of its shard, in the engine's memory), made at first use.
struct HeadTraining {
  std::mutex mu;  // held around every use of `trainer` and `pending`
  std::unique_ptr<HeadTrainer> trainer;
  PendingGrads pending;  // the contributions waiting in the trainer's pending buffers
};

struct ServedHead {
  std::string name;
  int64_t version = 1;
  std::shared_ptr<LceEngine> engine;        // what requests call (a group's front engine under TP)
  std::shared_ptr<LceEngine> shard_engine;  // this rank's engine of its shard (== engine without TP)
  // Host copy of this rank's shard as loaded or last updated; after an optimizer step the trainer's
  // Weights() is the served one (CurrentWeights).
  std::shared_ptr<const HeadWeights> weights;
  std::shared_ptr<HeadTraining> training;
};

// A new version of a head. `training` null: a new head's (no gradient, no optimizer state).
struct HeadVersion {
  std::shared_ptr<LceEngine> engine, shard_engine;
  std::shared_ptr<const HeadWeights> weights;
  std::shared_ptr<HeadTraining> training;
};

class HeadStore {
 public:
  // Adds the head `name`, or replaces it with version + 1. With expected_version != 0, replaces only
  // a head at that version (FAILED_PRECONDITION otherwise). The first head added is the default.
  absl::StatusOr<std::shared_ptr<const ServedHead>> Put(const std::string& name, HeadVersion version,
                                                        int64_t expected_version = 0);
  // A new head of one engine (no tensor parallelism).
  absl::StatusOr<std::shared_ptr<const ServedHead>> Put(const std::string& name, std::shared_ptr<LceEngine> engine,
                                                        std::shared_ptr<const HeadWeights> weights) {
    return Put(name, HeadVersion{engine, engine, std::move(weights), nullptr});
  }
  // "" selects the default head. NOT_FOUND names the unknown head.
  absl::StatusOr<std::shared_ptr<const ServedHead>> Get(const std::string& name) const;
  std::vector<std::shared_ptr<const ServedHead>> List() const;
  // The current version of `name`, 0 when there is no such head.
  int64_t Version(const std::string& name) const;

  // What Enter (a request's hold on its head's version, from its header to its end) or BeginChange
  // (the exclusive right to change a head) took, given back when destroyed.
  class Hold {
   public:
    Hold(Hold&& o) noexcept : store_(o.store_), name_(std::move(o.name_)), change_(o.change_) { o.store_ = nullptr; }
    Hold& operator=(Hold&&) = delete;
    ~Hold();

   private:
    friend class HeadStore;
    Hold(HeadStore* store, std::string name, bool change) : store_(store), name_(std::move(name)), change_(change) {}
    HeadStore* store_;
    std::string name_;
    bool change_;
  };
  using Use = Hold;
  using Change = Hold;

  // Waits while a change of the head is pending or running, then holds `head`. ABORTED when `head` is
  // no longer the current version by then (validate the request again: a pinned version is gone).
  absl::StatusOr<Use> Enter(const std::shared_ptr<const ServedHead>& head);

  // The exclusive right to change head `name` (which need not exist yet). Waits until no request runs
  // on it and no other change does; requests arriving meanwhile wait.
  // ABORTED, naming the requests still running, when that has not happened by `deadline`.
  absl::StatusOr<Change> BeginChange(const std::string& name, absl::Time deadline);

 private:
  // Requests on a head and changes of it.
  struct Gate {
    int64_t active = 0;           // requests holding a Use
    int64_t waiting_changes = 0;  // BeginChange calls waiting for them
    bool changing = false;
  };
  mutable std::mutex mu_;
  std::condition_variable gate_cv_;
  std::string default_name_;
  std::map<std::string, std::shared_ptr<const ServedHead>> heads_;
  std::map<std::string, Gate> gates_;
};

// This rank's trainer of a head shard, made at first use in `slot` (hold the head's training mutex).
absl::StatusOr<HeadTrainer*> TrainerFor(std::unique_ptr<HeadTrainer>& slot, const std::shared_ptr<LceEngine>& shard_engine,
                                        const std::shared_ptr<const HeadWeights>& weights, const EngineMaker& make_engine);
// The weight a shard serves now, in host memory: the trainer's (null: none yet) or `loaded`.
absl::StatusOr<std::shared_ptr<const HeadWeights>> CurrentWeights(HeadTrainer* trainer,
                                                                  std::shared_ptr<const HeadWeights> loaded);
// Serves `next` on this rank: through the trainer when there is one (its masters follow), else a new
// engine. Returns the engine serving it.
absl::StatusOr<std::shared_ptr<LceEngine>> ReplaceWeight(HeadTrainer* trainer, std::shared_ptr<const HeadWeights> next,
                                                         const EngineMaker& make_engine);

}  // namespace lce::server
