#include "tp_group.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <iostream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine_options.h"
#include "head_store.h"
#include "request_log.h"
#include "status_macros.h"

namespace lce::server {

enum class TpOp : uint32_t { kCompute = 1, kStop, kZeroGrad, kStep, kGetGrad, kSave, kLoad, kUpdate, kCommitPending, kReleasePending };

namespace {

constexpr uint32_t kMagic = 0x4c434536;  // "LCE6": this layout of the control block and these flags
enum Flags : uint32_t {
  // kCompute
  kGradLoss = 1,
  kGradLogprob = 2,
  kGradEntropy = 4,
  kAccumulateWeightGrad = 8,
  kFreshWeightGrad = 16,
  kClassWeights = 32,
  // kGetGrad: dB instead of dW; kUpdate: a new bias follows the weight
  kBiasPart = 64
};
enum Slot : int {
  kControl,
  kHidden,
  kTargets,
  kGradLossSlot,
  kGradLogprobSlot,
  kGradEntropySlot,
  kOutLogprob,
  kOutEntropy,
  kOutLse,
  kOutLoss,
  kOutDHidden,
  kScalars,
  kPiece,
  kClassWeightSlot,
  kOutZLoss,
  kOutArgmax,
  kOutTopTokens,
  kOutTopLogprobs
};
enum class SourceKind : uint32_t { kFile = 1, kSeeded = 2, kClone = 3 };

// Fixed-size control block broadcast before each operation's data.
struct TpControl {
  uint32_t magic = kMagic;
  TpOp op = TpOp::kCompute;
  char head[64] = {};     // every operation but kStop: the head's name
  int64_t version = 0;    // kCompute: the version the call runs on; kStep, kLoad, kUpdate: the new one
  // kCompute
  int64_t rows = 0;
  uint32_t mode = 0;
  uint32_t flags = 0;  // kCompute, kGetGrad, kUpdate: Flags
  OptionBytes options = EncodeOptions(LceOptions{});
  // kCompute with kAccumulateWeightGrad, kCommitPending, kReleasePending: the pending contribution
  // (HeadTrainer::AcquirePending; 0: dW itself), and kCommitPending's scale
  uint64_t pending = 0;
  float scale = 1;
  // kStep
  float lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0, max_grad_norm = 0;
  // kLoad: the source
  SourceKind source = SourceKind::kFile;
  uint32_t dtype = 0;
  int64_t seed_vocab = 0, seed_hidden = 0;
  uint64_t seed = 0;
  uint32_t seed_bias = 0;
  char tensor[128] = {};
  char clone_of[64] = {};
  char path[480] = {};  // kLoad: the file; kSave: the directory
};

// Copies `text` into a fixed field of the control block, NUL-terminated.
template <size_t N>
absl::Status PutText(char (&field)[N], const std::string& text, const char* what) {
  if (text.size() >= N) {
    return absl::InvalidArgumentError(absl::StrCat(what, " '", text, "' is longer than a tensor-parallel group takes (",
                                                   N - 1, " bytes)"));
  }
  std::memcpy(field, text.data(), text.size());
  return absl::OkStatus();
}
template <size_t N>
std::string GetText(const char (&field)[N]) {
  return std::string(field, strnlen(field, N));
}

// Broadcasts `bytes` at `src` (the root) or into a staging slot (the others); returns the staged pointer.
// A root's `src` in device memory (a chunk its request staged on the device) is broadcast where it is.
absl::StatusOr<void*> Share(TpCommunicator& comm, ChunkStaging& staging, int slot, const void* src, int64_t bytes,
                            bool src_on_device = false) {
  if (src_on_device) {
    void* p = const_cast<void*>(src);  // the root's in-place broadcast only reads it
    LCE_RETURN_IF_ERROR(comm.Broadcast(p, bytes, /*device=*/true, staging.stream()));
    return p;
  }
  absl::StatusOr<void*> buf = staging.Buffer(slot, std::max<int64_t>(bytes, 1));
  if (!buf.ok()) return buf.status();
  // The root's copy up is ordered before the broadcast on the staging's stream, which the broadcast
  // waits for: one wait a share, not two.
  if (src != nullptr) LCE_RETURN_IF_ERROR(staging.UploadAsync(*buf, src, bytes));
  if (absl::Status s = comm.Broadcast(*buf, bytes, staging.device(), staging.stream()); !s.ok()) {
    staging.Sync().IgnoreError();  // src must outlive the copy
    return s;
  }
  return *buf;
}

// The control block, host side: the root sends its own, the others receive it.
absl::Status ShareControl(TpCommunicator& comm, ChunkStaging& staging, TpControl& c, bool send) {
  absl::StatusOr<void*> buf = Share(comm, staging, kControl, send ? &c : nullptr, sizeof(c));
  if (!buf.ok() || send) return buf.status();
  return staging.Download(&c, *buf, sizeof(c));
}

}  // namespace

// All-reduces n floats of host memory through the staging (device memory for NCCL).
absl::Status AllReduceFloats(TpCommunicator& comm, ChunkStaging& staging, float* values, int n, ReduceOp op) {
  absl::StatusOr<void*> buf = staging.Buffer(kScalars, n * 4);
  if (!buf.ok()) return buf.status();
  LCE_RETURN_IF_ERROR(staging.Upload(*buf, values, n * 4));
  if (absl::Status s = comm.AllReduce(static_cast<float*>(*buf), n, op, staging.device(), staging.stream()); !s.ok()) {
    return s;
  }
  return staging.Download(values, *buf, n * 4);
}

namespace {

// Every rank's outcome of its part of an operation, agreed on by all: OK when every rank's part
// succeeded; else this rank's own error, or one naming the ranks that failed (with the largest of
// their codes; their logs say why). Each failed rank adds 2^rank to one sum.
absl::Status AgreeOnOutcome(TpCommunicator& comm, ChunkStaging& staging, const absl::Status& mine, const std::string& what) {
  float v[2] = {mine.ok() ? 0.0f : std::ldexp(1.0f, std::min(comm.rank(), 23)), static_cast<float>(mine.code())};
  LCE_RETURN_IF_ERROR(AllReduceFloats(comm, staging, v, 1, ReduceOp::kSum));
  LCE_RETURN_IF_ERROR(AllReduceFloats(comm, staging, v + 1, 1, ReduceOp::kMax));
  if (v[0] == 0.0f) return absl::OkStatus();
  if (!mine.ok()) return mine;
  std::vector<std::string> ranks;
  for (int r = 0; r < std::min(comm.world_size(), 24); ++r) {
    if (static_cast<int64_t>(v[0]) & (int64_t{1} << r)) ranks.push_back(absl::StrCat(r));
  }
  return absl::Status(static_cast<absl::StatusCode>(static_cast<int>(v[1])),
                      absl::StrCat("rank ", absl::StrJoin(ranks, ", rank "), " could not ", what, " (its log says why)"));
}

// Calls f(first_row, rows) for the pieces of `rows` rows of `row_bytes` each (at most piece_bytes a
// piece, one row at least), in order.
template <typename F>
absl::Status ForEachPiece(int64_t rows, int64_t row_bytes, int64_t piece_bytes, F&& f) {
  const int64_t per = std::max<int64_t>(1, piece_bytes / row_bytes);
  for (int64_t r0 = 0; r0 < rows; r0 += per) {
    LCE_RETURN_IF_ERROR(f(r0, std::min(per, rows - r0)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ScatterRows(TpCommunicator& comm, ChunkStaging& staging, int64_t vocab_size, const uint8_t* all,
                         int64_t row_bytes, int64_t piece_bytes) {
  for (int r = 1; r < comm.world_size(); ++r) {
    const VocabRange range = VocabShard(vocab_size, r, comm.world_size());
    absl::Status s =
        ForEachPiece(range.end - range.begin, row_bytes, piece_bytes, [&](int64_t r0, int64_t n) -> absl::Status {
          return Share(comm, staging, kPiece, all + (range.begin + r0) * row_bytes, n * row_bytes).status();
        });
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status ReceiveRows(TpCommunicator& comm, ChunkStaging& staging, int64_t vocab_size, uint8_t* mine,
                         int64_t row_bytes, int64_t piece_bytes) {
  for (int r = 1; r < comm.world_size(); ++r) {
    const VocabRange range = VocabShard(vocab_size, r, comm.world_size());
    absl::Status s =
        ForEachPiece(range.end - range.begin, row_bytes, piece_bytes, [&](int64_t r0, int64_t n) -> absl::Status {
          absl::StatusOr<void*> buf = Share(comm, staging, kPiece, nullptr, n * row_bytes);
          if (!buf.ok() || r != comm.rank()) return buf.status();
          return staging.Download(mine + r0 * row_bytes, *buf, n * row_bytes);
        });
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status GatherRows(TpCommunicator& comm, ChunkStaging& staging, int64_t vocab_size, int64_t cols,
                        const std::function<absl::Status(int64_t, int64_t, const float*)>& sink, int64_t piece_bytes) {
  absl::Status sunk;
  std::vector<float> host;
  for (int r = 1; r < comm.world_size(); ++r) {
    const VocabRange range = VocabShard(vocab_size, r, comm.world_size());
    absl::Status s =
        ForEachPiece(range.end - range.begin, cols * 4, piece_bytes, [&](int64_t r0, int64_t n) -> absl::Status {
          absl::StatusOr<void*> buf = staging.Buffer(kPiece, n * cols * 4);
          if (!buf.ok()) return buf.status();
          LCE_RETURN_IF_ERROR(comm.Broadcast(*buf, n * cols * 4, staging.device(), staging.stream(), r));
          host.resize(static_cast<size_t>(n * cols));
          LCE_RETURN_IF_ERROR(staging.Download(host.data(), *buf, n * cols * 4));
          if (sunk.ok()) sunk = sink(range.begin + r0, n, host.data());  // the peers go on regardless
          return absl::OkStatus();
        });
    if (!s.ok()) return s;
  }
  return sunk;
}

absl::Status SendRows(TpCommunicator& comm, ChunkStaging& staging, int64_t vocab_size, int64_t cols, float* mine,
                      int64_t piece_bytes) {
  for (int r = 1; r < comm.world_size(); ++r) {
    const VocabRange range = VocabShard(vocab_size, r, comm.world_size());
    absl::Status s =
        ForEachPiece(range.end - range.begin, cols * 4, piece_bytes, [&](int64_t r0, int64_t n) -> absl::Status {
          void* data = nullptr;
          if (r == comm.rank()) {
            data = mine + r0 * cols;
          } else {
            absl::StatusOr<void*> buf = staging.Buffer(kPiece, n * cols * 4);
            if (!buf.ok()) return buf.status();
            data = *buf;
          }
          return comm.Broadcast(data, n * cols * 4, staging.device(), staging.stream(), r);
        });
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

namespace {

absl::Status StatusOf(const absl::Status& s) { return s; }
template <typename T>
absl::Status StatusOf(const absl::StatusOr<T>& s) { return s.status(); }

// What every operation after the failure gets: its cause too (the parts of a split request that come
// after the one that met the failure name the lost rank as well).
absl::Status GroupDown(const absl::Status& cause) {
  return absl::UnavailableError(
      absl::StrCat("tensor-parallel group is down (", cause.message(), "); it is being restarted"));
}

}  // namespace

absl::StatusOr<ShardStep> StepShard(absl::StatusOr<HeadTrainer*> trainer, int64_t vocab_size, TpCommunicator* comm,
                                    ChunkStaging* staging, const AdamWParams& p, float max_grad_norm, GradReducer* dp) {
  absl::Status ready = trainer.status();
  if (ready.ok()) ready = (*trainer)->PrepareStep();
  if (dp != nullptr) ready = dp->Reduce(ready, trainer.ok() ? *trainer : nullptr, comm, staging);
  // Every tile's squared norm in its own slot (lce/training.h), then the ranks that cannot step.
  const int64_t tiles = VocabTileCount(vocab_size);
  std::vector<float> v(static_cast<size_t>(2 * tiles + 1), 0.0f);
  if (ready.ok()) {
    absl::StatusOr<TileSquaredNorms> local = (*trainer)->GradTileSquaredNorms();
    if (local.ok()) PackTileSquaredNorms(*local, v.data()); else ready = local.status();
  }
  v.back() = ready.ok() ? 0.0f : 1.0f;
  if (comm != nullptr) {
    if (absl::Status s = AllReduceFloats(*comm, *staging, v.data(), static_cast<int>(v.size()), ReduceOp::kSum); !s.ok()) {
      return s;
    }
    if (v.back() != 0.0f) {
      absl::Status agreed = AgreeOnOutcome(*comm, *staging, ready, "prepare its optimizer step");
      return agreed.ok() ? absl::InternalError("ranks disagree on a failed step") : agreed;
    }
  } else if (!ready.ok()) {
    return ready;
  }
  const double norm = std::sqrt(CombineTileSquaredNorms(v.data(), tiles));
  absl::StatusOr<std::shared_ptr<LceEngine>> engine = (*trainer)->Step(p, ClipScale(norm, max_grad_norm));
  if (!engine.ok()) {
    return absl::InternalError(absl::StrCat("the optimizer step failed after changing its state: ", engine.status().message()));
  }
  return ShardStep{norm, *std::move(engine)};
}

absl::StatusOr<std::shared_ptr<const HeadWeights>> LoadShard(
    const TpHeadSource& source, int rank, int world,
    const std::function<absl::StatusOr<std::shared_ptr<const HeadWeights>>(const std::string&)>& clone,
    int64_t max_shard_bytes) {
  if (!source.clone_of.empty()) return clone(source.clone_of);
  absl::StatusOr<std::shared_ptr<HeadWeights>> w = LoadHead(source.source, rank, world, max_shard_bytes);
  if (!w.ok()) return w.status();
  return std::shared_ptr<const HeadWeights>(*std::move(w));
}

// ---- the front ----

absl::Status TpGroup::Fail(absl::Status s) {
  if (!failed_) {
    failed_ = true;
    failure_ = s;
    comm_->Abort();
    if (on_failure_) on_failure_(s);
  }
  return s;
}

template <typename T, typename F>
T TpGroup::Locked(F&& op) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_) return T(GroupDown(failure_));
  T out = op();
  // The caller gets `out` itself; Fail's copy of the status only marks the group down.
  if (StatusOf(out).code() == absl::StatusCode::kUnavailable) Fail(StatusOf(out)).IgnoreError();
  return out;
}

absl::Status TpGroup::Compute(const std::string& head, int64_t version, LceEngine& local, const RowsView& rows,
                              const LceOptions& o, const Upstream& up, const RowOutputs& outputs, const GradOutputs& grads) {
  if (rows.space != MemorySpace::kHost && !staging_->device()) {
    return absl::InvalidArgumentError("a tensor-parallel group on host memory takes host rows");
  }
  return Locked<absl::Status>([&] { return ComputeLocked(head, version, local, rows, o, up, outputs, grads); });
}

absl::Status TpGroup::ComputeLocked(const std::string& head, int64_t version, LceEngine& local, const RowsView& rows,
                                    const LceOptions& o, const Upstream& up, const RowOutputs& outputs,
                                    const GradOutputs& grads) {
  const auto t0 = std::chrono::steady_clock::now();
  TpControl c;
  LCE_RETURN_IF_ERROR(PutText(c.head, head, "head name"));
  c.version = version;
  c.rows = rows.rows;
  c.mode = static_cast<uint32_t>(up.mode);
  c.flags = (up.grad_loss ? kGradLoss : 0) | (up.grad_logprob ? kGradLogprob : 0) |
            (up.grad_entropy ? kGradEntropy : 0) | (grads.d_weight ? kAccumulateWeightGrad : 0) |
            (grads.d_weight && grads.d_weight_fresh ? kFreshWeightGrad : 0) | (rows.class_weight ? kClassWeights : 0);
  c.pending = grads.d_weight_pending;
  c.options = EncodeOptions(o);
  LCE_RETURN_IF_ERROR(ShareControl(*comm_, *staging_, c, true));
  const auto t1 = std::chrono::steady_clock::now();
  absl::StatusOr<SharedInputs> in = ShareInputs(local.shape(), rows, up);
  if (!in.ok()) return in.status();
  if (RequestWork* w = RequestWork::Current(); w != nullptr) {
    w->tp_control_seconds += std::chrono::duration<double>(t1 - t0).count();
    w->tp_inputs_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  }
  // Staged rows come with device outputs (LceService::StageOnDevice), which the request downloads
  // itself after the call.
  if (!staging_->device() || rows.space == MemorySpace::kDevice) {
    return local.Compute(in->rows, o, in->up, outputs, grads);
  }
  return ComputeStaged(local, in->rows, o, in->up, outputs, grads);
}

// Rows (and their targets, upstream gradients and class weights) that the request staged on the
// device, outside the group's lock, go to the peers from there; host rows through the staging.
absl::StatusOr<TpGroup::SharedInputs> TpGroup::ShareInputs(const HeadShape& shape, const RowsView& rows,
                                                           const Upstream& up) {
  const int64_t n = rows.rows;
  const bool dev = rows.space == MemorySpace::kDevice;
  absl::StatusOr<void*> hidden = Share(*comm_, *staging_, kHidden, rows.hidden, n * shape.row_bytes(), dev);
  if (!hidden.ok()) return hidden.status();
  absl::StatusOr<void*> targets = Share(*comm_, *staging_, kTargets, rows.targets, n * 4, dev);
  if (!targets.ok()) return targets.status();
  SharedInputs in{RowsView{*hidden, static_cast<const int32_t*>(*targets), n,
                           staging_->device() ? MemorySpace::kDevice : MemorySpace::kHost, rows.targets_checked},
                  up};
  if (rows.class_weight != nullptr) {
    absl::StatusOr<void*> p = Share(*comm_, *staging_, kClassWeightSlot, rows.class_weight, shape.vocab_size * 4, dev);
    if (!p.ok()) return p.status();
    in.rows.class_weight = static_cast<const float*>(*p);
  }
  struct GradIn {
    const float* src;
    int slot;
    const float** dst;
  };
  for (GradIn g : {GradIn{up.grad_loss, kGradLossSlot, &in.up.grad_loss},
                   GradIn{up.grad_logprob, kGradLogprobSlot, &in.up.grad_logprob},
                   GradIn{up.grad_entropy, kGradEntropySlot, &in.up.grad_entropy}}) {
    if (g.src == nullptr) continue;
    absl::StatusOr<void*> p = Share(*comm_, *staging_, g.slot, g.src, n * 4, dev);
    if (!p.ok()) return p.status();
    *g.dst = static_cast<const float*>(*p);
  }
  return in;
}

// Device staging: outputs land in device buffers, then come back to the caller's host memory; dW
// (the front's trainer's) is device memory already.
absl::Status TpGroup::ComputeStaged(LceEngine& local, const RowsView& view, const LceOptions& o, const Upstream& up,
                                    const RowOutputs& outputs, const GradOutputs& grads) {
  const int64_t n = view.rows;
  const int64_t row_bytes = local.shape().row_bytes();
  RowOutputs dev_out = outputs;
  const int64_t k = std::max<int32_t>(o.top_k, 1);
  struct Out {
    int slot;
    void** dst;
    int64_t bytes;
  };
  std::vector<std::pair<void*, Out>> back;  // host destination, device buffer
  for (Out x : {Out{kOutLogprob, reinterpret_cast<void**>(&dev_out.logprob), n * 4},
                Out{kOutEntropy, reinterpret_cast<void**>(&dev_out.entropy), n * 4},
                Out{kOutLse, reinterpret_cast<void**>(&dev_out.lse), n * 4},
                Out{kOutLoss, reinterpret_cast<void**>(&dev_out.loss), n * 4},
                Out{kOutZLoss, reinterpret_cast<void**>(&dev_out.z_loss), n * 4},
                Out{kOutArgmax, reinterpret_cast<void**>(&dev_out.argmax), n * 4},
                Out{kOutTopTokens, reinterpret_cast<void**>(&dev_out.top_tokens), n * k * 4},
                Out{kOutTopLogprobs, reinterpret_cast<void**>(&dev_out.top_logprobs), n * k * 4}}) {
    if (*x.dst == nullptr) continue;
    absl::StatusOr<void*> p = staging_->Buffer(x.slot, x.bytes);
    if (!p.ok()) return p.status();
    back.push_back({*x.dst, x});
    *x.dst = *p;
  }
  GradOutputs dev_grads;
  dev_grads.d_weight = grads.d_weight;
  dev_grads.d_bias = grads.d_bias;
  dev_grads.d_weight_fresh = grads.d_weight_fresh;
  if (grads.d_hidden != nullptr) {
    absl::StatusOr<void*> p = staging_->Buffer(kOutDHidden, n * row_bytes);
    if (!p.ok()) return p.status();
    dev_grads.d_hidden = *p;
  }
  LCE_RETURN_IF_ERROR(local.Compute(view, o, up, dev_out, dev_grads));
  for (const auto& [host, x] : back) {
    LCE_RETURN_IF_ERROR(staging_->Download(host, *x.dst, x.bytes));
  }
  if (grads.d_hidden != nullptr) return staging_->Download(grads.d_hidden, dev_grads.d_hidden, n * row_bytes);
  return absl::OkStatus();
}

absl::Status TpGroup::StopPeers() {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_) return absl::OkStatus();
  TpControl c;
  c.op = TpOp::kStop;
  return ShareControl(*comm_, *staging_, c, true);
}

absl::Status TpGroup::ZeroGrad(const std::string& head) { return GradOp(head, TpOp::kZeroGrad); }
absl::Status TpGroup::CommitPending(const std::string& head, uint64_t id, float scale) {
  return GradOp(head, TpOp::kCommitPending, id, scale);
}
absl::Status TpGroup::ReleasePending(const std::string& head, uint64_t id) {
  return GradOp(head, TpOp::kReleasePending, id);
}

absl::Status TpGroup::GradOp(const std::string& head, TpOp op, uint64_t pending, float scale) {
  return Locked<absl::Status>([&]() -> absl::Status {
    TpControl c;
    c.op = op;
    c.pending = pending;
    c.scale = scale;
    LCE_RETURN_IF_ERROR(PutText(c.head, head, "head name"));
    return ShareControl(*comm_, *staging_, c, true);
  });
}

absl::StatusOr<ShardStep> TpGroup::Step(const std::string& head, int64_t version, int64_t vocab_size,
                                        absl::StatusOr<HeadTrainer*> front, const AdamWParams& p, float max_grad_norm,
                                        GradReducer* dp) {
  return Locked<absl::StatusOr<ShardStep>>([&]() -> absl::StatusOr<ShardStep> {
    TpControl c;
    c.op = TpOp::kStep;
    LCE_RETURN_IF_ERROR(PutText(c.head, head, "head name"));
    c.version = version;
    c.lr = p.lr;
    c.beta1 = p.beta1;
    c.beta2 = p.beta2;
    c.eps = p.eps;
    c.weight_decay = p.weight_decay;
    c.max_grad_norm = max_grad_norm;
    LCE_RETURN_IF_ERROR(ShareControl(*comm_, *staging_, c, true));
    absl::StatusOr<ShardStep> r = StepShard(std::move(front), vocab_size, comm_, staging_.get(), p, max_grad_norm, dp);
    if (r.status().code() == absl::StatusCode::kInternal) {
      return Fail(absl::InternalError(absl::StrCat("rank 0: ", r.status().message(),
                                                   "; the group's shards disagree and it restarts")));
    }
    return r;
  });
}

absl::Status TpGroup::GatherPeerGrads(const std::string& head, const HeadShape& shape,
                                      const std::function<absl::Status(int64_t, int64_t, const float*)>& sink,
                                      uint64_t pending, bool bias) {
  return Locked<absl::Status>([&]() -> absl::Status {
    TpControl c;
    c.op = TpOp::kGetGrad;
    c.pending = pending;
    c.flags = bias ? kBiasPart : 0;
    LCE_RETURN_IF_ERROR(PutText(c.head, head, "head name"));
    LCE_RETURN_IF_ERROR(ShareControl(*comm_, *staging_, c, true));
    return GatherRows(*comm_, *staging_, shape.vocab_size, bias ? 1 : shape.hidden_size, sink);
  });
}

absl::Status TpGroup::Save(const std::string& head, int64_t version, const std::string& dir,
                           const std::function<absl::Status()>& front_part) {
  return Locked<absl::Status>([&]() -> absl::Status {
    TpControl c;
    c.op = TpOp::kSave;
    c.version = version;
    LCE_RETURN_IF_ERROR(PutText(c.head, head, "head name"));
    LCE_RETURN_IF_ERROR(PutText(c.path, dir, "SaveHead directory"));
    LCE_RETURN_IF_ERROR(ShareControl(*comm_, *staging_, c, true));
    return AgreeOnOutcome(*comm_, *staging_, front_part(), absl::StrCat("write its shard to ", dir));
  });
}

absl::Status TpGroup::Load(const std::string& head, int64_t version, const TpHeadSource& source,
                           const std::function<absl::Status()>& front_part) {
  return Locked<absl::Status>([&]() -> absl::Status {
    TpControl c;
    c.op = TpOp::kLoad;
    c.version = version;
    LCE_RETURN_IF_ERROR(PutText(c.head, head, "head name"));
    const HeadSource& src = source.source;
    c.source = !source.clone_of.empty() ? SourceKind::kClone : src.file.empty() ? SourceKind::kSeeded : SourceKind::kFile;
    c.dtype = static_cast<uint32_t>(src.dtype);
    c.seed_vocab = src.seed_vocab;
    c.seed_hidden = src.seed_hidden;
    c.seed = src.seed;
    c.seed_bias = src.seed_bias ? 1 : 0;
    for (absl::Status s : {PutText(c.path, src.file, "LoadHead file"), PutText(c.tensor, src.tensor, "LoadHead tensor"),
                           PutText(c.clone_of, source.clone_of, "LoadHead clone_of")}) {
      if (!s.ok()) return s;
    }
    LCE_RETURN_IF_ERROR(ShareControl(*comm_, *staging_, c, true));
    return AgreeOnOutcome(*comm_, *staging_, front_part(), absl::StrCat("load its shard of head '", head, "'"));
  });
}

absl::Status TpGroup::Update(const std::string& head, int64_t version, const HeadWeights& full,
                             const std::function<absl::Status()>& front_part) {
  return Locked<absl::Status>([&]() -> absl::Status {
    TpControl c;
    c.op = TpOp::kUpdate;
    c.version = version;
    c.flags = full.bias.empty() ? 0 : kBiasPart;
    LCE_RETURN_IF_ERROR(PutText(c.head, head, "head name"));
    LCE_RETURN_IF_ERROR(ShareControl(*comm_, *staging_, c, true));
    const int64_t vocab = full.shape.vocab_size;
    LCE_RETURN_IF_ERROR(ScatterRows(*comm_, *staging_, vocab, full.weight.data(), full.shape.row_bytes()));
    if (!full.bias.empty()) {
      LCE_RETURN_IF_ERROR(
          ScatterRows(*comm_, *staging_, vocab, reinterpret_cast<const uint8_t*>(full.bias.data()), sizeof(float)));
    }
    absl::Status all = AgreeOnOutcome(*comm_, *staging_, front_part(), "serve its rows of the new weight");
    if (all.ok() || all.code() == absl::StatusCode::kUnavailable) return all;
    return Fail(absl::InternalError(absl::StrCat("UpdateWeights failed on part of the group, whose shards now disagree;",
                                                 " it restarts: ", all.message())));
  });
}

// ---- a peer ----

namespace {

class TpPeer {
 public:
  TpPeer(PeerHeadStart first, const EngineMaker& make, TpCommunicator& comm, ChunkStaging& staging, GradReducer* dp)
      : make_(make), comm_(comm), staging_(staging), dp_(dp) {
    Head& h = heads_[first.name];
    h.weights = std::move(first.weights);
    h.engine = std::move(first.engine);
  }

  absl::Status Run() {
    for (;;) {
      TpControl c;
      LCE_RETURN_IF_ERROR(ShareControl(comm_, staging_, c, false));
      if (c.magic != kMagic) return absl::DataLossError("tensor-parallel control block is corrupt (another build?)");
      if (c.op == TpOp::kStop) return absl::OkStatus();
      absl::Status s = Dispatch(c);
      if (!s.ok()) return s;
    }
  }

 private:
  struct Head {
    std::shared_ptr<const HeadWeights> weights;  // as loaded or last updated
    std::shared_ptr<LceEngine> engine;
    std::unique_ptr<HeadTrainer> trainer;        // made at first use
    int64_t version = 1;
  };

  absl::Status Dispatch(const TpControl& c) {
    switch (c.op) {
      case TpOp::kCompute: return OnCompute(c);
      case TpOp::kZeroGrad: return OnZeroGrad(c);
      case TpOp::kCommitPending: return OnCommitPending(c);
      case TpOp::kReleasePending: return OnReleasePending(c);
      case TpOp::kStep: return OnStep(c);
      case TpOp::kGetGrad: return OnGetGrad(c);
      case TpOp::kSave: return OnSave(c);
      case TpOp::kLoad: return OnLoad(c);
      case TpOp::kUpdate: return OnUpdate(c);
      default: return absl::DataLossError(absl::StrCat("unknown tensor-parallel operation ", static_cast<uint32_t>(c.op)));
    }
  }

  // The head an operation names; not holding it means this rank no longer follows the front.
  absl::StatusOr<Head*> Find(const TpControl& c) {
    auto it = heads_.find(GetText(c.head));
    if (it == heads_.end()) return absl::DataLossError(absl::StrCat("rank ", comm_.rank(), " holds no head '", GetText(c.head), "'"));
    return &it->second;
  }
  absl::StatusOr<HeadTrainer*> Trainer(Head& h) { return TrainerFor(h.trainer, h.engine, h.weights, make_); }
  // A failure the group agreed on changed nothing: log it and go on.
  void Log(const char* what, const absl::Status& s) {
    std::cerr << "lce_server: rank " << comm_.rank() << ": " << what << ": " << s << std::endl;
  }

  absl::Status OnCompute(const TpControl& c);
  // OnCompute's stages: the rows and the upstream gradients the front shares (in its order), this rank's outputs.
  absl::StatusOr<RowsView> ShareRows(const TpControl& c, const Head& head);
  absl::StatusOr<Upstream> ShareUpstream(const TpControl& c);
  absl::StatusOr<GradOutputs> PlaceGrads(const TpControl& c, Head& head, const Upstream& up);
  absl::Status OnZeroGrad(const TpControl& c) {
    absl::StatusOr<Head*> h = Find(c);
    if (!h.ok()) return h.status();
    return (*h)->trainer != nullptr ? (*h)->trainer->ZeroGrad() : absl::OkStatus();
  }
  // A rank that cannot commit its share of a contribution would leave dW's shards disagreeing: it
  // leaves the group. A rank without a trainer never held the contribution (it failed its compute).
  absl::Status OnCommitPending(const TpControl& c) {
    absl::StatusOr<Head*> h = Find(c);
    if (!h.ok()) return h.status();
    if ((*h)->trainer == nullptr) return absl::OkStatus();
    absl::Status s = (*h)->trainer->CommitPending(c.pending, c.scale);
    return s.code() == absl::StatusCode::kNotFound ? absl::OkStatus() : s;
  }
  absl::Status OnReleasePending(const TpControl& c) {
    absl::StatusOr<Head*> h = Find(c);
    if (!h.ok()) return h.status();
    if ((*h)->trainer != nullptr) (*h)->trainer->ReleasePending(c.pending);
    return absl::OkStatus();
  }
  absl::Status OnStep(const TpControl& c);
  absl::Status OnGetGrad(const TpControl& c);
  absl::Status OnSave(const TpControl& c);
  absl::Status OnLoad(const TpControl& c);
  absl::Status OnUpdate(const TpControl& c);

  const EngineMaker& make_;
  TpCommunicator& comm_;
  ChunkStaging& staging_;
  GradReducer* dp_;
  std::map<std::string, Head> heads_;
};

absl::Status TpPeer::OnCompute(const TpControl& c) {
  absl::StatusOr<Head*> found = Find(c);
  if (!found.ok()) return found.status();
  Head& head = **found;
  if (c.version != head.version) {
    return absl::DataLossError(absl::StrCat("rank ", comm_.rank(), " serves head '", GetText(c.head), "' at version ",
                                            head.version, ", the front at ", c.version));
  }
  // The front's inputs, shared in its order: the rows (hidden, targets, class weights), then the upstream gradients.
  absl::StatusOr<RowsView> rows = ShareRows(c, head);
  if (!rows.ok()) return rows.status();
  absl::StatusOr<Upstream> up = ShareUpstream(c);
  if (!up.ok()) return up.status();
  absl::StatusOr<GradOutputs> grads = PlaceGrads(c, head, *up);
  if (!grads.ok()) return grads.status();
  absl::Status st = head.engine->Compute(*rows, DecodeOptions(c.options), *up, RowOutputs{}, *grads);
  // Other errors (bad rows) are deterministic: the front got the same one and answered the client.
  return st.code() == absl::StatusCode::kUnavailable ? st : absl::OkStatus();
}

absl::StatusOr<RowsView> TpPeer::ShareRows(const TpControl& c, const Head& head) {
  const int64_t n = c.rows;
  absl::StatusOr<void*> hidden = Share(comm_, staging_, kHidden, nullptr, n * head.engine->shape().row_bytes());
  if (!hidden.ok()) return hidden.status();
  absl::StatusOr<void*> targets = Share(comm_, staging_, kTargets, nullptr, n * 4);
  if (!targets.ok()) return targets.status();
  RowsView rows{*hidden, static_cast<const int32_t*>(*targets), n,
                staging_.device() ? MemorySpace::kDevice : MemorySpace::kHost};
  if (c.flags & kClassWeights) {  // shared right after the targets, as the front does
    absl::StatusOr<void*> p = Share(comm_, staging_, kClassWeightSlot, nullptr, head.weights->shape.vocab_size * 4);
    if (!p.ok()) return p.status();
    rows.class_weight = static_cast<const float*>(*p);
  }
  return rows;
}

absl::StatusOr<Upstream> TpPeer::ShareUpstream(const TpControl& c) {
  Upstream up;
  up.mode = static_cast<GradMode>(c.mode);
  struct GradIn { uint32_t flag; int slot; const float** dst; };
  for (GradIn g : {GradIn{kGradLoss, kGradLossSlot, &up.grad_loss}, GradIn{kGradLogprob, kGradLogprobSlot, &up.grad_logprob},
                   GradIn{kGradEntropy, kGradEntropySlot, &up.grad_entropy}}) {
    if (!(c.flags & g.flag)) continue;
    absl::StatusOr<void*> p = Share(comm_, staging_, g.slot, nullptr, c.rows * 4);
    if (!p.ok()) return p.status();
    *g.dst = static_cast<const float*>(*p);
  }
  return up;
}

absl::StatusOr<GradOutputs> TpPeer::PlaceGrads(const TpControl& c, Head& head, const Upstream& up) {
  GradOutputs grads;
  if (c.flags & kAccumulateWeightGrad) {
    absl::StatusOr<HeadTrainer*> t = Trainer(head);
    if (!t.ok()) return t.status();  // this rank's dW would be missing: leave the group
    const bool fresh = (c.flags & kFreshWeightGrad) != 0 && c.pending != 0;
    absl::StatusOr<float*> d_weight = c.pending != 0 ? (*t)->AcquirePending(c.pending, /*zeroed=*/!fresh) : (*t)->grad();
    if (!d_weight.ok()) return d_weight.status();
    grads.d_weight = *d_weight;
    grads.d_bias = (*t)->BiasPart(*d_weight);
    grads.d_weight_pending = c.pending;
    grads.d_weight_fresh = fresh;
  }
  if (up.mode != GradMode::kNone) {
    // d_hidden's sum over the ranks needs every rank's part (into the front alone: EngineConfig::rank0_outputs).
    absl::StatusOr<void*> p = staging_.Buffer(kOutDHidden, c.rows * head.engine->shape().row_bytes());
    if (!p.ok()) return p.status();
    grads.d_hidden = *p;
  }
  return grads;
}

absl::Status TpPeer::OnStep(const TpControl& c) {
  absl::StatusOr<Head*> found = Find(c);
  if (!found.ok()) return found.status();
  Head& head = **found;
  const AdamWParams p{c.lr, c.beta1, c.beta2, c.eps, c.weight_decay};
  absl::StatusOr<ShardStep> r =
      StepShard(Trainer(head), head.weights->shape.vocab_size, &comm_, &staging_, p, c.max_grad_norm, dp_);
  if (!r.ok()) {
    const absl::StatusCode code = r.status().code();
    if (code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kInternal) return r.status();
    Log("optimizer step not taken", r.status());
    return absl::OkStatus();
  }
  head.engine = std::move(r->engine);
  head.version = c.version;
  return absl::OkStatus();
}

absl::Status TpPeer::OnGetGrad(const TpControl& c) {
  absl::StatusOr<Head*> found = Find(c);
  if (!found.ok()) return found.status();
  absl::StatusOr<HeadTrainer*> trainer = Trainer(**found);
  if (!trainer.ok()) return trainer.status();
  const HeadShape& shape = (*trainer)->shape();
  // dW, or a pending contribution the front found in its book (every rank holds its shard of it).
  absl::StatusOr<float*> source = c.pending != 0 ? (*trainer)->FindPending(c.pending) : (*trainer)->grad();
  if (!source.ok()) return source.status();  // this rank no longer follows the front
  const bool bias = (c.flags & kBiasPart) != 0;
  float* mine = bias ? (*trainer)->BiasPart(*source) : *source;  // dB follows dW in the buffer
  if (mine == nullptr) return absl::DataLossError(absl::StrCat("rank ", comm_.rank(), " holds no bias to send"));
  return SendRows(comm_, staging_, shape.vocab_size, bias ? 1 : shape.hidden_size, mine);
}

absl::Status TpPeer::OnSave(const TpControl& c) {
  absl::StatusOr<Head*> found = Find(c);
  if (!found.ok()) return found.status();
  Head& head = **found;
  absl::Status mine;
  absl::StatusOr<std::shared_ptr<const HeadWeights>> w = CurrentWeights(head.trainer.get(), head.weights);
  if (w.ok()) {
    mine = WriteHeadShard(GetText(c.path), GetText(c.head), c.version, **w, comm_.rank(), comm_.world_size()).status();
  } else {
    mine = w.status();
  }
  if (!mine.ok()) Log("SaveHead", mine);
  absl::Status all = AgreeOnOutcome(comm_, staging_, mine, "write its shard");
  return all.code() == absl::StatusCode::kUnavailable ? all : absl::OkStatus();
}

absl::Status TpPeer::OnLoad(const TpControl& c) {
  TpHeadSource source;
  source.source.file = c.source == SourceKind::kFile ? GetText(c.path) : "";
  source.source.tensor = GetText(c.tensor);
  source.source.seed_vocab = c.seed_vocab;
  source.source.seed_hidden = c.seed_hidden;
  source.source.seed = c.seed;
  source.source.seed_bias = c.seed_bias != 0;
  source.source.dtype = static_cast<DType>(c.dtype);
  if (c.source == SourceKind::kClone) source.clone_of = GetText(c.clone_of);
  absl::StatusOr<std::shared_ptr<const HeadWeights>> w =
      LoadShard(source, comm_.rank(), comm_.world_size(), [&](const std::string& name) -> absl::StatusOr<std::shared_ptr<const HeadWeights>> {
        auto it = heads_.find(name);
        if (it == heads_.end()) return absl::NotFoundError(absl::StrCat("unknown head '", name, "'"));
        return CurrentWeights(it->second.trainer.get(), it->second.weights);
      });
  absl::StatusOr<std::shared_ptr<LceEngine>> engine = w.ok() ? make_(*w) : absl::StatusOr<std::shared_ptr<LceEngine>>(w.status());
  if (!engine.ok()) Log("LoadHead", engine.status());
  absl::Status all = AgreeOnOutcome(comm_, staging_, engine.status(), "load its shard");
  if (!all.ok()) return all.code() == absl::StatusCode::kUnavailable ? all : absl::OkStatus();
  Head& head = heads_[GetText(c.head)];
  head = Head{*std::move(w), *std::move(engine), nullptr, c.version};
  return absl::OkStatus();
}

absl::Status TpPeer::OnUpdate(const TpControl& c) {
  absl::StatusOr<Head*> found = Find(c);
  if (!found.ok()) return found.status();
  Head& head = **found;
  const HeadShape& shape = head.weights->shape;
  const int64_t row_bytes = shape.row_bytes();
  auto next = std::make_shared<HeadWeights>();
  next->shape = shape;
  next->bias = head.weights->bias;  // kept unless a new one follows
  next->weight.resize(head.weights->weight.size());
  LCE_RETURN_IF_ERROR(ReceiveRows(comm_, staging_, shape.vocab_size, next->weight.data(), row_bytes));
  if (c.flags & kBiasPart) {
    // The front sends a bias only for a head with one; a rank whose shard has none no longer follows.
    if (!shape.has_bias) return absl::DataLossError(absl::StrCat("rank ", comm_.rank(), " holds no bias to update"));
    next->bias.resize(static_cast<size_t>(shape.shard_rows));
    LCE_RETURN_IF_ERROR(
        ReceiveRows(comm_, staging_, shape.vocab_size, reinterpret_cast<uint8_t*>(next->bias.data()), sizeof(float)));
  }
  absl::StatusOr<std::shared_ptr<LceEngine>> engine = ReplaceWeight(head.trainer.get(), next, make_);
  if (engine.ok()) {
    head.engine = *std::move(engine);
    head.weights = std::move(next);
    head.version = c.version;
  } else {
    Log("UpdateWeights", engine.status());
  }
  // A failure anywhere leaves the ranks serving different weights: the front restarts the group.
  return AgreeOnOutcome(comm_, staging_, engine.status(), "serve its rows of the new weight");
}

}  // namespace

absl::Status RunTpPeer(PeerHeadStart first, const EngineMaker& make_engine, TpCommunicator& comm, ChunkStaging& staging,
                       GradReducer* dp) {
  TpPeer peer(std::move(first), make_engine, comm, staging, dp);
  return peer.Run();
}

}  // namespace lce::server
