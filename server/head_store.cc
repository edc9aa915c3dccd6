#include "head_store.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace lce::server {

absl::Status HeadStore::Put(const std::string& name, std::shared_ptr<LceEngine> engine) {
  if (name.empty()) return absl::InvalidArgumentError("head name must not be empty");
  if (engine == nullptr) return absl::InvalidArgumentError("head has no engine");
  std::lock_guard<std::mutex> lock(mu_);
  auto head = std::make_shared<ServedHead>();
  head->name = name;
  head->engine = std::move(engine);
  auto it = heads_.find(name);
  head->version = it == heads_.end() ? 1 : it->second->version + 1;
  heads_[name] = std::move(head);
  if (default_name_.empty()) default_name_ = name;
  return absl::OkStatus();
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
