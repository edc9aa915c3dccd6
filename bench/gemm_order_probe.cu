// Which cuBLASLt algorithms give d_hidden's product the same bits (issue 36)?
//
// d_hidden = dA · W is one GEMM over the whole vocabulary shard (column-major [H, n] = W[H, Vs] · dA[Vs, n],
// n = the block's rows). A row's result is the same bits whatever n only if the reduction over Vs is
// done in one order for every n. This probe, on fresh random inputs (row j of dA the same in every n):
//   1. for each n, every heuristic candidate of the plain product (split-K allowed or not): its time and
//      whether its columns equal the reference's bit for bit (reference: the heuristic's first
//      algorithm without split-K at n = 8192);
//   2. the product in S fixed vocabulary chunks: S partials from one strided-batched GEMM then an
//      ordered fp32 sum (the chunk's canonical algorithm, and the batched problem's own heuristic
//      choice), against S products accumulated in place (beta 1) in the same order: equal bits? times.
// Build and run on the GPU machine: nvcc -O2 -arch=sm_90a -o /tmp/probe bench/gemm_order_probe.cu -lcublasLt
//   /tmp/probe [H] [Vs] [S,S,...] [skip1]      (default 4096 151936 4,5,8; skip1: no part 1)
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CK(x)                                                                                        \
  do {                                                                                               \
    auto e_ = (x);                                                                                   \
    if (static_cast<int>(e_) != 0) {                                                                 \
      std::fprintf(stderr, "%s:%d: %s failed (%d)\n", __FILE__, __LINE__, #x, static_cast<int>(e_)); \
      std::exit(1);                                                                                  \
    }                                                                                                \
  } while (0)

namespace {

__global__ void Fill(__nv_bfloat16* out, int64_t n, float scale, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t x = seed * 0x9e3779b97f4a7c15ULL + static_cast<uint64_t>(i);
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    const float u = ((x >> 40) + 0.5f) * (1.0f / 16777216.0f);
    out[i] = __float2bfloat16_rn(scale * (2.0f * u - 1.0f));
  }
}

// out = p[0] + p[1] + ... + p[s-1], left to right.
__global__ void OrderedSum(float* out, const float* p, int s, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float acc = p[i];
    for (int j = 1; j < s; ++j) acc = acc + p[j * n + i];
    out[i] = acc;
  }
}

struct Layouts {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  ~Layouts() {
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

// [H, n] = W[H, k] · B[k, n], W leading dimension H, B leading dimension ldb; batch > 1: strided.
void Make(Layouts* l, int64_t H, int64_t n, int64_t k, int64_t ldb, int batch, int64_t sa, int64_t sb, int64_t sc) {
  CK(cublasLtMatmulDescCreate(&l->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  CK(cublasLtMatrixLayoutCreate(&l->a, CUDA_R_16BF, H, k, H));
  CK(cublasLtMatrixLayoutCreate(&l->b, CUDA_R_16BF, k, n, ldb));
  CK(cublasLtMatrixLayoutCreate(&l->c, CUDA_R_32F, H, n, H));
  if (batch > 1) {
    const int32_t bc = batch;
    for (auto [lay, stride] : {std::pair{l->a, sa}, std::pair{l->b, sb}, std::pair{l->c, sc}}) {
      CK(cublasLtMatrixLayoutSetAttribute(lay, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc, sizeof(bc)));
      CK(cublasLtMatrixLayoutSetAttribute(lay, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
    }
  }
}

int Heuristics(cublasLtHandle_t lt, const Layouts& l, bool no_split, size_t ws, cublasLtMatmulHeuristicResult_t* res,
               int cap) {
  cublasLtMatmulPreference_t pref;
  CK(cublasLtMatmulPreferenceCreate(&pref));
  CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  if (no_split) {
    const uint32_t none = CUBLASLT_REDUCTION_SCHEME_NONE;
    CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &none, sizeof(none)));
  }
  int found = 0;
  cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(lt, l.desc, l.a, l.b, l.c, l.c, pref, cap, res, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  return s == CUBLAS_STATUS_SUCCESS ? found : 0;
}

void Describe(const cublasLtMatmulAlgo_t& a, char* buf, size_t len) {
  int32_t id = 0, tile = 0, stages = 0, splitk = 0, red = 0, swz = 0, custom = 0;
  uint16_t cluster = 0, inner = 0;
  size_t w;
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof(id), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof(stages), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof(splitk), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &red, sizeof(red), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swz, sizeof(swz), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &custom, sizeof(custom), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof(cluster), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, &inner, sizeof(inner), &w);
  std::snprintf(buf, len, "id%d tile%d st%d sk%d red%d swz%d cu%d cl%u in%u", id, tile, stages, splitk, red, swz,
                custom, cluster, inner);
}

struct Probe {
  cublasLtHandle_t lt;
  cudaStream_t st;
  void* ws;
  size_t ws_bytes;
  cudaEvent_t e0, e1;

  // Median-free: best of 3 after a warm-up, ms; < 0 if the algorithm refuses.
  float Time(const Layouts& l, const cublasLtMatmulAlgo_t* algo, const void* A, const void* B, float* C, float beta) {
    const float alpha = 1.0f;
    float best = 1e30f;
    for (int rep = 0; rep < 4; ++rep) {
      CK(cudaEventRecord(e0, st));
      if (cublasLtMatmul(lt, l.desc, &alpha, A, l.a, B, l.b, &beta, C, l.c, C, l.c, algo, ws, ws_bytes, st) !=
          CUBLAS_STATUS_SUCCESS) {
        return -1.0f;
      }
      CK(cudaEventRecord(e1, st));
      CK(cudaEventSynchronize(e1));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      if (rep > 0) best = std::min(best, ms);
    }
    return best;
  }
};

std::vector<float> Host(const float* d, int64_t count) {
  std::vector<float> h(count);
  CK(cudaMemcpy(h.data(), d, count * sizeof(float), cudaMemcpyDeviceToHost));
  return h;
}

constexpr int64_t kMaxN = 8192;
constexpr int64_t kRowCounts[] = {1, 7, 64, 300, 1000, 4096, 8192};

// The probe's inputs (W [H, Vs] and dA [Vs, n] of random bf16, zero-padded to ldb) and the reference product.
struct Run {
  Probe pr{};
  int64_t H = 0, Vs = 0, ldb = 0;
  __nv_bfloat16 *W = nullptr, *dA = nullptr;
  float *C = nullptr, *ref = nullptr, *parts = nullptr;
  cublasLtMatmulAlgo_t ref_algo{};
  std::vector<float> ref_h;

  // Whether the [H, n] product at dev equals the reference's first n columns bit for bit.
  bool Same(const float* dev, int64_t n) const {
    const std::vector<float> h = Host(dev, H * n);
    return std::memcmp(h.data(), ref_h.data(), h.size() * 4) == 0;
  }
};

void SetUp(Run* r) {
  r->ldb = (r->Vs + 8 * 64 + 63) / 64 * 64;  // room for the chunks' zero padding
  CK(cublasLtCreate(&r->pr.lt));
  CK(cudaStreamCreate(&r->pr.st));
  r->pr.ws_bytes = 64u << 20;
  CK(cudaMalloc(&r->pr.ws, r->pr.ws_bytes));
  CK(cudaEventCreate(&r->pr.e0));
  CK(cudaEventCreate(&r->pr.e1));
  const int64_t H = r->H, Vs = r->Vs, ldb = r->ldb;
  CK(cudaMalloc(&r->W, H * ldb * 2));
  CK(cudaMalloc(&r->dA, ldb * kMaxN * 2));
  CK(cudaMalloc(&r->C, H * kMaxN * 4));
  CK(cudaMalloc(&r->ref, H * kMaxN * 4));
  CK(cudaMalloc(&r->parts, 8 * H * kMaxN * 4));
  Fill<<<1024, 256>>>(r->W, H * Vs, 0.03f, 1);
  Fill<<<1024, 256>>>(r->dA, ldb * kMaxN, 1e-3f, 2);
  CK(cudaMemset(r->W + H * Vs, 0, H * (ldb - Vs) * 2));
  CK(cudaMemset2D(r->dA + Vs, ldb * 2, 0, (ldb - Vs) * 2, kMaxN));
  CK(cudaDeviceSynchronize());
}

// Reference: the first no-split-K candidate at n = kMaxN; false if there is none.
bool MakeReference(Run* r) {
  cublasLtMatmulHeuristicResult_t res[1];
  Layouts l;
  Make(&l, r->H, kMaxN, r->Vs, r->ldb, 1, 0, 0, 0);
  if (Heuristics(r->pr.lt, l, true, r->pr.ws_bytes, res, 1) < 1) return false;
  r->ref_algo = res[0].algo;
  const float t = r->pr.Time(l, &r->ref_algo, r->W, r->dA, r->ref, 0.0f);
  char d[160];
  Describe(r->ref_algo, d, sizeof d);
  std::printf("reference n=%ld: %s  %.3f ms\n", static_cast<long>(kMaxN), d, t);
  r->ref_h = Host(r->ref, r->H * kMaxN);
  return true;
}

// 1. Every heuristic candidate at n rows: its time and whether it gives the reference's bits.
void CompareCandidates(Run& r, int64_t n) {
  cublasLtMatmulHeuristicResult_t res[32];
  Layouts l;
  Make(&l, r.H, n, r.Vs, r.ldb, 1, 0, 0, 0);
  const int found = Heuristics(r.pr.lt, l, false, r.pr.ws_bytes, res, 32);
  float best_all = 1e30f, best_same = 1e30f;
  int n_same = 0, n_nosplit = 0, n_nosplit_same = 0;
  for (int i = 0; i < found; ++i) {
    const float t = r.pr.Time(l, &res[i].algo, r.W, r.dA, r.C, 0.0f);
    if (t < 0) continue;
    const bool eq = r.Same(r.C, n);
    char d[160];
    Describe(res[i].algo, d, sizeof d);
    int32_t splitk = 1;
    size_t w;
    cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof(splitk), &w);
    const bool nosplit = splitk <= 1;
    n_nosplit += nosplit;
    n_same += eq;
    n_nosplit_same += nosplit && eq;
    best_all = std::min(best_all, t);
    if (eq) best_same = std::min(best_same, t);
    std::printf("  n=%-5ld %-58s %8.3f ms  %s\n", static_cast<long>(n), d, t, eq ? "SAME" : "differs");
  }
  // The reference's own algorithm at this n.
  const float t_ref = r.pr.Time(l, &r.ref_algo, r.W, r.dA, r.C, 0.0f);
  const bool ref_eq = t_ref >= 0 && r.Same(r.C, n);
  std::printf(
      "n=%-5ld candidates %d (no split-K %d): same bits %d (no split-K %d); best %.3f ms, best same-bits %.3f,"
      " reference algo %.3f (%s)\n",
      static_cast<long>(n), found, n_nosplit, n_same, n_nosplit_same, best_all, best_same, t_ref,
      ref_eq ? "same" : "DIFFERS");
}

// S products of c-column chunks accumulated in place into r.C (beta 1 after the first), best of two after a
// warm-up, ms.
float InPlaceMs(Run& r, const Layouts& l1, const cublasLtMatmulAlgo_t& canon, int S, int64_t c) {
  const float alpha = 1.0f;
  float t_in = -1;
  for (int rep = 0; rep < 3; ++rep) {
    CK(cudaEventRecord(r.pr.e0, r.pr.st));
    for (int s = 0; s < S; ++s) {
      const float beta = s == 0 ? 0.0f : 1.0f;
      CK(cublasLtMatmul(r.pr.lt, l1.desc, &alpha, r.W + s * c * r.H, l1.a, r.dA + s * c, l1.b, &beta, r.C, l1.c, r.C,
                        l1.c, &canon, r.pr.ws, r.pr.ws_bytes, r.pr.st));
    }
    CK(cudaEventRecord(r.pr.e1, r.pr.st));
    CK(cudaEventSynchronize(r.pr.e1));
    float t = 0;
    CK(cudaEventElapsedTime(&t, r.pr.e0, r.pr.e1));
    if (rep > 0) t_in = t_in < 0 ? t : std::min(t_in, t);
  }
  return t_in;
}

// 2. At n rows, S chunks of c columns: S partials by one strided-batched GEMM (the chunk's canonical algorithm,
// then the batched problem's own heuristic pick), each then summed in order, against S products in place.
void CompareChunks(Run& r, int S, int64_t c, const cublasLtMatmulAlgo_t& canon, int64_t n) {
  Layouts lb, l1;
  Make(&lb, r.H, n, c, r.ldb, S, c * r.H, c, r.H * n);
  Make(&l1, r.H, n, c, r.ldb, 1, 0, 0, 0);
  const auto sum = [&]() {
    OrderedSum<<<1024, 256, 0, r.pr.st>>>(r.C, r.parts, S, r.H * n);
    CK(cudaStreamSynchronize(r.pr.st));
    return Host(r.C, r.H * n);
  };
  const float t_bc = r.pr.Time(lb, &canon, r.W, r.dA, r.parts, 0.0f);
  const std::vector<float> a = t_bc >= 0 ? sum() : std::vector<float>{};
  float t_bh = -1;
  bool bh_same = false;
  char dh[160] = "-";
  cublasLtMatmulHeuristicResult_t res[1];
  if (Heuristics(r.pr.lt, lb, true, r.pr.ws_bytes, res, 1) >= 1) {
    Describe(res[0].algo, dh, sizeof dh);
    t_bh = r.pr.Time(lb, &res[0].algo, r.W, r.dA, r.parts, 0.0f);
    bh_same = t_bh >= 0 && sum() == a;
  }
  const float t_in = InPlaceMs(r, l1, canon, S, c);
  const bool in_same = Host(r.C, r.H * n) == a;
  std::printf(
      "  S=%d n=%-5ld batched canonical %.3f ms | batched heuristic %.3f ms (%s) %s | in place canonical"
      " %.3f ms %s\n",
      S, static_cast<long>(n), t_bc, t_bh, dh, bh_same ? "SAME" : "differs", t_in, in_same ? "SAME" : "differs");
}

// Fixed chunks of c = RoundUp(ceil(Vs / S), 64) columns (W's pad rows and dA's pad columns zero); false if the
// chunk has no no-split-K algorithm.
bool CompareChunkCount(Run& r, int S) {
  const int64_t c = ((r.Vs + S - 1) / S + 63) / 64 * 64;
  if (S * c > r.ldb) return true;
  cublasLtMatmulHeuristicResult_t res[1];
  Layouts lc;
  Make(&lc, r.H, kMaxN, c, r.ldb, 1, 0, 0, 0);
  if (Heuristics(r.pr.lt, lc, true, r.pr.ws_bytes, res, 1) < 1) return false;
  const cublasLtMatmulAlgo_t canon = res[0].algo;
  char d[160];
  Describe(canon, d, sizeof d);
  std::printf("S=%d chunk %ld: canonical (n=%ld, no split-K) %s\n", S, static_cast<long>(c), static_cast<long>(kMaxN),
              d);
  for (int64_t n : kRowCounts) CompareChunks(r, S, c, canon, n);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Run r;
  r.H = argc > 1 ? std::atoll(argv[1]) : 4096;
  r.Vs = argc > 2 ? std::atoll(argv[2]) : 151936;
  std::vector<int> chunk_counts;
  for (const char* p = argc > 3 ? argv[3] : "4,5,8"; *p != 0;) {
    chunk_counts.push_back(std::atoi(p));
    while (*p != 0 && *p != ',') ++p;
    if (*p == ',') ++p;
  }
  SetUp(&r);
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s  H=%ld Vs=%ld\n", prop.name, static_cast<long>(r.H), static_cast<long>(r.Vs));
  if (!MakeReference(&r)) return 1;
  if (argc <= 4) {
    for (int64_t n : kRowCounts) CompareCandidates(r, n);
  }
  for (int S : chunk_counts) {
    if (!CompareChunkCount(r, S)) return 1;
  }
  return 0;
}
