#include "pending_grads.h"

#include <algorithm>
#include <random>

#include "absl/strings/str_cat.h"

namespace lce::server {
namespace {

constexpr size_t kRememberedDrops = 256;

}  // namespace

const char* PendingGrads::DropName(Drop why) {
  switch (why) {
    case Drop::kReleased: return "released";
    case Drop::kExpired: return "expired";
    case Drop::kEvicted: return "evicted";
    case Drop::kStale: return "stale";
  }
  return "unknown";
}

absl::StatusOr<std::vector<PendingGrads::Dropped>> PendingGrads::MakeRoom(int64_t version, absl::Time now,
                                                                          const PendingGradLimits& limits) {
  std::vector<Dropped> out;
  for (auto it = entries_.begin(); it != entries_.end();) {
    const Entry& e = it->second;
    const bool stale = e.version != version && !e.filling();
    if (stale || (!e.filling() && now >= e.deadline)) {
      out.push_back({it->first, stale ? Drop::kStale : Drop::kExpired});
      Dropping(e, out.back().why);
      it = entries_.erase(it);
    } else {
      ++it;
    }
  }
  // The age order keeps only ids still in the book (committed and released ones leave through Take),
  // so it never outgrows the book however many requests a head serves.
  order_.erase(std::remove_if(order_.begin(), order_.end(), [this](uint64_t id) { return entries_.count(id) == 0; }),
               order_.end());
  // Oldest waiting ones first, until one more fits.
  const int64_t cap = std::max<int64_t>(1, limits.max_per_head);
  for (auto it = order_.begin(); size() >= cap && it != order_.end();) {
    auto e = entries_.find(*it);
    if (e->second.filling()) {
      ++it;
    } else {
      out.push_back({*it, Drop::kEvicted});
      Dropping(e->second, Drop::kEvicted);
      entries_.erase(e);
      it = order_.erase(it);
    }
  }
  for (const Dropped& d : out) Remember(d.id, d.why);
  if (size() >= cap) {
    return absl::ResourceExhaustedError(absl::StrCat("the head has ", size(), " weight-gradient contributions being "
                                                     "computed now (--max-pending-grads=", cap, "); retry later"));
  }
  return out;
}

uint64_t PendingGrads::Begin(int64_t version, uint64_t split, int parts) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  uint64_t id = 0;
  while (id == 0 || entries_.count(id) != 0 || gone_.count(id) != 0) id = rng();
  Entry e;
  e.version = version;
  e.split = split;
  e.parts = std::max(parts, 1);
  entries_.emplace(id, e);
  order_.push_back(id);
  return id;
}

absl::StatusOr<uint64_t> PendingGrads::JoinSplit(uint64_t split, int parts, int64_t version) {
  if (auto g = gone_splits_.find(split); g != gone_splits_.end()) {
    return absl::AbortedError(
        absl::StrCat("the weight-gradient contribution of split request ", split, " is gone (", g->second, ")"));
  }
  for (auto& [id, e] : entries_) {
    if (e.split != split) continue;
    if (e.failed) return absl::AbortedError(absl::StrCat("another part of split request ", split, " failed"));
    if (e.version != version || e.parts != parts || e.running + e.done >= e.parts) {
      return absl::AbortedError(absl::StrCat("this part does not belong to split request ", split, " (version ",
                                             version, " of ", parts, " parts; it has version ", e.version, ", ",
                                             e.running + e.done, " of ", e.parts, " parts begun)"));
    }
    ++e.running;
    e.deadline = absl::InfiniteFuture();
    return id;
  }
  return 0;
}

PendingGrads::PartEnd PendingGrads::EndPart(uint64_t id, bool ok, absl::Time deadline) {
  auto it = entries_.find(id);
  if (it == entries_.end()) return PartEnd::kGone;
  Entry& e = it->second;
  --e.running;
  if (ok && !e.failed) ++e.done;
  if (!ok && !e.failed) {
    e.failed = true;
    if (e.split != 0) RememberSplit(e.split, "another part of it failed");
  }
  if (e.failed) return e.filling() ? PartEnd::kFailed : PartEnd::kAbandoned;
  if (e.complete()) return PartEnd::kComplete;
  if (!e.filling()) e.deadline = deadline;  // the parts still due may never come
  return PartEnd::kWaiting;
}

void PendingGrads::Ready(uint64_t id, absl::Time deadline) {
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  it->second.deadline = deadline;
}

absl::StatusOr<PendingGrads::Entry> PendingGrads::Take(uint64_t id) {
  auto it = entries_.find(id);
  if (it == entries_.end()) {
    auto g = gone_.find(id);
    if (g == gone_.end()) return absl::NotFoundError(absl::StrCat("no pending weight gradient ", id, " on this head"));
    const char* why = g->second == Drop::kExpired   ? "it expired (--pending-grad-ttl)"
                      : g->second == Drop::kEvicted ? "it was evicted by newer ones (--max-pending-grads)"
                      : g->second == Drop::kStale   ? "the head's weight changed since its forward"
                                                    : "it was committed or released already";
    const std::string message = absl::StrCat("pending weight gradient ", id, " is gone: ", why);
    return g->second == Drop::kStale ? absl::FailedPreconditionError(message) : absl::NotFoundError(message);
  }
  Entry e = it->second;
  entries_.erase(it);
  return e;
}

std::vector<PendingGrads::Dropped> PendingGrads::TakeAll(Drop why) {
  std::vector<Dropped> out;
  for (const auto& [id, e] : entries_) {
    out.push_back({id, why});
    Dropping(e, why);
  }
  entries_.clear();
  order_.clear();
  for (const Dropped& d : out) Remember(d.id, d.why);
  return out;
}

void PendingGrads::Remember(uint64_t id, Drop why) {
  if (gone_.emplace(id, why).second) gone_order_.push_back(id);
  while (gone_order_.size() > kRememberedDrops) {
    gone_.erase(gone_order_.front());
    gone_order_.pop_front();
  }
}

void PendingGrads::RememberSplit(uint64_t split, std::string why) {
  if (gone_splits_.emplace(split, std::move(why)).second) gone_splits_order_.push_back(split);
  while (gone_splits_order_.size() > kRememberedDrops) {
    gone_splits_.erase(gone_splits_order_.front());
    gone_splits_order_.pop_front();
  }
}

}  // namespace lce::server
