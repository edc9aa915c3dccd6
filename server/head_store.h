// The heads a server holds, by name. A request takes a snapshot (shared_ptr) of its head when its
// header arrives, so replacing a head never disturbs requests in flight.
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

struct ServedHead {
  std::string name;
  int64_t version = 1;
  std::shared_ptr<LceEngine> engine;
};

class HeadStore {
 public:
  // Adds (or replaces, with version + 1) the head `name`. The first head added is the default.
  absl::Status Put(const std::string& name, std::shared_ptr<LceEngine> engine);
  // "" selects the default head. NOT_FOUND names the unknown head.
  absl::StatusOr<std::shared_ptr<const ServedHead>> Get(const std::string& name) const;
  std::vector<std::shared_ptr<const ServedHead>> List() const;

 private:
  mutable std::mutex mu_;
  std::string default_name_;
  std::map<std::string, std::shared_ptr<const ServedHead>> heads_;
};

}  // namespace lce::server
