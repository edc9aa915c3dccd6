// Pending weight-gradient contributions (docs/MATH.md, "When dW is committed"): a request that
// accumulates dW does so into a buffer of its own (a split request's parts into one together); it
// reaches the head's dW when the request succeeds (scale 1), or, deferred, when its client's backward
// sends the upstream gradient (CommitGrad); a failed request's, a discarded one's, an expired or
// evicted one's, and those left when the head's weight changes are freed without touching dW. Under
// tensor parallelism every rank holds its shard of each contribution under the same id.
#include <cmath>

#include "absl/strings/str_cat.h"
#include "grpc_status.h"
#include "lce_service.h"
#include "status_macros.h"

namespace lce::server {

absl::StatusOr<LceService::Contribution> LceService::BeginContribution(const ServedHead& head, uint64_t split,
                                                                       int parts) {
  HeadTraining& t = *head.training;
  std::lock_guard<std::mutex> lock(t.mu);
  absl::StatusOr<HeadTrainer*> trainer = TrainerOf(head);
  if (!trainer.ok()) return trainer.status();
  uint64_t id = 0;
  if (split != 0) {
    absl::StatusOr<uint64_t> joined = t.pending.JoinSplit(split, parts, head.version);
    if (!joined.ok()) return joined.status();
    id = *joined;
  }
  if (id == 0) {
    absl::StatusOr<std::vector<PendingGrads::Dropped>> dropped =
        t.pending.MakeRoom(head.version, absl::Now(), config_.pending_grads);
    if (!dropped.ok()) {
      if (config_.metrics != nullptr) config_.metrics->rejections.WithLabels({"pending_grads"}).Increment();
      return dropped.status();
    }
    ReleaseContributions(head, *dropped);
    id = t.pending.Begin(head.version, split, parts);
  }
  // One request's comes unzeroed: its first engine call writes it (GradOutputs::d_weight_fresh). A split
  // request's parts call the engine in any order: theirs is zeroed here, and every call adds to it.
  absl::StatusOr<float*> buffer = (*trainer)->AcquirePending(id, /*zeroed=*/split != 0);
  if (!buffer.ok()) {
    EndPartLocked(head, id, /*ok=*/false, /*defer=*/false).IgnoreError();
    return buffer.status();
  }
  return Contribution{id, *buffer, (*trainer)->BiasPart(*buffer), /*zeroed=*/split != 0};
}

absl::StatusOr<bool> LceService::EndContribution(const ServedHead& head, uint64_t id, bool ok, bool defer) {
  std::lock_guard<std::mutex> lock(head.training->mu);
  return EndPartLocked(head, id, ok, defer);
}

absl::StatusOr<bool> LceService::EndPartLocked(const ServedHead& head, uint64_t id, bool ok, bool defer) {
  PendingGrads& book = head.training->pending;
  const absl::Time deadline = absl::Now() + config_.pending_grads.ttl;
  auto aborted = [] {
    return absl::AbortedError(
        "another part of this split request failed: nothing of its weight gradient is added; retry the request");
  };
  switch (book.EndPart(id, ok, deadline)) {
    case PendingGrads::PartEnd::kGone:  // released with the head's old weight: CommitGrad says so
      return defer;
    case PendingGrads::PartEnd::kWaiting: return false;
    case PendingGrads::PartEnd::kFailed:
      if (ok) return aborted();
      return false;
    case PendingGrads::PartEnd::kAbandoned:
      book.Take(id).IgnoreError();
      ReleaseContributions(head, {{id, PendingGrads::Drop::kReleased}});
      if (ok) return aborted();
      return false;
    case PendingGrads::PartEnd::kComplete: break;
  }
  if (defer) {
    book.Ready(id, deadline);
    return true;
  }
  book.Take(id).IgnoreError();
  LCE_RETURN_IF_ERROR(CommitContribution(head, id, 1.0f));
  return true;
}

absl::Status LceService::CommitContribution(const ServedHead& head, uint64_t id, float scale) {
  HeadTrainer* trainer = head.training->trainer.get();
  head.training->pending.Remember(id, PendingGrads::Drop::kReleased);
  if (trainer == nullptr) return absl::InternalError("a pending weight gradient without a trainer");
  absl::Status s = trainer->CommitPending(id, scale);
  if (config_.tp_group != nullptr) {
    absl::Status peers = config_.tp_group->CommitPending(head.name, id, scale);
    if (s.ok()) s = peers;
  }
  return s;
}

void LceService::ReleaseContributions(const ServedHead& head, const std::vector<PendingGrads::Dropped>& dropped) {
  HeadTrainer* trainer = head.training->trainer.get();
  for (const PendingGrads::Dropped& d : dropped) {
    if (trainer != nullptr) trainer->ReleasePending(d.id);
    // A group that cannot hear it is down (TpGroup marks it failed); nothing else is to be done here.
    if (config_.tp_group != nullptr) config_.tp_group->ReleasePending(head.name, d.id).IgnoreError();
    if (config_.metrics != nullptr) {
      config_.metrics->pending_grads_dropped.WithLabels({PendingGrads::DropName(d.why)}).Increment();
    }
  }
}

grpc::Status LceService::CommitGrad(grpc::ServerContext* ctx, const v1::CommitGradRequest* req,
                                    v1::CommitGradResponse* resp) {
  return Recorded("CommitGrad", ctx, [&]() -> absl::Status {
    LCE_RETURN_IF_ERROR(Authenticate(ctx, Access::kScoring));
    const float scale = req->has_scale() ? req->scale() : 1.0f;
    if (!std::isfinite(scale)) {
      return absl::InvalidArgumentError(absl::StrCat("CommitGrad scale must be finite, got ", scale));
    }
    absl::StatusOr<std::shared_ptr<const ServedHead>> head = heads_->Get(req->head());
    if (!head.ok()) return head.status();
    const ServedHead& h = **head;
    std::lock_guard<std::mutex> lock(h.training->mu);
    const PendingGrads::Entry* found = h.training->pending.Find(req->pending_grad_id());
    if (found != nullptr && !found->complete()) {
      return absl::FailedPreconditionError(absl::StrCat("pending weight gradient ", req->pending_grad_id(),
                                                        " belongs to a request still running (or a split request "
                                                        "whose parts have not all ended)"));
    }
    absl::StatusOr<PendingGrads::Entry> entry = h.training->pending.Take(req->pending_grad_id());
    if (!entry.ok()) return entry.status();
    resp->set_head_version(entry->version);
    if (entry->version != h.version) {
      ReleaseContributions(h, {{req->pending_grad_id(), PendingGrads::Drop::kStale}});
      return absl::FailedPreconditionError(absl::StrCat("pending weight gradient ", req->pending_grad_id(),
                                                        " was made on version ", entry->version, " of head '", h.name,
                                                        "', which is now at version ", h.version, "; it is dropped"));
    }
    if (req->discard()) {
      ReleaseContributions(h, {{req->pending_grad_id(), PendingGrads::Drop::kReleased}});
      return absl::OkStatus();
    }
    return CommitContribution(h, req->pending_grad_id(), scale);
  });
}

}  // namespace lce::server
