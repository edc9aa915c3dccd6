// The heads a server holds, by name and version. A request takes a snapshot (shared_ptr) of its
// head when its header arrives, so replacing a head never disturbs requests in flight: they finish
// on the version they started with.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lce/engine.h"

namespace lce::server {

// Training state of one head, shared by all its versions: the fp32 gradient buffer dW (this
// rank's shard), and after the first optimizer step the fp32 master weights and AdamW moments.
struct HeadTrainingState {
  std::mutex mu;  // held while the buffer is accumulated into, read, zeroed or stepped
  std::vector<float> grad;
  std::vector<float> master, exp_avg, exp_avg_sq;
  int64_t step = 0;
};

struct ServedHead {
  std::string name;
  int64_t version = 1;
  std::shared_ptr<LceEngine> engine;
  std::shared_ptr<const HeadWeights> weights;  // host copy of this rank's shard
  std::shared_ptr<HeadTrainingState> training;
};

class HeadStore {
 public:
  // Adds the head `name`, or replaces it with version + 1 (keeping its training state when the
  // shape is unchanged). With expected_version != 0, replaces only a head at that version
  // (FAILED_PRECONDITION otherwise). The first head added is the default.
  absl::StatusOr<std::shared_ptr<const ServedHead>> Put(const std::string& name, std::shared_ptr<LceEngine> engine,
                                                        std::shared_ptr<const HeadWeights> weights,
                                                        int64_t expected_version = 0);
  // "" selects the default head. NOT_FOUND names the unknown head.
  absl::StatusOr<std::shared_ptr<const ServedHead>> Get(const std::string& name) const;
  std::vector<std::shared_ptr<const ServedHead>> List() const;

 private:
  mutable std::mutex mu_;
  std::string default_name_;
  std::map<std::string, std::shared_ptr<const ServedHead>> heads_;
};

}  // namespace lce::server
