// Internal: the CUDA engine's class, whose methods live in cuda_engine.cc (set-up and the call's loop),
// call_plan.cc (plan), workspace.cc (scratch), engine_forward.cc (stage, forward, merge, finalize), engine_rankings.cc
// (rankings) and engine_backward.cc (backward, copy out). Design: the comment atop cuda_engine.cc.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>

#include "absl/status/statusor.h"
#include "cuda/call_plan.h"
#include "cuda/cuda_engine.h"
#include "cuda/gemm.h"
#include "cuda/kernels.h"
#include "cuda/workspace.h"
#include "lce/cuda_tuning.h"
#include "lce/device_memory.h"
#include "lce/engine.h"
#include "leaf_plan.h"

namespace lce::cuda {

inline constexpr int64_t kMiB = int64_t{1} << 20;
inline constexpr int64_t kCublasWorkspace = 32 * kMiB;
inline constexpr int64_t kHostDwSlabBytes = 64 * kMiB;
inline constexpr int64_t kMaxRowsPerBlock = 32768;              // grid.y limit is 65535
inline constexpr int64_t kWideLogitBytes = int64_t{256} << 20;  // small blocks' logit tiles (WideTile)
// The epilogue GEMM's first pass, whose max sets the fast path's c_row: a row's first 1024 columns rounded up
// to whole column tiles (four of 256, six of 192), so that a block of a few thousand rows is one wave on 132
// SMs (2048 columns, two waves at 2816 rows, took 2.7% of the forward for 1.3% of its products). Fixed, not
// chosen by the block: c_row must depend on the row alone.
inline constexpr int64_t kFirstPassCols = 1024;
// Rankings on the epilogue GEMM's path: a row's candidate list holds kRankCap (v, id) pairs; blocks of
// at most kRankRowsPerBlock rows keep the lists at 256 MiB; overflowed rows are redone kRankDumpRows
// at a time. (4096 places in 8192-row blocks measured no faster, and at k = 64 with V = 201088 its
// lists overflowed: 3.2x the plain score.)
inline constexpr int64_t kRankCap = 8192;
inline constexpr int64_t kRankRowsPerBlock = 4096;
inline constexpr int64_t kRankDumpRows = 64;
inline constexpr int64_t kRankCallListBytes = int64_t{64} << 20;  // the call's first pass lists at most
// d_hidden's product over the head's canonical leaves (DHiddenProduct, leaf_plan.h), summed in fixed point
// whatever the row count and the group; rows in slices of at most kDhSliceRows, their partials at most
// kDhPartBytes.
inline constexpr int64_t kDhSliceRows = 2048;
inline constexpr int64_t kDhMinSliceRows = 512;  // room a row block leaves for them (PlanCall)
inline constexpr int64_t kDhPartBytes = 128 * kMiB;
// Leaves' products run at once (LeafProducts), each with this share of the d_hidden product's cuBLAS workspace.
inline constexpr int64_t kLeafWorkspace = kCublasWorkspace / kMaxLeaves / 256 * 256;

// Where a product goes (CudaEngine::Gemm): stream_ and its cuBLAS workspace unless another stream is named,
// with a workspace of its own (two products running at once must not share one); prepare_only chooses
// the algorithm (timing the candidates on first sight) and runs nothing.
struct GemmPlace {
  cudaStream_t stream = nullptr;
  void* workspace = nullptr;
  bool prepare_only = false;
  int64_t workspace_bytes = 0;  // of `workspace`; 0: kCublasWorkspace
};

inline cudaDataType_t CudaType(DType d) {
  switch (d) {
    case DType::kBFloat16: return CUDA_R_16BF;
    case DType::kFloat16: return CUDA_R_16F;
    case DType::kFloat32: break;
  }
  return CUDA_R_32F;
}

class CudaEngine final : public LceEngine {
 public:
  CudaEngine(std::shared_ptr<const HeadWeights> weights, const EngineConfig& config)
      : weights_(std::move(weights)), shape_(weights_->shape), config_(config) {}
  ~CudaEngine() override;

  absl::Status Init();
  // Takes `tuning` (Init's, or SetCudaTuning's between calls) and what follows from it.
  absl::Status ApplyTuning(const CudaTuning& tuning);
  absl::Status Retune(const CudaTuning& tuning);

  std::string_view backend() const override { return "cuda"; }
  EngineInvariance invariance() const override;
  const HeadShape& shape() const override { return shape_; }
  // Read while a call runs (the metrics' sampler): the sizes, kept apart from the buffers.
  EngineMemory memory() const override { return {weights_bytes_.load(), scratch_bytes_.load()}; }
  EngineWeightOnDevice weight_on_device() const {
    return {weight_->data(), config_.device, bias_ != nullptr ? reinterpret_cast<float*>(bias_->data()) : nullptr};
  }

  absl::Status Compute(const RowsView& rows, const LceOptions& options, const Upstream& upstream,
                       const RowOutputs& outputs, const GradOutputs& grads) override;

 private:
  // --- The call's phases (Compute runs them in this order).
  absl::Status CheckCall(const RowsView& rows, const LceOptions& o, const Upstream& up) const;
  // Zeroes a fresh d_weight that no device product of this call will write; sets p.dw_fresh.
  absl::Status ZeroFreshDWeight(CallPlan& p);
  // Plan: the paths, the scratch layout, the block size and tile width (host only).
  absl::Status PlanCall(CallPlan& p);
  // The call's paths (fast, epilogue statistics, target apart, d_hidden beside dW...) and their scratch layout.
  ScratchLayout ChoosePaths(CallPlan& p);
  // The row block (a size every rank of a group agrees on) and the logit tile's width; the plan's last fields.
  absl::Status SizeBlocks(CallPlan& p, ScratchLayout layout);
  int64_t WholeSliceRows(const CallPlan& p, int64_t r_max) const;  // r_max, or whole d_hidden slices of it
  // The smallest of the group's ranks' values (the value itself alone): their largest row blocks and d_hidden
  // slices (their workspaces differ with their shards), so that every rank splits a call the same way: each
  // block's merge and each slice's exact sum is a collective.
  absl::StatusOr<int64_t> GroupMin(int64_t value);
  // The workspace grown to the plan's and carved; pinned staging; the targets checked.
  absl::Status PrepareCall(CallPlan& p, Scratch& s);
  // Stage: block r0's inputs on the device (host rows copied; unaligned device rows for the epilogue GEMM).
  absl::Status StageBlock(const CallPlan& p, Scratch& s, int64_t r0, BlockIo& b);
  // Forward, merge and finalize, again on the general path where the fast path's exp could overflow.
  absl::Status ForwardBlock(const CallPlan& p, Scratch& s, BlockIo& b);
  // Rankings (engine_rankings.cc). The buffers; on the epilogue GEMM's path the threshold before the
  // block's forward and the candidates' selection after it; then, after Finalize (the rows' m and
  // log S), the fallback for rows whose lists overflowed and the merge into the call's outputs.
  absl::Status PrepareRankings(CallPlan& p);
  absl::Status RankThreshold(const CallPlan& p, Scratch& s, const BlockIo& b);
  absl::Status RankThresholdsForCall(const CallPlan& p, Scratch& s);
  absl::Status RankSamplePass(const CallPlan& p, Scratch& s, const void* h, const int32_t* y, int64_t n, float* list,
                              unsigned* count, int64_t cap, float* thr);
  int64_t RankSample(int64_t k) const;  // the first pass's columns for a top-k
  absl::Status RankSelect(const CallPlan& p, const Scratch& s, const BlockIo& b);
  absl::Status RankOverflowedRows(const CallPlan& p, Scratch& s, const BlockIo& b);
  absl::Status Rank(const CallPlan& p, Scratch& s, const BlockIo& b);
  // Forward: the logit tiles' (or the epilogue GEMM's) segment partials and, for a backward, compact copy.
  absl::Status Forward(const CallPlan& p, Scratch& s, const BlockIo& b);
  absl::Status ForwardTiles(const CallPlan& p, Scratch& s, const BlockIo& b, StoreMode mode, unsigned* overflow);
  // Merge: the partials folded per row, across the group under tensor parallelism.
  absl::Status Merge(const CallPlan& p, Scratch& s, const BlockIo& b);
  // Finalize: per-row outputs and backward coefficients; the block's one host sync and its checks.
  // True: the fast path's exp would overflow: redo the block on the general path.
  absl::StatusOr<bool> Finalize(const CallPlan& p, Scratch& s, const BlockIo& b);
  absl::Status TraceForward(const CallPlan& p, const BlockIo& b);
  // Backward, fast loss path: dW += qᵀ · (s ⊙ h) − scatter(t ⊙ h);  d_hidden = s ⊙ (q · W) − t ⊙ W[y].
  absl::Status BackwardFast(const CallPlan& p, Scratch& s, const BlockIo& b);
  absl::Status TraceFast(const CallPlan& p, const BlockIo& b);
  // Backward, general path: dA in place chunk by chunk with each chunk's dW product, then d_hidden.
  absl::Status BackwardGeneral(const CallPlan& p, Scratch& s, const BlockIo& b);
  absl::Status WriteGradAndDWeight(const CallPlan& p, Scratch& s, const BlockIo& b);
  absl::Status GeneralDHidden(const CallPlan& p, Scratch& s, const BlockIo& b);
  absl::Status TraceGeneral(const CallPlan& p, const BlockIo& b);
  // A group's d_hidden summed over its ranks (into rank 0 alone with EngineConfig::rank0_outputs), and
  // whether this rank's d_hidden is read (copied out).
  absl::Status SumDHiddenOverRanks(float* dh, int64_t n);
  bool DHiddenReadHere() const;
  // Copy out: s.dh (fp32, reduced) to the caller's d_hidden in the head dtype.
  absl::Status CopyOutDHidden(const CallPlan& p, Scratch& s, const BlockIo& b);
  // Host d_weight, slab by slab through the device: host += a[nr, slab]ᵀ · x, with x = h and a = dA
  // (general path), or x = s ⊙ h and a = q, then the target rows −= t ⊙ h (fast_targets).
  absl::Status HostDWeightSlabs(const CallPlan& p, Scratch& s, const BlockIo& b, const void* x, bool fast_targets);
  // A head's bias: dB (p.d_bias) += the block's column sums of dL/da (bias_grad.cu); host rows' dB on the device,
  // copied in (PrepareCall) and out (after the last block).
  absl::Status PrepareBiasGrad(CallPlan& p);
  absl::Status PrepareSmoothingSums(CallPlan& p);
  absl::Status BiasGrad(const CallPlan& p, const Scratch& s, const BlockIo& b, bool fast);
  absl::Status CopyOutBiasGrad(const CallPlan& p);

  // --- Pieces of the phases.
  // The forward of a row block through the epilogue-statistics GEMM: segment partials into s.part and
  // target logits into s.packed, as the logit tiles and TileStats leave them; for a backward, the compact
  // copy into s.store (kExp: c_row into s.row_c, the overflow flag as TileStats raises it).
  enum class EpiCopy { kNone, kShifted, kExp };
  absl::Status EpilogueStatsForward(Scratch& s, const void* h, int64_t nr, const int32_t* y, int32_t ignore_index,
                                    const LogitTransform& tf, EpiCopy copy, bool entropy, unsigned* overflow,
                                    const RankLists* ranks);
  // The epilogue GEMM's arguments for the block's rows h [nr, H] over the whole shard.
  EpilogueStatsArgs EpiArgs(Scratch& s, const void* h, int64_t nr, const int32_t* y, int32_t ignore_index,
                            const LogitTransform& tf) const;
  // Host rows: checked here. Device rows: a kernel writes the first bad row into s.bad[2], read with the
  // first block's flags (BadTarget), before anything touches d_weight: no synchronization of its own.
  absl::Status CheckTargets(const RowsView& rows, const LceOptions& o, Scratch& s);
  // The error of row `row`, whose target is y (host rows) or is read from device rows.
  absl::Status BadTarget(int64_t row, int32_t y, const LceOptions& o) const;
  absl::Status BadTarget(const RowsView& rows, const LceOptions& o, unsigned long long row) const;
  // s.dh [nr, H] = dA (s.store) · W on place's stream: a product a leaf of the shard, their exact sum
  // (with `finish`, the fast path's s ⊙ · − t ⊙ W[y] inside it) whatever nr (CudaTuning::dh_fixed_order;
  // else one product, cuBLAS's choice for nr).
  absl::Status DHiddenProduct(Scratch& s, int64_t nr, bool tf32, const GemmPlace& place,
                              const DhFinish* finish = nullptr);
  // Rows [r0, r0 + n)'s product a leaf into s.dh_parts, on place's stream, or at once on the leaf streams
  // (LeavesAtOnce) joined to it.
  bool LeavesAtOnce(int64_t n) const;
  absl::Status LeafProducts(Scratch& s, int64_t r0, int64_t n, bool tf32, const GemmPlace& place);
  DhFinish Finish(const Scratch& s, const int32_t* y, int32_t ignore_index) const;  // for a block's rows
  // Where it buys batch invariance: after the epilogue GEMM's forward, or with batch-invariant GEMMs. (Its
  // partials' batch stride, H·rows floats, stays 16-byte aligned for H a multiple of 4.)
  bool DHiddenChunked() const {
    return tuning_.dh_fixed_order && !tuning_.gemm_ex && shape_.hidden_size % 4 == 0 &&
           (UseEpilogueStats() || batch_invariant_);
  }
  // The ranks of this engine's TP group (1: no group).
  int GroupSize() const { return config_.collectives != nullptr ? config_.collectives->world_size() : 1; }
  // A group sums d_hidden's leaves in fixed point over its ranks (GroupLeafSum) rather than all-reducing floats.
  bool DhExactGroup() const { return DHiddenChunked() && GroupSize() > 1; }
  int64_t DhPartRowBytes() const {  // a row's leaf partials (and in a group its int32 sum and codes)
    return static_cast<int64_t>(dh_leaves_.size()) * shape_.hidden_size * 4 +
           (DhExactGroup() ? shape_.hidden_size * 5 : 0);
  }
  // A slice's leaves summed over the group into dst (rank 0's alone with rank0_outputs), on `stream`.
  absl::Status GroupLeafSum(const Scratch& s, float* dst, int leaves, int64_t n, const DhFinish& f,
                            cudaStream_t stream);
  // The rows of a slice whose partials fit `fits` rows (0: none fits), whole 128-row tiles where it holds one.
  int64_t DhSliceRows(int64_t fits) const {
    const int64_t rows = std::clamp<int64_t>(kDhPartBytes / DhPartRowBytes(), 1, kDhSliceRows);
    const int64_t slice = std::min(rows, std::max<int64_t>(fits, 0));
    return slice >= 128 ? slice / 128 * 128 : slice;
  }
  // The fast loss path's d_hidden before its all-reduce: s.dh = s ⊙ (q · W) − t ⊙ W[y], on place's stream.
  absl::Status FastDHidden(Scratch& s, int64_t nr, const int32_t* y, int32_t ignore_index, bool tf32,
                           const GemmPlace& place);
  absl::Status FastGradsBeside(Scratch& s, const void* h, int64_t nr, const int32_t* y, int32_t ignore_index,
                               float* d_weight, float dw_beta, bool tf32, bool trace);
  // C (fp32, column-major) = op(A)·op(B) + beta·C. Through cuBLASLt with a tuned algorithm (GemmRunner;
  // c_is_scratch says C may be overwritten while tuning), cublasGemmEx with CudaTuning::gemm_ex.
  absl::Status Gemm(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, const void* A,
                    cudaDataType_t at, int64_t lda, const void* B, cudaDataType_t bt, int64_t ldb, float beta, void* C,
                    cudaDataType_t ct, int64_t ldc, bool tf32, bool c_is_scratch = false, int sm_target = 0,
                    bool rows_in_n = false, bool cols_in_m = false, const GemmPlace& place = {});
  // The products' compute type: fp32, TF32 for an fp32 head where the call allows it.
  cublasComputeType_t ComputeType(bool tf32) const {
    return shape_.dtype == DType::kFloat32 && tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  }
  // g through the GemmRunner on place's stream and workspace (Gemm's route; not with CudaTuning::gemm_ex).
  absl::Status RunGemm(const GemmSpec& g, bool c_is_scratch, const GemmPlace& place);

  // --- Scratch sizes (workspace.cc).
  // Lays out the scratch of R rows (base null: only counts); returns the bytes.
  int64_t Carve(const ScratchLayout& l, int64_t R, uint8_t* base, Scratch* s) const;
  int64_t Bytes(const ScratchLayout& l, int64_t R) const;
  // buf holds at least `bytes` (grown after stream_ has finished with the old one).
  absl::Status GrowDeviceBuffer(std::unique_ptr<DeviceBuffer>& buf, int64_t bytes);
  // Largest R whose scratch fits `budget` (at least 1), at most `want`.
  int64_t RowsPerBlock(const ScratchLayout& l, int64_t want, int64_t budget) const;
  // Logit tile columns for blocks of R rows: the default for large blocks; for a few rows as many as
  // kWideLogitBytes of double-buffered fp32 logits hold, up to the whole shard. A GEMM of 8192
  // vocabulary rows by a handful of batch rows keeps too few SMs streaming W; one over the whole
  // shard reads W at near HBM speed (bench/RESULTS.md: 1-64 rows, 0.60 -> 0.48-0.54 ms at V=151936).
  int64_t WideTile(int64_t R) const;
  int64_t TileOf(const ScratchLayout& l) const { return l.tile > 0 ? l.tile : tile_; }
  int64_t Ldz(const ScratchLayout& l) const { return RoundUp(std::min(TileOf(l), shape_.shard_rows), 4); }
  int64_t StoreBytes() const { return shape_.dtype == DType::kFloat32 ? 4 : 2; }
  int64_t DwSlabRows() const {
    return std::clamp<int64_t>(kHostDwSlabBytes / (shape_.hidden_size * 4), 1, shape_.shard_rows);
  }
  // The epilogue-statistics GEMM's column tiles over the shard (epilogue_stats_gemm.cu).
  int64_t EpiTiles() const {
    const int64_t cols = EpiTileCols();
    return cols > 0 ? (shape_.shard_rows + cols - 1) / cols : 0;
  }
  int EpiTileCols() const {
#if defined(LCE_WITH_CUTLASS)
    return EpilogueStatsTileCols(epi_config_ >= 0 ? epi_config_ : tuning_.epi_large);
#else
    return 0;
#endif
  }
  // Whether calls' forwards run through the epilogue-statistics GEMM (CudaTuning::epilogue_stats, on by
  // default): a bf16 head on an sm_90 device, hidden a multiple of 8 (rows not 16-byte aligned are staged).
  bool UseEpilogueStats() const {
#if defined(LCE_WITH_CUTLASS)
    return epi_capable_ && tuning_.epilogue_stats && shape_.dtype == DType::kBFloat16 && shape_.hidden_size % 8 == 0;
#else
    return false;
#endif
  }
  bool SegmentsAreGlobal() const {
    return VocabTile(shape_.vocab_size) == kSegment && shape_.vocab_begin % kSegment == 0;
  }

  std::shared_ptr<const HeadWeights> weights_;
  HeadShape shape_;
  EngineConfig config_;
  CudaTuning tuning_;  // taken at Init (ApplyTuning)
  // stream_ runs the GEMMs (cuBLAS is bound to it) and the per-row kernels; aux_ runs the elementwise
  // tile kernels so that they overlap the next GEMM, and the fast path's d_hidden product beside dW's.
  cudaStream_t stream_ = nullptr, aux_ = nullptr;
  enum { kEvGemm0, kEvGemm1, kEvStats0, kEvStats1, kEvHandoff, kEvDHidden, kNumEvents };
  cudaEvent_t events_[kNumEvents] = {};
  cudaEvent_t trace_[8] = {};  // CudaTuning::trace: phase timings of the first row block, to stderr
  // LeafProducts at once: leaves after the first on streams of their own, forked from and joined to the product's.
  cudaStream_t leaf_streams_[kMaxLeaves - 1] = {};
  cudaEvent_t leaf_fork_ = nullptr, leaf_join_[kMaxLeaves - 1] = {};
  cublasHandle_t cublas_ = nullptr;
  GemmRunner gemm_;
  float* tune_scratch_ = nullptr;  // the logit tiles, free during the backward: where GEMMs are tuned
  int64_t tune_floats_ = 0;
  void* cublas_ws_ = nullptr;
  std::unique_ptr<DeviceBuffer> weight_, bias_, workspace_;
  std::unique_ptr<DeviceBuffer> class_weight_;  // host rows' class weights, copied once a call
  std::unique_ptr<DeviceBuffer> smoothing_sums_;  // PrepareSmoothingSums: segment sums [nseg_global_, H + 2], then u
  std::unique_ptr<DeviceBuffer> rank_buf_;      // rankings' candidates and host rows' staged outputs
  std::unique_ptr<DeviceBuffer> rank_dump_;     // the rankings' fallback: a few rows' v over the shard
  std::unique_ptr<DeviceBuffer> agree_;         // GroupMin's one float
  std::unique_ptr<DeviceBuffer> bias_grad_;     // host rows' dB, on the device during a call
  PinnedStaging pinned_;
  PinnedStaging rank_flags_;  // a block's rows whose candidate lists overflowed, read after Finalize's sync
  // memory(): the head's device copy (and bias), and the buffers GrowDeviceBuffer sizes.
  std::atomic<int64_t> weights_bytes_{0}, scratch_bytes_{0};
  int64_t tile_ = 0, lds_ = 0, nseg_ = 0;
  // d_hidden's canonical leaves in this shard (leaf_plan.h, shard-local), and an element's terms over the
  // whole head (its leaves and the target's): the exact sum's scale, the same in every group.
  std::vector<VocabRange> dh_leaves_;
  int dh_terms_ = 0;
  bool batch_invariant_ = false;  // one GEMM algorithm for every row count (GemmSpec::n_invariant)
  // EngineConfig::tp_invariant: one logit GEMM algorithm for every tile length too, and under TP the
  // forward's statistics gathered and folded in global segment order, so that groups of any size
  // give one GPU's bits.
  bool tp_invariant_option_ = false;
  bool tp_invariant_ = false;
  int64_t nseg_global_ = 0;
  int sm_count_ = 0;
  int fwd_sm_target_ = 0;
  bool epi_capable_ = false;  // an sm_90 device: the epilogue-statistics GEMM can run
  int epi_config_ = -1;       // its kernel configuration (EpilogueStatsArgs::config), fixed per engine
  std::mutex mu_;
};

}  // namespace lce::cuda
