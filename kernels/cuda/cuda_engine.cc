// CUDA backend of the LCE engine (docs/MATH.md). Design, measurements and every variant tried:
// bench/NOTES.md.
//
// Rows are processed in blocks of R rows, R as large as EngineConfig.workspace_bytes allows (the
// workspace is allocated once, grown up to that budget, and reused). For one row block:
//   forward   for each vocabulary tile (8192 columns; LCE_CUDA_VOCAB_TILE): one cuBLASLt GEMM writes the
//             fp32 logit tile [R, tile] (stream_); TileStats reduces it to per-(row, kSegment-column
//             segment) softmax partials (aux_, overlapping the next GEMM) and, when a gradient is
//             wanted, keeps a compact [R, V_shard] copy: z − m_segment (fp16; fp32 for fp32 heads) on
//             the general path, exp(z − c_row) (bf16) on the fast loss path. MergeSegments folds the
//             partials per row; under tensor parallelism two all-reduces (max, then sum of the
//             rescaled partials) make them global; FinalizeRows writes logprob/entropy/lse/loss and
//             the backward coefficients. One host sync per block: a non-finite row stops the call
//             before d_weight is touched.
//   backward  general path: WriteGrad turns the compact copy into dL/da in the head dtype in place
//             (aux_, chunk by chunk, each chunk's dW product on stream_ behind it), then
//             d_hidden = dA[R, V_shard] · W (fp32, all-reduced across ranks, converted), summed in fixed
//             vocabulary chunks so that a row's bits do not depend on R (DHiddenProduct); where one chunk's
//             product leaves most of a wave idle, the chunks' products run at once on streams of their own
//             (LeafProducts).
//             fast loss path (bf16, kLoss, no softcap, no label smoothing): no dA pass at all;
//             dW += qᵀ·(s ⊙ h) − scatter(t ⊙ h) and d_hidden = s ⊙ (q·W) − t ⊙ W[y] (fast_grad.cu); on
//             device rows the two products run at once, d_hidden's on aux_ (FastGradsBeside).
//             A head's bias: dB += the column sums of dL/da from the same copy (bias_grad.cu).
// So a train step costs three GEMMs of N·H·V_shard (the floor) plus elementwise passes.
// Epilogue statistics (bf16, sm_90, built with CUTLASS; LCE_CUDA_EPILOGUE_STATS=0 turns them off): the
// forward is one GEMM over the whole shard whose epilogue writes per-(row, column tile) partials (192 columns: the
// ping-pong 128×192 kernel, by default) and the target logits (epilogue_stats_gemm.cu), folded into the same segment
// partials: no logit tiles, no TileStats. A training call's epilogue also writes the compact copy: exp(z − c_row)
// (bf16) for the fast loss path, c_row from a first pass of the same GEMM over the first kFirstPassCols columns, or z −
// m_tile (fp16), which WriteGrad reads with the tiles' m. Score and training take the same GEMM, so a row's logprob is
// the same bits in both, and in any batch.
//
// A call is a short loop of named phases (Compute): plan (PlanCall, PrepareCall: call_plan.cc), then for
// each row block stage, forward, merge, finalize (engine_forward.cc), backward and copy out
// (engine_backward.cc). Knobs (CudaTuning, lce/cuda_tuning.h) are taken once, at Init.
#include "cuda/cuda_engine.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_engine_impl.h"
#include "cuda/gemm.h"
#include "cuda/kernels.h"
#include "lce/cuda_tuning.h"
#include "leaf_plan.h"

namespace lce::cuda {

CudaEngine::~CudaEngine() {
  cudaSetDevice(config_.device);
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  workspace_.reset();
  weight_.reset();
  bias_.reset();
  if (cublas_ != nullptr) cublasDestroy(cublas_);
  for (cudaEvent_t e : events_) {
    if (e != nullptr) cudaEventDestroy(e);
  }
  for (cudaEvent_t e : trace_) {
    if (e != nullptr) cudaEventDestroy(e);
  }
  if (leaf_fork_ != nullptr) cudaEventDestroy(leaf_fork_);
  for (cudaEvent_t e : leaf_join_) {
    if (e != nullptr) cudaEventDestroy(e);
  }
  for (cudaStream_t ls : leaf_streams_) {
    if (ls != nullptr) cudaStreamDestroy(ls);
  }
  if (aux_ != nullptr) cudaStreamDestroy(aux_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::Status CudaEngine::Init() {
  int count = 0;
  LCE_CUDA_CHECK(cudaGetDeviceCount(&count));
  if (config_.device < 0 || config_.device >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA device ", config_.device, " does not exist (", count, " visible)"));
  }
  LCE_CUDA_CHECK(cudaSetDevice(config_.device));
  LCE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  LCE_CUDA_CHECK(cudaStreamCreateWithFlags(&aux_, cudaStreamNonBlocking));
  for (cudaEvent_t& e : events_) LCE_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  for (cudaEvent_t& e : trace_) LCE_CUDA_CHECK(cudaEventCreate(&e));
  for (cudaStream_t& ls : leaf_streams_) LCE_CUDA_CHECK(cudaStreamCreateWithFlags(&ls, cudaStreamNonBlocking));
  LCE_CUDA_CHECK(cudaEventCreateWithFlags(&leaf_fork_, cudaEventDisableTiming));
  for (cudaEvent_t& e : leaf_join_) LCE_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  LCE_CUDA_CHECK(cublasCreate(&cublas_));
  LCE_CUDA_CHECK(cublasSetStream(cublas_, stream_));
  LCE_CUDA_CHECK(cublasSetPointerMode(cublas_, CUBLAS_POINTER_MODE_HOST));
  LCE_CUDA_CHECK(gemm_.Init());
  // d_hidden's leaves in this shard, and the terms of an element over the whole head (DHiddenProduct).
  dh_leaves_ = ShardLeaves(shape_.vocab_size, VocabRange{shape_.vocab_begin, shape_.vocab_end()});
  dh_terms_ = static_cast<int>(LeafBounds(shape_.vocab_size).size());  // the head's leaves (bounds − 1) + the target's
  const int64_t w_bytes = static_cast<int64_t>(weights_->weight.size());
  absl::StatusOr<std::unique_ptr<DeviceBuffer>> weight = AllocateDeviceBuffer(w_bytes, config_.device);
  if (!weight.ok()) return weight.status();
  weight_ = std::move(*weight);
  weights_bytes_ = weight_->size();
  LCE_CUDA_CHECK(cudaMemcpy(weight_->data(), weights_->weight.data(), w_bytes, cudaMemcpyHostToDevice));
  if (shape_.has_bias) {
    absl::StatusOr<std::unique_ptr<DeviceBuffer>> bias =
        AllocateDeviceBuffer(static_cast<int64_t>(weights_->bias.size() * sizeof(float)), config_.device);
    if (!bias.ok()) return bias.status();
    bias_ = std::move(*bias);
    weights_bytes_ += bias_->size();
    LCE_CUDA_CHECK(cudaMemcpy(bias_->data(), weights_->bias.data(), weights_->bias.size() * sizeof(float),
                              cudaMemcpyHostToDevice));
  }
  // A copy from pageable memory may return before its DMA lands, and the engine's streams are
  // non-blocking (no implicit order with these copies): wait for the weights here.
  LCE_CUDA_CHECK(cudaDeviceSynchronize());
  cudaDeviceProp prop{};
  LCE_CUDA_CHECK(cudaGetDeviceProperties(&prop, config_.device));
  sm_count_ = prop.multiProcessorCount;
  epi_capable_ = prop.major == 9 && prop.minor == 0;
  return ApplyTuning(config_.cuda_tuning.has_value() ? *config_.cuda_tuning : CudaTuningFromEnv());
}

absl::Status CudaEngine::ApplyTuning(const CudaTuning& tuning) {
  tuning_ = tuning;
  // Forward logit GEMMs leave this many multiprocessors to the tile reductions on aux_.
  const int64_t spare = std::clamp<int64_t>(tuning_.stats_sms, 0, sm_count_ / 2);
  fwd_sm_target_ = spare > 0 ? sm_count_ - static_cast<int>(spare) : 0;
  batch_invariant_ = tuning_.batch_invariant.value_or(config_.batch_invariant);
  // Wherever a row's results are batch invariant: the epilogue GEMM's path, or batch-invariant GEMMs.
  tp_invariant_option_ =
      (batch_invariant_ || UseEpilogueStats()) && tuning_.tp_invariant.value_or(config_.tp_invariant);
  tile_ = RoundUp(std::max<int64_t>(tuning_.vocab_tile, kSegment), kSegment);
  tile_ = std::min(tile_, RoundUp(shape_.shard_rows, kSegment));
  lds_ = RoundUp(shape_.shard_rows, 8);
  nseg_ = (shape_.shard_rows + kSegment - 1) / kSegment;
  // Segments at fixed global offsets (VocabTile(V) == kSegment: V >= 98304, and shards of whole
  // tiles): a group folds every segment in global order, as one GPU does (docs/MATH.md).
  nseg_global_ = (shape_.vocab_size + kSegment - 1) / kSegment;
  tp_invariant_ = config_.collectives != nullptr && tp_invariant_option_ && SegmentsAreGlobal();
  epi_config_ = tuning_.epi_kernel;
  gemm_.set_tune(tuning_.gemm_tune);
  gemm_.set_log(tuning_.gemm_log);
  // The smallest block must fit the budget.
  const int64_t smallest = Bytes({true, true, true, true, true}, 1);
  if (smallest > config_.workspace_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("workspace_bytes ", config_.workspace_bytes,
                                                   " is too small for one row of this head (needs ", smallest, ")"));
  }
  return absl::OkStatus();
}

absl::Status CudaEngine::Retune(const CudaTuning& tuning) {
  std::lock_guard<std::mutex> lock(mu_);
  const CudaTuning before = tuning_;
  absl::Status st = ApplyTuning(tuning);
  if (!st.ok()) (void)ApplyTuning(before);
  return st;
}

// Per-row statistics come from fixed vocabulary tiles and segments whatever N; with batch-invariant
// GEMMs (EngineConfig::batch_invariant) the logit and d_hidden products use one algorithm without
// split-K for every row count (docs/MATH.md). Without, cuBLAS's tuned choice varies with N.
EngineInvariance CudaEngine::invariance() const {
  // A group of three or more sums its ranks' partials through NCCL, whose order for an element changes with
  // the message's size (the row count): nothing per row holds unless the partials are gathered and folded
  // in one order (tp_invariant_). Two ranks' a + b is the same bits either way.
  if (GroupSize() > 2 && !tp_invariant_) return {};
  // The epilogue GEMM's forward is batch invariant by construction, and so is d_hidden over the leaves
  // (DHiddenProduct) after it; on the logit tiles, only with batch-invariant GEMMs.
  if (!batch_invariant_ && !UseEpilogueStats()) return {};
  EngineInvariance inv{{"logprob", "entropy", "lse", "loss"}, {}};
  if (batch_invariant_ || DHiddenChunked()) inv.across_batches.push_back("d_hidden");
  // Across group sizes: the forward's statistics folded in global segment order, the fast path's c_row from
  // the head's first columns, d_hidden's leaves summed in fixed point (DHiddenProduct) in groups whose
  // shards are whole leaves.
  if (tp_invariant_option_ && SegmentsAreGlobal()) {
    inv.across_tp_sizes = {"logprob", "entropy", "lse", "loss"};
    const int world = GroupSize();
    const bool leaf_group =
        std::find(std::begin(kLeafGroupSizes), std::end(kLeafGroupSizes), world) != std::end(kLeafGroupSizes);
    if (DHiddenChunked() && leaf_group) inv.across_tp_sizes.push_back("d_hidden");
  }
  return inv;
}

absl::Status CudaEngine::Compute(const RowsView& rows, const LceOptions& o, const Upstream& up, const RowOutputs& out,
                                 const GradOutputs& grads) {
  if (absl::Status s = CheckCall(rows, o, up); !s.ok()) return s;
  if (grads.d_bias != nullptr && (!shape_.has_bias || grads.d_weight == nullptr)) {
    return absl::InvalidArgumentError("d_bias goes with d_weight, for a head with a bias");
  }
  if (absl::Status s = ValidateOutputs(o, out); !s.ok()) return s;
  std::lock_guard<std::mutex> lock(mu_);
  LCE_CUDA_CHECK(cudaSetDevice(config_.device));
  CallPlan p{rows, o, up, out, grads};
  LCE_CUDA_CHECK(ZeroFreshDWeight(p));
  if (rows.rows == 0) return absl::OkStatus();
  LCE_CUDA_CHECK(PlanCall(p));
  Scratch s;
  LCE_CUDA_CHECK(PrepareCall(p, s));
  if (p.ranks.call_thr != nullptr) LCE_CUDA_CHECK(RankThresholdsForCall(p, s));
  for (int64_t r0 = 0; r0 < rows.rows; r0 += p.R) {
    BlockIo b;
    LCE_CUDA_CHECK(StageBlock(p, s, r0, b));
    LCE_CUDA_CHECK(ForwardBlock(p, s, b));  // forward, merge, finalize
    if (p.o.top_k > 0) LCE_CUDA_CHECK(Rank(p, s, b));
    if (!p.backward) {
      if (b.trace) LCE_CUDA_CHECK(TraceForward(p, b));
      continue;
    }
    LCE_CUDA_CHECK(b.fast ? BackwardFast(p, s, b) : BackwardGeneral(p, s, b));  // and copy out
  }
  LCE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (p.host && p.d_bias != nullptr) LCE_CUDA_CHECK(CopyOutBiasGrad(p));
  return absl::OkStatus();
}

absl::Status CudaEngine::Gemm(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k,
                              const void* A, cudaDataType_t at, int64_t lda, const void* B, cudaDataType_t bt,
                              int64_t ldb, float beta, void* C, cudaDataType_t ct, int64_t ldc, bool tf32,
                              bool c_is_scratch, int sm_target, bool rows_in_n, bool cols_in_m,
                              const GemmPlace& place) {
  const float alpha = 1.0f;
  const cublasComputeType_t compute = ComputeType(tf32);
  for (int64_t v : {m, n, k, lda, ldb, ldc}) {
    if (v > INT_MAX) return absl::InvalidArgumentError("GEMM dimension exceeds int32");
  }
  if (!tuning_.gemm_ex) {
    GemmSpec g;
    g.ta = ta;
    g.tb = tb;
    g.m = m;
    g.n = n;
    g.k = k;
    g.a = A;
    g.lda = lda;
    g.b = B;
    g.ldb = ldb;
    g.c = C;
    g.ldc = ldc;
    g.ab_type = at;
    g.c_type = ct;
    g.compute = compute;
    g.beta = beta;
    g.sm_target = sm_target;
    g.n_invariant = rows_in_n && batch_invariant_;
    g.m_invariant = cols_in_m && g.n_invariant && tp_invariant_option_;
    return RunGemm(g, c_is_scratch, place);
  }
  if (place.prepare_only) return absl::OkStatus();
  if (place.stream != nullptr) return absl::InternalError("cublasGemmEx runs on stream_ only");
  LCE_CUDA_CHECK(cublasGemmEx(cublas_, ta, tb, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), &alpha, A,
                              at, static_cast<int>(lda), B, bt, static_cast<int>(ldb), &beta, C, ct,
                              static_cast<int>(ldc), compute, CUBLAS_GEMM_DEFAULT));
  return absl::OkStatus();
}

absl::Status CudaEngine::RunGemm(const GemmSpec& g, bool c_is_scratch, const GemmPlace& place) {
  cudaStream_t stream = place.stream != nullptr ? place.stream : stream_;
  void* ws = place.workspace != nullptr ? place.workspace : cublas_ws_;
  const size_t ws_bytes = static_cast<size_t>(place.workspace_bytes > 0 ? place.workspace_bytes : kCublasWorkspace);
  if (place.prepare_only) return gemm_.Prepare(g, c_is_scratch, tune_scratch_, tune_floats_, ws, ws_bytes, stream);
  return gemm_.Run(g, c_is_scratch, tune_scratch_, tune_floats_, ws, ws_bytes, stream);
}

absl::Status CudaEngine::CheckCall(const RowsView& rows, const LceOptions& o, const Upstream& up) const {
  if (absl::Status s = ValidateOptions(o); !s.ok()) return s;
  if (rows.rows < 0) return absl::InvalidArgumentError("negative row count");
  if (rows.rows > 0 && (rows.hidden == nullptr || rows.targets == nullptr)) {
    return absl::InvalidArgumentError("hidden and targets must be given");
  }
  if (rows.space != MemorySpace::kHost && rows.space != MemorySpace::kDevice) {
    return absl::InvalidArgumentError("unknown memory space");
  }
  if (up.mode != GradMode::kNone && up.mode != GradMode::kLoss && up.mode != GradMode::kGeneric) {
    return absl::InvalidArgumentError("unknown gradient mode");
  }
  return absl::OkStatus();
}

absl::Status CudaEngine::CheckTargets(const RowsView& rows, const LceOptions& o, Scratch& s) {
  const int64_t V = shape_.vocab_size;
  if (rows.space == MemorySpace::kHost) {
    for (int64_t i = 0; i < rows.rows; ++i) {
      const int32_t y = rows.targets[i];
      if (y != o.ignore_index && (y < 0 || y >= V)) return BadTarget(i, y, o);
    }
    return absl::OkStatus();
  }
  LCE_CUDA_CHECK(cudaMemsetAsync(s.bad + 2, 0xff, sizeof(unsigned long long), stream_));
  LCE_CUDA_CHECK(LaunchCheckTargets(rows.targets, rows.rows, V, o.ignore_index, s.bad + 2, stream_));
  return absl::OkStatus();
}

absl::Status CudaEngine::BadTarget(int64_t row, int32_t y, const LceOptions& o) const {
  return absl::InvalidArgumentError(absl::StrCat("row ", row, ": target ", y, " is outside [0, ", shape_.vocab_size,
                                                 ") and is not ignore_index ", o.ignore_index));
}

// Device rows' bad target, found by CheckTargets' kernel (a forward with it was safe: every kernel
// bounds-checks targets).
absl::Status CudaEngine::BadTarget(const RowsView& rows, const LceOptions& o, unsigned long long row) const {
  int32_t y = 0;
  LCE_CUDA_CHECK(cudaMemcpy(&y, rows.targets + row, sizeof(y), cudaMemcpyDeviceToHost));
  return BadTarget(static_cast<int64_t>(row), y, o);
}

bool DeviceAvailable() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return false;
  }
  return count > 0;
}

bool EpilogueStatsAvailable(int device) {
#if defined(LCE_WITH_CUTLASS)
  cudaDeviceProp prop{};
  return DeviceAvailable() && cudaGetDeviceProperties(&prop, device) == cudaSuccess && prop.major == 9 &&
         prop.minor == 0;
#else
  (void)device;
  return false;
#endif
}

absl::StatusOr<EngineWeightOnDevice> WeightOnDevice(LceEngine& engine) {
  auto* cuda = dynamic_cast<CudaEngine*>(&engine);
  if (cuda == nullptr) return absl::InvalidArgumentError("not a CUDA engine");
  return cuda->weight_on_device();
}

absl::StatusOr<std::unique_ptr<LceEngine>> CreateCudaEngine(std::shared_ptr<const HeadWeights> weights,
                                                            const EngineConfig& config) {
  if (weights == nullptr) return absl::InvalidArgumentError("no head weights");
  if (config.collectives != nullptr) {
    const VocabRange want = VocabShard(weights->shape.vocab_size, config.collectives->rank(),
                                       config.collectives->world_size());
    if (want.begin != weights->shape.vocab_begin || want.end != weights->shape.vocab_end()) {
      return absl::InvalidArgumentError(absl::StrCat("head shard [", weights->shape.vocab_begin, ", ",
                                                     weights->shape.vocab_end(), ") does not match rank ",
                                                     config.collectives->rank(), "'s range [", want.begin, ", ",
                                                     want.end, ")"));
    }
  }
  if (!DeviceAvailable()) return absl::FailedPreconditionError("no CUDA device is visible");
  auto engine = std::make_unique<CudaEngine>(std::move(weights), config);
  if (absl::Status s = engine->Init(); !s.ok()) return s;
  return std::unique_ptr<LceEngine>(std::move(engine));
}

}  // namespace lce::cuda

namespace lce {

absl::Status SetCudaTuning(LceEngine& engine, const CudaTuning& tuning) {
  auto* cuda = dynamic_cast<cuda::CudaEngine*>(&engine);
  if (cuda == nullptr) return absl::InvalidArgumentError("not a CUDA engine");
  return cuda->Retune(tuning);
}

}  // namespace lce
