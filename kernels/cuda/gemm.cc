#include "cuda/gemm.h"

#include <algorithm>
#include <cstdlib>
#include <limits>

#include "absl/strings/str_cat.h"
#include "cuda/cuda_check.h"

namespace lce::cuda {
namespace {

// Largest power of two (at most 256) that divides the address.
uint32_t Alignment(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && a % al != 0) al /= 2;
  return al;
}

// The size class of a GEMM dimension: exact up to 64, else rounded up to a quarter of its octave
// (1024, 1280, 1536, 1792, 2048, 2560, ...). Problems of one class share their tuned algorithm:
// requests of every row count must not each pay for timing the candidates.
int64_t SizeClass(int64_t x) {
  if (x <= 64) return x;
  int64_t octave = 1;
  while (octave * 2 <= x) octave *= 2;
  const int64_t step = octave / 4;
  return (x + step - 1) / step * step;
}

// Exact problems whose plans (descriptors and layouts, cheap to remake) stay cached.
constexpr size_t kMaxPlans = 512;

}  // namespace

GemmRunner::~GemmRunner() {
  for (auto& [key, plan] : plans_) FreePlan(&plan);
  for (cudaEvent_t e : ev_) {
    if (e != nullptr) cudaEventDestroy(e);
  }
  if (lt_ != nullptr) cublasLtDestroy(lt_);
}

absl::Status GemmRunner::Init() {
  LCE_CUDA_CHECK(cublasLtCreate(&lt_));
  for (cudaEvent_t& e : ev_) LCE_CUDA_CHECK(cudaEventCreate(&e));
  return absl::OkStatus();
}

void GemmRunner::FreePlan(Plan* p) {
  if (p->la != nullptr) cublasLtMatrixLayoutDestroy(p->la);
  if (p->lb != nullptr) cublasLtMatrixLayoutDestroy(p->lb);
  if (p->lc != nullptr) cublasLtMatrixLayoutDestroy(p->lc);
  if (p->desc != nullptr) cublasLtMatmulDescDestroy(p->desc);
  *p = Plan{};
}

absl::Status GemmRunner::MakePlan(const GemmSpec& g, int64_t n, Plan* p) const {
  LCE_CUDA_CHECK(cublasLtMatmulDescCreate(&p->desc, g.compute, CUDA_R_32F));
  LCE_CUDA_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &g.ta, sizeof(g.ta)));
  LCE_CUDA_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &g.tb, sizeof(g.tb)));
  if (g.sm_target > 0) {
    const int32_t sms = g.sm_target;
    LCE_CUDA_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &sms, sizeof(sms)));
  }
  const bool ta = g.ta == CUBLAS_OP_T, tb = g.tb == CUBLAS_OP_T;
  LCE_CUDA_CHECK(cublasLtMatrixLayoutCreate(&p->la, g.ab_type, ta ? g.k : g.m, ta ? g.m : g.k, g.lda));
  LCE_CUDA_CHECK(cublasLtMatrixLayoutCreate(&p->lb, g.ab_type, tb ? n : g.k, tb ? g.k : n, g.ldb));
  LCE_CUDA_CHECK(cublasLtMatrixLayoutCreate(&p->lc, g.c_type, g.m, n, g.ldc));
  return absl::OkStatus();
}

absl::Status GemmRunner::Tune(const GemmSpec& g, bool c_is_scratch, float* tune_scratch, int64_t tune_floats,
                              void* workspace, size_t workspace_bytes, cudaStream_t stream, Plan* p) {
  const uint32_t al_a = Alignment(g.a), al_b = Alignment(g.b), al_c = Alignment(g.c);
  // Candidates for the real problem.
  cublasLtMatmulPreference_t pref = nullptr;
  LCE_CUDA_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  LCE_CUDA_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                      &workspace_bytes, sizeof(workspace_bytes)));
  const uint32_t al_tc = c_is_scratch ? al_c : std::min<uint32_t>(al_c, Alignment(tune_scratch));
  LCE_CUDA_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a,
                                                      sizeof(al_a)));
  LCE_CUDA_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b,
                                                      sizeof(al_b)));
  LCE_CUDA_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_tc,
                                                      sizeof(al_tc)));
  LCE_CUDA_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_tc,
                                                      sizeof(al_tc)));
  constexpr int kMaxCandidates = 8;
  cublasLtMatmulHeuristicResult_t res[kMaxCandidates];
  int found = 0;
  const cublasStatus_t hs =
      cublasLtMatmulAlgoGetHeuristic(lt_, p->desc, p->la, p->lb, p->lc, p->lc, pref, kMaxCandidates, res, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  LCE_CUDA_CHECK(hs);
  if (found == 0) return absl::InternalError("cuBLASLt found no algorithm for a GEMM");
  p->algo = res[0].algo;
  p->has_algo = true;
  const char* no_tune = std::getenv("LCE_CUDA_NO_GEMM_TUNE");
  if (found > 1 && (no_tune == nullptr || *no_tune == '0')) {
    // Where to time: in place on scratch output, else on tune_scratch with n cut to fit.
    int64_t tn = g.n;
    void* tc = g.c;
    if (!c_is_scratch) {
      tn = tune_scratch == nullptr ? 0 : std::min<int64_t>(g.n, tune_floats / std::max<int64_t>(g.ldc, 1));
      if (g.c_type != CUDA_R_32F) tn = 0;  // scratch is fp32-sized; only fp32 outputs are tuned out of place
      tn = tn >= 256 ? tn / 256 * 256 : (tn == g.n ? tn : 0);
      tc = tune_scratch;
    }
    if (tn > 0) {
      Plan tp;
      absl::Status ms = MakePlan(g, tn, &tp);
      const float alpha = 1.0f;
      float best = std::numeric_limits<float>::infinity();
      for (int i = 0; ms.ok() && i < found; ++i) {
        cublasLtMatmulHeuristicResult_t check{};
        if (tn != g.n &&
            cublasLtMatmulAlgoCheck(lt_, p->desc, p->la, p->lb, p->lc, p->lc, &res[i].algo, &check) !=
                CUBLAS_STATUS_SUCCESS) {
          continue;  // not valid for the real problem
        }
        float t_min = std::numeric_limits<float>::infinity();
        for (int rep = 0; rep < 3; ++rep) {
          LCE_CUDA_CHECK(cudaEventRecord(ev_[0], stream));
          const cublasStatus_t rs = cublasLtMatmul(lt_, tp.desc, &alpha, g.a, tp.la, g.b, tp.lb, &g.beta, tc, tp.lc,
                                                   tc, tp.lc, &res[i].algo, workspace, workspace_bytes, stream);
          if (rs != CUBLAS_STATUS_SUCCESS) break;
          LCE_CUDA_CHECK(cudaEventRecord(ev_[1], stream));
          LCE_CUDA_CHECK(cudaEventSynchronize(ev_[1]));
          float ms_i = 0;
          LCE_CUDA_CHECK(cudaEventElapsedTime(&ms_i, ev_[0], ev_[1]));
          if (rep > 0) t_min = std::min(t_min, ms_i);  // first run warms up
        }
        if (t_min < best) {
          best = t_min;
          p->algo = res[i].algo;
        }
      }
      FreePlan(&tp);
      if (!ms.ok()) return ms;
    }
  }
  return absl::OkStatus();
}

absl::Status GemmRunner::Run(const GemmSpec& g, bool c_is_scratch, float* tune_scratch, int64_t tune_floats,
                             void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (g.m <= 0 || g.n <= 0) return absl::OkStatus();
  if (g.k <= 0) return absl::InternalError("GEMM with k = 0");
  const uint32_t al_a = Alignment(g.a), al_b = Alignment(g.b), al_c = Alignment(g.c);
  const Key key{g.ta, g.tb, g.m, g.n, g.k, g.lda, g.ldb, g.ldc, g.ab_type, g.c_type, g.compute, g.beta != 0.0f,
                static_cast<int>(al_a), static_cast<int>(al_b), static_cast<int>(al_c), g.sm_target};
  auto it = plans_.find(key);
  if (it == plans_.end()) {
    if (plans_.size() >= kMaxPlans) {  // many row counts seen: start over (their algorithms stay)
      for (auto& [k, old] : plans_) FreePlan(&old);
      plans_.clear();
    }
    Plan plan;
    absl::Status s = MakePlan(g, g.n, &plan);
    Key size_class = key;
    std::get<2>(size_class) = SizeClass(g.m);
    std::get<3>(size_class) = SizeClass(g.n);
    std::get<4>(size_class) = SizeClass(g.k);
    if (s.ok()) {
      // The algorithm tuned for this size class where it is valid for this problem, else tune now.
      auto tuned = algos_.find(size_class);
      cublasLtMatmulHeuristicResult_t check{};
      if (tuned != algos_.end() &&
          cublasLtMatmulAlgoCheck(lt_, plan.desc, plan.la, plan.lb, plan.lc, plan.lc, &tuned->second, &check) ==
              CUBLAS_STATUS_SUCCESS &&
          check.workspaceSize <= workspace_bytes) {
        plan.algo = tuned->second;
        plan.has_algo = true;
      } else {
        s = Tune(g, c_is_scratch, tune_scratch, tune_floats, workspace, workspace_bytes, stream, &plan);
        if (s.ok()) algos_[size_class] = plan.algo;
      }
    }
    if (!s.ok()) {
      FreePlan(&plan);
      return s;
    }
    it = plans_.emplace(key, plan).first;
  }
  const Plan& p = it->second;
  const float alpha = 1.0f;
  LCE_CUDA_CHECK(cublasLtMatmul(lt_, p.desc, &alpha, g.a, p.la, g.b, p.lb, &g.beta, g.c, p.lc, g.c, p.lc, &p.algo,
                                workspace, workspace_bytes, stream));
  return absl::OkStatus();
}

}  // namespace lce::cuda
