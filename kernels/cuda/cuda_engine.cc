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
//             (aux_, chunk by chunk, each chunk's dW product on stream_ behind it), then ONE GEMM
//             d_hidden = dA[R, V_shard] · W (fp32, all-reduced across ranks, converted).
//             fast loss path (bf16, kLoss, no softcap, no label smoothing): no dA pass at all;
//             dW += qᵀ·(s ⊙ h) − scatter(t ⊙ h) and d_hidden = s ⊙ (q·W) − t ⊙ W[y] (fast_grad.cu); on
//             device rows the two products run at once, d_hidden's on aux_ (FastGradsBeside).
// So a train step costs three GEMMs of N·H·V_shard (the floor) plus elementwise passes.
// Epilogue statistics (bf16, sm_90, built with CUTLASS; LCE_CUDA_EPILOGUE_STATS=0 turns them off): the
// forward is one GEMM over the whole shard whose epilogue writes per-(row, 256-column tile) partials
// and the target logits (epilogue_stats_gemm.cu), folded into the same segment partials: no logit
// tiles, no TileStats. A training call's epilogue also writes the compact copy: exp(z − c_row) (bf16)
// for the fast loss path, c_row from a first pass of the same GEMM over the first kFirstPassCols columns,
// or z − m_tile (fp16), which WriteGrad reads with the tiles' m. Score and training take the same
// GEMM, so a row's logprob is the same bits in both, and in any batch.
#include "cuda/cuda_engine.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "cuda/cuda_check.h"
#include "cuda/gemm.h"
#include "cuda/kernels.h"
#include "tile_tree.h"

namespace lce::cuda {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kCublasWorkspace = 32 * kMiB;
constexpr int64_t kHostDwSlabBytes = 64 * kMiB;
constexpr int64_t kMaxRowsPerBlock = 32768;  // grid.y limit is 65535
constexpr int64_t kWideLogitBytes = int64_t{256} << 20;  // small blocks' logit tiles (WideTile)
// The epilogue GEMM's first pass, whose max sets the fast path's c_row: a row's first 1024 columns, four
// 256-column tiles a 128-row tile, so that a block of up to 4224 rows is one wave on 132 SMs (2048
// columns, two waves at 2816 rows, took 2.7% of the forward for 1.3% of its products). Fixed, not
// chosen by the block: c_row must depend on the row alone.
constexpr int64_t kFirstPassCols = 1024;

// Where a product goes (CudaEngine::Gemm): stream_ and its cuBLAS workspace unless another stream is named,
// with a workspace of its own (two products running at once must not share one); prepare_only chooses
// the algorithm (timing the candidates on first sight) and runs nothing.
struct GemmPlace {
  cudaStream_t stream = nullptr;
  void* workspace = nullptr;
  bool prepare_only = false;
};

int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

int64_t EnvInt(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  return std::strtoll(v, nullptr, 10);
}

cudaDataType_t CudaType(DType d) {
  switch (d) {
    case DType::kBFloat16: return CUDA_R_16BF;
    case DType::kFloat16: return CUDA_R_16F;
    case DType::kFloat32: break;
  }
  return CUDA_R_32F;
}

// Bytes of device memory owned by cudaMalloc / cudaMallocHost.
class DeviceMemory {
 public:
  DeviceMemory() = default;
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  ~DeviceMemory() { Reset(); }
  absl::Status Allocate(int64_t bytes) {
    Reset();
    if (bytes <= 0) return absl::OkStatus();
    LCE_CUDA_CHECK(cudaMalloc(&ptr_, static_cast<size_t>(bytes)));
    bytes_ = bytes;
    return absl::OkStatus();
  }
  void Reset() {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }
  uint8_t* get() const { return static_cast<uint8_t*>(ptr_); }
  int64_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  int64_t bytes_ = 0;
};

class PinnedMemory {
 public:
  PinnedMemory() = default;
  PinnedMemory(const PinnedMemory&) = delete;
  PinnedMemory& operator=(const PinnedMemory&) = delete;
  ~PinnedMemory() { Reset(); }
  absl::Status Ensure(int64_t bytes) {
    if (bytes <= bytes_) return absl::OkStatus();
    Reset();
    LCE_CUDA_CHECK(cudaMallocHost(&ptr_, static_cast<size_t>(bytes)));
    bytes_ = bytes;
    return absl::OkStatus();
  }
  void Reset() {
    if (ptr_ != nullptr) cudaFreeHost(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }
  uint8_t* get() const { return static_cast<uint8_t*>(ptr_); }

 private:
  void* ptr_ = nullptr;
  int64_t bytes_ = 0;
};

// Carves aligned pieces out of one allocation.
class Carver {
 public:
  explicit Carver(uint8_t* base) : base_(base) {}
  template <typename T>
  T* Take(int64_t count) {
    off_ = RoundUp(off_, 256);
    T* p = reinterpret_cast<T*>(base_ == nullptr ? nullptr : base_ + off_);
    off_ += count * static_cast<int64_t>(sizeof(T));
    return p;
  }
  int64_t used() const { return RoundUp(off_, 256); }

 private:
  uint8_t* base_;
  int64_t off_ = 0;
};

// Scratch of one row block of R rows.
struct Scratch {
  void* cublas_ws = nullptr;
  float* logits[2] = {nullptr, nullptr};  // [R, ldz] fp32 logit tiles (double-buffered)
  float* tile_part = nullptr;     // [R, ntile, 4] epilogue-statistics GEMM's per-tile partials (Layout::epi)
  void* store = nullptr;          // [R, lds] compact z − m_seg, then dA (backward only)
  float* part = nullptr;          // [R, nseg, 4]
  float* part_global = nullptr;   // [R, nseg_global, 4] (tensor parallel, tp_invariant_)
  float* zy = nullptr;            // [R] target logits gathered over the ranks (likewise)
  float* packed = nullptr;        // [R, 4]
  float* m_local = nullptr;       // [R]
  float* m = nullptr;             // [R]
  float* info = nullptr;          // [R, kRowInfo]
  float* dh = nullptr;            // [R, H] fp32 (backward only; may alias the logit tiles)
  float* tree = nullptr;          // [TreeSlots(), R, H] fp32: d_hidden's tile tree (tree_dh_)
  float* tree_gathered = nullptr; // [GatheredNodes(), R, H] fp32: every rank's subtrees (tree_dh_, TP)
  // [3]: the first non-finite row; [1] the overflow flag (float bits); [2] the first bad target (device rows)
  unsigned long long* bad = nullptr;
  float* row_c = nullptr;         // [R] fast path: c_row
  void* h_scaled = nullptr;       // [R, H] bf16, fast path with d_weight
  void* target_order = nullptr;   // the target scatter's sort (TargetOrderBytes(R)), fast path with d_weight
  int64_t target_order_bytes = 0;
  void* side_ws = nullptr;        // cuBLAS workspace of d_hidden's product on aux_ (Layout::side)
  // kHost staging on the device.
  void* hidden = nullptr;         // [R, H] head dtype
  int32_t* targets = nullptr;     // [R]
  float* up[3] = {nullptr, nullptr, nullptr};   // grad_loss, grad_logprob, grad_entropy [R]
  float* out[4] = {nullptr, nullptr, nullptr, nullptr};  // logprob, entropy, lse, loss [R]
  void* d_hidden = nullptr;       // [R, H] head dtype
  float* dw_slab = nullptr;       // [slab_rows, H] fp32 (kHost with d_weight)
};

struct Layout {
  bool backward = false;
  bool host = false;
  bool host_dw = false;
  bool fast = false;  // fast loss path with d_weight: needs the scaled copy of h
  bool target_dw = false;  // the general path's target term scattered into d_weight (target_order scratch)
  bool tree = false;  // d_hidden over the canonical tile tree (tree_dh_)
  int64_t tile = 0;   // logit tile columns (0: the engine's default, tile_)
  bool epi = false;   // forward through the epilogue-statistics GEMM: no logit tiles
  bool stage = false; // device rows not 16-byte aligned, copied to s.hidden for the epilogue GEMM's TMA
  bool side = false;  // fast path, device rows: d_hidden's product on aux_ beside dW's (FastGradsBeside)
};

class CudaEngine final : public LceEngine {
 public:
  CudaEngine(std::shared_ptr<const HeadWeights> weights, const EngineConfig& config)
      : weights_(std::move(weights)), shape_(weights_->shape), config_(config) {}

  ~CudaEngine() override {
    cudaSetDevice(config_.device);
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    workspace_.Reset();
    weight_.Reset();
    bias_.Reset();
    if (cublas_ != nullptr) cublasDestroy(cublas_);
    for (cudaEvent_t e : events_) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    for (cudaEvent_t e : trace_) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    if (aux_ != nullptr) cudaStreamDestroy(aux_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  absl::Status Init() {
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
    LCE_CUDA_CHECK(cublasCreate(&cublas_));
    LCE_CUDA_CHECK(cublasSetStream(cublas_, stream_));
    LCE_CUDA_CHECK(cublasSetPointerMode(cublas_, CUBLAS_POINTER_MODE_HOST));
    LCE_CUDA_CHECK(gemm_.Init());
    LCE_CUDA_CHECK(weight_.Allocate(static_cast<int64_t>(weights_->weight.size())));
    LCE_CUDA_CHECK(cudaMemcpy(weight_.get(), weights_->weight.data(), weights_->weight.size(),
                              cudaMemcpyHostToDevice));
    if (shape_.has_bias) {
      LCE_CUDA_CHECK(bias_.Allocate(static_cast<int64_t>(weights_->bias.size() * sizeof(float))));
      LCE_CUDA_CHECK(cudaMemcpy(bias_.get(), weights_->bias.data(), weights_->bias.size() * sizeof(float),
                                cudaMemcpyHostToDevice));
    }
    // A copy from pageable memory may return before its DMA lands, and the engine's streams are
    // non-blocking (no implicit order with these copies): wait for the weights here.
    LCE_CUDA_CHECK(cudaDeviceSynchronize());
    cudaDeviceProp prop{};
    LCE_CUDA_CHECK(cudaGetDeviceProperties(&prop, config_.device));
    // Forward logit GEMMs leave this many multiprocessors to the tile reductions on aux_.
    const int64_t spare = std::clamp<int64_t>(EnvInt("LCE_CUDA_STATS_SMS", 0), 0, prop.multiProcessorCount / 2);
    fwd_sm_target_ = spare > 0 ? prop.multiProcessorCount - static_cast<int>(spare) : 0;
    batch_invariant_ = EnvInt("LCE_CUDA_BATCH_INVARIANT", config_.batch_invariant ? 1 : 0) != 0;
    tp_invariant_option_ = batch_invariant_ && EnvInt("LCE_CUDA_TP_INVARIANT", config_.tp_invariant ? 1 : 0) != 0;
    tile_ = RoundUp(std::max<int64_t>(EnvInt("LCE_CUDA_VOCAB_TILE", 8192), kSegment), kSegment);
    tile_ = std::min(tile_, RoundUp(shape_.shard_rows, kSegment));
    lds_ = RoundUp(shape_.shard_rows, 8);
    nseg_ = (shape_.shard_rows + kSegment - 1) / kSegment;
    // Segments at fixed global offsets (VocabTile(V) == kSegment: V >= 131072, and shards of whole
    // tiles): a group folds every segment in global order, as one GPU does (docs/MATH.md).
    nseg_global_ = (shape_.vocab_size + kSegment - 1) / kSegment;
    tp_invariant_ = config_.collectives != nullptr && tp_invariant_option_ && SegmentsAreGlobal();
    epi_capable_ = prop.major == 9 && prop.minor == 0;
    epi_config_ = static_cast<int>(EnvInt("LCE_CUDA_EPI_KERNEL", -1));
    tree_dh_ = tp_invariant_option_ && SegmentsAreGlobal();
    // The smallest block must fit the budget.
    if (Bytes({true, true, true, true, true, tree_dh_}, 1) > config_.workspace_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("workspace_bytes ", config_.workspace_bytes,
                                                     " is too small for one row of this head (needs ",
                                                     Bytes({true, true, true, true, true, tree_dh_}, 1), ")"));
    }
    return absl::OkStatus();
  }

  std::string_view backend() const override { return "cuda"; }
  // Per-row statistics come from fixed vocabulary tiles and segments whatever N; with batch-invariant
  // GEMMs (EngineConfig::batch_invariant) the logit and d_hidden products use one algorithm without
  // split-K for every row count (docs/MATH.md). Without, cuBLAS's tuned choice varies with N.
  EngineInvariance invariance() const override {
    // The epilogue GEMM's forward is batch invariant by construction; d_hidden's product is only with
    // batch-invariant GEMMs.
    if (!batch_invariant_) return UseEpilogueStats() ? EngineInvariance{{"logprob", "entropy", "lse", "loss"}, {}}
                                                     : EngineInvariance{};
    EngineInvariance inv{{"logprob", "entropy", "lse", "loss", "d_hidden"}, {}};
    if (tree_dh_) inv.across_tp_sizes = {"logprob", "entropy", "lse", "loss", "d_hidden"};
    return inv;
  }
  bool SegmentsAreGlobal() const {
    return VocabTile(shape_.vocab_size) == kSegment && shape_.vocab_begin % kSegment == 0;
  }
  const HeadShape& shape() const override { return shape_; }
  EngineWeightOnDevice weight_on_device() const { return {weight_.get(), config_.device}; }

  absl::Status Compute(const RowsView& rows, const LceOptions& options, const Upstream& upstream,
                       const RowOutputs& outputs, const GradOutputs& grads) override;

 private:
  // Lays out the scratch of R rows (base null: only counts); returns the bytes.
  int64_t Carve(const Layout& l, int64_t R, uint8_t* base, Scratch* s) const {
    const int64_t H = shape_.hidden_size;
    const int64_t esz = DTypeSize(shape_.dtype);
    Carver c(base);
    s->cublas_ws = c.Take<uint8_t>(kCublasWorkspace);
    const int64_t ldz = Ldz(l);
    if (l.epi) {
      s->tile_part = c.Take<float>(R * EpiTiles() * 4);
    } else {
      s->logits[0] = c.Take<float>(2 * R * ldz);
      s->logits[1] = s->logits[0] == nullptr ? nullptr : s->logits[0] + R * ldz;
    }
    s->part = c.Take<float>(R * nseg_ * 4);
    if (tp_invariant_) {
      s->part_global = c.Take<float>(R * nseg_global_ * 4);
      s->zy = c.Take<float>(R);
    }
    s->packed = c.Take<float>(R * kPacked);
    s->m_local = c.Take<float>(R);
    s->m = c.Take<float>(R);
    s->info = c.Take<float>(R * kRowInfo);
    s->bad = c.Take<unsigned long long>(3);
    s->row_c = c.Take<float>(R);
    if (l.fast) s->h_scaled = c.Take<uint8_t>(R * H * 2);
    if (l.fast || l.target_dw) {
      s->target_order_bytes = TargetOrderBytes(R);
      s->target_order = c.Take<uint8_t>(s->target_order_bytes);
    }
    if (l.side) s->side_ws = c.Take<uint8_t>(kCublasWorkspace);
    if (l.backward) {
      s->store = c.Take<uint8_t>(R * lds_ * (shape_.dtype == DType::kFloat32 ? 4 : 2));
      // d_hidden's fp32 accumulator reuses the logit tiles (free by then) where it fits.
      s->dh = !l.epi && H <= 2 * ldz ? s->logits[0] : c.Take<float>(R * H);
    }
    if (l.backward && l.tree) {
      s->tree = c.Take<float>(TreeSlots() * R * H);
      if (config_.collectives != nullptr) s->tree_gathered = c.Take<float>(GatheredNodes() * R * H);
    }
    if (l.host || l.stage) s->hidden = c.Take<uint8_t>(R * H * esz);
    if (l.host) {
      s->targets = c.Take<int32_t>(R);
      for (float*& p : s->up) p = c.Take<float>(R);
      for (float*& p : s->out) p = c.Take<float>(R);
      if (l.backward) s->d_hidden = c.Take<uint8_t>(R * H * esz);
    }
    if (l.host_dw) s->dw_slab = c.Take<float>(DwSlabRows() * H);
    return c.used();
  }
  int64_t TileOf(const Layout& l) const { return l.tile > 0 ? l.tile : tile_; }
  // The epilogue-statistics GEMM's column tiles over the shard (epilogue_stats_gemm.cu).
  int64_t EpiTiles() const {
    const int64_t cols = EpiTileCols();
    return cols > 0 ? (shape_.shard_rows + cols - 1) / cols : 0;
  }
  int EpiTileCols() const {
#if defined(LCE_WITH_CUTLASS)
    return EpilogueStatsTileCols(epi_config_);
#else
    return 0;
#endif
  }
  // Whether calls' forwards run through the epilogue-statistics GEMM (on unless LCE_CUDA_EPILOGUE_STATS=0):
  // a bf16 head on an sm_90 device, hidden a multiple of 8 (rows not 16-byte aligned are staged).
  bool UseEpilogueStats() const {
#if defined(LCE_WITH_CUTLASS)
    return epi_capable_ && EnvInt("LCE_CUDA_EPILOGUE_STATS", 1) != 0 && shape_.dtype == DType::kBFloat16 &&
           shape_.hidden_size % 8 == 0;
#else
    return false;
#endif
  }
  int64_t Ldz(const Layout& l) const { return RoundUp(std::min(TileOf(l), shape_.shard_rows), 4); }
  // Logit tile columns for blocks of R rows: the default for large blocks; for a few rows as many as
  // kWideLogitBytes of double-buffered fp32 logits hold, up to the whole shard. A GEMM of 8192
  // vocabulary rows by a handful of batch rows keeps too few SMs streaming W; one over the whole
  // shard reads W at near HBM speed (bench/RESULTS.md: 1-64 rows, 0.60 -> 0.48-0.54 ms at V=151936).
  int64_t WideTile(int64_t R) const {
    const int64_t fits = kWideLogitBytes / (2 * static_cast<int64_t>(sizeof(float)) * R) / kSegment * kSegment;
    return std::min(RoundUp(shape_.shard_rows, kSegment), std::max(tile_, fits));
  }
  int64_t Bytes(const Layout& l, int64_t R) const {
    Scratch s;
    return Carve(l, R, nullptr, &s);
  }
  int64_t StoreBytes() const { return shape_.dtype == DType::kFloat32 ? 4 : 2; }
  int64_t DwSlabRows() const {
    return std::clamp<int64_t>(kHostDwSlabBytes / (shape_.hidden_size * 4), 1, shape_.shard_rows);
  }
  // Largest R that fits the budget (at least 1: Init checked), at most `want`.
  int64_t RowsPerBlock(const Layout& l, int64_t want) const {
    int64_t lo = 1, hi = std::min<int64_t>(want, kMaxRowsPerBlock);
    if (const int64_t cap = EnvInt("LCE_CUDA_MAX_ROWS", 0); cap > 0) hi = std::min(hi, cap);
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (Bytes(l, mid) <= config_.workspace_bytes) lo = mid; else hi = mid - 1;
    }
    return lo;
  }

  // C (fp32, column-major) = op(A)·op(B) + beta·C. Through cuBLASLt with a tuned algorithm (GemmRunner;
  // c_is_scratch says C may be overwritten while tuning), cublasGemmEx when LCE_CUDA_GEMMEX=1.
  absl::Status Gemm(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, const void* A,
                    cudaDataType_t at, int64_t lda, const void* B, cudaDataType_t bt, int64_t ldb, float beta,
                    void* C, cudaDataType_t ct, int64_t ldc, bool tf32, bool c_is_scratch = false,
                    int sm_target = 0, bool rows_in_n = false, bool cols_in_m = false, const GemmPlace& place = {}) {
    const float alpha = 1.0f;
    const cublasComputeType_t compute =
        shape_.dtype == DType::kFloat32 ? (tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F)
                                        : CUBLAS_COMPUTE_32F;
    for (int64_t v : {m, n, k, lda, ldb, ldc}) {
      if (v > INT_MAX) return absl::InvalidArgumentError("GEMM dimension exceeds int32");
    }
    if (EnvInt("LCE_CUDA_GEMMEX", 0) == 0) {
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
      cudaStream_t stream = place.stream != nullptr ? place.stream : stream_;
      void* ws = place.workspace != nullptr ? place.workspace : cublas_ws_;
      if (place.prepare_only) {
        return gemm_.Prepare(g, c_is_scratch, tune_scratch_, tune_floats_, ws, kCublasWorkspace, stream);
      }
      return gemm_.Run(g, c_is_scratch, tune_scratch_, tune_floats_, ws, kCublasWorkspace, stream);
    }
    if (place.prepare_only) return absl::OkStatus();
    if (place.stream != nullptr) return absl::InternalError("cublasGemmEx runs on stream_ only");
    LCE_CUDA_CHECK(cublasGemmEx(cublas_, ta, tb, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
                                &alpha, A, at, static_cast<int>(lda), B, bt, static_cast<int>(ldb), &beta, C, ct,
                                static_cast<int>(ldc), compute, CUBLAS_GEMM_DEFAULT));
    return absl::OkStatus();
  }

  absl::Status CheckCall(const RowsView& rows, const LceOptions& o, const Upstream& up) const;
  // The forward of a row block through the epilogue-statistics GEMM: segment partials into s.part and
  // target logits into s.packed, as the logit tiles and TileStats leave them; for a backward, the compact
  // copy into s.store (kExp: c_row into s.row_c, the overflow flag as TileStats raises it).
  enum class EpiCopy { kNone, kShifted, kExp };
  absl::Status EpilogueStatsForward(Scratch& s, const void* h, int64_t nr, const int32_t* y, int32_t ignore_index,
                                    const LogitTransform& tf, EpiCopy copy, bool entropy, unsigned* overflow);
  // Host rows: checked here. Device rows: a kernel writes the first bad row into s.bad[2], read with the
  // first block's flags (BadTarget), before anything touches d_weight: no synchronization of its own.
  absl::Status CheckTargets(const RowsView& rows, const LceOptions& o, Scratch& s);
  // The error of row `row`, whose target is y (host rows) or is read from device rows.
  absl::Status BadTarget(int64_t row, int32_t y, const LceOptions& o) const;
  absl::Status BadTarget(const RowsView& rows, const LceOptions& o, unsigned long long row) const;

  // d_hidden's tile tree (tree_dh_): the node slots a block needs (a stack of subtrees over the
  // shard's tiles, and temporaries of the final sum), and the subtrees of every rank together.
  int64_t TreeSlots() const {
    int depth = 0;
    while ((int64_t{1} << depth) < VocabTileCount(shape_.vocab_size)) ++depth;
    return 2 * (depth + 2);
  }
  int64_t GatheredNodes() const;
  absl::Status DHiddenByTiles(Scratch& s, int64_t nr, const uint8_t* w, bool tf32);
  // The fast loss path's d_hidden before its all-reduce: s.dh = s ⊙ (q · W) − t ⊙ W[y], on place's stream.
  absl::Status FastDHidden(Scratch& s, int64_t nr, const int32_t* y, int32_t ignore_index, bool tf32,
                           const GemmPlace& place);
  absl::Status FastGradsBeside(Scratch& s, const void* h, int64_t nr, const int32_t* y, int32_t ignore_index,
                               float* d_weight, float dw_beta, bool tf32, bool trace);

  std::shared_ptr<const HeadWeights> weights_;
  HeadShape shape_;
  EngineConfig config_;
  // stream_ runs the GEMMs (cuBLAS is bound to it) and the per-row kernels; aux_ runs the elementwise
  // tile kernels so that they overlap the next GEMM, and the fast path's d_hidden product beside dW's.
  cudaStream_t stream_ = nullptr, aux_ = nullptr;
  enum { kEvGemm0, kEvGemm1, kEvStats0, kEvStats1, kEvHandoff, kEvDHidden, kNumEvents };
  cudaEvent_t events_[kNumEvents] = {};
  cudaEvent_t trace_[8] = {};  // LCE_CUDA_TRACE=1: phase timings of the first row block, to stderr
  cublasHandle_t cublas_ = nullptr;
  GemmRunner gemm_;
  float* tune_scratch_ = nullptr;  // the logit tiles, free during the backward: where GEMMs are tuned
  int64_t tune_floats_ = 0;
  void* cublas_ws_ = nullptr;
  DeviceMemory weight_, bias_, workspace_;
  PinnedMemory pinned_;
  int64_t tile_ = 0, lds_ = 0, nseg_ = 0;
  bool batch_invariant_ = false;  // one GEMM algorithm for every row count (GemmSpec::n_invariant)
  // EngineConfig::tp_invariant: one logit GEMM algorithm for every tile length too, and under TP the
  // forward's statistics gathered and folded in global segment order, so that groups of any size
  // give one GPU's bits.
  bool tp_invariant_option_ = false;
  bool tp_invariant_ = false;
  // d_hidden as the canonical tree over the head's tiles (tp_invariant with global segments): the
  // same additions in the same order on one GPU and on any group (DHiddenByTiles).
  bool tree_dh_ = false;
  int64_t nseg_global_ = 0;
  int fwd_sm_target_ = 0;
  bool epi_capable_ = false;  // an sm_90 device: the epilogue-statistics GEMM can run
  int epi_config_ = -1;       // its kernel configuration (EpilogueStatsArgs::config), fixed per engine
  std::mutex mu_;
};

absl::Status CudaEngine::CheckCall(const RowsView& rows, const LceOptions& o, const Upstream& up) const {
  if (absl::Status s = ValidateOptions(o); !s.ok()) return s;
  // Rankings, class weights and the z-loss output are the CPU engine's so far (docs/API.md).
  if (o.top_k > 0 || rows.class_weight != nullptr) {
    return absl::UnimplementedError("argmax / top-k rankings and class weights are not on the CUDA engine yet");
  }
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

absl::Status CudaEngine::Compute(const RowsView& rows, const LceOptions& o, const Upstream& up,
                                 const RowOutputs& out, const GradOutputs& grads) {
  if (absl::Status s = CheckCall(rows, o, up); !s.ok()) return s;
  std::lock_guard<std::mutex> lock(mu_);
  LCE_CUDA_CHECK(cudaSetDevice(config_.device));
  // A fresh d_weight (GradOutputs::d_weight_fresh) is written by the first row block's dW products
  // (beta 0); where no device product covers it (no rows, no backward, host d_weight's slabs), it is
  // zeroed first.
  const bool dw_fresh_in = grads.d_weight != nullptr && grads.d_weight_fresh;
  const bool dw_products = rows.rows > 0 && up.mode != GradMode::kNone && rows.space == MemorySpace::kDevice;
  if (dw_fresh_in && !dw_products) {
    const size_t dw_bytes = static_cast<size_t>(shape_.shard_rows * shape_.hidden_size) * sizeof(float);
    if (rows.space == MemorySpace::kHost) {
      std::memset(grads.d_weight, 0, dw_bytes);
    } else {
      LCE_CUDA_CHECK(cudaMemsetAsync(grads.d_weight, 0, dw_bytes, stream_));
      LCE_CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
  }
  const bool dw_fresh = dw_fresh_in && dw_products;
  if (rows.rows == 0) return absl::OkStatus();

  const int64_t N = rows.rows;
  const int64_t H = shape_.hidden_size;
  const int64_t Vs = shape_.shard_rows;
  const int64_t esz = DTypeSize(shape_.dtype);
  const int64_t sesz = StoreBytes();
  const bool host = rows.space == MemorySpace::kHost;
  const bool want_grad = up.mode != GradMode::kNone;
  const bool backward = want_grad && (grads.d_hidden != nullptr || grads.d_weight != nullptr);
  const bool tp = config_.collectives != nullptr;
  const bool fp32 = shape_.dtype == DType::kFloat32;
  const bool tf32 = o.allow_tf32;
  // The epilogue GEMM's Q (the entropy's statistic), where the call uses it. A group's ranks always compute
  // it: only rank 0 sees the call's outputs, and their partials are merged.
  const bool entropy = tp || out.entropy != nullptr || (up.mode == GradMode::kGeneric && up.grad_entropy != nullptr);
  const cudaDataType_t dt = CudaType(shape_.dtype);
  const bool epi = UseEpilogueStats();
  // Fast loss path (fast_grad.cu): no dA pass; the per-row factors go around the GEMMs. Host rows take
  // it as device rows do (host d_weight through the device in slabs, as on the general path), so that
  // a row's d_hidden is the same computation whatever memory its hidden state came from (README.md,
  // Guarantees). The general path rounded dL/da, the target's −C included, to bf16 before its GEMM:
  // CudaTest.HundredThousandRows' host rows took it and were 0.0169 from float64 per value (H200); the
  // fast path gives 0.0081, bf16 rounding of the exact d_hidden alone 0.0039 (a CPU replica of these
  // kernels' arithmetic, which gives the H200's 0.0168526 to the digit).
  const bool fast = backward && shape_.dtype == DType::kBFloat16 && up.mode == GradMode::kLoss &&
                    o.softcap == 0.0f && o.label_smoothing == 0.0f && !tree_dh_ &&
                    EnvInt("LCE_CUDA_NO_FAST", 0) == 0;
  // So the general path of a bf16 head keeps its target term apart too: out of the bf16 dL/da, added in
  // fp32 to d_hidden (before a group's all-reduce) and scattered into d_weight in a fixed order, as the fast
  // path's (RowInfoSlot). Not with d_hidden over the tile tree, whose canonical sum has no place for it.
  // LCE_CUDA_TARGET_APART=0: in the copy (the way before; for comparison).
  const bool target_apart = backward && shape_.dtype == DType::kBFloat16 && !tree_dh_ &&
                            EnvInt("LCE_CUDA_TARGET_APART", 1) != 0;
  Layout layout{backward, host, host && backward && grads.d_weight != nullptr,
                fast && grads.d_weight != nullptr, target_apart && grads.d_weight != nullptr, tree_dh_};
  layout.epi = epi;
  layout.stage = epi && !host && reinterpret_cast<uintptr_t>(rows.hidden) % 16 != 0;
  // LCE_CUDA_DH_BESIDE=0: one after the other (bench/NOTES.md, e10). dW is the same bits either way: the
  // target scatter's order is fixed (LaunchScatterTargetDW), not the GPU's schedule.
  layout.side = fast && !host && grads.d_weight != nullptr && grads.d_hidden != nullptr &&
                EnvInt("LCE_CUDA_DH_BESIDE", 1) != 0 && EnvInt("LCE_CUDA_GEMMEX", 0) == 0;

  // Row blocks of near-equal size, a multiple of 128 rows where that fits (whole GEMM tiles).
  const int64_t r_max = RowsPerBlock(layout, N);
  const int64_t nblocks = (N + r_max - 1) / r_max;
  int64_t R = (N + nblocks - 1) / nblocks;
  if (nblocks > 1 && RoundUp(R, 128) <= r_max) R = RoundUp(R, 128);
  // Small blocks take wider logit tiles (WideTile). Not with batch-invariant GEMMs, whose algorithm
  // is chosen per tile length: a row's logits would then change with the row count.
  if (!batch_invariant_ && !layout.epi) {
    Layout wide = layout;
    wide.tile = WideTile(R);
    if (wide.tile > tile_ && Bytes(wide, R) <= config_.workspace_bytes) layout = wide;
  }
  const int64_t tile = TileOf(layout), ldz = Ldz(layout);
  // Timing aid only (results are wrong), bits: 1 skips TileStats, 2 WriteGrad, 4 the epilogue GEMM's epilogue.
  const int64_t debug_skip = EnvInt("LCE_CUDA_DEBUG_SKIP", 0);
  const int64_t need = Bytes(layout, R);
  if (workspace_.bytes() < need) {
    LCE_CUDA_CHECK(cudaStreamSynchronize(stream_));
    LCE_CUDA_CHECK(workspace_.Allocate(need));
  }
  Scratch s;
  Carve(layout, R, workspace_.get(), &s);
  LCE_CUDA_CHECK(cublasSetWorkspace(cublas_, s.cublas_ws, kCublasWorkspace));
  cublas_ws_ = s.cublas_ws;
  // GEMMs are tuned on scratch free while they run: the logit tiles, or d_hidden's accumulator (written
  // only after the dW products) where the epilogue GEMM left no tiles.
  tune_scratch_ = layout.epi ? s.dh : s.logits[0];
  tune_floats_ = layout.epi ? (s.dh != nullptr ? R * H : 0) : 2 * R * ldz;
  const int64_t bad_off = RoundUp(R * H * esz, 64);  // s.bad's 3 × u64 after the staging
  if (host) LCE_CUDA_CHECK(pinned_.Ensure(bad_off + 64));
  unsigned long long* bad_host = nullptr;
  if (host) bad_host = reinterpret_cast<unsigned long long*>(pinned_.get() + bad_off);

  const bool targets_pending = !rows.targets_checked && !host;  // device rows: read with block 0's flags
  if (!rows.targets_checked) {
    if (absl::Status st = CheckTargets(rows, o, s); !st.ok()) return st;
  }

  const LogitTransform tf{shape_.has_bias ? reinterpret_cast<const float*>(bias_.get()) : nullptr, o.softcap,
                          o.temperature};
  const uint8_t* w = weight_.get();
  // Host d_weight, slab by slab through the device: host += a[nr, slab]ᵀ · x, with x = h and a = dA
  // (general path), or x = s ⊙ h and a = q, then the target rows −= t ⊙ h (fast path).
  auto host_dw_slabs = [&](const void* x, const void* h_rows, const int32_t* y_rows, int64_t nr,
                           bool fast_targets) -> absl::Status {
    const int64_t slab = DwSlabRows();
    for (int64_t v0 = 0; v0 < Vs; v0 += slab) {
      const int64_t nv = std::min(slab, Vs - v0);
      float* host_dw = grads.d_weight + v0 * H;
      LCE_CUDA_CHECK(cudaMemcpyAsync(s.dw_slab, host_dw, nv * H * sizeof(float), cudaMemcpyHostToDevice, stream_));
      LCE_CUDA_CHECK(Gemm(CUBLAS_OP_N, CUBLAS_OP_T, H, nv, nr, x, dt, H, static_cast<uint8_t*>(s.store) + v0 * sesz,
                          dt, lds_, 1.0f, s.dw_slab, CUDA_R_32F, H, tf32));
      if (fast_targets) {
        LCE_CUDA_CHECK(LaunchScatterTargetDW(s.dw_slab, nr, H, s.info, h_rows, y_rows, o.ignore_index,
                                             shape_.vocab_begin + v0, nv, s.target_order, s.target_order_bytes,
                                             stream_));
      }
      LCE_CUDA_CHECK(cudaMemcpyAsync(host_dw, s.dw_slab, nv * H * sizeof(float), cudaMemcpyDeviceToHost, stream_));
      LCE_CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
    return absl::OkStatus();
  };
  for (int64_t r0 = 0; r0 < N; r0 += R) {
    const int64_t nr = std::min(R, N - r0);
    const float dw_beta = dw_fresh && r0 == 0 ? 0.0f : 1.0f;  // the first block writes a fresh d_weight
    // Inputs of this block, on the device.
    const void* h = static_cast<const uint8_t*>(rows.hidden) + r0 * H * esz;
    const int32_t* y = rows.targets + r0;
    const float* gl = up.grad_loss != nullptr ? up.grad_loss + r0 : nullptr;
    const float* glp = up.grad_logprob != nullptr ? up.grad_logprob + r0 : nullptr;
    const float* ge = up.grad_entropy != nullptr ? up.grad_entropy + r0 : nullptr;
    float* o_logprob = out.logprob != nullptr ? out.logprob + r0 : nullptr;
    float* o_entropy = out.entropy != nullptr ? out.entropy + r0 : nullptr;
    float* o_lse = out.lse != nullptr ? out.lse + r0 : nullptr;
    float* o_loss = out.loss != nullptr ? out.loss + r0 : nullptr;
    if (host) {
      // Pinned staging for the bulk input; the small per-row arrays go straight.
      std::memcpy(pinned_.get(), h, static_cast<size_t>(nr * H * esz));
      LCE_CUDA_CHECK(cudaMemcpyAsync(s.hidden, pinned_.get(), nr * H * esz, cudaMemcpyHostToDevice, stream_));
      LCE_CUDA_CHECK(cudaMemcpyAsync(s.targets, y, nr * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
      const float* srcs[3] = {gl, glp, ge};
      const float** dsts[3] = {&gl, &glp, &ge};
      for (int k = 0; k < 3; ++k) {
        if (srcs[k] == nullptr) continue;
        LCE_CUDA_CHECK(cudaMemcpyAsync(s.up[k], srcs[k], nr * sizeof(float), cudaMemcpyHostToDevice, stream_));
        *dsts[k] = s.up[k];
      }
      h = s.hidden;
      y = s.targets;
      o_logprob = o_logprob != nullptr ? s.out[0] : nullptr;
      o_entropy = o_entropy != nullptr ? s.out[1] : nullptr;
      o_lse = o_lse != nullptr ? s.out[2] : nullptr;
      o_loss = o_loss != nullptr ? s.out[3] : nullptr;
    } else if (layout.stage) {
      LCE_CUDA_CHECK(cudaMemcpyAsync(s.hidden, h, nr * H * esz, cudaMemcpyDeviceToDevice, stream_));
      h = s.hidden;
    }

    // Forward: logit tiles -> segment partials (+ compact copy for the backward). The fast path
    // runs it again on the general path if exp(z − c_row) could overflow (extreme logit spread).
    const bool trace = r0 == 0 && EnvInt("LCE_CUDA_TRACE", 0) != 0;
    bool block_fast = fast;
   forward:
    const StoreMode mode = block_fast ? StoreMode::kExpBf16 : fp32 ? StoreMode::kShiftedFloat : StoreMode::kShiftedHalf;
    if (trace) LCE_CUDA_CHECK(cudaEventRecord(trace_[0], stream_));
    LCE_CUDA_CHECK(cudaMemsetAsync(s.packed, 0, nr * kPacked * sizeof(float), stream_));
    LCE_CUDA_CHECK(cudaMemsetAsync(s.bad + 1, 0, sizeof(unsigned long long), stream_));
    unsigned* overflow = reinterpret_cast<unsigned*>(s.bad + 1);
    if (layout.epi) {
      const EpiCopy copy = !backward ? EpiCopy::kNone : block_fast ? EpiCopy::kExp : EpiCopy::kShifted;
      if (absl::Status st = EpilogueStatsForward(s, h, nr, y, o.ignore_index, tf, copy, entropy, overflow); !st.ok()) {
        return st;
      }
    }
    // GEMM of tile t on stream_ overlaps TileStats of tile t−1 on aux_; two logit buffers.
    int64_t t = 0;
    for (int64_t v0 = layout.epi ? Vs : 0; v0 < Vs; v0 += tile, ++t) {
      const int64_t nv = std::min(tile, Vs - v0);
      const int b = static_cast<int>(t % 2);
      if (t >= 2) LCE_CUDA_CHECK(cudaStreamWaitEvent(stream_, events_[kEvStats0 + b], 0));
      // logits[nr, nv] = h[nr, H] · W[v0:v0+nv, H]ᵀ   (column-major: [nv, nr] = Wᵀ · h): whole
      // segments through one algorithm for every m and n, a ragged last segment (the head's own, the
      // same for every group size) apart, so that a logit's bits depend on neither the row count nor
      // where its tile starts.
      const int64_t whole = nv / kSegment * kSegment;
      if (whole > 0) {
        LCE_CUDA_CHECK(Gemm(CUBLAS_OP_T, CUBLAS_OP_N, whole, nr, H, w + v0 * H * esz, dt, H, h, dt, H, 0.0f,
                            s.logits[b], CUDA_R_32F, ldz, tf32, /*c_is_scratch=*/true, fwd_sm_target_,
                            /*rows_in_n=*/true, /*cols_in_m=*/true));
      }
      if (whole < nv) {
        LCE_CUDA_CHECK(Gemm(CUBLAS_OP_T, CUBLAS_OP_N, nv - whole, nr, H, w + (v0 + whole) * H * esz, dt, H, h, dt,
                            H, 0.0f, s.logits[b] + whole, CUDA_R_32F, ldz, tf32, /*c_is_scratch=*/true,
                            fwd_sm_target_, /*rows_in_n=*/true));
      }
      LCE_CUDA_CHECK(cudaEventRecord(events_[kEvGemm0 + b], stream_));
      LCE_CUDA_CHECK(cudaStreamWaitEvent(aux_, events_[kEvGemm0 + b], 0));
      if (!(debug_skip & 1)) {
        // The fast path's first segment sets c_row before the rest of the shard is stored.
        const int64_t first = (block_fast && v0 == 0) ? std::min<int64_t>(nv, kSegment) : nv;
        LCE_CUDA_CHECK(LaunchTileStats(s.logits[b], ldz, nr, v0, first, tf, y, o.ignore_index, shape_.vocab_begin,
                                       s.part, nseg_, s.packed, backward ? s.store : nullptr, lds_, mode, s.row_c,
                                       overflow, aux_));
        if (first < nv) {
          LCE_CUDA_CHECK(LaunchTileStats(s.logits[b] + first, ldz, nr, v0 + first, nv - first, tf, y, o.ignore_index,
                                         shape_.vocab_begin, s.part, nseg_, s.packed, s.store, lds_, mode, s.row_c,
                                         overflow, aux_));
        }
      }
      LCE_CUDA_CHECK(cudaEventRecord(events_[kEvStats0 + b], aux_));
    }
    LCE_CUDA_CHECK(cudaEventRecord(events_[kEvHandoff], aux_));
    LCE_CUDA_CHECK(cudaStreamWaitEvent(stream_, events_[kEvHandoff], 0));
    if (trace) LCE_CUDA_CHECK(cudaEventRecord(trace_[1], stream_));
    if (tp) {
      // Every rank takes part (and retries together), whatever path it is on.
      LCE_CUDA_CHECK(config_.collectives->AllReduce(reinterpret_cast<float*>(overflow), 1, ReduceOp::kMax, true,
                                                    stream_));
    }
    if (tp && tp_invariant_) {
      // Every rank gathers every segment's partials and folds them in global order, as one GPU does.
      LCE_CUDA_CHECK(LaunchSpreadPartials(s.part, nseg_, shape_.vocab_begin / kSegment, s.packed, y, o.ignore_index,
                                          shape_.vocab_begin, shape_.vocab_end(), nr, s.part_global, nseg_global_,
                                          s.zy, stream_));
      LCE_CUDA_CHECK(config_.collectives->AllReduce(s.part_global, nr * nseg_global_ * 4, ReduceOp::kMax, true,
                                                    stream_));
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
    FinalizeArgs fa;
    fa.rows = nr;
    fa.targets = y;
    fa.ignore_index = o.ignore_index;
    fa.vocab_size = shape_.vocab_size;
    fa.label_smoothing = o.label_smoothing;
    fa.z_loss = o.z_loss;
    fa.grad = !backward ? GradKind::kNone : up.mode == GradMode::kLoss ? GradKind::kLoss : GradKind::kGeneric;
    fa.grad_loss = gl;
    fa.grad_logprob = glp;
    fa.grad_entropy = ge;
    fa.lse = o_lse;
    fa.logprob = o_logprob;
    fa.entropy = o_entropy;
    fa.loss = o_loss;
    fa.row_c = block_fast ? s.row_c : nullptr;
    fa.temperature = o.temperature;
    fa.softcap = o.softcap;
    fa.target_apart = target_apart;  // read where row_c is null: a general-path block
    LCE_CUDA_CHECK(cudaMemsetAsync(s.bad, 0xff, sizeof(unsigned long long), stream_));
    LCE_CUDA_CHECK(LaunchFinalizeRows(fa, s.m, s.packed, s.info, s.bad, stream_));
    unsigned long long flags[3] = {ULLONG_MAX, 0, ULLONG_MAX};
    LCE_CUDA_CHECK(cudaMemcpyAsync(host ? bad_host : flags, s.bad, sizeof(flags), cudaMemcpyDeviceToHost, stream_));
    if (host) {
      float* dsts[4] = {out.logprob, out.entropy, out.lse, out.loss};
      for (int k = 0; k < 4; ++k) {
        if (dsts[k] == nullptr) continue;
        LCE_CUDA_CHECK(cudaMemcpyAsync(dsts[k] + r0, s.out[k], nr * sizeof(float), cudaMemcpyDeviceToHost, stream_));
      }
    }
    // One sync per row block: a non-finite row must stop the call before it touches d_weight.
    LCE_CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (host) std::memcpy(flags, bad_host, sizeof(flags));
    if (targets_pending && r0 == 0 && flags[2] != ULLONG_MAX) return BadTarget(rows, o, flags[2]);
    const unsigned long long bad = flags[0];
    if (bad != ULLONG_MAX && debug_skip == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "row ", r0 + static_cast<int64_t>(bad), ": non-finite logits (NaN or Inf in the hidden states, or overflow)"));
    }
    if (flags[1] != 0 && debug_skip == 0) {
      block_fast = false;  // logit spread too wide for exp(z − c_row): redo this block exactly
      goto forward;
    }
    if (!backward) {
      if (trace) {
        float ms = 0;
        LCE_CUDA_CHECK(cudaEventElapsedTime(&ms, trace_[0], trace_[1]));
        std::fprintf(stderr, "lce trace: rows %ld/%ld (R=%ld) tiles fwd %.3f ms\n", static_cast<long>(nr),
                     static_cast<long>(N), static_cast<long>(R), ms);
      }
      continue;
    }

    if (block_fast) {
      // dW += qᵀ · (s ⊙ h) − scatter(t ⊙ h);  d_hidden = s ⊙ (q · W) − t ⊙ W[y].
      if (trace) LCE_CUDA_CHECK(cudaEventRecord(trace_[2], stream_));
      if (layout.side) {
        LCE_CUDA_CHECK(FastGradsBeside(s, h, nr, y, o.ignore_index, grads.d_weight, dw_beta, tf32, trace));
      } else {
        if (grads.d_weight != nullptr) {
          LCE_CUDA_CHECK(LaunchScaleRows(h, nr, H, s.info, s.h_scaled, stream_));
          if (host) {
            LCE_CUDA_CHECK(host_dw_slabs(s.h_scaled, h, y, nr, /*fast_targets=*/true));
          } else {
            LCE_CUDA_CHECK(Gemm(CUBLAS_OP_N, CUBLAS_OP_T, H, Vs, nr, s.h_scaled, dt, H, s.store, dt, lds_, dw_beta,
                                grads.d_weight, CUDA_R_32F, H, tf32));
            LCE_CUDA_CHECK(LaunchScatterTargetDW(grads.d_weight, nr, H, s.info, h, y, o.ignore_index,
                                                 shape_.vocab_begin, Vs, s.target_order, s.target_order_bytes,
                                                 stream_));
          }
        }
        if (trace) LCE_CUDA_CHECK(cudaEventRecord(trace_[3], stream_));
        if (grads.d_hidden != nullptr) LCE_CUDA_CHECK(FastDHidden(s, nr, y, o.ignore_index, tf32, GemmPlace{}));
      }
      if (grads.d_hidden != nullptr) {
        if (tp) LCE_CUDA_CHECK(config_.collectives->AllReduce(s.dh, nr * H, ReduceOp::kSum, true, stream_));
        void* dst = host ? s.d_hidden : static_cast<uint8_t*>(grads.d_hidden) + r0 * H * esz;
        LCE_CUDA_CHECK(LaunchFloatToDType(s.dh, shape_.dtype, dst, nr * H, stream_));
        if (host) {
          LCE_CUDA_CHECK(cudaMemcpyAsync(pinned_.get(), s.d_hidden, nr * H * esz, cudaMemcpyDeviceToHost, stream_));
          LCE_CUDA_CHECK(cudaStreamSynchronize(stream_));
          std::memcpy(static_cast<uint8_t*>(grads.d_hidden) + r0 * H * esz, pinned_.get(),
                      static_cast<size_t>(nr * H * esz));
        }
      }
      if (trace) {
        LCE_CUDA_CHECK(cudaEventRecord(trace_[4], stream_));
        LCE_CUDA_CHECK(cudaStreamSynchronize(stream_));
        float ms[4] = {0, 0, 0, 0};
        LCE_CUDA_CHECK(cudaEventElapsedTime(&ms[0], trace_[0], trace_[1]));
        LCE_CUDA_CHECK(cudaEventElapsedTime(&ms[1], trace_[2], trace_[3]));
        // Beside dW, d_hidden is timed from the same start; "both" is the whole backward of the block.
        LCE_CUDA_CHECK(cudaEventElapsedTime(&ms[2], trace_[layout.side ? 2 : 3], trace_[layout.side ? 5 : 4]));
        LCE_CUDA_CHECK(cudaEventElapsedTime(&ms[3], trace_[2], trace_[4]));
        std::fprintf(stderr,
                     "lce trace (fast%s): rows %ld/%ld (R=%ld) tiles fwd %.3f ms | dW %.3f ms | dh %.3f ms"
                     " | both %.3f ms\n",
                     layout.side ? ", dh beside dW" : "", static_cast<long>(nr), static_cast<long>(N),
                     static_cast<long>(R), ms[0], ms[1], ms[2], ms[3]);
      }
      continue;
    }
    // Backward: dA in place on aux_, chunk by chunk; on the device path each chunk's dW product runs
    // on stream_ while aux_ writes the next chunk. Then one d_hidden product over the whole shard.
    if (trace) LCE_CUDA_CHECK(cudaEventRecord(trace_[2], stream_));
    LCE_CUDA_CHECK(cudaEventRecord(events_[kEvHandoff], stream_));
    LCE_CUDA_CHECK(cudaStreamWaitEvent(aux_, events_[kEvHandoff], 0));
    const bool dw_device = grads.d_weight != nullptr && !host;
    const int64_t chunk = std::max<int64_t>(kSegment, RoundUp(EnvInt("LCE_CUDA_BWD_CHUNK", 16384), kSegment));
    for (int64_t v0 = 0; v0 < Vs; v0 += chunk) {
      const int64_t nc = std::min(chunk, Vs - v0);
      if (!(debug_skip & 2)) {
        LCE_CUDA_CHECK(LaunchWriteGrad(shape_.dtype, s.store, lds_, nr, v0, nc, layout.epi ? s.tile_part : s.part,
                                       layout.epi ? EpiTiles() : nseg_, layout.epi ? EpiTileCols() : kSegment, s.info,
                                       y, o.ignore_index, shape_.vocab_begin, o.softcap, o.temperature,
                                       target_apart, aux_));
      }
      LCE_CUDA_CHECK(cudaEventRecord(events_[kEvHandoff], aux_));
      if (dw_device) {
        LCE_CUDA_CHECK(cudaStreamWaitEvent(stream_, events_[kEvHandoff], 0));
        // dW[v0:v0+nc, H] += dA[nr, v0:v0+nc]ᵀ · h[nr, H]   (column-major: [H, nc] += h · dAᵀ)
        LCE_CUDA_CHECK(Gemm(CUBLAS_OP_N, CUBLAS_OP_T, H, nc, nr, h, dt, H, static_cast<uint8_t*>(s.store) + v0 * sesz,
                            dt, lds_, dw_beta, grads.d_weight + v0 * H, CUDA_R_32F, H, tf32));
      }
    }
    LCE_CUDA_CHECK(cudaStreamWaitEvent(stream_, events_[kEvHandoff], 0));
    if (dw_device && target_apart) {
      LCE_CUDA_CHECK(LaunchScatterTargetDW(grads.d_weight, nr, H, s.info, h, y, o.ignore_index, shape_.vocab_begin,
                                           Vs, s.target_order, s.target_order_bytes, stream_));
    }
    if (trace) LCE_CUDA_CHECK(cudaEventRecord(trace_[3], stream_));
    if (grads.d_hidden != nullptr) {
      if (tree_dh_) {
        if (absl::Status st = DHiddenByTiles(s, nr, w, tf32); !st.ok()) return st;
      } else {
        // dh[nr, H] = dA[nr, Vs] · W[Vs, H]   (column-major: [H, nr] = W · dA)
        LCE_CUDA_CHECK(Gemm(CUBLAS_OP_N, CUBLAS_OP_N, H, nr, Vs, w, dt, H, s.store, dt, lds_, 0.0f, s.dh, CUDA_R_32F,
                            H, tf32, /*c_is_scratch=*/true, 0, /*rows_in_n=*/true));
        if (target_apart) {
          LCE_CUDA_CHECK(LaunchFinishDHidden(s.dh, nr, H, s.info, w, y, o.ignore_index, shape_.vocab_begin, Vs,
                                             stream_));
        }
        if (tp) LCE_CUDA_CHECK(config_.collectives->AllReduce(s.dh, nr * H, ReduceOp::kSum, true, stream_));
      }
      void* dst = host ? s.d_hidden : static_cast<uint8_t*>(grads.d_hidden) + r0 * H * esz;
      LCE_CUDA_CHECK(LaunchFloatToDType(s.dh, shape_.dtype, dst, nr * H, stream_));
      if (host) {
        LCE_CUDA_CHECK(cudaMemcpyAsync(pinned_.get(), s.d_hidden, nr * H * esz, cudaMemcpyDeviceToHost, stream_));
        LCE_CUDA_CHECK(cudaStreamSynchronize(stream_));
        std::memcpy(static_cast<uint8_t*>(grads.d_hidden) + r0 * H * esz, pinned_.get(),
                    static_cast<size_t>(nr * H * esz));
      }
    }
    if (trace) LCE_CUDA_CHECK(cudaEventRecord(trace_[4], stream_));
    if (grads.d_weight != nullptr && host) {
      // dW slabs through the device: host += dA[nr, slab]ᵀ · h.
      LCE_CUDA_CHECK(host_dw_slabs(h, h, y, nr, /*fast_targets=*/target_apart));
    }
    if (trace) {
      LCE_CUDA_CHECK(cudaStreamSynchronize(stream_));
      float ms[3] = {0, 0, 0};
      LCE_CUDA_CHECK(cudaEventElapsedTime(&ms[0], trace_[0], trace_[1]));
      LCE_CUDA_CHECK(cudaEventElapsedTime(&ms[1], trace_[2], trace_[3]));
      LCE_CUDA_CHECK(cudaEventElapsedTime(&ms[2], trace_[3], trace_[4]));
      std::fprintf(stderr, "lce trace: rows %ld/%ld (R=%ld) tiles fwd %.3f ms | dA+dW %.3f ms | dh %.3f ms\n",
                   static_cast<long>(nr), static_cast<long>(N), static_cast<long>(R), ms[0], ms[1], ms[2]);
    }
  }
  LCE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

absl::Status CudaEngine::EpilogueStatsForward(Scratch& s, const void* h, int64_t nr, const int32_t* y,
                                              int32_t ignore_index, const LogitTransform& tf, EpiCopy copy,
                                              bool entropy, unsigned* overflow) {
#if defined(LCE_WITH_CUTLASS)
  EpilogueStatsArgs a;
  a.hidden = h;
  a.weight = weight_.get();
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
  a.small_rows = EnvInt("LCE_CUDA_EPI_SMALL_ROWS", a.small_rows);
  a.large_config = static_cast<int>(EnvInt("LCE_CUDA_EPI_LARGE", a.large_config));
  a.swizzle = static_cast<int>(EnvInt("LCE_CUDA_EPI_SWIZZLE", 1));
  a.raster = static_cast<int>(EnvInt("LCE_CUDA_EPI_RASTER", 0));
  a.entropy = entropy;
  a.timing_skip = (EnvInt("LCE_CUDA_DEBUG_SKIP", 0) & 4) != 0;
  if (copy == EpiCopy::kExp) {
    // First pass over the first kFirstPassCols columns: their max per row (into s.part, one segment a
    // row, overwritten by the whole shard's fold below) sets c_row before any exp is stored.
    EpilogueStatsArgs first = a;
    first.cols = std::min<int64_t>(kFirstPassCols, a.cols);
    first.ntile = (first.cols + EpiTileCols() - 1) / EpiTileCols();
    first.entropy = false;  // only its max is used
    LCE_CUDA_CHECK(LaunchEpilogueStatsGemm(first, stream_));
    LCE_CUDA_CHECK(LaunchFoldTilePartials(s.tile_part, first.ntile, EpiTileCols(), nr, s.part, 1, stream_));
    a.first = s.part;
    a.row_c = s.row_c;
    a.overflow = overflow;
  }
  a.store = copy != EpiCopy::kNone ? s.store : nullptr;
  a.lds = lds_;
  LCE_CUDA_CHECK(LaunchEpilogueStatsGemm(a, stream_));
  return LaunchFoldTilePartials(s.tile_part, a.ntile, EpiTileCols(), nr, s.part, nseg_, stream_);
#else
  (void)s, (void)h, (void)nr, (void)y, (void)ignore_index, (void)tf, (void)copy, (void)entropy, (void)overflow;
  return absl::InternalError("built without CUTLASS: no epilogue-statistics GEMM");
#endif
}

int64_t CudaEngine::GatheredNodes() const {
  const int world = config_.collectives->world_size();
  int64_t nodes = 0;
  for (int r = 0; r < world; ++r) nodes += static_cast<int64_t>(RankSubtrees(shape_.vocab_size, r, world).size());
  return nodes;
}

absl::Status CudaEngine::FastDHidden(Scratch& s, int64_t nr, const int32_t* y, int32_t ignore_index, bool tf32,
                                     const GemmPlace& place) {
  const int64_t H = shape_.hidden_size, Vs = shape_.shard_rows;
  const uint8_t* w = weight_.get();
  const cudaDataType_t dt = CudaType(shape_.dtype);
  LCE_CUDA_CHECK(Gemm(CUBLAS_OP_N, CUBLAS_OP_N, H, nr, Vs, w, dt, H, s.store, dt, lds_, 0.0f, s.dh, CUDA_R_32F, H, tf32,
                      /*c_is_scratch=*/true, 0, /*rows_in_n=*/true, false, place));
  cudaStream_t stream = place.stream != nullptr ? place.stream : stream_;
  LCE_CUDA_CHECK(LaunchFinishDHidden(s.dh, nr, H, s.info, w, y, ignore_index, shape_.vocab_begin, Vs, stream));
  return absl::OkStatus();
}

// The fast loss path's two backward products at once: d_hidden's (and its finish) on aux_, dW's on stream_,
// each on the multiprocessors the other leaves idle (d_hidden's last wave of tiles, dW's fp32 read-modify-write:
// bench/NOTES.md, e10). Both only read s.store, s.info, h and W. dW's algorithm is chosen before d_hidden's
// product is queued: its timing runs write s.dh (tune_scratch_) and must run alone.
absl::Status CudaEngine::FastGradsBeside(Scratch& s, const void* h, int64_t nr, const int32_t* y,
                                         int32_t ignore_index, float* d_weight, float dw_beta, bool tf32,
                                         bool trace) {
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
                        static_cast<const uint8_t*>(s.store) + v0 * sesz, dt, lds_, 0.0f, slot, CUDA_R_32F, H,
                        tf32, /*c_is_scratch=*/true, 0, /*rows_in_n=*/true));
    PushTreeNode(stack, Node{0, t, slot}, [&](Node& left, Node& right) {
      if (status.ok()) status = LaunchAddFloats(left.value, left.value, right.value, n, stream_);
      free_slots.push_back(right.value);
    });
    if (!status.ok()) return status;
  }
  std::vector<Node> held = stack;
  if (config_.collectives != nullptr) {
    const int world = config_.collectives->world_size(), me = config_.collectives->rank();
    LCE_CUDA_CHECK(LaunchFillFloats(s.tree_gathered, -std::numeric_limits<float>::infinity(), GatheredNodes() * n,
                                    stream_));
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

}  // namespace

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
