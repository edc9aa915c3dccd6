// The CUDA backend's matrix products: cuBLASLt with fp32 accumulation, the algorithm for each size
// class of problem (dimensions rounded up to a quarter octave) chosen once by timing cuBLASLt's
// heuristic candidates (on scratch memory, never on the caller's buffers) and cached, so that
// requests of every row count do not each pay for the timing. Host functions only.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <string>
#include <tuple>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace lce::cuda {

// Column-major D = alpha·op(A)·op(B) + beta·C with C == D.
struct GemmSpec {
  cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  void* c = nullptr;
  int64_t ldc = 0;
  cudaDataType_t ab_type = CUDA_R_16BF;
  cudaDataType_t c_type = CUDA_R_32F;
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  float beta = 0.0f;
  int sm_target = 0;  // > 0: leave the other multiprocessors to a concurrent stream
  // Each column of C must be the same bits whatever n (n counts a call's rows): one algorithm for
  // every n, without split-K, chosen by cuBLASLt's heuristic for a canonical n instead of timed.
  bool n_invariant = false;
  // With n_invariant: each row of C the same bits whatever m too — one algorithm for every m that is
  // a multiple of 2048 (up to ldc) and every n.
  bool m_invariant = false;
  // Timed among the candidates without split-K of one cuBLASLt algorithm (the heuristic's first
  // without split-K at n = 8192): each column of C is then summed over k in one order whatever n and
  // whichever candidate is fastest (every such candidate gave the same bits on H200 with cuBLAS 13:
  // bench/gemm_order_probe.cu), at the tuned speed of every n.
  bool fixed_k_order = false;
};

// A cuBLASLt algorithm as it is configured: its id, tile, stages, split-K and cluster shape (for logs and probes).
std::string DescribeGemmAlgo(const cublasLtMatmulAlgo_t& algo);

class GemmRunner {
 public:
  GemmRunner() = default;
  GemmRunner(const GemmRunner&) = delete;
  GemmRunner& operator=(const GemmRunner&) = delete;
  ~GemmRunner();

  absl::Status Init();
  // Whether Tune times cuBLASLt's candidates (CudaTuning::gemm_tune); false: its heuristic's first.
  void set_tune(bool tune) { tune_ = tune; }
  // Whether Tune writes each candidate, its time and the pick to stderr (CudaTuning::gemm_log).
  void set_log(bool log) { log_ = log; }
  // Runs g on stream. On the first call for a size class of problem, times the candidates: in place when g writes
  // scratch (c_is_scratch), else on a slice of n columns in tune_scratch (tune_floats floats) or, where that is
  // too narrow to rank them, in a buffer allocated on stream for the timing.
  absl::Status Run(const GemmSpec& g, bool c_is_scratch, float* tune_scratch, int64_t tune_floats, void* workspace,
                   size_t workspace_bytes, cudaStream_t stream);
  // Chooses g's algorithm as Run does (on first sight: times the candidates, waiting for them) without
  // running g: for a product whose timing must not overlap kernels already queued on another stream.
  absl::Status Prepare(const GemmSpec& g, bool c_is_scratch, float* tune_scratch, int64_t tune_floats, void* workspace,
                       size_t workspace_bytes, cudaStream_t stream);

 private:
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
    cublasLtMatmulAlgo_t algo{};
    bool has_algo = false;
  };
  using Key = std::tuple<int, int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int, int, bool, int, int,
                         int, int, int>;
  // g's cache key with m, n and k as given (exact, a size class, or 0 for any) and its beta's zeroness.
  static Key KeyOf(const GemmSpec& g, int64_t m, int64_t n, int64_t k, bool beta_nonzero);
  absl::Status MakePlan(const GemmSpec& g, int64_t n, Plan* plan) const;
  // cuBLASLt's heuristic candidates for `plan` (at most cap) within workspace_bytes, for operands of these
  // alignments, without split-K where asked.
  absl::Status Heuristic(const Plan& plan, size_t workspace_bytes, uint32_t al_a, uint32_t al_b, uint32_t al_c,
                         bool no_split_k, int cap, cublasLtMatmulHeuristicResult_t* res, int* found) const;
  // Picks plan->algo among cuBLASLt's heuristic candidates by timing them (Run's scratch rules).
  absl::Status Tune(const GemmSpec& g, bool c_is_scratch, float* tune_scratch, int64_t tune_floats, void* workspace,
                    size_t workspace_bytes, cudaStream_t stream, Plan* plan);
  // Where an out-of-place product is timed: n columns of c (n = 0: nowhere), owned (freed after the timing)
  // when c was allocated for it.
  struct OutOfPlaceSlice {
    int64_t n = 0;
    void* c = nullptr;
    void* owned = nullptr;
  };
  // tune_scratch where it holds a slice of kTuneColumns (gemm.cc), else a stream-ordered buffer that does;
  // without room on the device for one, tune_scratch's narrower slice.
  absl::StatusOr<OutOfPlaceSlice> SliceToTimeOn(const GemmSpec& g, float* tune_scratch, int64_t tune_floats,
                                                cudaStream_t stream) const;
  // Times res[0, found) that plan can run on g's first tn columns written to tc (3 runs each, the first a warm-up)
  // and sets plan->algo to the fastest.
  absl::Status TimeOnSlice(const GemmSpec& g, int64_t tn, void* tc, const cublasLtMatmulHeuristicResult_t* res,
                           int found, void* workspace, size_t workspace_bytes, cudaStream_t stream, Plan* plan);
  // fixed_k_order problems: the algorithm whose cuBLASLt algorithm id their candidates must share.
  absl::StatusOr<cublasLtMatmulAlgo_t> FixedOrderFamily(const GemmSpec& g, size_t workspace_bytes);
  // Drops res[0, *found) that fixed_k_order excludes (split-K, another algorithm id); none left: the
  // family's own algorithm where `plan` can run it.
  absl::Status KeepFixedOrder(const GemmSpec& g, size_t workspace_bytes, const Plan& plan,
                              cublasLtMatmulHeuristicResult_t* res, int* found);
  // n_invariant problems: the heuristic's first algorithm without split-K for n = kCanonicalN.
  absl::Status CanonicalAlgo(const GemmSpec& g, size_t workspace_bytes, cublasLtMatmulAlgo_t* algo) const;
  // The algorithm to run `plan` with: the size class's, tuned or canonical as g asks.
  absl::Status ChooseAlgo(const GemmSpec& g, bool c_is_scratch, float* tune_scratch, int64_t tune_floats,
                          void* workspace, size_t workspace_bytes, cudaStream_t stream, Plan* plan);
  // The cached plan of g's exact problem, made (its algorithm chosen) on first sight.
  absl::Status FindPlan(const GemmSpec& g, bool c_is_scratch, float* tune_scratch, int64_t tune_floats, void* workspace,
                        size_t workspace_bytes, cudaStream_t stream, const Plan** plan);
  static void FreePlan(Plan* plan);

  cublasLtHandle_t lt_ = nullptr;
  bool tune_ = true;
  bool log_ = false;
  cudaEvent_t ev_[2] = {nullptr, nullptr};
  std::map<Key, Plan> plans_;                     // by exact problem, bounded
  std::map<Key, cublasLtMatmulAlgo_t> algos_;     // tuned, by size class of m, n, k (SizeClass in gemm.cc)
  std::map<Key, cublasLtMatmulAlgo_t> families_;  // fixed_k_order: the family's algorithm, by problem without n
};

}  // namespace lce::cuda
