// The CUDA engine's phases of a row block up to its per-row outputs: stage, forward, merge, finalize
// (the design: cuda_engine.cc's opening comment).
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_engine_impl.h"

namespace lce::cuda {

absl::Status CudaEngine::StageBlock(const CallPlan& p, Scratch& s, int64_t r0, BlockIo& b) {
  const int64_t H = shape_.hidden_size, esz = DTypeSize(shape_.dtype);
  const int64_t nr = std::min(p.R, p.rows.rows - r0);
  b.r0 = r0;
  b.nr = nr;
  b.dw_beta = p.dw_fresh && r0 == 0 ? 0.0f : 1.0f;  // the first block writes a fresh d_weight
  b.trace = r0 == 0 && tuning_.trace;
  // Inputs of this block, on the device.
  b.h = static_cast<const uint8_t*>(p.rows.hidden) + r0 * H * esz;
  b.y = p.rows.targets + r0;
  b.gl = p.up.grad_loss != nullptr ? p.up.grad_loss + r0 : nullptr;
  b.glp = p.up.grad_logprob != nullptr ? p.up.grad_logprob + r0 : nullptr;
  b.ge = p.up.grad_entropy != nullptr ? p.up.grad_entropy + r0 : nullptr;
  b.o_logprob = p.out.logprob != nullptr ? p.out.logprob + r0 : nullptr;
  b.o_entropy = p.out.entropy != nullptr ? p.out.entropy + r0 : nullptr;
  b.o_lse = p.out.lse != nullptr ? p.out.lse + r0 : nullptr;
  b.o_loss = p.out.loss != nullptr ? p.out.loss + r0 : nullptr;
  b.o_z_loss = p.out.z_loss != nullptr ? p.out.z_loss + r0 : nullptr;
  if (p.host) {
    // Pinned staging for the bulk input; the small per-row arrays go straight.
    std::memcpy(pinned_.get(), b.h, static_cast<size_t>(nr * H * esz));
    LCE_CUDA_CHECK(cudaMemcpyAsync(s.hidden, pinned_.get(), nr * H * esz, cudaMemcpyHostToDevice, stream_));
    LCE_CUDA_CHECK(cudaMemcpyAsync(s.targets, b.y, nr * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
    const float* srcs[3] = {b.gl, b.glp, b.ge};
    const float** dsts[3] = {&b.gl, &b.glp, &b.ge};
    for (int k = 0; k < 3; ++k) {
      if (srcs[k] == nullptr) continue;
      LCE_CUDA_CHECK(cudaMemcpyAsync(s.up[k], srcs[k], nr * sizeof(float), cudaMemcpyHostToDevice, stream_));
      *dsts[k] = s.up[k];
    }
    b.h = s.hidden;
    b.y = s.targets;
    b.o_logprob = b.o_logprob != nullptr ? s.out[0] : nullptr;
    b.o_entropy = b.o_entropy != nullptr ? s.out[1] : nullptr;
    b.o_lse = b.o_lse != nullptr ? s.out[2] : nullptr;
    b.o_loss = b.o_loss != nullptr ? s.out[3] : nullptr;
    b.o_z_loss = b.o_z_loss != nullptr ? s.out[4] : nullptr;
  } else if (p.layout.stage) {
    LCE_CUDA_CHECK(cudaMemcpyAsync(s.hidden, b.h, nr * H * esz, cudaMemcpyDeviceToDevice, stream_));
    b.h = s.hidden;
  }
  return absl::OkStatus();
}

// The fast path runs the forward again on the general path if exp(z − c_row) could overflow (extreme
// logit spread): Finalize says so after the block's sync.
absl::Status CudaEngine::ForwardBlock(const CallPlan& p, Scratch& s, BlockIo& b) {
  b.fast = p.fast;
  for (;;) {
    LCE_CUDA_CHECK(Forward(p, s, b));
    LCE_CUDA_CHECK(Merge(p, s, b));
    absl::StatusOr<bool> redo = Finalize(p, s, b);
    if (!redo.ok()) return redo.status();
    if (!*redo) return absl::OkStatus();
    b.fast = false;  // logit spread too wide for exp(z − c_row): redo this block exactly
    if (tuning_.trace)
      std::fprintf(stderr, "lce trace: rows from %ld redone on the general path\n", static_cast<long>(b.r0));
  }
}

// Logit tiles -> segment partials (+ compact copy for the backward), or the epilogue GEMM's same.
absl::Status CudaEngine::Forward(const CallPlan& p, Scratch& s, const BlockIo& b) {
  const bool fp32 = shape_.dtype == DType::kFloat32;
  const StoreMode mode = b.fast ? StoreMode::kExpBf16 : fp32 ? StoreMode::kShiftedFloat : StoreMode::kShiftedHalf;
  if (b.trace) LCE_CUDA_CHECK(cudaEventRecord(trace_[0], stream_));
  LCE_CUDA_CHECK(cudaMemsetAsync(s.packed, 0, b.nr * kPacked * sizeof(float), stream_));
  LCE_CUDA_CHECK(cudaMemsetAsync(s.bad + 1, 0, sizeof(unsigned long long), stream_));
  if (p.o.top_k > 0) LCE_CUDA_CHECK(LaunchFillRankings(p.cand, b.nr, p.rank_slots, p.o.top_k, stream_));
  unsigned* overflow = reinterpret_cast<unsigned*>(s.bad + 1);
  if (p.layout.epi) {
    const EpiCopy copy = !p.backward ? EpiCopy::kNone : b.fast ? EpiCopy::kExp : EpiCopy::kShifted;
    const bool ranked = p.o.top_k > 0;
    if (ranked && p.ranks.tile_arg == nullptr) LCE_CUDA_CHECK(RankThreshold(p, s, b));
    if (ranked && b.trace) LCE_CUDA_CHECK(cudaEventRecord(trace_[2], stream_));
    RankLists ranks = p.ranks;
    if (ranks.call_thr != nullptr) ranks.thr = ranks.call_thr + b.r0;  // the call's first pass
    if (absl::Status st = EpilogueStatsForward(s, b.h, b.nr, b.y, p.o.ignore_index, p.tf, copy, p.entropy, overflow,
                                               ranked ? &ranks : nullptr);
        !st.ok()) {
      return st;
    }
    if (ranked && b.trace) LCE_CUDA_CHECK(cudaEventRecord(trace_[3], stream_));
    if (ranked) LCE_CUDA_CHECK(RankSelect(p, s, b));
  }
  LCE_CUDA_CHECK(ForwardTiles(p, s, b, mode, overflow));
  LCE_CUDA_CHECK(cudaEventRecord(events_[kEvHandoff], aux_));
  LCE_CUDA_CHECK(cudaStreamWaitEvent(stream_, events_[kEvHandoff], 0));
  if (b.trace) LCE_CUDA_CHECK(cudaEventRecord(trace_[1], stream_));
  return absl::OkStatus();
}

// GEMM of tile t on stream_ overlaps TileStats of tile t−1 on aux_; two logit buffers. None with the
// epilogue GEMM.
absl::Status CudaEngine::ForwardTiles(const CallPlan& p, Scratch& s, const BlockIo& b, StoreMode mode,
                                      unsigned* overflow) {
  const int64_t H = shape_.hidden_size, Vs = shape_.shard_rows, esz = DTypeSize(shape_.dtype);
  const int64_t nr = b.nr, tile = p.tile, ldz = p.ldz;
  const cudaDataType_t dt = CudaType(shape_.dtype);
  const bool tf32 = p.o.allow_tf32;
  const uint8_t* w = weight_->data();
  int64_t t = 0;
  for (int64_t v0 = p.layout.epi ? Vs : 0; v0 < Vs; v0 += tile, ++t) {
    const int64_t nv = std::min(tile, Vs - v0);
    const int buf = static_cast<int>(t % 2);
    if (t >= 2) LCE_CUDA_CHECK(cudaStreamWaitEvent(stream_, events_[kEvStats0 + buf], 0));
    // logits[nr, nv] = h[nr, H] · W[v0:v0+nv, H]ᵀ   (column-major: [nv, nr] = Wᵀ · h): whole
    // segments through one algorithm for every m and n, a ragged last segment (the head's own, the
    // same for every group size) apart, so that a logit's bits depend on neither the row count nor
    // where its tile starts.
    const int64_t whole = nv / kSegment * kSegment;
    if (whole > 0) {
      LCE_CUDA_CHECK(Gemm(CUBLAS_OP_T, CUBLAS_OP_N, whole, nr, H, w + v0 * H * esz, dt, H, b.h, dt, H, 0.0f,
                          s.logits[buf], CUDA_R_32F, ldz, tf32, /*c_is_scratch=*/true, fwd_sm_target_,
                          /*rows_in_n=*/true, /*cols_in_m=*/true));
    }
    if (whole < nv) {
      LCE_CUDA_CHECK(Gemm(CUBLAS_OP_T, CUBLAS_OP_N, nv - whole, nr, H, w + (v0 + whole) * H * esz, dt, H, b.h, dt, H,
                          0.0f, s.logits[buf] + whole, CUDA_R_32F, ldz, tf32, /*c_is_scratch=*/true, fwd_sm_target_,
                          /*rows_in_n=*/true));
    }
    LCE_CUDA_CHECK(cudaEventRecord(events_[kEvGemm0 + buf], stream_));
    LCE_CUDA_CHECK(cudaStreamWaitEvent(aux_, events_[kEvGemm0 + buf], 0));
    if (!(p.debug_skip & 1)) {
      // The fast path's first segment sets c_row before the rest of the shard is stored.
      const int64_t first = (b.fast && v0 == 0) ? std::min<int64_t>(nv, kSegment) : nv;
      LCE_CUDA_CHECK(LaunchTileStats(s.logits[buf], ldz, nr, v0, first, p.tf, b.y, p.o.ignore_index, shape_.vocab_begin,
                                     s.part, nseg_, s.packed, p.backward ? s.store : nullptr, lds_, mode, s.row_c,
                                     overflow, aux_));
      if (first < nv) {
        LCE_CUDA_CHECK(LaunchTileStats(s.logits[buf] + first, ldz, nr, v0 + first, nv - first, p.tf, b.y,
                                       p.o.ignore_index, shape_.vocab_begin, s.part, nseg_, s.packed, s.store, lds_,
                                       mode, s.row_c, overflow, aux_));
      }
    }
    if (p.o.top_k > 0) {
      LCE_CUDA_CHECK(LaunchSegmentTopK(s.logits[buf], ldz, nr, v0, nv, p.tf, p.o.top_k, shape_.vocab_begin, p.cand,
                                       p.rank_slots, p.rank_slot0, aux_));
    }
    LCE_CUDA_CHECK(cudaEventRecord(events_[kEvStats0 + buf], aux_));
  }
  return absl::OkStatus();
}

absl::Status CudaEngine::Merge(const CallPlan& p, Scratch& s, const BlockIo& b) {
  const bool tp = config_.collectives != nullptr;
  const int64_t nr = b.nr;
  if (tp) {
    // Every rank takes part (and retries together), whatever path it is on.
    LCE_CUDA_CHECK(
        config_.collectives->AllReduce(reinterpret_cast<float*>(s.bad + 1), 1, ReduceOp::kMax, true, stream_));
  }
  if (tp && tp_invariant_) {
    // Every rank gathers every segment's partials and folds them in global order, as one GPU does.
    LCE_CUDA_CHECK(LaunchSpreadPartials(s.part, nseg_, shape_.vocab_begin / kSegment, s.packed, b.y, p.o.ignore_index,
                                        shape_.vocab_begin, shape_.vocab_end(), nr, s.part_global, nseg_global_, s.zy,
                                        stream_));
    LCE_CUDA_CHECK(config_.collectives->AllReduce(s.part_global, nr * nseg_global_ * 4, ReduceOp::kMax, true, stream_));
    LCE_CUDA_CHECK(config_.collectives->AllReduce(s.zy, nr, ReduceOp::kMax, true, stream_));
    LCE_CUDA_CHECK(LaunchMergeSegments(s.part_global, nseg_global_, nr, s.m_local, s.m, s.packed, stream_));
    LCE_CUDA_CHECK(LaunchTakeGatheredTargets(s.zy, nr, s.packed, stream_));
  } else {
    LCE_CUDA_CHECK(LaunchMergeSegments(s.part, nseg_, nr, s.m_local, s.m, s.packed, stream_));
    if (tp) {
      LCE_CUDA_CHECK(config_.collectives->AllReduce(s.m, nr, ReduceOp::kMax, true, stream_));
      LCE_CUDA_CHECK(LaunchRescalePartials(s.m_local, s.m, nr, s.packed, stream_));
      LCE_CUDA_CHECK(config_.collectives->AllReduce(s.packed, nr * kPacked, ReduceOp::kSum, true, stream_));
    }
  }
  // Σz becomes Σ_j w_j z_j (class weights with label smoothing; with a softcap the tiles weighted it).
  if (p.smoothing_u != nullptr && p.tf.sum_weight == nullptr) {
    LCE_CUDA_CHECK(LaunchSmoothingRowSums(b.h, shape_.dtype, nr, shape_.hidden_size, p.smoothing_u, p.o.temperature,
                                          s.packed, stream_));
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> CudaEngine::Finalize(const CallPlan& p, Scratch& s, const BlockIo& b) {
  const int64_t nr = b.nr;
  FinalizeArgs fa;
  fa.rows = nr;
  fa.targets = b.y;
  fa.ignore_index = p.o.ignore_index;
  fa.vocab_size = shape_.vocab_size;
  fa.label_smoothing = p.o.label_smoothing;
  fa.z_loss = p.o.z_loss;
  fa.grad = !p.backward ? GradKind::kNone : p.up.mode == GradMode::kLoss ? GradKind::kLoss : GradKind::kGeneric;
  fa.grad_loss = b.gl;
  fa.grad_logprob = b.glp;
  fa.grad_entropy = b.ge;
  fa.lse = b.o_lse;
  fa.logprob = b.o_logprob;
  fa.entropy = b.o_entropy;
  fa.loss = b.o_loss;
  fa.z_loss_out = b.o_z_loss;
  fa.class_weight = p.class_weight;
  fa.class_weight_sum = p.smoothing_u != nullptr ? p.smoothing_u + shape_.hidden_size + 1 : nullptr;
  fa.row_c = b.fast ? s.row_c : nullptr;
  fa.temperature = p.o.temperature;
  fa.softcap = p.o.softcap;
  fa.target_apart = p.target_apart;  // read where row_c is null: a general-path block
  LCE_CUDA_CHECK(cudaMemsetAsync(s.bad, 0xff, sizeof(unsigned long long), stream_));
  LCE_CUDA_CHECK(LaunchFinalizeRows(fa, s.m, s.packed, s.info, s.bad, stream_));
  unsigned long long flags[3] = {ULLONG_MAX, 0, ULLONG_MAX};
  LCE_CUDA_CHECK(cudaMemcpyAsync(p.host ? p.bad_host : flags, s.bad, sizeof(flags), cudaMemcpyDeviceToHost, stream_));
  if (p.host) {
    float* dsts[5] = {p.out.logprob, p.out.entropy, p.out.lse, p.out.loss, p.out.z_loss};
    for (int k = 0; k < 5; ++k) {
      if (dsts[k] == nullptr) continue;
      LCE_CUDA_CHECK(cudaMemcpyAsync(dsts[k] + b.r0, s.out[k], nr * sizeof(float), cudaMemcpyDeviceToHost, stream_));
    }
  }
  // One sync per row block: a non-finite row must stop the call before it touches d_weight.
  LCE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (p.host) std::memcpy(flags, p.bad_host, sizeof(flags));
  if (p.targets_pending && b.r0 == 0 && flags[2] != ULLONG_MAX) return BadTarget(p.rows, p.o, flags[2]);
  const unsigned long long bad = flags[0];
  if (bad != ULLONG_MAX && p.debug_skip == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("row ", b.r0 + static_cast<int64_t>(bad),
                     ": non-finite logits (NaN or Inf in the hidden states, or overflow)"));
  }
  return flags[1] != 0 && p.debug_skip == 0;
}

absl::Status CudaEngine::TraceForward(const CallPlan& p, const BlockIo& b) {
  float ms = 0;
  LCE_CUDA_CHECK(cudaEventElapsedTime(&ms, trace_[0], trace_[1]));
  std::fprintf(stderr, "lce trace: rows %ld/%ld (R=%ld) tiles fwd %.3f ms\n", static_cast<long>(b.nr),
               static_cast<long>(p.rows.rows), static_cast<long>(p.R), ms);
  if (p.o.top_k > 0 && p.layout.epi) {  // the rankings' phases (engine_rankings.cc), events 0, 2-6
    float t[5] = {};
    LCE_CUDA_CHECK(cudaEventSynchronize(trace_[6]));  // recorded by Rank, after this block's sync
    const int from[5] = {0, 2, 3, 1, 5}, to[5] = {2, 3, 1, 5, 6};
    for (int i = 0; i < 5; ++i) LCE_CUDA_CHECK(cudaEventElapsedTime(&t[i], trace_[from[i]], trace_[to[i]]));
    std::fprintf(stderr,
                 "lce trace: rankings k=%ld sample %ld: first pass %.3f, main pass %.3f, select %.3f, "
                 "finalize %.3f, overflowed rows + merge %.3f ms\n",
                 static_cast<long>(p.o.top_k), static_cast<long>(p.ranks.sample), t[0], t[1], t[2], t[3], t[4]);
  }
  return absl::OkStatus();
}

EpilogueStatsArgs CudaEngine::EpiArgs(Scratch& s, const void* h, int64_t nr, const int32_t* y, int32_t ignore_index,
                                      const LogitTransform& tf) const {
  EpilogueStatsArgs a;
  a.hidden = h;
  a.weight = weight_->data();
  a.rows = nr;
  a.cols = shape_.shard_rows;
  a.hidden_size = shape_.hidden_size;
  a.tf = tf;
  a.targets = y;
  a.ignore_index = ignore_index;
  a.vocab_begin = shape_.vocab_begin;
  a.tile_part = s.tile_part;
  a.ntile = EpiTiles();
  a.packed = s.packed;
  a.config = epi_config_;
  a.small_rows = tuning_.epi_small_rows;
  a.large_config = tuning_.epi_large;
  a.swizzle = tuning_.epi_swizzle;
  a.raster = tuning_.epi_raster;
  a.timing_skip = (tuning_.debug_skip & 4) != 0;
  return a;
}

absl::Status CudaEngine::EpilogueStatsForward(Scratch& s, const void* h, int64_t nr, const int32_t* y,
                                              int32_t ignore_index, const LogitTransform& tf, EpiCopy copy,
                                              bool entropy, unsigned* overflow, const RankLists* ranks) {
#if defined(LCE_WITH_CUTLASS)
  EpilogueStatsArgs a = EpiArgs(s, h, nr, y, ignore_index, tf);
  a.entropy = entropy;
  if (copy == EpiCopy::kExp) {
    // First pass over the first kFirstPassCols columns: their max per row (into s.part, one segment a
    // row, overwritten by the whole shard's fold below) sets c_row before any exp is stored.
    // A TP-invariant group takes the head's first columns (rank 0's) for every rank's c_row, as one GPU
    // does: the others' −inf under a max all-reduce.
    const bool group = tp_invariant_ && config_.collectives->world_size() > 1;
    if (!group || config_.collectives->rank() == 0) {
      EpilogueStatsArgs first = a;
      first.cols = std::min<int64_t>(RoundUp(kFirstPassCols, EpiTileCols()), a.cols);
      first.ntile = (first.cols + EpiTileCols() - 1) / EpiTileCols();
      first.entropy = false;  // only its max is used
      LCE_CUDA_CHECK(LaunchEpilogueStatsGemm(first, stream_));
      LCE_CUDA_CHECK(LaunchFoldTilePartials(s.tile_part, first.ntile, EpiTileCols(), nr, s.part, 1, stream_));
    } else {
      LCE_CUDA_CHECK(LaunchFillFloats(s.part, -std::numeric_limits<float>::infinity(), nr * 4, stream_));
    }
    if (group) LCE_CUDA_CHECK(config_.collectives->AllReduce(s.part, nr * 4, ReduceOp::kMax, true, stream_));
    a.first = s.part;
    a.row_c = s.row_c;
    a.overflow = overflow;
  }
  a.store = copy != EpiCopy::kNone ? s.store : nullptr;
  a.lds = lds_;
  if (ranks != nullptr && ranks->tile_arg != nullptr) {
    a.tile_arg = ranks->tile_arg;
  } else if (ranks != nullptr) {
    a.rank_list = ranks->list;
    a.rank_count = ranks->count;
    a.rank_thr = ranks->thr;
    a.rank_cap = ranks->cap;
  }
  LCE_CUDA_CHECK(LaunchEpilogueStatsGemm(a, stream_));
  return LaunchFoldTilePartials(s.tile_part, a.ntile, EpiTileCols(), nr, s.part, nseg_, stream_);
#else
  (void)s, (void)h, (void)nr, (void)y, (void)ignore_index, (void)tf, (void)copy, (void)entropy, (void)overflow,
      (void)ranks;
  return absl::InternalError("built without CUTLASS: no epilogue-statistics GEMM");
#endif
}

}  // namespace lce::cuda
