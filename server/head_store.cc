#include "head_store.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace lce::server {

absl::StatusOr<std::shared_ptr<const ServedHead>> HeadStore::Put(const std::string& name,
                                                                 std::shared_ptr<LceEngine> engine,
                                                                 std::shared_ptr<const HeadWeights> weights,
                                                                 int64_t expected_version) {
  if (name.empty()) return absl::InvalidArgumentError("head name must not be empty");
  if (engine == nullptr) return absl::InvalidArgumentError("head has no engine");
  std::lock_guard<std::mutex> lock(mu_);
  auto head = std::make_shared<ServedHead>();
  head->name = name;
  head->engine = std::move(engine);
  head->weights = std::move(weights);
  auto it = heads_.find(name);
  if (expected_version != 0) {
    const int64_t current = it == heads_.end() ? 0 : it->second->version;
    if (current != expected_version) {
      return absl::FailedPreconditionError(absl::StrCat("head '", name, "' is at version ", current,
                                                        ", the update expected version ", expected_version));
    }
  }
  const HeadShape& shape = head->engine->shape();
  const bool same_shape = it != heads_.end() && it->second->engine->shape().shard_rows == shape.shard_rows &&
                          it->second->engine->shape().hidden_size == shape.hidden_size;
  head->version = it == heads_.end() ? 1 : it->second->version + 1;
  if (same_shape) {
    head->training = it->second->training;
  } else {
    head->training = std::make_shared<HeadTrainingState>();
    head->training->grad.assign(static_cast<size_t>(shape.shard_rows * shape.hidden_size), 0.0f);
  }
  std::shared_ptr<const ServedHead> out = head;
  heads_[name] = out;
  if (default_name_.empty()) default_name_ = name;
  return out;
}

absl::StatusOr<std::shared_ptr<const ServedHead>> HeadStore::Get(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string& key = name.empty() ? default_name_ : name;
  auto it = heads_.find(key);
  if (it == heads_.end()) {
    std::vector<std::string> names;
    for (const auto& [n, _] : heads_) names.push_back(n);
    return absl::NotFoundError(absl::StrCat("unknown head '", name, "' (this server holds: ",
                                            absl::StrJoin(names, ", "), ")"));
  }
  return it->second;
}

std::vector<std::shared_ptr<const ServedHead>> HeadStore::List() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::shared_ptr<const ServedHead>> out;
  for (const auto& [_, h] : heads_) out.push_back(h);
  return out;
}

}  // namespace lce::server
