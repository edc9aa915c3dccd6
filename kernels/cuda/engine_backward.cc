// The CUDA engine's backward of a row block and its copy out (the design: cuda_engine.cc's opening
// comment): the fast loss path's two products, or the general path's dA chunks with their dW products
// and d_hidden's products over the head's leaves; host d_weight in slabs through the device.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/cuda_engine_impl.h"

namespace lce::cuda {

absl::Status CudaEngine::BackwardFast(const CallPlan& p, Scratch& s, const BlockIo& b) {
  const int64_t H = shape_.hidden_size, Vs = shape_.shard_rows, nr = b.nr;
  const cudaDataType_t dt = CudaType(shape_.dtype);
  const bool tf32 = p.o.allow_tf32;
  const GradOutputs& grads = p.grads;
  // dW += qᵀ · (s ⊙ h) − scatter(t ⊙ h);  d_hidden = s ⊙ (q · W) − t ⊙ W[y].
  if (b.trace) LCE_CUDA_CHECK(cudaEventRecord(trace_[2], stream_));
  if (p.layout.side) {
    LCE_CUDA_CHECK(FastGradsBeside(s, b.h, nr, b.y, p.o.ignore_index, grads.d_weight, b.dw_beta, tf32, b.trace));
  } else {
    if (grads.d_weight != nullptr) {
      LCE_CUDA_CHECK(LaunchScaleRows(b.h, nr, H, s.info, s.h_scaled, stream_));
      if (p.host) {
        LCE_CUDA_CHECK(HostDWeightSlabs(p, s, b, s.h_scaled, /*fast_targets=*/true));
      } else {
        LCE_CUDA_CHECK(Gemm(CUBLAS_OP_N, CUBLAS_OP_T, H, Vs, nr, s.h_scaled, dt, H, s.store, dt, lds_, b.dw_beta,
                            grads.d_weight, CUDA_R_32F, H, tf32));
        LCE_CUDA_CHECK(LaunchScatterTargetDW(grads.d_weight, nr, H, s.info, b.h, b.y, p.o.ignore_index,
                                             shape_.vocab_begin, Vs, s.target_order, s.target_order_bytes, stream_));
      }
    }
    if (b.trace) LCE_CUDA_CHECK(cudaEventRecord(trace_[3], stream_));
    if (grads.d_hidden != nullptr) LCE_CUDA_CHECK(FastDHidden(s, nr, b.y, p.o.ignore_index, tf32, GemmPlace{}));
  }
  if (p.d_bias != nullptr) LCE_CUDA_CHECK(BiasGrad(p, s, b, /*fast=*/true));
  if (grads.d_hidden != nullptr) {
    LCE_CUDA_CHECK(SumDHiddenOverRanks(s.dh, nr * H));
    if (DHiddenReadHere()) LCE_CUDA_CHECK(CopyOutDHidden(p, s, b));
  }
  if (b.trace) LCE_CUDA_CHECK(TraceFast(p, b));
  return absl::OkStatus();
}

absl::Status CudaEngine::TraceFast(const CallPlan& p, const BlockIo& b) {
  const bool side = p.layout.side;
  LCE_CUDA_CHECK(cudaEventRecord(trace_[4], stream_));
  LCE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  float ms[4] = {0, 0, 0, 0};
  LCE_CUDA_CHECK(cudaEventElapsedTime(&ms[0], trace_[0], trace_[1]));
  LCE_CUDA_CHECK(cudaEventElapsedTime(&ms[1], trace_[2], trace_[3]));
  // Beside dW, d_hidden is timed from the same start; "both" is the whole backward of the block.
  LCE_CUDA_CHECK(cudaEventElapsedTime(&ms[2], trace_[side ? 2 : 3], trace_[side ? 5 : 4]));
  LCE_CUDA_CHECK(cudaEventElapsedTime(&ms[3], trace_[2], trace_[4]));
  std::fprintf(stderr,
               "lce trace (fast%s): rows %ld/%ld (R=%ld) tiles fwd %.3f ms | dW %.3f ms | dh %.3f ms"
               " | both %.3f ms\n",
               side ? ", dh beside dW" : "", static_cast<long>(b.nr), static_cast<long>(p.rows.rows),
               static_cast<long>(p.R), ms[0], ms[1], ms[2], ms[3]);
  return absl::OkStatus();
}

// dA in place on aux_, chunk by chunk; on the device path each chunk's dW product runs on stream_ while
// aux_ writes the next chunk. Then one d_hidden product over the whole shard.
absl::Status CudaEngine::BackwardGeneral(const CallPlan& p, Scratch& s, const BlockIo& b) {
  if (b.trace) LCE_CUDA_CHECK(cudaEventRecord(trace_[2], stream_));
  LCE_CUDA_CHECK(WriteGradAndDWeight(p, s, b));
  if (p.d_bias != nullptr) LCE_CUDA_CHECK(BiasGrad(p, s, b, /*fast=*/false));
  if (b.trace) LCE_CUDA_CHECK(cudaEventRecord(trace_[3], stream_));
  if (p.grads.d_hidden != nullptr) {
    LCE_CUDA_CHECK(GeneralDHidden(p, s, b));
    if (DHiddenReadHere()) LCE_CUDA_CHECK(CopyOutDHidden(p, s, b));
  }
  if (b.trace) LCE_CUDA_CHECK(cudaEventRecord(trace_[4], stream_));
  if (p.grads.d_weight != nullptr && p.host) {
    // dW slabs through the device: host += dA[nr, slab]ᵀ · h.
    LCE_CUDA_CHECK(HostDWeightSlabs(p, s, b, b.h, /*fast_targets=*/p.target_apart));
  }
  if (b.trace) LCE_CUDA_CHECK(TraceGeneral(p, b));
  return absl::OkStatus();
}

absl::Status CudaEngine::WriteGradAndDWeight(const CallPlan& p, Scratch& s, const BlockIo& b) {
  const int64_t H = shape_.hidden_size, Vs = shape_.shard_rows, nr = b.nr, sesz = StoreBytes();
  const cudaDataType_t dt = CudaType(shape_.dtype);
  const GradOutputs& grads = p.grads;
  LCE_CUDA_CHECK(cudaEventRecord(events_[kEvHandoff], stream_));
  LCE_CUDA_CHECK(cudaStreamWaitEvent(aux_, events_[kEvHandoff], 0));
  const bool dw_device = grads.d_weight != nullptr && !p.host;
  const int64_t chunk = std::max<int64_t>(kSegment, RoundUp(tuning_.backward_chunk, kSegment));
  for (int64_t v0 = 0; v0 < Vs; v0 += chunk) {
    const int64_t nc = std::min(chunk, Vs - v0);
    if (!(p.debug_skip & 2)) {
      LCE_CUDA_CHECK(LaunchWriteGrad(shape_.dtype, s.store, lds_, nr, v0, nc, p.layout.epi ? s.tile_part : s.part,
                                     p.layout.epi ? EpiTiles() : nseg_, p.layout.epi ? EpiTileCols() : kSegment, s.info,
                                     b.y, p.o.ignore_index, shape_.vocab_begin,
                                     p.smoothing_u != nullptr ? p.class_weight : nullptr, p.o.softcap, p.o.temperature,
                                     p.target_apart, aux_));
    }
    LCE_CUDA_CHECK(cudaEventRecord(events_[kEvHandoff], aux_));
    if (dw_device) {
      LCE_CUDA_CHECK(cudaStreamWaitEvent(stream_, events_[kEvHandoff], 0));
      // dW[v0:v0+nc, H] += dA[nr, v0:v0+nc]ᵀ · h[nr, H]   (column-major: [H, nc] += h · dAᵀ)
      LCE_CUDA_CHECK(Gemm(CUBLAS_OP_N, CUBLAS_OP_T, H, nc, nr, b.h, dt, H, static_cast<uint8_t*>(s.store) + v0 * sesz,
                          dt, lds_, b.dw_beta, grads.d_weight + v0 * H, CUDA_R_32F, H, p.o.allow_tf32));
    }
  }
  LCE_CUDA_CHECK(cudaStreamWaitEvent(stream_, events_[kEvHandoff], 0));
  if (dw_device && p.target_apart) {
    LCE_CUDA_CHECK(LaunchScatterTargetDW(grads.d_weight, nr, H, s.info, b.h, b.y, p.o.ignore_index, shape_.vocab_begin,
                                         Vs, s.target_order, s.target_order_bytes, stream_));
  }
  return absl::OkStatus();
}

// s.dh before its conversion: the leaves' products and their exact sum (the target's term in it), over the
// group too; or one product, the target's term and the group's float sum.
absl::Status CudaEngine::GeneralDHidden(const CallPlan& p, Scratch& s, const BlockIo& b) {
  const int64_t H = shape_.hidden_size, Vs = shape_.shard_rows, nr = b.nr;
  const cudaDataType_t dt = CudaType(shape_.dtype);
  const uint8_t* w = weight_->data();
  const bool tf32 = p.o.allow_tf32;
  // With the target apart, its term (s_r = 1: RowInfoSlot) goes into the exact sum too.
  const DhFinish finish = Finish(s, b.y, p.o.ignore_index);
  LCE_CUDA_CHECK(DHiddenProduct(s, nr, tf32, GemmPlace{}, p.target_apart ? &finish : nullptr));
  if (p.target_apart && !DHiddenChunked()) {
    LCE_CUDA_CHECK(LaunchFinishDHidden(s.dh, nr, H, s.info, w, b.y, p.o.ignore_index, shape_.vocab_begin, Vs, stream_));
  }
  return SumDHiddenOverRanks(s.dh, nr * H);
}

// d_hidden's sum over a group's ranks: into rank 0 alone where only its outputs are read
// (EngineConfig::rank0_outputs; at 4 ranks a reduce moves half an all-reduce's bytes).
absl::Status CudaEngine::SumDHiddenOverRanks(float* dh, int64_t n) {
  if (config_.collectives == nullptr || DhExactGroup()) return absl::OkStatus();  // GroupLeafSum summed it
  if (config_.rank0_outputs) return config_.collectives->ReduceSumToRoot(dh, n, true, stream_);
  return config_.collectives->AllReduce(dh, n, ReduceOp::kSum, true, stream_);
}

bool CudaEngine::DHiddenReadHere() const {
  return !config_.rank0_outputs || config_.collectives == nullptr || config_.collectives->rank() == 0;
}

absl::Status CudaEngine::TraceGeneral(const CallPlan& p, const BlockIo& b) {
  LCE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  float ms[3] = {0, 0, 0};
  LCE_CUDA_CHECK(cudaEventElapsedTime(&ms[0], trace_[0], trace_[1]));
  LCE_CUDA_CHECK(cudaEventElapsedTime(&ms[1], trace_[2], trace_[3]));
  LCE_CUDA_CHECK(cudaEventElapsedTime(&ms[2], trace_[3], trace_[4]));
  std::fprintf(stderr, "lce trace: rows %ld/%ld (R=%ld) tiles fwd %.3f ms | dA+dW %.3f ms | dh %.3f ms\n",
               static_cast<long>(b.nr), static_cast<long>(p.rows.rows), static_cast<long>(p.R), ms[0], ms[1], ms[2]);
  return absl::OkStatus();
}

// Fast path: dL/da = s_r·q − t_r·1[y_r]; general path: the copy is dL/da, its target term apart where
// p.target_apart. Host rows add to their device copy of dB (beta 1: a fresh one was zeroed).
absl::Status CudaEngine::BiasGrad(const CallPlan& p, const Scratch& s, const BlockIo& b, bool fast) {
  return LaunchBiasGrad(p.d_bias, p.host ? 1.0f : b.dw_beta, s.store, shape_.dtype, lds_, b.nr, shape_.shard_rows,
                        s.info, /*scale=*/fast, /*target=*/fast || p.target_apart, b.y, p.o.ignore_index,
                        shape_.vocab_begin, stream_);
}

absl::Status CudaEngine::CopyOutDHidden(const CallPlan& p, Scratch& s, const BlockIo& b) {
  const int64_t H = shape_.hidden_size, esz = DTypeSize(shape_.dtype), nr = b.nr;
  void* dst = p.host ? s.d_hidden : static_cast<uint8_t*>(p.grads.d_hidden) + b.r0 * H * esz;
  LCE_CUDA_CHECK(LaunchFloatToDType(s.dh, shape_.dtype, dst, nr * H, stream_));
  if (p.host) {
    LCE_CUDA_CHECK(cudaMemcpyAsync(pinned_.get(), s.d_hidden, nr * H * esz, cudaMemcpyDeviceToHost, stream_));
    LCE_CUDA_CHECK(cudaStreamSynchronize(stream_));
    std::memcpy(static_cast<uint8_t*>(p.grads.d_hidden) + b.r0 * H * esz, pinned_.get(),
                static_cast<size_t>(nr * H * esz));
  }
  return absl::OkStatus();
}

absl::Status CudaEngine::HostDWeightSlabs(const CallPlan& p, Scratch& s, const BlockIo& b, const void* x,
                                          bool fast_targets) {
  const int64_t H = shape_.hidden_size, Vs = shape_.shard_rows, nr = b.nr, sesz = StoreBytes();
  const cudaDataType_t dt = CudaType(shape_.dtype);
  const int64_t slab = DwSlabRows();
  for (int64_t v0 = 0; v0 < Vs; v0 += slab) {
    const int64_t nv = std::min(slab, Vs - v0);
    float* host_dw = p.grads.d_weight + v0 * H;
    LCE_CUDA_CHECK(cudaMemcpyAsync(s.dw_slab, host_dw, nv * H * sizeof(float), cudaMemcpyHostToDevice, stream_));
    LCE_CUDA_CHECK(Gemm(CUBLAS_OP_N, CUBLAS_OP_T, H, nv, nr, x, dt, H, static_cast<uint8_t*>(s.store) + v0 * sesz, dt,
                        lds_, 1.0f, s.dw_slab, CUDA_R_32F, H, p.o.allow_tf32));
    if (fast_targets) {
      LCE_CUDA_CHECK(LaunchScatterTargetDW(s.dw_slab, nr, H, s.info, b.h, b.y, p.o.ignore_index,
                                           shape_.vocab_begin + v0, nv, s.target_order, s.target_order_bytes, stream_));
    }
    LCE_CUDA_CHECK(cudaMemcpyAsync(host_dw, s.dw_slab, nv * H * sizeof(float), cudaMemcpyDeviceToHost, stream_));
    LCE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  return absl::OkStatus();
}

absl::Status CudaEngine::FastDHidden(Scratch& s, int64_t nr, const int32_t* y, int32_t ignore_index, bool tf32,
                                     const GemmPlace& place) {
  const int64_t H = shape_.hidden_size, Vs = shape_.shard_rows;
  const uint8_t* w = weight_->data();
  const DhFinish finish = Finish(s, y, ignore_index);
  LCE_CUDA_CHECK(DHiddenProduct(s, nr, tf32, place, &finish));
  if (DHiddenChunked()) return absl::OkStatus();  // the finish was in the exact sum
  cudaStream_t stream = place.stream != nullptr ? place.stream : stream_;
  LCE_CUDA_CHECK(LaunchFinishDHidden(s.dh, nr, H, s.info, w, y, ignore_index, shape_.vocab_begin, Vs, stream));
  return absl::OkStatus();
}

DhFinish CudaEngine::Finish(const Scratch& s, const int32_t* y, int32_t ignore_index) const {
  DhFinish f;
  f.info = s.info;
  f.targets = y;
  f.ignore_index = ignore_index;
  f.weight = weight_->data();
  f.vocab_begin = shape_.vocab_begin;
  f.shard_rows = shape_.shard_rows;
  f.hidden = shape_.hidden_size;
  return f;
}

// dh[nr, H] = dA[nr, Vs] · W[Vs, H] (column-major: [H, nr] = W · dA). Over the head's canonical leaves
// (leaf_plan.h): per slice of rows, a product a leaf of this shard (each summed in one order by whichever
// algorithm is timed fastest for the slice, GemmSpec::fixed_k_order) into its partial, then their exact
// sum (exact_sum.cu), rounded once: a row's bits depend on neither the row count, the slicing nor, over a
// group's leaves, the group size (bench/RESULTS.md).
absl::Status CudaEngine::DHiddenProduct(Scratch& s, int64_t nr, bool tf32, const GemmPlace& place,
                                        const DhFinish* finish) {
  const int64_t H = shape_.hidden_size, Vs = shape_.shard_rows;
  const cudaDataType_t dt = CudaType(shape_.dtype);
  if (!DHiddenChunked()) {
    return Gemm(CUBLAS_OP_N, CUBLAS_OP_N, H, nr, Vs, weight_->data(), dt, H, s.store, dt, lds_, 0.0f, s.dh, CUDA_R_32F,
                H, tf32, /*c_is_scratch=*/true, 0, /*rows_in_n=*/true, false, place);
  }
  if (s.dh_parts == nullptr || s.dh_slice == 0) return absl::InternalError("d_hidden's leaves: no room for partials");
  cudaStream_t stream = place.stream != nullptr ? place.stream : stream_;
  const int leaves = static_cast<int>(dh_leaves_.size());
  for (int64_t r0 = 0; r0 < nr; r0 += s.dh_slice) {
    const int64_t n = std::min(s.dh_slice, nr - r0);
    LCE_CUDA_CHECK(LeafProducts(s, r0, n, tf32, place));
    DhFinish f = finish != nullptr ? *finish : DhFinish{};
    if (f.info != nullptr) f.info += r0 * kRowInfo, f.targets += r0;
    if (DhExactGroup()) {
      LCE_CUDA_CHECK(GroupLeafSum(s, s.dh + r0 * H, leaves, n * H, f, stream));
    } else {
      LCE_CUDA_CHECK(LaunchExactLeafSum(s.dh + r0 * H, s.dh_parts, leaves, dh_terms_, n * H, f, stream));
    }
  }
  return absl::OkStatus();
}

// Whether a slice of n rows runs its leaves' products at once: where one alone leaves more than a tenth of its
// waves' slots idle (its tiles taken as 128 rows by 256 columns of d_hidden). 2816-row blocks slice as 2048 + 768
// rows: at H = 2048 the 768-row leaves are 48 tiles each, a third of a wave of 132 SMs, and 4 of them in turn take
// 4 waves' time for 1.5 waves' work. Products that fill their waves run one after the other, as before (at
// H = 8192 at once measured +1.4% of a train step: bench/NOTES.md e26).
bool CudaEngine::LeavesAtOnce(int64_t n) const {
  if (dh_leaves_.size() < 2 || sm_count_ < 1) return false;
  const int64_t tiles = (n + 127) / 128 * ((shape_.hidden_size + 255) / 256);
  const int64_t slots = RoundUp(tiles, sm_count_);
  return (slots - tiles) * 10 > slots;
}

// Rows [r0, r0 + n)'s product a leaf, each into its partial. LeavesAtOnce: their algorithms are chosen (timed)
// one after the other first, on the product's stream; then they run at once, leaf l > 0 on leaf_streams_[l − 1],
// each with its share of the workspace, all joined back to place's stream. Each product is the same computation
// wherever it runs: the same bits.
absl::Status CudaEngine::LeafProducts(Scratch& s, int64_t r0, int64_t n, bool tf32, const GemmPlace& place) {
  const int64_t H = shape_.hidden_size, sesz = StoreBytes(), esz = DTypeSize(shape_.dtype);
  cudaStream_t stream = place.stream != nullptr ? place.stream : stream_;
  const int leaves = static_cast<int>(dh_leaves_.size());
  const auto spec = [&](int l) {
    const VocabRange leaf = dh_leaves_[static_cast<size_t>(l)];
    GemmSpec g;
    g.m = H;
    g.n = n;
    g.k = leaf.end - leaf.begin;
    g.a = weight_->data() + leaf.begin * H * esz;
    g.lda = H;
    g.b = static_cast<const uint8_t*>(s.store) + (r0 * lds_ + leaf.begin) * sesz;
    g.ldb = lds_;
    g.c = s.dh_parts + l * n * H;
    g.ldc = H;
    g.ab_type = CudaType(shape_.dtype);
    g.c_type = CUDA_R_32F;
    g.compute = ComputeType(tf32);
    g.fixed_k_order = true;
    return g;
  };
  if (!LeavesAtOnce(n)) {
    for (int l = 0; l < leaves; ++l) LCE_CUDA_CHECK(RunGemm(spec(l), /*c_is_scratch=*/true, place));
    return absl::OkStatus();
  }
  uint8_t* ws = static_cast<uint8_t*>(place.workspace != nullptr ? place.workspace : cublas_ws_);
  // Timing on first sight writes the partial and runs on the product's stream, behind the last slice's sum.
  const auto at = [&](int l, bool prepare_only) {
    cudaStream_t on = l == 0 || prepare_only ? stream : leaf_streams_[l - 1];
    return GemmPlace{on, ws + l * kLeafWorkspace, prepare_only, kLeafWorkspace};
  };
  for (int l = 0; l < leaves; ++l) LCE_CUDA_CHECK(RunGemm(spec(l), /*c_is_scratch=*/true, at(l, true)));
  LCE_CUDA_CHECK(cudaEventRecord(leaf_fork_, stream));
  absl::Status st = absl::OkStatus();
  int forked = 0;
  for (int l = 0; l < leaves && st.ok(); ++l) {
    if (l > 0) {
      st =
          ToStatus(cudaStreamWaitEvent(leaf_streams_[l - 1], leaf_fork_, 0), "cudaStreamWaitEvent", __FILE__, __LINE__);
      if (!st.ok()) break;
      forked = l;
    }
    st = RunGemm(spec(l), /*c_is_scratch=*/true, at(l, false));
  }
  // Joined whatever failed: the slice's sum, the next slice and a later call rewrite the partials.
  for (int l = 1; l <= forked; ++l) {
    LCE_CUDA_CHECK(cudaEventRecord(leaf_join_[l - 1], leaf_streams_[l - 1]));
    LCE_CUDA_CHECK(cudaStreamWaitEvent(stream, leaf_join_[l - 1], 0));
  }
  return st;
}

// The group's scale an element (the largest code of every rank's terms), every rank's terms at it as
// integers, their int32 sum (exact: any order, any grouping) and one rounding: one GPU's bits.
absl::Status CudaEngine::GroupLeafSum(const Scratch& s, float* dst, int leaves, int64_t n, const DhFinish& f,
                                      cudaStream_t stream) {
  Collectives& c = *config_.collectives;
  if (s.dh_fixed == nullptr) return absl::InternalError("d_hidden's group sum: no room for its integers");
  LCE_CUDA_CHECK(LaunchLeafCodes(s.dh_codes, s.dh_parts, leaves, n, f, stream));
  LCE_CUDA_CHECK(c.AllReduceMaxBytes(s.dh_codes, n, true, stream));
  LCE_CUDA_CHECK(LaunchFixedLeafSum(s.dh_fixed, s.dh_codes, s.dh_parts, leaves, dh_terms_, n, f, stream));
  if (config_.rank0_outputs) {
    LCE_CUDA_CHECK(c.ReduceSumInt32ToRoot(s.dh_fixed, n, true, stream));
    if (c.rank() != 0) return absl::OkStatus();
  } else {
    LCE_CUDA_CHECK(c.AllReduceSumInt32(s.dh_fixed, n, true, stream));
  }
  return LaunchFixedToFloat(dst, s.dh_fixed, s.dh_codes, dh_terms_, n, stream);
}

// The fast loss path's two backward products at once: d_hidden's (and its finish) on aux_, dW's on stream_,
// each on the multiprocessors the other leaves idle (d_hidden's last wave of tiles, dW's fp32 read-modify-write:
// bench/NOTES.md, e10). Both only read s.store, s.info, h and W. dW's algorithm is chosen before d_hidden's
// product is queued: its timing runs write s.dh (tune_scratch_) and must run alone.
absl::Status CudaEngine::FastGradsBeside(Scratch& s, const void* h, int64_t nr, const int32_t* y, int32_t ignore_index,
                                         float* d_weight, float dw_beta, bool tf32, bool trace) {
  const int64_t H = shape_.hidden_size, Vs = shape_.shard_rows;
  const cudaDataType_t dt = CudaType(shape_.dtype);
  LCE_CUDA_CHECK(LaunchScaleRows(h, nr, H, s.info, s.h_scaled, stream_));
  const auto dw = [&](const GemmPlace& place) {
    return Gemm(CUBLAS_OP_N, CUBLAS_OP_T, H, Vs, nr, s.h_scaled, dt, H, s.store, dt, lds_, dw_beta, d_weight,
                CUDA_R_32F, H, tf32, false, 0, false, false, place);
  };
  LCE_CUDA_CHECK(dw(GemmPlace{nullptr, nullptr, /*prepare_only=*/true}));
  LCE_CUDA_CHECK(cudaEventRecord(events_[kEvHandoff], stream_));
  LCE_CUDA_CHECK(cudaStreamWaitEvent(aux_, events_[kEvHandoff], 0));
  absl::Status st = FastDHidden(s, nr, y, ignore_index, tf32, GemmPlace{aux_, s.side_ws});
  if (trace) LCE_CUDA_CHECK(cudaEventRecord(trace_[5], aux_));
  LCE_CUDA_CHECK(cudaEventRecord(events_[kEvDHidden], aux_));
  const auto dw_and_targets = [&]() -> absl::Status {
    LCE_CUDA_CHECK(dw(GemmPlace{}));
    LCE_CUDA_CHECK(LaunchScatterTargetDW(d_weight, nr, H, s.info, h, y, ignore_index, shape_.vocab_begin, Vs,
                                         s.target_order, s.target_order_bytes, stream_));
    return absl::OkStatus();
  };
  if (st.ok()) st = dw_and_targets();
  if (trace) LCE_CUDA_CHECK(cudaEventRecord(trace_[3], stream_));
  // Joined whatever failed: d_hidden's all-reduce and conversion follow on stream_, the next block's forward
  // rewrites s.store, and a later call must not meet aux_ still writing s.dh.
  LCE_CUDA_CHECK(cudaStreamWaitEvent(stream_, events_[kEvDHidden], 0));
  return st;
}

}  // namespace lce::cuda
