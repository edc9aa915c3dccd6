// The CUDA engine's plan of a call (call_plan.h): what it computes, on which path, in blocks of how
// many rows, and the scratch that holds them.
#include "cuda/call_plan.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_engine_impl.h"

namespace lce::cuda {

// A fresh d_weight (GradOutputs::d_weight_fresh) is written by the first row block's dW products
// (beta 0); where no device product covers it (no rows, no backward, host d_weight's slabs), it is
// zeroed first.
absl::Status CudaEngine::ZeroFreshDWeight(CallPlan& p) {
  const RowsView& rows = p.rows;
  const bool dw_fresh_in = p.grads.d_weight != nullptr && p.grads.d_weight_fresh;
  const bool dw_products = rows.rows > 0 && p.up.mode != GradMode::kNone && rows.space == MemorySpace::kDevice;
  if (dw_fresh_in && !dw_products) {
    const size_t dw_bytes = static_cast<size_t>(shape_.shard_rows * shape_.hidden_size) * sizeof(float);
    const size_t db_bytes = static_cast<size_t>(shape_.shard_rows) * sizeof(float);
    if (rows.space == MemorySpace::kHost) {
      std::memset(p.grads.d_weight, 0, dw_bytes);
      if (p.grads.d_bias != nullptr) std::memset(p.grads.d_bias, 0, db_bytes);
    } else {
      LCE_CUDA_CHECK(cudaMemsetAsync(p.grads.d_weight, 0, dw_bytes, stream_));
      if (p.grads.d_bias != nullptr) LCE_CUDA_CHECK(cudaMemsetAsync(p.grads.d_bias, 0, db_bytes, stream_));
      LCE_CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
  }
  p.dw_fresh = dw_fresh_in && dw_products;
  return absl::OkStatus();
}

absl::Status CudaEngine::PlanCall(CallPlan& p) { return SizeBlocks(p, ChoosePaths(p)); }

ScratchLayout CudaEngine::ChoosePaths(CallPlan& p) {
  const LceOptions& o = p.o;
  const GradOutputs& grads = p.grads;
  const bool host = p.rows.space == MemorySpace::kHost;
  const bool want_grad = p.up.mode != GradMode::kNone;
  const bool backward = want_grad && (grads.d_hidden != nullptr || grads.d_weight != nullptr);
  p.host = host;
  p.backward = backward;
  // The epilogue GEMM's Q (the entropy's statistic), where the call uses it. A group's ranks always compute
  // it: only rank 0 sees the call's outputs, and their partials are merged.
  p.entropy = config_.collectives != nullptr || p.out.entropy != nullptr ||
              (p.up.mode == GradMode::kGeneric && p.up.grad_entropy != nullptr);
  // Rankings take the epilogue GEMM with 192- or 256-column tiles (the tiles' argmax for k = 1, candidates for
  // k > 1), in scores and training calls alike (the candidates are written before the exponentials
  // overwrite v with the training copy's e); with 128-column tiles they read the logit tiles.
  const bool epi = UseEpilogueStats() && (o.top_k == 0 || EpiTileCols() != 128);
  // Fast loss path (fast_grad.cu): no dA pass; the per-row factors go around the GEMMs. Host rows take
  // it as device rows do (host d_weight through the device in slabs, as on the general path), so that
  // a row's d_hidden is the same computation whatever memory its hidden state came from (README.md,
  // Guarantees). The general path rounded dL/da, the target's −C included, to bf16 before its GEMM:
  // CudaTest.HundredThousandRows' host rows took it and were 0.0169 from float64 per value (H200); the
  // fast path gives 0.0081, bf16 rounding of the exact d_hidden alone 0.0039 (a CPU replica of these
  // kernels' arithmetic, which gives the H200's 0.0168526 to the digit).
  p.fast = backward && shape_.dtype == DType::kBFloat16 && p.up.mode == GradMode::kLoss && o.softcap == 0.0f &&
           o.label_smoothing == 0.0f && tuning_.fast_loss_path && (epi || !tp_invariant_option_);
  // So the general path of a bf16 head keeps its target term apart too: out of the bf16 dL/da, added in
  // fp32 to d_hidden (before a group's all-reduce) and scattered into d_weight in a fixed order, as the fast
  // path's (RowInfoSlot).
  // CudaTuning::target_apart false: in the copy (the way before; for comparison).
  p.target_apart = backward && shape_.dtype == DType::kBFloat16 && tuning_.target_apart;
  p.dh_chunks = backward && grads.d_hidden != nullptr && DHiddenChunked();
  ScratchLayout layout{backward, host, host && backward && grads.d_weight != nullptr,
                       p.fast && grads.d_weight != nullptr, p.target_apart && grads.d_weight != nullptr};
  layout.epi = epi;
  layout.stage = epi && !host && reinterpret_cast<uintptr_t>(p.rows.hidden) % 16 != 0;
  // CudaTuning::dh_beside false: one after the other (bench/NOTES.md, e10). dW is the same bits either way:
  // the target scatter's order is fixed (LaunchScatterTargetDW), not the GPU's schedule.
  layout.side = p.fast && !host && grads.d_weight != nullptr && grads.d_hidden != nullptr && tuning_.dh_beside &&
                !tuning_.gemm_ex;
  return layout;
}

absl::Status CudaEngine::SizeBlocks(CallPlan& p, ScratchLayout layout) {
  const LceOptions& o = p.o;
  const bool epi = layout.epi;
  // Row blocks of near-equal size, a multiple of 128 rows where that fits (whole GEMM tiles).
  const int64_t N = p.rows.rows;
  // The blocks leave room for a slice of d_hidden's chunk partials: slices of a few rows, each a product of
  // its own, doubled a TP-2 training step's d_hidden (bench/RESULTS.md, 2026-11-28).
  const int64_t reserve = p.dh_chunks ? std::min(N, kDhMinSliceRows) * DhPartRowBytes() : 0;
  // The side product's own cuBLAS workspace (32 MiB) where the budget holds it beside a row; else one after the
  // other (the same bits). A budget that holds no row of this call is an error that names it, on every rank
  // of a group (their shards, and so their rows' bytes, may differ).
  if (layout.side && Bytes(layout, 1) + reserve > config_.workspace_bytes) layout.side = false;
  const int64_t least = Bytes(layout, 1) + reserve;
  int64_t want = least <= config_.workspace_bytes ? RowsPerBlock(layout, N, config_.workspace_bytes - reserve) : 0;
  if (epi && o.top_k > 1) want = std::min(want, kRankRowsPerBlock);  // the candidates' lists
  absl::StatusOr<int64_t> group_r_max = GroupMin(want);
  if (!group_r_max.ok()) return group_r_max.status();
  const int64_t r_max = WholeSliceRows(p, *group_r_max);
  if (r_max < 1) {
    return absl::InvalidArgumentError(absl::StrCat("workspace_bytes ", config_.workspace_bytes,
                                                   " is too small for a row block of this call (a row needs ", least,
                                                   " on this rank or another of its group)"));
  }
  const int64_t nblocks = (N + r_max - 1) / r_max;
  int64_t R = (N + nblocks - 1) / nblocks;
  if (nblocks > 1 && RoundUp(R, 128) <= r_max) R = RoundUp(R, 128);
  // Small blocks take wider logit tiles (WideTile). Not with batch-invariant GEMMs, whose algorithm
  // is chosen per tile length: a row's logits would then change with the row count.
  if (!batch_invariant_ && !layout.epi) {
    ScratchLayout wide = layout;
    wide.tile = WideTile(R);
    if (wide.tile > tile_ && Bytes(wide, R) <= config_.workspace_bytes) layout = wide;
  }
  p.layout = layout;
  p.R = R;
  p.tile = TileOf(layout);
  p.ldz = Ldz(layout);
  p.debug_skip = tuning_.debug_skip;
  p.tf = LogitTransform{shape_.has_bias ? reinterpret_cast<const float*>(bias_->data()) : nullptr, o.softcap,
                        o.temperature};
  return absl::OkStatus();
}

// On one GPU at 2048 <= H <= 3584, a training call's blocks hold whole d_hidden slices (kDhSliceRows): at 16384
// rows the 1 GiB budget's 2816-row block is a 2048-row slice and a 768-row one whose leaf products leave most of
// their waves idle, which costs more there than two more blocks' dW read-modify-writes (bench/NOTES.md e27, train:
// 16384×2048 −1.8%, 32768×2048 −5%, 16384×3584 −1.3%; but 16384×1536 +1.2% and 16384×896 level, hence not below
// 2048). H = 4096 (2048-row blocks level or slower, e26) and TP groups (not measured) keep the budget's blocks.
int64_t CudaEngine::WholeSliceRows(const CallPlan& p, int64_t r_max) const {
  const int64_t H = shape_.hidden_size;
  if (!tuning_.slice_blocks || !p.dh_chunks || GroupSize() > 1 || H < 2048 || H > 3584) return r_max;
  if (p.rows.rows <= r_max || r_max < kDhSliceRows) return r_max;
  return r_max / kDhSliceRows * kDhSliceRows;
}

absl::StatusOr<int64_t> CudaEngine::GroupMin(int64_t value) {
  if (GroupSize() < 2) return value;
  if (agree_ == nullptr) {
    absl::StatusOr<std::unique_ptr<DeviceBuffer>> b = AllocateDeviceBuffer(sizeof(float), config_.device);
    if (!b.ok()) return b.status();
    agree_ = std::move(*b);
  }
  // −value under a max all-reduce is the group's smallest; exact as a float (value < 2^24).
  float v = -static_cast<float>(value);
  float* d = reinterpret_cast<float*>(agree_->data());
  LCE_CUDA_CHECK(cudaMemcpyAsync(d, &v, sizeof(v), cudaMemcpyHostToDevice, stream_));
  LCE_CUDA_CHECK(config_.collectives->AllReduce(d, 1, ReduceOp::kMax, true, stream_));
  LCE_CUDA_CHECK(cudaMemcpyAsync(&v, d, sizeof(v), cudaMemcpyDeviceToHost, stream_));
  LCE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return static_cast<int64_t>(-v);
}

absl::Status CudaEngine::PrepareCall(CallPlan& p, Scratch& s) {
  const int64_t R = p.R, H = shape_.hidden_size, esz = DTypeSize(shape_.dtype);
  const int64_t need = RoundUp(Bytes(p.layout, R), 256);
  // d_hidden's leaf partials go after the block's scratch, in what it leaves of the budget (PlanCall kept
  // room for a slice of kDhMinSliceRows).
  s.dh_slice = 0;
  if (p.dh_chunks) {
    s.dh_slice = DhSliceRows(std::min(R, (config_.workspace_bytes - need) / DhPartRowBytes()));
    if (DhExactGroup()) {  // a slice is a collective's length: every rank's the same
      absl::StatusOr<int64_t> slice = GroupMin(s.dh_slice);
      if (!slice.ok()) return slice.status();
      s.dh_slice = *slice;
    }
  }
  LCE_CUDA_CHECK(GrowDeviceBuffer(workspace_, need + s.dh_slice * DhPartRowBytes()));
  Carve(p.layout, R, workspace_->data(), &s);
  s.dh_parts = s.dh_slice > 0 ? reinterpret_cast<float*>(workspace_->data() + need) : nullptr;
  if (s.dh_parts != nullptr && DhExactGroup()) {
    const int64_t n = s.dh_slice * shape_.hidden_size;
    s.dh_fixed = reinterpret_cast<int32_t*>(s.dh_parts + static_cast<int64_t>(dh_leaves_.size()) * n);
    s.dh_codes = reinterpret_cast<uint8_t*>(s.dh_fixed + n);
  }
  LCE_CUDA_CHECK(cublasSetWorkspace(cublas_, s.cublas_ws, kCublasWorkspace));
  cublas_ws_ = s.cublas_ws;
  // GEMMs are tuned on scratch free while they run: the logit tiles, or d_hidden's accumulator (written
  // only after the dW products) where the epilogue GEMM left no tiles.
  tune_scratch_ = p.layout.epi ? s.dh : s.logits[0];
  tune_floats_ = p.layout.epi ? (s.dh != nullptr ? R * H : 0) : 2 * R * p.ldz;
  const int64_t bad_off = RoundUp(R * H * esz, 64);  // s.bad's 3 × u64 after the staging
  if (p.host) LCE_CUDA_CHECK(pinned_.Ensure(bad_off + 64, config_.device));
  if (p.host) p.bad_host = reinterpret_cast<unsigned long long*>(pinned_.get() + bad_off);

  p.class_weight = p.rows.class_weight;
  if (p.class_weight != nullptr && p.host) {
    const int64_t bytes = shape_.vocab_size * static_cast<int64_t>(sizeof(float));
    if (class_weight_ == nullptr) {
      absl::StatusOr<std::unique_ptr<DeviceBuffer>> b = AllocateDeviceBuffer(bytes, config_.device);
      if (!b.ok()) return b.status();
      class_weight_ = std::move(*b);
    }
    LCE_CUDA_CHECK(cudaMemcpyAsync(class_weight_->data(), p.rows.class_weight, bytes, cudaMemcpyHostToDevice, stream_));
    p.class_weight = reinterpret_cast<const float*>(class_weight_->data());
  }
  const bool loss_wanted = p.out.loss != nullptr || (p.backward && p.up.mode == GradMode::kLoss);
  if (p.class_weight != nullptr && p.o.label_smoothing > 0.0f && loss_wanted) {
    // With a softcap z is not linear in h: the tiles weight their own Σz (u gives Σ_j w_j alone).
    if (p.o.softcap > 0.0f) p.tf.sum_weight = p.class_weight + shape_.vocab_begin;
    LCE_CUDA_CHECK(PrepareSmoothingSums(p));
  }
  if (p.grads.d_bias != nullptr && p.backward) LCE_CUDA_CHECK(PrepareBiasGrad(p));
  if (p.o.top_k > 0) LCE_CUDA_CHECK(PrepareRankings(p));
  p.targets_pending = !p.rows.targets_checked && !p.host;  // device rows: read with block 0's flags
  if (!p.rows.targets_checked) {
    if (absl::Status st = CheckTargets(p.rows, p.o, s); !st.ok()) return st;
  }
  return absl::OkStatus();
}

// Class weights with label smoothing: u = Σ_j w_j·[W_j | b_j | 1] over the whole vocabulary for
// LaunchSmoothingRowSums, the same bits on every rank and for any group size: each global segment's sum
// comes from the one rank that holds it (the others add zeros), then the segments are summed in order.
// Where the tiles weight their own sums (p.tf.sum_weight) only its last columns, without reading the head.
absl::Status CudaEngine::PrepareSmoothingSums(CallPlan& p) {
  const int64_t width = shape_.hidden_size + 2;
  LCE_CUDA_CHECK(GrowDeviceBuffer(smoothing_sums_, (nseg_global_ + 1) * width * static_cast<int64_t>(sizeof(float))));
  float* segs = reinterpret_cast<float*>(smoothing_sums_->data());
  float* u = segs + nseg_global_ * width;
  const float* bias = bias_ != nullptr ? reinterpret_cast<const float*>(bias_->data()) : nullptr;
  LCE_CUDA_CHECK(cudaMemsetAsync(segs, 0, nseg_global_ * width * sizeof(float), stream_));
  const int64_t first_col = p.tf.sum_weight != nullptr ? shape_.hidden_size : 0;
  LCE_CUDA_CHECK(LaunchSmoothingSegmentSums(weight_->data(), shape_.dtype, shape_.hidden_size, bias, p.class_weight,
                                            shape_.vocab_begin, shape_.shard_rows, first_col, segs, stream_));
  if (config_.collectives != nullptr) {
    LCE_CUDA_CHECK(config_.collectives->AllReduce(segs, nseg_global_ * width, ReduceOp::kSum, true, stream_));
  }
  LCE_CUDA_CHECK(LaunchOrderedSum(u, segs, static_cast<int>(nseg_global_), width, stream_));
  p.smoothing_u = u;
  return absl::OkStatus();
}

// dB where the blocks add to it: the caller's on device rows; for host rows a device copy of theirs (zeroed
// by ZeroFreshDWeight when fresh), copied back by CopyOutBiasGrad.
absl::Status CudaEngine::PrepareBiasGrad(CallPlan& p) {
  if (!p.host) {
    p.d_bias = p.grads.d_bias;
    return absl::OkStatus();
  }
  const int64_t bytes = shape_.shard_rows * static_cast<int64_t>(sizeof(float));
  LCE_CUDA_CHECK(GrowDeviceBuffer(bias_grad_, bytes));
  p.d_bias = reinterpret_cast<float*>(bias_grad_->data());
  LCE_CUDA_CHECK(cudaMemcpyAsync(p.d_bias, p.grads.d_bias, bytes, cudaMemcpyHostToDevice, stream_));
  return absl::OkStatus();
}

absl::Status CudaEngine::CopyOutBiasGrad(const CallPlan& p) {
  const int64_t bytes = shape_.shard_rows * static_cast<int64_t>(sizeof(float));
  LCE_CUDA_CHECK(cudaMemcpyAsync(p.grads.d_bias, p.d_bias, bytes, cudaMemcpyDeviceToHost, stream_));
  LCE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

}  // namespace lce::cuda
