#include "tp_group.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "head_source.h"
#include "lce/numeric.h"

namespace lce::server {
namespace {

constexpr uint32_t kMagic = 0x4c434531;  // "LCE1"
enum class TpOp : uint32_t { kCompute = 1, kStop = 2, kZeroGrad = 3, kStep = 4, kGetGrad = 5, kSave = 6 };
enum Flags : uint32_t { kGradLoss = 1, kGradLogprob = 2, kGradEntropy = 4, kAccumulateWeightGrad = 8 };
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
  // kStep
  float lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0, max_grad_norm = 0;
  // kSave: directory and head name, NUL-terminated
  char dir[480] = {};
  char name[64] = {};
};

// Rank r's training state of its shard (the front's lives in the head store).
struct ShardTraining {
  std::vector<float> grad, master, exp_avg, exp_avg_sq;
  int64_t step = 0;
};

// The AdamW scale for a global norm: min(1, max / (norm + 1e-6)) when clipping (as torch).
float ClipScale(double norm, float max_grad_norm) {
  return max_grad_norm > 0.0f && norm > max_grad_norm ? static_cast<float>(max_grad_norm / (norm + 1e-6)) : 1.0f;
}

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
  c.flags = (up.grad_loss ? kGradLoss : 0) | (up.grad_logprob ? kGradLogprob : 0) | (up.grad_entropy ? kGradEntropy : 0) |
            (grads.d_weight ? kAccumulateWeightGrad : 0);
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

absl::Status TpFrontEngine::ZeroGradPeers() {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_) return absl::UnavailableError("tensor-parallel group is down; it is being restarted");
  TpControl c;
  c.op = TpOp::kZeroGrad;
  absl::Status s = ShareControl(*comm_, *staging_, c, true);
  return s.code() == absl::StatusCode::kUnavailable ? Fail(s) : s;
}

absl::StatusOr<double> TpFrontEngine::Step(
    const AdamWParams& p, float max_grad_norm, double local_sq_norm,
    const std::function<absl::StatusOr<std::shared_ptr<LceEngine>>(float)>& step_front) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_) return absl::UnavailableError("tensor-parallel group is down; it is being restarted");
  TpControl c;
  c.op = TpOp::kStep;
  c.lr = p.lr;
  c.beta1 = p.beta1;
  c.beta2 = p.beta2;
  c.eps = p.eps;
  c.weight_decay = p.weight_decay;
  c.max_grad_norm = max_grad_norm;
  absl::Status s = ShareControl(*comm_, *staging_, c, true);
  float sq = static_cast<float>(local_sq_norm);
  if (s.ok()) s = comm_->AllReduce(&sq, 1, ReduceOp::kSum, false, nullptr);
  if (!s.ok()) return s.code() == absl::StatusCode::kUnavailable ? Fail(s) : s;
  const double norm = std::sqrt(static_cast<double>(sq));
  absl::StatusOr<std::shared_ptr<LceEngine>> next = step_front(ClipScale(norm, max_grad_norm));
  if (!next.ok()) return next.status();
  local_ = std::move(*next);
  return norm;
}

absl::Status TpFrontEngine::FetchPeerGrads(const std::function<absl::Status(int64_t, int64_t, const float*)>& sink) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_) return absl::UnavailableError("tensor-parallel group is down; it is being restarted");
  TpControl c;
  c.op = TpOp::kGetGrad;
  absl::Status s = ShareControl(*comm_, *staging_, c, true);
  const HeadShape& shape = local_->shape();
  std::vector<float> buf;
  for (int r = 1; s.ok() && r < comm_->world_size(); ++r) {
    const VocabRange range = VocabShard(shape.vocab_size, r, comm_->world_size());
    buf.resize(static_cast<size_t>((range.end - range.begin) * shape.hidden_size));
    s = comm_->Broadcast(buf.data(), static_cast<int64_t>(buf.size() * 4), false, nullptr, r);
    if (s.ok()) s = sink(range.begin, range.end - range.begin, buf.data());
  }
  return s.code() == absl::StatusCode::kUnavailable ? Fail(s) : s;
}

absl::Status TpFrontEngine::SaveShards(const std::string& dir, const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_) return absl::UnavailableError("tensor-parallel group is down; it is being restarted");
  TpControl c;
  c.op = TpOp::kSave;
  if (dir.size() >= sizeof(c.dir) || name.size() >= sizeof(c.name)) {
    return absl::InvalidArgumentError("SaveHead directory or head name too long for a tensor-parallel group");
  }
  std::memcpy(c.dir, dir.data(), dir.size());
  std::memcpy(c.name, name.data(), name.size());
  absl::Status s = ShareControl(*comm_, *staging_, c, true);
  // Every peer answers with its status code (0 = OK), so that a failed write is not silent.
  for (int r = 1; s.ok() && r < comm_->world_size(); ++r) {
    float code = 0;
    s = comm_->Broadcast(&code, sizeof(code), false, nullptr, r);
    if (s.ok() && code != 0) s = absl::InternalError(absl::StrCat("rank ", r, " could not write its shard to ", dir));
  }
  return s.code() == absl::StatusCode::kUnavailable ? Fail(s) : s;
}

absl::Status RunTpPeer(std::shared_ptr<const HeadWeights> weights, std::shared_ptr<LceEngine> engine,
                       const EngineFactory& make_engine, TpCommunicator& comm, ChunkStaging& staging) {
  const HeadShape shape = engine->shape();
  const int64_t row_bytes = shape.hidden_size * DTypeSize(shape.dtype);
  const int64_t shard_elems = shape.shard_rows * shape.hidden_size;
  ShardTraining training;
  training.grad.assign(static_cast<size_t>(shard_elems), 0.0f);
  for (;;) {
    TpControl c;
    if (absl::Status st = ShareControl(comm, staging, c, false); !st.ok()) return st;
    if (c.magic != kMagic) return absl::DataLossError("tensor-parallel control block is corrupt");
    if (c.op == TpOp::kStop) return absl::OkStatus();
    if (c.op == TpOp::kZeroGrad) {
      std::fill(training.grad.begin(), training.grad.end(), 0.0f);
      continue;
    }
    if (c.op == TpOp::kStep) {
      float sq = static_cast<float>(SquaredNorm(training.grad.data(), shard_elems));
      if (absl::Status st = comm.AllReduce(&sq, 1, ReduceOp::kSum, false, nullptr); !st.ok()) return st;
      if (training.master.empty()) {
        training.master.resize(static_cast<size_t>(shard_elems));
        ConvertToFloat(weights->weight.data(), shape.dtype, shard_elems, training.master.data());
        training.exp_avg.assign(static_cast<size_t>(shard_elems), 0.0f);
        training.exp_avg_sq.assign(static_cast<size_t>(shard_elems), 0.0f);
      }
      AdamWParams p{c.lr, c.beta1, c.beta2, c.eps, c.weight_decay};
      ++training.step;
      AdamWStep(training.master.data(), training.exp_avg.data(), training.exp_avg_sq.data(), training.grad.data(),
                shard_elems, p, training.step, ClipScale(std::sqrt(static_cast<double>(sq)), c.max_grad_norm));
      auto next = std::make_shared<HeadWeights>();
      next->shape = shape;
      next->bias = weights->bias;
      next->weight.resize(weights->weight.size());
      ConvertFromFloat(training.master.data(), shard_elems, shape.dtype, next->weight.data());
      absl::StatusOr<std::shared_ptr<LceEngine>> e = make_engine(next);
      if (!e.ok()) return e.status();  // the ranks would disagree from here on: leave the group
      engine = std::move(*e);
      weights = std::move(next);
      continue;
    }
    if (c.op == TpOp::kGetGrad) {
      for (int r = 1; r < comm.world_size(); ++r) {
        std::vector<float> other;
        float* data = training.grad.data();
        if (r != comm.rank()) {  // another peer's turn: receive (and drop) its shard
          const VocabRange range = VocabShard(shape.vocab_size, r, comm.world_size());
          other.resize(static_cast<size_t>((range.end - range.begin) * shape.hidden_size));
          data = other.data();
        }
        const int64_t bytes = r == comm.rank() ? shard_elems * 4 : static_cast<int64_t>(other.size() * 4);
        if (absl::Status st = comm.Broadcast(data, bytes, false, nullptr, r); !st.ok()) return st;
      }
      continue;
    }
    if (c.op == TpOp::kSave) {
      c.dir[sizeof(c.dir) - 1] = 0;
      c.name[sizeof(c.name) - 1] = 0;
      for (int r = 1; r < comm.world_size(); ++r) {
        float code = 0;
        if (r == comm.rank()) code = WriteHeadShard(c.dir, c.name, *weights, r, comm.world_size()).ok() ? 0.0f : 1.0f;
        if (absl::Status st = comm.Broadcast(&code, sizeof(code), false, nullptr, r); !st.ok()) return st;
      }
      continue;
    }
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
    if (c.flags & kAccumulateWeightGrad) grads.d_weight = training.grad.data();
    if (up.mode != GradMode::kNone) {
      // The d_hidden all-reduce inside the engine needs every rank; the front keeps the result.
      absl::StatusOr<void*> p = staging.Buffer(kOutDHidden, n * row_bytes);
      if (!p.ok()) return p.status();
      grads.d_hidden = *p;
    }
    RowsView rows{*hidden, static_cast<const int32_t*>(*targets), n,
                  staging.device() ? MemorySpace::kDevice : MemorySpace::kHost};
    absl::Status st = engine->Compute(rows, o, up, RowOutputs{}, grads);
    if (st.code() == absl::StatusCode::kUnavailable) return st;
    // Other errors (bad rows) are deterministic: the front got the same one and answered the client.
  }
}

}  // namespace lce::server
