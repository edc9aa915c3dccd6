#include "head_store.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace lce::server {

absl::StatusOr<std::shared_ptr<const ServedHead>> HeadStore::Put(const std::string& name, HeadVersion v,
                                                                 int64_t expected_version) {
  if (name.empty()) return absl::InvalidArgumentError("head name must not be empty");
  if (v.engine == nullptr || v.shard_engine == nullptr) return absl::InvalidArgumentError("head has no engine");
  std::lock_guard<std::mutex> lock(mu_);
  auto it = heads_.find(name);
  const int64_t current = it == heads_.end() ? 0 : it->second->version;
  if (expected_version != 0 && current != expected_version) {
    return absl::FailedPreconditionError(absl::StrCat("head '", name, "' is at version ", current,
                                                      ", the update expected version ", expected_version));
  }
  auto head = std::make_shared<ServedHead>();
  head->name = name;
  head->version = current + 1;
  head->engine = std::move(v.engine);
  head->shard_engine = std::move(v.shard_engine);
  head->weights = std::move(v.weights);
  head->training = v.training != nullptr ? std::move(v.training) : std::make_shared<HeadTraining>();
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

int64_t HeadStore::Version(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = heads_.find(name);
  return it == heads_.end() ? 0 : it->second->version;
}

absl::StatusOr<HeadStore::Use> HeadStore::Enter(const std::shared_ptr<const ServedHead>& head) {
  std::unique_lock<std::mutex> lock(mu_);
  Gate& g = gates_[head->name];
  gate_cv_.wait(lock, [&] { return !g.changing && g.waiting_changes == 0; });
  auto it = heads_.find(head->name);
  if (it == heads_.end() || it->second != head) {
    return absl::AbortedError(absl::StrCat("head '", head->name, "' changed while the request waited"));
  }
  ++g.active;
  return Hold(this, head->name, /*change=*/false);
}

HeadStore::Hold::~Hold() {
  if (store_ == nullptr) return;
  std::lock_guard<std::mutex> lock(store_->mu_);
  Gate& g = store_->gates_[name_];
  if (change_) {
    g.changing = false;
  } else {
    --g.active;
  }
  store_->gate_cv_.notify_all();
}

absl::StatusOr<HeadStore::Change> HeadStore::BeginChange(const std::string& name, absl::Time deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  Gate& g = gates_[name];
  ++g.waiting_changes;
  const bool free = gate_cv_.wait_until(lock, absl::ToChronoTime(deadline), [&] { return g.active == 0 && !g.changing; });
  --g.waiting_changes;
  if (!free) {
    gate_cv_.notify_all();  // requests held back for this change may go on
    auto it = heads_.find(name);
    return absl::AbortedError(absl::StrCat(
        "head '", name, "': ", g.active, " request(s) still running on version ", it == heads_.end() ? 0 : it->second->version,
        g.changing ? " and another weight change in progress" : "",
        "; the weight change waits for them to end and was given up at its deadline (retry)"));
  }
  g.changing = true;
  return Hold(this, name, /*change=*/true);
}

absl::StatusOr<HeadTrainer*> TrainerFor(std::unique_ptr<HeadTrainer>& slot, const std::shared_ptr<LceEngine>& shard_engine,
                                        const std::shared_ptr<const HeadWeights>& weights, const EngineMaker& make_engine) {
  if (slot == nullptr) {
    absl::StatusOr<std::unique_ptr<HeadTrainer>> t = CreateHeadTrainer(shard_engine, weights, make_engine);
    if (!t.ok()) return t.status();
    slot = std::move(*t);
  }
  return slot.get();
}

absl::StatusOr<std::shared_ptr<const HeadWeights>> CurrentWeights(HeadTrainer* trainer,
                                                                  std::shared_ptr<const HeadWeights> loaded) {
  if (trainer != nullptr) return trainer->Weights();
  return loaded;
}

absl::StatusOr<std::shared_ptr<LceEngine>> ReplaceWeight(HeadTrainer* trainer, std::shared_ptr<const HeadWeights> next,
                                                         const EngineMaker& make_engine) {
  if (trainer != nullptr) return trainer->SetWeight(std::move(next));
  if (!make_engine) return absl::FailedPreconditionError("this server cannot build new head versions");
  return make_engine(std::move(next));
}

}  // namespace lce::server
