#include "tp_group.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"

namespace lce::server {
namespace {

constexpr uint32_t kMagic = 0x4c434531;  // "LCE1"
enum class TpOp : uint32_t { kCompute = 1, kStop = 2 };
enum Flags : uint32_t { kGradLoss = 1, kGradLogprob = 2, kGradEntropy = 4 };
enum Slot : int { kControl, kHidden, kTargets, kGradLossSlot, kGradLogprobSlot, kGradEntropySlot,
                  kOutLogprob, kOutEntropy, kOutLse, kOutLoss, kOutDHidden };

// Fixed-size control block broadcast before each call's data.
struct TpControl {
  uint32_t magic = kMagic;
  TpOp op = TpOp::kCompute;
  int64_t rows = 0;
  uint32_t mode = 0;
  uint32_t flags = 0;
  float temperature = 1, softcap = 0, label_smoothing = 0, z_loss = 0;
  int32_t ignore_index = -100;
  uint32_t allow_tf32 = 0;
};

// Broadcasts `bytes` at `src` (front) or into a staging slot (peers); returns the staged pointer.
absl::StatusOr<void*> Share(TpCommunicator& comm, ChunkStaging& staging, int slot, const void* src, int64_t bytes) {
  absl::StatusOr<void*> buf = staging.Buffer(slot, std::max<int64_t>(bytes, 1));
  if (!buf.ok()) return buf.status();
  if (src != nullptr) {
    if (absl::Status s = staging.Upload(*buf, src, bytes); !s.ok()) return s;
  }
  if (absl::Status s = comm.Broadcast(*buf, bytes, staging.device(), staging.stream()); !s.ok()) return s;
  return *buf;
}

// The control block, host side.
absl::Status ShareControl(TpCommunicator& comm, ChunkStaging& staging, TpControl& c, bool send) {
  absl::StatusOr<void*> buf = Share(comm, staging, kControl, send ? &c : nullptr, sizeof(c));
  if (!buf.ok()) return buf.status();
  return staging.Download(&c, *buf, sizeof(c));
}

}  // namespace

absl::Status TpFrontEngine::Fail(absl::Status s) {
  if (!failed_) {
    failed_ = true;
    comm_->Abort();
    if (on_failure_) on_failure_(s);
  }
  return s;
}

absl::Status TpFrontEngine::Compute(const RowsView& rows, const LceOptions& o, const Upstream& up,
                                    const RowOutputs& outputs, const GradOutputs& grads) {
  if (rows.space != MemorySpace::kHost) return absl::InvalidArgumentError("tensor-parallel front takes host rows");
  if (grads.d_weight != nullptr && staging_->device()) {
    return absl::UnimplementedError("weight gradients on a GPU tensor-parallel group are not supported yet");
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_) return absl::UnavailableError("tensor-parallel group is down; it is being restarted");
  absl::Status s = ComputeLocked(rows, o, up, outputs, grads);
  if (s.code() == absl::StatusCode::kUnavailable) return Fail(s);
  return s;
}

absl::Status TpFrontEngine::ComputeLocked(const RowsView& rows, const LceOptions& o, const Upstream& up,
                                          const RowOutputs& outputs, const GradOutputs& grads) {
  TpControl c;
  c.rows = rows.rows;
  c.mode = static_cast<uint32_t>(up.mode);
  c.flags = (up.grad_loss ? kGradLoss : 0) | (up.grad_logprob ? kGradLogprob : 0) | (up.grad_entropy ? kGradEntropy : 0);
  c.temperature = o.temperature;
  c.softcap = o.softcap;
  c.label_smoothing = o.label_smoothing;
  c.z_loss = o.z_loss;
  c.ignore_index = o.ignore_index;
  c.allow_tf32 = o.allow_tf32 ? 1 : 0;
  if (absl::Status s = ShareControl(*comm_, *staging_, c, true); !s.ok()) return s;
  const HeadShape& shape = local_->shape();
  const int64_t n = rows.rows;
  const int64_t row_bytes = shape.hidden_size * DTypeSize(shape.dtype);
  absl::StatusOr<void*> hidden = Share(*comm_, *staging_, kHidden, rows.hidden, n * row_bytes);
  if (!hidden.ok()) return hidden.status();
  absl::StatusOr<void*> targets = Share(*comm_, *staging_, kTargets, rows.targets, n * 4);
  if (!targets.ok()) return targets.status();
  Upstream staged_up = up;
  struct GradIn { const float* host; int slot; const float** dst; };
  for (GradIn g : {GradIn{up.grad_loss, kGradLossSlot, &staged_up.grad_loss},
                   GradIn{up.grad_logprob, kGradLogprobSlot, &staged_up.grad_logprob},
                   GradIn{up.grad_entropy, kGradEntropySlot, &staged_up.grad_entropy}}) {
    if (g.host == nullptr) continue;
    absl::StatusOr<void*> p = Share(*comm_, *staging_, g.slot, g.host, n * 4);
    if (!p.ok()) return p.status();
    *g.dst = static_cast<const float*>(*p);
  }
  if (!staging_->device()) {
    RowsView view{*hidden, static_cast<const int32_t*>(*targets), n, MemorySpace::kHost};
    return local_->Compute(view, o, staged_up, outputs, grads);
  }
  // Device staging: outputs land in device buffers, then come back to the caller's host memory.
  RowOutputs dev_out;
  struct Out { float* host; int slot; float** dst; };
  for (Out x : {Out{outputs.logprob, kOutLogprob, &dev_out.logprob}, Out{outputs.entropy, kOutEntropy, &dev_out.entropy},
                Out{outputs.lse, kOutLse, &dev_out.lse}, Out{outputs.loss, kOutLoss, &dev_out.loss}}) {
    if (x.host == nullptr) continue;
    absl::StatusOr<void*> p = staging_->Buffer(x.slot, n * 4);
    if (!p.ok()) return p.status();
    *x.dst = static_cast<float*>(*p);
  }
  GradOutputs dev_grads;
  if (grads.d_hidden != nullptr) {
    absl::StatusOr<void*> p = staging_->Buffer(kOutDHidden, n * row_bytes);
    if (!p.ok()) return p.status();
    dev_grads.d_hidden = *p;
  }
  RowsView view{*hidden, static_cast<const int32_t*>(*targets), n, MemorySpace::kDevice};
  if (absl::Status s = local_->Compute(view, o, staged_up, dev_out, dev_grads); !s.ok()) return s;
  for (auto [host, dev] : {std::pair{outputs.logprob, dev_out.logprob}, std::pair{outputs.entropy, dev_out.entropy},
                           std::pair{outputs.lse, dev_out.lse}, std::pair{outputs.loss, dev_out.loss}}) {
    if (host == nullptr) continue;
    if (absl::Status s = staging_->Download(host, dev, n * 4); !s.ok()) return s;
  }
  if (grads.d_hidden != nullptr) return staging_->Download(grads.d_hidden, dev_grads.d_hidden, n * row_bytes);
  return absl::OkStatus();
}

absl::Status TpFrontEngine::StopPeers() {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_) return absl::OkStatus();
  TpControl c;
  c.op = TpOp::kStop;
  return ShareControl(*comm_, *staging_, c, true);
}

absl::Status RunTpPeer(LceEngine& engine, TpCommunicator& comm, ChunkStaging& staging) {
  const HeadShape& shape = engine.shape();
  const int64_t row_bytes = shape.hidden_size * DTypeSize(shape.dtype);
  for (;;) {
    TpControl c;
    if (absl::Status st = ShareControl(comm, staging, c, false); !st.ok()) return st;
    if (c.magic != kMagic) return absl::DataLossError("tensor-parallel control block is corrupt");
    if (c.op == TpOp::kStop) return absl::OkStatus();
    const int64_t n = c.rows;
    absl::StatusOr<void*> hidden = Share(comm, staging, kHidden, nullptr, n * row_bytes);
    if (!hidden.ok()) return hidden.status();
    absl::StatusOr<void*> targets = Share(comm, staging, kTargets, nullptr, n * 4);
    if (!targets.ok()) return targets.status();
    Upstream up;
    up.mode = static_cast<GradMode>(c.mode);
    struct GradIn { uint32_t flag; int slot; const float** dst; };
    for (GradIn g : {GradIn{kGradLoss, kGradLossSlot, &up.grad_loss}, GradIn{kGradLogprob, kGradLogprobSlot, &up.grad_logprob},
                     GradIn{kGradEntropy, kGradEntropySlot, &up.grad_entropy}}) {
      if (!(c.flags & g.flag)) continue;
      absl::StatusOr<void*> p = Share(comm, staging, g.slot, nullptr, n * 4);
      if (!p.ok()) return p.status();
      *g.dst = static_cast<const float*>(*p);
    }
    LceOptions o;
    o.temperature = c.temperature;
    o.softcap = c.softcap;
    o.label_smoothing = c.label_smoothing;
    o.z_loss = c.z_loss;
    o.ignore_index = c.ignore_index;
    o.allow_tf32 = c.allow_tf32 != 0;
    GradOutputs grads;
    if (up.mode != GradMode::kNone) {
      // The d_hidden all-reduce inside the engine needs every rank; the front keeps the result.
      absl::StatusOr<void*> p = staging.Buffer(kOutDHidden, n * row_bytes);
      if (!p.ok()) return p.status();
      grads.d_hidden = *p;
    }
    RowsView rows{*hidden, static_cast<const int32_t*>(*targets), n,
                  staging.device() ? MemorySpace::kDevice : MemorySpace::kHost};
    absl::Status st = engine.Compute(rows, o, up, RowOutputs{}, grads);
    if (st.code() == absl::StatusCode::kUnavailable) return st;
    // Other errors (bad rows) are deterministic: the front got the same one and answered the client.
  }
}

}  // namespace lce::server
