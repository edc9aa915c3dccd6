#include "cuda/gemm.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

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

// Out-of-place candidates are timed on a slice of C at least this wide, in at most this many bytes: narrower,
// an fp32 C fits in the L2 and candidates that tie there are 15% apart on the whole product (bench/NOTES.md
// e29: dW at H = 2048 timed on 2048 columns picked tile 24 or 23 by chance; from 8192 columns up, 29).
constexpr int64_t kTuneColumns = 16384;
constexpr int64_t kTuneBytes = int64_t{256} << 20;

// Exact problems whose plans (descriptors and layouts, cheap to remake) stay cached.
constexpr size_t kMaxPlans = 512;

// The row count n_invariant GEMMs are planned for (a large block: where their time goes), and the
// row counts their algorithm must also be valid for: one algorithm serves every n.
constexpr int64_t kCanonicalN = 8192;
constexpr int64_t kProbeNs[] = {1, 7, 64, 300, 1000, 4096, 8192, 16384, 32768};
// The m that m_invariant GEMMs are planned for and probed at (multiples of 2048, up to ldc).
constexpr int64_t kCanonicalM = 8192;
constexpr int64_t kProbeMs[] = {2048, 4096, 6144, 8192, 16384};

// The problems an algorithm for g must serve: g's m (or, m_invariant, every probe m up to ldc).
std::vector<int64_t> ProbeMs(const GemmSpec& g) {
  if (!g.m_invariant) return {g.m};
  std::vector<int64_t> ms;
  for (int64_t m : kProbeMs) {
    if (m <= g.ldc) ms.push_back(m);
  }
  return ms;
}

void SetAlignments(cublasLtMatmulPreference_t pref, uint32_t a, uint32_t b, uint32_t c) {
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &a, sizeof(a));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &b, sizeof(b));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &c, sizeof(c));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &c, sizeof(c));
}

}  // namespace

std::string DescribeGemmAlgo(const cublasLtMatmulAlgo_t& algo) {
  const cublasLtMatmulAlgoConfigAttributes_t attrs[] = {CUBLASLT_ALGO_CONFIG_ID, CUBLASLT_ALGO_CONFIG_TILE_ID,
                                                        CUBLASLT_ALGO_CONFIG_STAGES_ID, CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                                                        CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID};
  const char* names[] = {"id", "tile", "stages", "splitk", "cluster"};
  std::string out;
  for (int i = 0; i < 5; ++i) {
    int32_t v = -1;
    size_t written = 0;
    cublasLtMatmulAlgoConfigGetAttribute(&algo, attrs[i], &v, sizeof(v), &written);
    absl::StrAppend(&out, i > 0 ? " " : "", names[i], "=", v);
  }
  return out;
}

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

absl::Status GemmRunner::Heuristic(const Plan& plan, size_t workspace_bytes, uint32_t al_a, uint32_t al_b,
                                   uint32_t al_c, bool no_split_k, int cap, cublasLtMatmulHeuristicResult_t* res,
                                   int* found) const {
  *found = 0;
  cublasLtMatmulPreference_t pref = nullptr;
  LCE_CUDA_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                           &workspace_bytes, sizeof(workspace_bytes));
  SetAlignments(pref, al_a, al_b, al_c);
  if (no_split_k) {
    const uint32_t none = CUBLASLT_REDUCTION_SCHEME_NONE;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &none, sizeof(none));
  }
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = cublasLtMatmulAlgoGetHeuristic(lt_, plan.desc, plan.la, plan.lb, plan.lc, plan.lc, pref, cap, res, found);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  LCE_CUDA_CHECK(st);
  return absl::OkStatus();
}

GemmRunner::Key GemmRunner::KeyOf(const GemmSpec& g, int64_t m, int64_t n, int64_t k, bool beta_nonzero) {
  const int modes = (g.n_invariant ? 1 : 0) | (g.m_invariant ? 2 : 0) | (g.fixed_k_order ? 4 : 0);
  return Key{g.ta,
             g.tb,
             m,
             n,
             k,
             g.lda,
             g.ldb,
             g.ldc,
             g.ab_type,
             g.c_type,
             g.compute,
             beta_nonzero,
             static_cast<int>(Alignment(g.a)),
             static_cast<int>(Alignment(g.b)),
             static_cast<int>(Alignment(g.c)),
             g.sm_target,
             modes};
}

absl::StatusOr<cublasLtMatmulAlgo_t> GemmRunner::FixedOrderFamily(const GemmSpec& g, size_t workspace_bytes) {
  // One family for a leaf's product however it runs: written or accumulated (beta).
  GemmSpec plain = g;
  plain.beta = 0.0f;
  const Key key = KeyOf(plain, g.m, 0, g.k, false);
  if (auto it = families_.find(key); it != families_.end()) return it->second;
  Plan canon;
  absl::Status s = MakePlan(plain, kCanonicalN, &canon);
  cublasLtMatmulHeuristicResult_t first{};
  int found = 0;
  if (s.ok()) {
    s = Heuristic(canon, workspace_bytes, Alignment(g.a), Alignment(g.b), Alignment(g.c), /*no_split_k=*/true, 1,
                  &first, &found);
  }
  FreePlan(&canon);
  if (!s.ok()) return s;
  if (found == 0) return absl::NotFoundError("no cuBLASLt algorithm without split-K at n = 8192");
  families_.emplace(key, first.algo);
  return first.algo;
}

absl::Status GemmRunner::KeepFixedOrder(const GemmSpec& g, size_t workspace_bytes, const Plan& plan,
                                        cublasLtMatmulHeuristicResult_t* res, int* found) {
  absl::StatusOr<cublasLtMatmulAlgo_t> family = FixedOrderFamily(g, workspace_bytes);
  if (!family.ok() && !absl::IsNotFound(family.status())) return family.status();
  int32_t family_id = -1;
  size_t written = 0;
  if (family.ok()) {
    LCE_CUDA_CHECK(cublasLtMatmulAlgoConfigGetAttribute(&*family, CUBLASLT_ALGO_CONFIG_ID, &family_id,
                                                        sizeof(family_id), &written));
  }
  int kept = 0;
  for (int i = 0; family.ok() && i < *found; ++i) {
    int32_t id = -1, split_k = 0, reduction = -1;
    cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof(id), &written);
    cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split_k, sizeof(split_k),
                                         &written);
    cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &reduction,
                                         sizeof(reduction), &written);
    if (id == family_id && split_k <= 1 && reduction == CUBLASLT_REDUCTION_SCHEME_NONE) res[kept++] = res[i];
  }
  cublasLtMatmulHeuristicResult_t check{};
  if (kept == 0 && family.ok() &&
      cublasLtMatmulAlgoCheck(lt_, plan.desc, plan.la, plan.lb, plan.lc, plan.lc, &*family, &check) ==
          CUBLAS_STATUS_SUCCESS &&
      check.workspaceSize <= workspace_bytes) {
    res[0].algo = *family;  // none of the heuristic's few: the family's own, untimed
    kept = 1;
  }
  if (kept == 0) {
    // Served, but this product's sums may then change order with the row count (its last bits).
    std::fprintf(stderr, "lce: no fixed-order GEMM algorithm for m=%ld n=%ld k=%ld; using the heuristic's\n",
                 static_cast<long>(g.m), static_cast<long>(g.n), static_cast<long>(g.k));
    return absl::OkStatus();
  }
  *found = kept;
  return absl::OkStatus();
}

absl::Status GemmRunner::Tune(const GemmSpec& g, bool c_is_scratch, float* tune_scratch, int64_t tune_floats,
                              void* workspace, size_t workspace_bytes, cudaStream_t stream, Plan* p) {
  // Candidates for the real problem.
  const uint32_t al_c = Alignment(g.c);
  const uint32_t al_tc = c_is_scratch ? al_c : std::min<uint32_t>(al_c, Alignment(tune_scratch));
  constexpr int kMaxCandidates = 8;
  cublasLtMatmulHeuristicResult_t res[kMaxCandidates];
  int found = 0;
  LCE_CUDA_CHECK(Heuristic(*p, workspace_bytes, Alignment(g.a), Alignment(g.b), al_tc, g.fixed_k_order, kMaxCandidates,
                           res, &found));
  if (found == 0) return absl::InternalError("cuBLASLt found no algorithm for a GEMM");
  if (g.fixed_k_order) LCE_CUDA_CHECK(KeepFixedOrder(g, workspace_bytes, *p, res, &found));
  p->algo = res[0].algo;
  p->has_algo = true;
  if (found > 1 && tune_) {
    absl::StatusOr<OutOfPlaceSlice> where = OutOfPlaceSlice{g.n, g.c, nullptr};  // in place on scratch output
    if (!c_is_scratch) where = SliceToTimeOn(g, tune_scratch, tune_floats, stream);
    if (!where.ok()) return where.status();
    const OutOfPlaceSlice& slice = *where;
    absl::Status ts = slice.n > 0 ? TimeOnSlice(g, slice.n, slice.c, res, found, workspace, workspace_bytes, stream, p)
                                  : absl::OkStatus();
    if (slice.owned != nullptr) {
      const cudaError_t fe = cudaFreeAsync(slice.owned, stream);
      if (ts.ok() && fe != cudaSuccess) ts = absl::InternalError(cudaGetErrorString(fe));
    }
    if (!ts.ok()) return ts;
  }
  if (log_) {
    std::fprintf(stderr, "lce gemm: m=%ld n=%ld k=%ld beta=%g ta=%d tb=%d: %d candidates, picked %s\n",
                 static_cast<long>(g.m), static_cast<long>(g.n), static_cast<long>(g.k), g.beta, g.ta, g.tb, found,
                 DescribeGemmAlgo(p->algo).c_str());
  }
  return absl::OkStatus();
}

absl::StatusOr<GemmRunner::OutOfPlaceSlice> GemmRunner::SliceToTimeOn(const GemmSpec& g, float* tune_scratch,
                                                                      int64_t tune_floats, cudaStream_t stream) const {
  OutOfPlaceSlice slice;
  if (g.c_type != CUDA_R_32F) return slice;  // scratch is fp32-sized; only fp32 outputs are tuned out of place
  const int64_t ldc = std::max<int64_t>(g.ldc, 1);
  const int64_t want = std::min(g.n, std::max<int64_t>(256, std::min(kTuneColumns, kTuneBytes / 4 / ldc)));
  int64_t have = tune_scratch == nullptr ? 0 : std::min<int64_t>(g.n, tune_floats / ldc);
  slice.c = tune_scratch;
  if (have < want) {
    void* buf = nullptr;
    const size_t bytes = static_cast<size_t>(want * ldc) * sizeof(float);
    if (cudaMallocAsync(&buf, bytes, stream) == cudaSuccess) {
      slice.owned = slice.c = buf;
      have = want;
      // A beta product reads it: defined values (compute-sanitizer's initcheck). Tune frees it after the timing.
      if (const cudaError_t e = cudaMemsetAsync(buf, 0, bytes, stream); e != cudaSuccess) {
        cudaFreeAsync(buf, stream);
        LCE_CUDA_CHECK(e);
      }
    } else {
      cudaGetLastError();  // no room on the device: the scratch's narrower slice (not an error)
    }
  }
  have = std::min(have, want);
  slice.n = have >= 256 ? have / 256 * 256 : (have == g.n ? have : 0);
  return slice;
}

absl::Status GemmRunner::TimeOnSlice(const GemmSpec& g, int64_t tn, void* tc,
                                     const cublasLtMatmulHeuristicResult_t* res, int found, void* workspace,
                                     size_t workspace_bytes, cudaStream_t stream, Plan* p) {
  Plan tp;
  absl::Status ms = MakePlan(g, tn, &tp);
  const float alpha = 1.0f;
  // One run of a candidate on the slice: its time, or +inf where cuBLASLt refuses to run it.
  const auto time_once = [&](const cublasLtMatmulAlgo_t& algo) -> absl::StatusOr<float> {
    LCE_CUDA_CHECK(cudaEventRecord(ev_[0], stream));
    if (cublasLtMatmul(lt_, tp.desc, &alpha, g.a, tp.la, g.b, tp.lb, &g.beta, tc, tp.lc, tc, tp.lc, &algo, workspace,
                       workspace_bytes, stream) != CUBLAS_STATUS_SUCCESS) {
      return std::numeric_limits<float>::infinity();
    }
    LCE_CUDA_CHECK(cudaEventRecord(ev_[1], stream));
    LCE_CUDA_CHECK(cudaEventSynchronize(ev_[1]));
    float run_ms = 0;
    LCE_CUDA_CHECK(cudaEventElapsedTime(&run_ms, ev_[0], ev_[1]));
    return run_ms;
  };
  float best = std::numeric_limits<float>::infinity();
  for (int i = 0; ms.ok() && i < found; ++i) {
    cublasLtMatmulHeuristicResult_t check{};
    if (tn != g.n && cublasLtMatmulAlgoCheck(lt_, p->desc, p->la, p->lb, p->lc, p->lc, &res[i].algo, &check) !=
                         CUBLAS_STATUS_SUCCESS) {
      continue;  // not valid for the real problem
    }
    float t_min = std::numeric_limits<float>::infinity();
    for (int rep = 0; rep < 3; ++rep) {
      absl::StatusOr<float> t = time_once(res[i].algo);
      if (!t.ok()) ms = t.status();
      if (!t.ok() || std::isinf(*t)) break;
      if (rep > 0) t_min = std::min(t_min, *t);  // first run warms up
    }
    if (log_ && ms.ok()) {
      std::fprintf(stderr, "lce gemm: m=%ld n=%ld k=%ld beta=%g timed on n=%ld: candidate %d (%s) %.4f ms\n",
                   static_cast<long>(g.m), static_cast<long>(g.n), static_cast<long>(g.k), g.beta,
                   static_cast<long>(tn), i, DescribeGemmAlgo(res[i].algo).c_str(), t_min);
    }
    if (t_min < best) {
      best = t_min;
      p->algo = res[i].algo;
    }
  }
  FreePlan(&tp);  // on every path
  return ms;
}

absl::Status GemmRunner::CanonicalAlgo(const GemmSpec& g, size_t workspace_bytes, cublasLtMatmulAlgo_t* algo) const {
  const std::vector<int64_t> ms = ProbeMs(g);
  if (ms.empty()) return absl::NotFoundError("no probe m fits ldc");
  GemmSpec canon_spec = g;
  if (g.m_invariant) canon_spec.m = std::min(kCanonicalM, ms.back());
  Plan canon;
  if (absl::Status s = MakePlan(canon_spec, kCanonicalN, &canon); !s.ok()) {
    FreePlan(&canon);
    return s;
  }
  constexpr int kMaxCandidates = 16;
  cublasLtMatmulHeuristicResult_t res[kMaxCandidates];
  int found = 0;
  const absl::Status hs = Heuristic(canon, workspace_bytes, Alignment(g.a), Alignment(g.b), Alignment(g.c),
                                    /*no_split_k=*/true, kMaxCandidates, res, &found);
  FreePlan(&canon);
  if (!hs.ok()) return hs;
  // The first candidate valid for every probe row count (and m, when m_invariant).
  for (int i = 0; i < found; ++i) {
    bool fits = true;
    for (int64_t m : ms) {
      GemmSpec gm = g;
      gm.m = m;
      for (int64_t n : kProbeNs) {
        Plan probe;
        cublasLtMatmulHeuristicResult_t check{};
        fits = MakePlan(gm, n, &probe).ok() &&
               cublasLtMatmulAlgoCheck(lt_, probe.desc, probe.la, probe.lb, probe.lc, probe.lc, &res[i].algo, &check) ==
                   CUBLAS_STATUS_SUCCESS &&
               check.workspaceSize <= workspace_bytes;
        FreePlan(&probe);
        if (!fits) break;
      }
      if (!fits) break;
    }
    if (fits) {
      *algo = res[i].algo;
      return absl::OkStatus();
    }
  }
  std::string why;
  for (int64_t n : kProbeNs) {  // what the first candidate lacks, for the log
    Plan probe;
    cublasLtMatmulHeuristicResult_t check{};
    const cublasStatus_t cs =
        found == 0 || !MakePlan(g, n, &probe).ok()
            ? CUBLAS_STATUS_NOT_SUPPORTED
            : cublasLtMatmulAlgoCheck(lt_, probe.desc, probe.la, probe.lb, probe.lc, probe.lc, &res[0].algo, &check);
    FreePlan(&probe);
    if (cs != CUBLAS_STATUS_SUCCESS || check.workspaceSize > workspace_bytes) {
      absl::StrAppend(&why, " n=", n, ":", static_cast<int>(cs), "/ws", check.workspaceSize);
    }
  }
  return absl::NotFoundError(absl::StrCat("no cuBLASLt algorithm without split-K fits every row count (", found,
                                          " candidates; the first fails at", why, ")"));
}

absl::Status GemmRunner::ChooseAlgo(const GemmSpec& g, bool c_is_scratch, float* tune_scratch, int64_t tune_floats,
                                    void* workspace, size_t workspace_bytes, cudaStream_t stream, Plan* plan) {
  // n_invariant problems: exact m and k (fixed by the head's shape, so few), one entry for every n.
  const int64_t m_class = g.m_invariant ? 0 : g.n_invariant ? g.m : SizeClass(g.m);
  const Key size_class =
      KeyOf(g, m_class, g.n_invariant ? 0 : SizeClass(g.n), g.n_invariant ? g.k : SizeClass(g.k), g.beta != 0.0f);
  auto tuned = algos_.find(size_class);
  if (tuned == algos_.end() && g.n_invariant) {
    cublasLtMatmulAlgo_t algo;
    if (absl::Status s = CanonicalAlgo(g, workspace_bytes, &algo); s.ok()) {
      tuned = algos_.emplace(size_class, algo).first;
    } else if (absl::IsNotFound(s)) {
      std::fprintf(stderr, "lce: m=%ld k=%ld: %s\n", static_cast<long>(g.m), static_cast<long>(g.k),
                   std::string(s.message()).c_str());
    } else {
      return s;
    }
  }
  cublasLtMatmulHeuristicResult_t check{};
  if (tuned != algos_.end() &&
      cublasLtMatmulAlgoCheck(lt_, plan->desc, plan->la, plan->lb, plan->lc, plan->lc, &tuned->second, &check) ==
          CUBLAS_STATUS_SUCCESS &&
      check.workspaceSize <= workspace_bytes) {
    plan->algo = tuned->second;
    plan->has_algo = true;
    return absl::OkStatus();
  }
  if (g.n_invariant) {
    // Served, but this shape's results may then vary with the row count in their last bits.
    std::fprintf(stderr, "lce: no batch-invariant GEMM algorithm for m=%ld n=%ld k=%ld; using a tuned one\n",
                 static_cast<long>(g.m), static_cast<long>(g.n), static_cast<long>(g.k));
  }
  absl::Status s = Tune(g, c_is_scratch, tune_scratch, tune_floats, workspace, workspace_bytes, stream, plan);
  if (s.ok()) algos_[size_class] = plan->algo;
  return s;
}

absl::Status GemmRunner::FindPlan(const GemmSpec& g, bool c_is_scratch, float* tune_scratch, int64_t tune_floats,
                                  void* workspace, size_t workspace_bytes, cudaStream_t stream, const Plan** out) {
  const Key key = KeyOf(g, g.m, g.n, g.k, g.beta != 0.0f);
  auto it = plans_.find(key);
  if (it == plans_.end()) {
    if (plans_.size() >= kMaxPlans) {  // many row counts seen: start over (their algorithms stay)
      for (auto& [k, old] : plans_) FreePlan(&old);
      plans_.clear();
    }
    Plan plan;
    absl::Status s = MakePlan(g, g.n, &plan);
    if (s.ok()) s = ChooseAlgo(g, c_is_scratch, tune_scratch, tune_floats, workspace, workspace_bytes, stream, &plan);
    if (!s.ok()) {
      FreePlan(&plan);
      return s;
    }
    it = plans_.emplace(key, plan).first;
  }
  *out = &it->second;
  return absl::OkStatus();
}

absl::Status GemmRunner::Prepare(const GemmSpec& g, bool c_is_scratch, float* tune_scratch, int64_t tune_floats,
                                 void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (g.m <= 0 || g.n <= 0 || g.k <= 0) return absl::OkStatus();  // Run says what is wrong with it
  const Plan* p = nullptr;
  return FindPlan(g, c_is_scratch, tune_scratch, tune_floats, workspace, workspace_bytes, stream, &p);
}

absl::Status GemmRunner::Run(const GemmSpec& g, bool c_is_scratch, float* tune_scratch, int64_t tune_floats,
                             void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (g.m <= 0 || g.n <= 0) return absl::OkStatus();
  if (g.k <= 0) return absl::InternalError("GEMM with k = 0");
  const Plan* p = nullptr;
  if (absl::Status s = FindPlan(g, c_is_scratch, tune_scratch, tune_floats, workspace, workspace_bytes, stream, &p);
      !s.ok()) {
    return s;
  }
  const float alpha = 1.0f;
  LCE_CUDA_CHECK(cublasLtMatmul(lt_, p->desc, &alpha, g.a, p->la, g.b, p->lb, &g.beta, g.c, p->lc, g.c, p->lc, &p->algo,
                                workspace, workspace_bytes, stream));
  return absl::OkStatus();
}

}  // namespace lce::cuda
