// The CUDA engine's backward of a row block and its copy out (the design: cuda_engine.cc's opening
// comment): the fast loss path's two products, or the general path's dA chunks with their dW products
// and one d_hidden product (or d_hidden's tile tree); host d_weight in slabs through the device.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/cuda_engine_impl.h"
#include "tile_tree.h"

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

// s.dh before its conversion: over the tile tree (tree_dh_), or one product, the target's term and the
// group's sum.
absl::Status CudaEngine::GeneralDHidden(const CallPlan& p, Scratch& s, const BlockIo& b) {
  const int64_t H = shape_.hidden_size, Vs = shape_.shard_rows, nr = b.nr;
  const cudaDataType_t dt = CudaType(shape_.dtype);
  const uint8_t* w = weight_->data();
  const bool tf32 = p.o.allow_tf32;
  if (tree_dh_) return DHiddenByTiles(s, nr, w, tf32);
  LCE_CUDA_CHECK(DHiddenProduct(s, nr, tf32, GemmPlace{}));
  if (p.target_apart) {
    LCE_CUDA_CHECK(LaunchFinishDHidden(s.dh, nr, H, s.info, w, b.y, p.o.ignore_index, shape_.vocab_begin, Vs, stream_));
  }
  return SumDHiddenOverRanks(s.dh, nr * H);
}

// d_hidden's sum over a group's ranks: into rank 0 alone where only its outputs are read
// (EngineConfig::rank0_outputs; at 4 ranks a reduce moves half an all-reduce's bytes).
absl::Status CudaEngine::SumDHiddenOverRanks(float* dh, int64_t n) {
  if (config_.collectives == nullptr) return absl::OkStatus();
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
  LCE_CUDA_CHECK(DHiddenProduct(s, nr, tf32, place));
  cudaStream_t stream = place.stream != nullptr ? place.stream : stream_;
  LCE_CUDA_CHECK(LaunchFinishDHidden(s.dh, nr, H, s.info, w, y, ignore_index, shape_.vocab_begin, Vs, stream));
  return absl::OkStatus();
}

// dh[nr, H] = dA[nr, Vs] · W[Vs, H] (column-major: [H, nr] = W · dA). In fixed chunks: per slice of rows, one
// strided-batched GEMM writes every chunk's partial and an ordered sum adds them in chunk order. Each chunk is
// summed in one order by whichever algorithm is timed fastest for the slice (GemmSpec::fixed_k_order), so a
// row's bits depend on neither the row count nor the slicing; the batch gives a few rows the parallelism that
// split-K would (bench/RESULTS.md). W's rows and the store's columns past the shard, up to the last chunk's
// end, are zero.
absl::Status CudaEngine::DHiddenProduct(Scratch& s, int64_t nr, bool tf32, const GemmPlace& place) {
  const int64_t H = shape_.hidden_size, Vs = shape_.shard_rows, sesz = StoreBytes();
  const uint8_t* w = weight_->data();
  const cudaDataType_t dt = CudaType(shape_.dtype);
  if (!DHiddenChunked()) {
    return Gemm(CUBLAS_OP_N, CUBLAS_OP_N, H, nr, Vs, w, dt, H, s.store, dt, lds_, 0.0f, s.dh, CUDA_R_32F, H, tf32,
                /*c_is_scratch=*/true, 0, /*rows_in_n=*/true, false, place);
  }
  cudaStream_t stream = place.stream != nullptr ? place.stream : stream_;
  uint8_t* store = static_cast<uint8_t*>(s.store);
  if (const int64_t pad = dh_chunks_ * dh_chunk_ - Vs; pad > 0) {
    LCE_CUDA_CHECK(cudaMemset2DAsync(store + Vs * sesz, lds_ * sesz, 0, pad * sesz, nr, stream));
  }
  GemmSpec g;
  g.m = H;
  g.k = dh_chunk_;
  g.a = w;
  g.lda = H;
  g.ldb = lds_;
  g.c = s.dh_parts;
  g.ldc = H;
  g.ab_type = dt;
  g.c_type = CUDA_R_32F;
  g.compute = ComputeType(tf32);
  g.fixed_k_order = true;
  if (s.dh_parts == nullptr || s.dh_slice == 0 || DHiddenInPlace(nr)) {
    // In place: a product a chunk over all nr rows, each added to the last (beta 1) in chunk order, as the
    // ordered sum adds them; the same family of algorithms, so the same bits.
    // Every chunk's algorithm is chosen (timed on s.dh) before the first product writes it.
    const int64_t esz = DTypeSize(shape_.dtype);
    g.n = nr;
    g.c = s.dh;
    const GemmPlace prepare{place.stream, place.workspace, /*prepare_only=*/true};
    for (const GemmPlace& run : {prepare, place}) {
      for (int64_t c = 0; c < dh_chunks_; ++c) {
        g.a = w + c * dh_chunk_ * H * esz;
        g.b = store + c * dh_chunk_ * sesz;
        g.beta = c == 0 ? 0.0f : 1.0f;
        LCE_CUDA_CHECK(RunGemm(g, /*c_is_scratch=*/true, run));
      }
    }
    return absl::OkStatus();
  }
  g.k_chunks = static_cast<int>(dh_chunks_);
  const int64_t slice = s.dh_slice;
  for (int64_t r0 = 0; r0 < nr; r0 += slice) {
    g.n = std::min(slice, nr - r0);
    g.b = store + r0 * lds_ * sesz;
    LCE_CUDA_CHECK(RunGemm(g, /*c_is_scratch=*/true, place));
    LCE_CUDA_CHECK(LaunchOrderedSum(s.dh + r0 * H, s.dh_parts, g.k_chunks, g.n * H, stream));
  }
  return absl::OkStatus();
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

// d_hidden of a block into s.dh over the canonical tile tree (tile_tree.h): each tile's product
// dA[:, tile] · W[tile, :] through one GEMM algorithm whatever the row count (rows in n), joined as
// the tiles come; a group gathers every rank's subtrees (−inf elsewhere: a max all-reduce copies
// them) and each rank sums the same tree. A GEMM per tile and an add per join, against one GEMM and
// NCCL's sum (whose order varies with its algorithm): the cost is in bench/RESULTS.md.
absl::Status CudaEngine::DHiddenByTiles(Scratch& s, int64_t nr, const uint8_t* w, bool tf32) {
  const int64_t H = shape_.hidden_size, Vs = shape_.shard_rows, n = nr * H;
  const int64_t esz = DTypeSize(shape_.dtype), sesz = StoreBytes();
  const cudaDataType_t dt = CudaType(shape_.dtype);
  struct Node {
    int level = 0;
    int64_t index = 0;
    float* value = nullptr;
  };
  std::vector<float*> free_slots;
  for (int64_t i = TreeSlots() - 1; i >= 0; --i) free_slots.push_back(s.tree + i * n);
  auto take = [&]() -> float* {
    float* p = free_slots.empty() ? nullptr : free_slots.back();
    if (p != nullptr) free_slots.pop_back();
    return p;
  };
  absl::Status status;
  std::vector<Node> stack;
  for (int64_t v0 = 0, t = shape_.vocab_begin / kSegment; v0 < Vs; v0 += kSegment, ++t) {
    const int64_t nv = std::min<int64_t>(kSegment, Vs - v0);
    float* slot = take();
    if (slot == nullptr) return absl::InternalError("d_hidden tile tree: out of node slots");
    // [H, nr] = W[v0:v0+nv, H]ᵀ-major · dA[nr, v0:v0+nv]   (column-major, as the one-GEMM path)
    LCE_CUDA_CHECK(Gemm(CUBLAS_OP_N, CUBLAS_OP_N, H, nr, nv, w + v0 * H * esz, dt, H,
                        static_cast<const uint8_t*>(s.store) + v0 * sesz, dt, lds_, 0.0f, slot, CUDA_R_32F, H, tf32,
                        /*c_is_scratch=*/true, 0, /*rows_in_n=*/true));
    PushTreeNode(stack, Node{0, t, slot}, [&](Node& left, Node& right) {
      if (status.ok()) status = LaunchAddFloats(left.value, left.value, right.value, n, stream_);
      free_slots.push_back(right.value);
    });
    if (!status.ok()) return status;
  }
  std::vector<Node> held = stack;
  if (config_.collectives != nullptr) {
    const int world = config_.collectives->world_size(), me = config_.collectives->rank();
    LCE_CUDA_CHECK(
        LaunchFillFloats(s.tree_gathered, -std::numeric_limits<float>::infinity(), GatheredNodes() * n, stream_));
    held.clear();
    for (int r = 0; r < world; ++r) {
      const std::vector<TileTreeNode> subtrees = RankSubtrees(shape_.vocab_size, r, world);
      for (size_t i = 0; i < subtrees.size(); ++i) {
        float* dst = s.tree_gathered + static_cast<int64_t>(held.size()) * n;
        if (r == me) {
          LCE_CUDA_CHECK(cudaMemcpyAsync(dst, stack[i].value, n * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
          free_slots.push_back(stack[i].value);
        }
        held.push_back({subtrees[i].level, subtrees[i].index, dst});
      }
    }
    LCE_CUDA_CHECK(config_.collectives->AllReduce(s.tree_gathered, static_cast<int64_t>(held.size()) * n,
                                                  ReduceOp::kMax, true, stream_));
  }
  // The canonical sum from the held subtrees; a temporary is a slot of ours, a held node is not.
  const int64_t tiles = VocabTileCount(shape_.vocab_size);
  struct Value {
    float* p = nullptr;
    bool temp = false;
  };
  std::function<Value(int, int64_t)> sum = [&](int level, int64_t index) -> Value {
    if ((index << level) >= tiles || !status.ok()) return {};
    for (const Node& h : held) {
      if (h.level == level && h.index == index) return {h.value, false};
    }
    Value left = sum(level - 1, 2 * index), right = sum(level - 1, 2 * index + 1);
    if (right.p == nullptr || !status.ok()) return left;
    Value out{left.temp ? left.p : take(), true};
    if (out.p == nullptr) {
      status = absl::InternalError("d_hidden tile tree: out of node slots");
      return {};
    }
    status = LaunchAddFloats(out.p, left.p, right.p, n, stream_);
    if (right.temp) free_slots.push_back(right.p);
    return out;
  };
  const Value root = sum(TileTreeRootLevel(tiles), 0);
  if (!status.ok()) return status;
  LCE_CUDA_CHECK(cudaMemcpyAsync(s.dh, root.p, n * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
  return absl::OkStatus();
}

}  // namespace lce::cuda
