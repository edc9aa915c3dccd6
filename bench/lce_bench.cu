// Benchmark of the CUDA LCE engine against the cuBLAS GEMM floor, same process, same inputs.
//
// For each shape N×H×V (bf16): inputs drawn like ../shared/bench/peers.py (h ~ 0.5·N(0,1),
// W ~ N(0,1)/sqrt(H), targets uniform with 5% ignore_index), all in device memory (MemorySpace::kDevice).
//   floor  one bf16 [N,H]×[H,V] cublasGemmEx (fp32 accumulate, bf16 out, as torch's a @ b.t())
//   train  Compute(kLoss, mean over valid rows): loss, d_hidden (bf16), d_weight (fp32, accumulated)
//   score  Compute(kNone): logprob + entropy (--score-logprob-only: logprob alone, as QuACK's and Liger's
//          loss-only forwards; the epilogue then skips the entropy's statistic)
//   --epi-ab: score and train again with LCE_CUDA_EPILOGUE_STATS=0 and =1 in turns (two rounds of each,
//          one engine; the epilogue-statistics GEMM where built), and the largest |difference| of the two
//          paths' logprob, entropy, loss and d_hidden
// Median of --reps timed calls after --warmup, CUDA events. Extra memory = device memory the engine
// takes beyond its weight copy (cudaMemGetInfo around the first calls; outputs are the caller's).
//
// Options of the loss (train and score): --bias (the head has a bias ~ 0.1·N(0,1); train also returns dB),
// --label-smoothing E, --class-weights (w_j = 0.5 + (j mod 101)/100), --softcap S.
//
// Usage: lce_bench [--shapes 8192x4096x128256,...] [--reps 10] [--warmup 3] [--json FILE] [--epi-ab]
//                  [--score-logprob-only] [--bias] [--label-smoothing E] [--class-weights] [--softcap S]
//                  [--workspace-mib M]  (EngineConfig::workspace_bytes, default 1024: fewer row blocks with more)
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench_check.h"
#include "cuda/gemm.h"
#include "lce/cuda_tuning.h"
#include "lce/engine.h"

namespace {

__device__ uint64_t Mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

__global__ void NormalBf16(__nv_bfloat16* out, int64_t n, float scale, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t r = Mix(seed * 0x9e3779b97f4a7c15ULL + static_cast<uint64_t>(i));
    const float u1 = ((r >> 40) + 1) * (1.0f / 16777217.0f);
    const float u2 = ((r >> 16) & 0xffffff) * (1.0f / 16777216.0f);
    out[i] = __float2bfloat16_rn(scale * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2));
  }
}

__global__ void Targets(int32_t* t, float* g, int64_t n, int64_t v, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t r = Mix(seed * 0x9e3779b97f4a7c15ULL + static_cast<uint64_t>(i));
    const bool ignored = (r & 0xffff) < 0.05 * 65536;
    t[i] = ignored ? -100 : static_cast<int32_t>((r >> 20) % static_cast<uint64_t>(v));
    g[i] = ignored ? 0.0f : 1.0f;  // rescaled to 1/N_valid on the host
  }
}

template <typename F>
double MedianMs(F&& f, int warmup, int reps, cudaStream_t stream, std::vector<float>* all = nullptr) {
  for (int i = 0; i < warmup; ++i) f();
  std::vector<float> ms;
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < reps; ++i) {
    CHECK_CUDA(cudaEventRecord(a, stream));
    f();
    CHECK_CUDA(cudaEventRecord(b, stream));
    CHECK_CUDA(cudaEventSynchronize(b));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  if (all != nullptr) all->insert(all->end(), ms.begin(), ms.end());
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

int64_t FreeBytes() {
  size_t free_b = 0, total = 0;
  CHECK_CUDA(cudaMemGetInfo(&free_b, &total));
  return static_cast<int64_t>(free_b);
}

struct Row {
  int64_t N, H, V;
  double gemm_ms, train_ms, score_ms, extra_gib, loss;
  double off_ms = NAN, on_ms = NAN, d_logprob = NAN, d_entropy = NAN;          // --epi-ab: score
  double train_off_ms = NAN, train_on_ms = NAN, d_loss = NAN, d_hidden = NAN;  // --epi-ab: train
};

double MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(static_cast<double>(a[i]) - b[i]));
  return m;
}

// --epi-ab: score and train with the epilogue-statistics GEMM off and on (CudaTuning::epilogue_stats,
// LCE_CUDA_EPILOGUE_STATS=0 and =1) in turns on one engine (two rounds of each, the faster round kept), then
// each path once more to compare their outputs.
void SetEpilogueStats(lce::LceEngine& engine, bool on) {
  lce::CudaTuning t = lce::CudaTuningFromEnv();
  t.epilogue_stats = on;
  const absl::Status st = lce::SetCudaTuning(engine, t);
  if (!st.ok()) {
    std::fprintf(stderr, "SetCudaTuning: %s\n", st.ToString().c_str());
    std::exit(1);
  }
}

template <class Score, class Train>
void EpilogueAb(lce::LceEngine& engine, int64_t N, int64_t H, Score score, Train train, const float* lp,
                const float* ent, const float* loss, const __nv_bfloat16* dh, int warmup, int reps, cudaStream_t stream,
                Row* row) {
  std::vector<float> s_ms[2], t_ms[2];
  for (int round = 0; round < 2; ++round) {
    for (int on = 0; on < 2; ++on) {
      SetEpilogueStats(engine, on != 0);
      s_ms[on].push_back(static_cast<float>(MedianMs(score, warmup, reps, stream)));
      t_ms[on].push_back(static_cast<float>(MedianMs(train, warmup, reps, stream)));
    }
  }
  std::vector<float> lp_[2], ent_[2], loss_[2], dh_[2];
  std::vector<__nv_bfloat16> dh_raw(N * H);
  for (int on = 0; on < 2; ++on) {
    SetEpilogueStats(engine, on != 0);
    score();
    train();
    CHECK_CUDA(cudaDeviceSynchronize());
    for (auto [dst, src] : {std::pair{&lp_[on], lp}, std::pair{&ent_[on], ent}, std::pair{&loss_[on], loss}}) {
      dst->resize(N);
      CHECK_CUDA(cudaMemcpy(dst->data(), src, N * 4, cudaMemcpyDeviceToHost));
    }
    CHECK_CUDA(cudaMemcpy(dh_raw.data(), dh, N * H * 2, cudaMemcpyDeviceToHost));
    dh_[on].resize(N * H);
    for (int64_t i = 0; i < N * H; ++i) dh_[on][i] = __bfloat162float(dh_raw[i]);
  }
  const absl::Status restored = lce::SetCudaTuning(engine, lce::CudaTuningFromEnv());  // as the engine was made
  if (!restored.ok()) std::fprintf(stderr, "SetCudaTuning: %s\n", restored.ToString().c_str());
  row->off_ms = std::min(s_ms[0][0], s_ms[0][1]);
  row->on_ms = std::min(s_ms[1][0], s_ms[1][1]);
  row->train_off_ms = std::min(t_ms[0][0], t_ms[0][1]);
  row->train_on_ms = std::min(t_ms[1][0], t_ms[1][1]);
  row->d_logprob = MaxAbsDiff(lp_[1], lp_[0]);
  row->d_entropy = MaxAbsDiff(ent_[1], ent_[0]);
  row->d_loss = MaxAbsDiff(loss_[1], loss_[0]);
  row->d_hidden = MaxAbsDiff(dh_[1], dh_[0]);
  std::printf(
      "N=%ld H=%ld V=%ld: switch off/on: score %.3f / %.3f ms (rounds %.3f/%.3f, %.3f/%.3f), train %.3f / "
      "%.3f ms (rounds %.3f/%.3f, %.3f/%.3f) | max |d logprob| %.2e |d entropy| %.2e |d loss| %.2e "
      "|d d_hidden| %.2e\n",
      row->N, row->H, row->V, row->off_ms, row->on_ms, s_ms[0][0], s_ms[0][1], s_ms[1][0], s_ms[1][1],
      row->train_off_ms, row->train_on_ms, t_ms[0][0], t_ms[0][1], t_ms[1][0], t_ms[1][1], row->d_logprob,
      row->d_entropy, row->d_loss, row->d_hidden);
}

// --top-k K: the score (and, unless --score-only, the training step: `train` given the options and row
// outputs) again with each row's top K and argmax, its time against the plain call's.
void TimeRankings(lce::LceEngine& engine, const lce::RowsView& view, float* lp, float* ent, bool logprob_only,
                  int64_t N, int k, int warmup, int reps, cudaStream_t stream, double score_ms,
                  const std::function<void(const lce::LceOptions&, const lce::RowOutputs&)>& train, double train_ms) {
  int32_t *argmax = nullptr, *tokens = nullptr;
  float* logprobs = nullptr;
  CHECK_CUDA(cudaMalloc(&argmax, N * 4));
  CHECK_CUDA(cudaMalloc(&tokens, N * k * 4));
  CHECK_CUDA(cudaMalloc(&logprobs, N * k * 4));
  lce::LceOptions opt;
  opt.top_k = k;
  lce::RowOutputs out{lp, logprob_only ? nullptr : ent};
  out.argmax = argmax;
  out.top_tokens = tokens;
  out.top_logprobs = logprobs;
  auto ranked = [&] {
    absl::Status st = engine.Compute(view, opt, {}, out, {});
    if (!st.ok()) {
      std::fprintf(stderr, "score with rankings: %s\n", st.ToString().c_str());
      std::exit(1);
    }
  };
  const double ms = MedianMs(ranked, warmup, reps, stream);
  std::printf("N=%ld: score with top-%d and argmax %.3f ms (x%.3f of the plain score's %.3f ms)\n", N, k, ms,
              ms / score_ms, score_ms);
  if (train) {
    lce::RowOutputs train_out;
    train_out.argmax = argmax;
    train_out.top_tokens = tokens;
    train_out.top_logprobs = logprobs;
    const double t_ms = MedianMs([&] { train(opt, train_out); }, warmup, reps, stream);
    std::printf("N=%ld: train with top-%d and argmax %.3f ms (x%.3f of the plain train's %.3f ms)\n", N, k, t_ms,
                t_ms / train_ms, train_ms);
  }
  for (void* p : {static_cast<void*>(argmax), static_cast<void*>(tokens), static_cast<void*>(logprobs)}) cudaFree(p);
}

// One product --probe times: C[m,n] = op(A)·op(B), bf16 inputs, into the probe's output buffer.
struct ProbeGemm {
  const char* name;
  cublasOperation_t ta, tb;
  int64_t m, n, k;
  const void* A;
  int64_t lda;
  const void* B;
  int64_t ldb;
  int64_t ldc;
};

// g through cublasGemmEx: beta 1 / 0 into fp32, beta 0 into bf16.
void ProbeGemmEx(cublasHandle_t cublas, const ProbeGemm& g, int64_t R, void* c) {
  const float one = 1.0f, zero = 0.0f;
  const double flop = 2.0 * g.m * g.n * g.k;
  for (int variant = 0; variant < 3; ++variant) {
    const float* beta = variant == 0 ? &one : &zero;
    const cudaDataType_t ct = variant == 2 ? CUDA_R_16BF : CUDA_R_32F;
    auto f = [&] {
      CHECK_CUBLAS(cublasGemmEx(cublas, g.ta, g.tb, g.m, g.n, g.k, &one, g.A, CUDA_R_16BF, g.lda, g.B, CUDA_R_16BF,
                                g.ldb, beta, c, ct, g.ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    };
    const double ms = MedianMs(f, 3, 10, nullptr);
    std::printf("probe R=%ld %s GemmEx %s %s: %.3f ms (%.0f TFLOP/s)\n", R, g.name, variant == 0 ? "beta=1" : "beta=0",
                variant == 2 ? "bf16-out" : "fp32-out", ms, flop / ms / 1e9);
  }
}

// g through every cuBLASLt heuristic candidate, fp32 out, beta as the engine uses it (1 for dW, 0 for the forward).
void ProbeLtCandidates(cublasLtHandle_t lt, const ProbeGemm& g, int64_t R, void* c, void* ws, size_t ws_bytes) {
  const float one = 1.0f, zero = 0.0f;
  const float* beta = g.ta == CUBLAS_OP_N ? &one : &zero;
  const double flop = 2.0 * g.m * g.n * g.k;
  cublasLtMatmulDesc_t desc;
  CHECK_CUBLAS(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &g.ta, sizeof(g.ta)));
  CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &g.tb, sizeof(g.tb)));
  cublasLtMatrixLayout_t la, lb, lc;
  const bool ta = g.ta == CUBLAS_OP_T, tb = g.tb == CUBLAS_OP_T;
  CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, ta ? g.k : g.m, ta ? g.m : g.k, g.lda));
  CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, tb ? g.n : g.k, tb ? g.k : g.n, g.ldb));
  CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, g.m, g.n, g.ldc));
  cublasLtMatmulPreference_t pref;
  CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
  CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                                    sizeof(ws_bytes)));
  cublasLtMatmulHeuristicResult_t res[16];
  int found = 0;
  CHECK_CUBLAS(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 16, res, &found));
  for (int i = 0; i < found; ++i) {
    auto f = [&] {
      CHECK_CUBLAS(
          cublasLtMatmul(lt, desc, &one, g.A, la, g.B, lb, beta, c, lc, c, lc, &res[i].algo, ws, ws_bytes, nullptr));
    };
    const double ms = MedianMs(f, 2, 6, nullptr);
    std::printf("probe R=%ld %s n=%ld Lt algo %2d (%s): %.3f ms (%.0f TFLOP/s)\n", R, g.name, g.n, i,
                lce::cuda::DescribeGemmAlgo(res[i].algo).c_str(), ms, flop / ms / 1e9);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatmulDescDestroy(desc);
}

// --probe R: times the GEMM shapes the engine runs per row block of R rows with cublasGemmEx (beta 1 / 0,
// fp32 / bf16 out) and every cuBLASLt heuristic candidate (its configuration beside it): the fast path's dW
// product whole (all V columns, as it runs) and on the R columns its timing slice holds (GemmRunner::Tune
// times out-of-place products there: bench/NOTES.md e24), and a forward logit tile.
void Probe(int64_t R, int64_t H, int64_t V, cublasHandle_t cublas) {
  const int64_t lds = (V + 7) / 8 * 8, tile = 8192, slice = std::min(V, R / 256 * 256);
  __nv_bfloat16 *h, *da, *w;
  float* c;
  CHECK_CUDA(cudaMalloc(&h, R * H * 2));
  CHECK_CUDA(cudaMalloc(&da, R * lds * 2));
  CHECK_CUDA(cudaMalloc(&w, tile * H * 2));
  CHECK_CUDA(cudaMalloc(&c, std::max(H * V, R * tile) * 4));
  NormalBf16<<<4096, 256>>>(h, R * H, 0.5f, 11);
  NormalBf16<<<4096, 256>>>(da, R * lds, 1e-3f, 12);
  NormalBf16<<<4096, 256>>>(w, tile * H, 0.02f, 13);
  CHECK_CUDA(cudaMemset(c, 0, std::max(H * V, R * tile) * 4));
  const ProbeGemm gs[3] = {{"dW whole  NT", CUBLAS_OP_N, CUBLAS_OP_T, H, V, R, h, H, da, lds, H},
                           {"dW slice  NT", CUBLAS_OP_N, CUBLAS_OP_T, H, slice, R, h, H, da, lds, H},
                           {"fwd tile  TN", CUBLAS_OP_T, CUBLAS_OP_N, tile, R, H, w, H, h, H, tile}};
  cublasLtHandle_t lt;
  CHECK_CUBLAS(cublasLtCreate(&lt));
  void* ws;
  const size_t ws_bytes = 32 << 20;
  CHECK_CUDA(cudaMalloc(&ws, ws_bytes));
  for (const ProbeGemm& g : gs) {
    if (g.n == 0) continue;  // R < 256: the engine times no slice (it takes the heuristic's first)
    ProbeGemmEx(cublas, g, R, c);
    ProbeLtCandidates(lt, g, R, c, ws, ws_bytes);
  }
  std::fflush(stdout);
  cublasLtDestroy(lt);
  for (void* p : {static_cast<void*>(h), static_cast<void*>(da), static_cast<void*>(w), static_cast<void*>(c), ws})
    cudaFree(p);
}

struct BenchArgs {
  std::string shapes = "8192x4096x128256,16384x2048x151936,4096x8192x152064,16384x4096x151936";
  std::string json;
  int reps = 10, warmup = 3;
  int top_k = 0;  // --top-k K: also a score with the rankings (argmax, top K), its time beside the plain score's
  int64_t probe_rows = 0;
  bool score_ab = false;
  bool logprob_only = false;
  bool score_only = false;  // times the score alone (train reported as 0)
  bool with_bias = false, class_weights = false;
  int64_t workspace_mib = 0;  // 0: EngineConfig's default
  float label_smoothing = 0.0f, softcap = 0.0f;
};

// The command line into *a; false (the argument named on stderr) on one it does not know.
bool ParseArgs(int argc, char** argv, BenchArgs* a) {
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (s == "--shapes")
      a->shapes = next();
    else if (s == "--json")
      a->json = next();
    else if (s == "--reps")
      a->reps = std::atoi(next().c_str());
    else if (s == "--warmup")
      a->warmup = std::atoi(next().c_str());
    else if (s == "--epi-ab")
      a->score_ab = true;
    else if (s == "--score-logprob-only")
      a->logprob_only = true;
    else if (s == "--score-only")
      a->score_only = true;
    else if (s == "--probe")
      a->probe_rows = std::atoll(next().c_str());
    else if (s == "--workspace-mib")
      a->workspace_mib = std::atoll(next().c_str());
    else if (s == "--bias")
      a->with_bias = true;
    else if (s == "--class-weights")
      a->class_weights = true;
    else if (s == "--label-smoothing")
      a->label_smoothing = std::strtof(next().c_str(), nullptr);
    else if (s == "--softcap")
      a->softcap = std::strtof(next().c_str(), nullptr);
    else if (s == "--top-k")
      a->top_k = std::atoi(next().c_str());
    else {
      std::fprintf(stderr, "unknown argument %s\n", s.c_str());
      return false;
    }
  }
  return true;
}

struct Shape {
  int64_t N = 0, H = 0, V = 0;
};

// --shapes' comma-separated N×H×V; false (the shape named on stderr) on one that does not parse.
bool ParseShapes(const std::string& list, std::vector<Shape>* shapes) {
  size_t pos = 0;
  while (pos < list.size()) {
    size_t end = list.find(',', pos);
    if (end == std::string::npos) end = list.size();
    const std::string s = list.substr(pos, end - pos);
    pos = end + 1;
    Shape sh;
    if (std::sscanf(s.c_str(), "%ldx%ldx%ld", &sh.N, &sh.H, &sh.V) != 3) {
      std::fprintf(stderr, "bad shape %s\n", s.c_str());
      return false;
    }
    shapes->push_back(sh);
  }
  return true;
}

void PrintDevice(const BenchArgs& a) {
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf(
      "device: %s (%d SMs)  score: %s  bias %d, class weights %d, label smoothing %g, softcap %g  "
      "LCE_CUDA_VOCAB_TILE=%s LCE_CUDA_MAX_ROWS=%s\n",
      prop.name, prop.multiProcessorCount, a.logprob_only ? "logprob only" : "logprob + entropy", a.with_bias ? 1 : 0,
      a.class_weights ? 1 : 0, a.label_smoothing, a.softcap,
      std::getenv("LCE_CUDA_VOCAB_TILE") ? std::getenv("LCE_CUDA_VOCAB_TILE") : "-",
      std::getenv("LCE_CUDA_MAX_ROWS") ? std::getenv("LCE_CUDA_MAX_ROWS") : "-");
}

// A shape's inputs in device memory, drawn as peers.py draws them; g = 1/N_valid on the valid rows.
struct Inputs {
  __nv_bfloat16 *h = nullptr, *w = nullptr;
  int32_t* t = nullptr;
  float* g = nullptr;
  double valid = 0;
};

Inputs MakeInputs(const Shape& s) {
  Inputs in;
  CHECK_CUDA(cudaMalloc(&in.h, s.N * s.H * 2));
  CHECK_CUDA(cudaMalloc(&in.w, s.V * s.H * 2));
  CHECK_CUDA(cudaMalloc(&in.t, s.N * 4));
  CHECK_CUDA(cudaMalloc(&in.g, s.N * 4));
  NormalBf16<<<4096, 256>>>(in.h, s.N * s.H, 0.5f, 1);
  NormalBf16<<<4096, 256>>>(in.w, s.V * s.H, 1.0f / std::sqrt(static_cast<float>(s.H)), 2);
  Targets<<<256, 256>>>(in.t, in.g, s.N, s.V, 3);
  CHECK_CUDA(cudaGetLastError());
  std::vector<float> gh(s.N);
  CHECK_CUDA(cudaMemcpy(gh.data(), in.g, s.N * 4, cudaMemcpyDeviceToHost));
  for (float x : gh) in.valid += x;
  for (float& x : gh) x = x / static_cast<float>(in.valid);
  CHECK_CUDA(cudaMemcpy(in.g, gh.data(), s.N * 4, cudaMemcpyHostToDevice));
  return in;
}

// The floor: one bf16 GEMM [N,H]x[H,V] -> [N,V] bf16, 20 runs after `warmup`, their times appended to *ms.
void TimeFloor(cublasHandle_t cublas, const Inputs& in, const Shape& s, int warmup, cudaStream_t stream,
               std::vector<float>* ms) {
  __nv_bfloat16* logits = nullptr;
  CHECK_CUDA(cudaMalloc(&logits, s.N * s.V * 2));
  const float one = 1.0f, zero = 0.0f;
  auto gemm = [&] {
    CHECK_CUBLAS(cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(s.V), static_cast<int>(s.N),
                              static_cast<int>(s.H), &one, in.w, CUDA_R_16BF, static_cast<int>(s.H), in.h, CUDA_R_16BF,
                              static_cast<int>(s.H), &zero, logits, CUDA_R_16BF, static_cast<int>(s.V),
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  };
  MedianMs(gemm, warmup, 20, stream, ms);
  CHECK_CUDA(cudaDeviceSynchronize());
  CHECK_CUDA(cudaFree(logits));
}

// The engine's copy of the head: in.w's bytes, and with --bias a bias ~ 0.1·N(0,1).
std::shared_ptr<lce::HeadWeights> HeadOf(const BenchArgs& a, const Inputs& in, const Shape& s) {
  auto head = std::make_shared<lce::HeadWeights>();
  head->shape.vocab_size = s.V;
  head->shape.hidden_size = s.H;
  head->shape.dtype = lce::DType::kBFloat16;
  head->shape.shard_rows = s.V;
  head->weight.resize(s.V * s.H * 2);
  CHECK_CUDA(cudaMemcpy(head->weight.data(), in.w, s.V * s.H * 2, cudaMemcpyDeviceToHost));
  if (a.with_bias) {
    head->shape.has_bias = true;
    std::mt19937 rng(5);
    std::normal_distribution<float> normal(0.0f, 0.1f);
    for (int64_t j = 0; j < s.V; ++j) head->bias.push_back(normal(rng));
  }
  return head;
}

// The caller's buffers of a call: gradients, row outputs and (--class-weights) w_j = 0.5 + (j mod 101)/100.
struct Outputs {
  __nv_bfloat16* dh = nullptr;
  float *dw = nullptr, *lp = nullptr, *ent = nullptr, *loss = nullptr, *db = nullptr, *cw = nullptr;
};

Outputs MakeOutputs(const BenchArgs& a, const Shape& s) {
  Outputs o;
  if (a.with_bias) {
    CHECK_CUDA(cudaMalloc(&o.db, s.V * 4));
    CHECK_CUDA(cudaMemset(o.db, 0, s.V * 4));
  }
  if (a.class_weights) {
    std::vector<float> host_cw(s.V);
    for (int64_t j = 0; j < s.V; ++j) host_cw[j] = 0.5f + static_cast<float>(j % 101) / 100.0f;
    CHECK_CUDA(cudaMalloc(&o.cw, s.V * 4));
    CHECK_CUDA(cudaMemcpy(o.cw, host_cw.data(), s.V * 4, cudaMemcpyHostToDevice));
  }
  CHECK_CUDA(cudaMalloc(&o.dh, s.N * s.H * 2));
  CHECK_CUDA(cudaMalloc(&o.dw, s.V * s.H * 4));
  CHECK_CUDA(cudaMemset(o.dw, 0, s.V * s.H * 4));
  CHECK_CUDA(cudaMalloc(&o.lp, s.N * 4));
  CHECK_CUDA(cudaMalloc(&o.ent, s.N * 4));
  CHECK_CUDA(cudaMalloc(&o.loss, s.N * 4));
  CHECK_CUDA(cudaDeviceSynchronize());
  return o;
}

void FreeAll(const Inputs& in, const Outputs& o) {
  for (void* p :
       {static_cast<void*>(in.h), static_cast<void*>(in.w), static_cast<void*>(in.t), static_cast<void*>(in.g),
        static_cast<void*>(o.dh), static_cast<void*>(o.dw), static_cast<void*>(o.lp), static_cast<void*>(o.ent),
        static_cast<void*>(o.loss), static_cast<void*>(o.db), static_cast<void*>(o.cw)}) {
    CHECK_CUDA(cudaFree(p));
  }
}

// The engine's train and score on one shape: their medians, the mean loss, the extra memory its first calls
// took beyond free_after_create, and (--top-k, --epi-ab) the rankings' and the two paths' times.
Row TimeEngine(const BenchArgs& a, lce::LceEngine& engine, const Inputs& in, const Outputs& o, const Shape& s,
               int64_t free_after_create, cudaStream_t stream) {
  lce::RowsView view{in.h, in.t, s.N, lce::MemorySpace::kDevice};
  view.class_weight = o.cw;
  lce::LceOptions opt;
  opt.label_smoothing = a.label_smoothing;
  opt.softcap = a.softcap;
  lce::Upstream train_up;
  train_up.mode = lce::GradMode::kLoss;
  train_up.grad_loss = in.g;
  // The training step with `call` and row outputs `out` (its loss added), as the timed one.
  auto train_with = [&](const lce::LceOptions& call, const lce::RowOutputs& out) {
    lce::GradOutputs grads{o.dh, o.dw};
    grads.d_bias = o.db;
    lce::RowOutputs with_loss = out;
    with_loss.loss = o.loss;
    lce::LceOptions c = call;
    c.label_smoothing = a.label_smoothing;
    c.softcap = a.softcap;
    absl::Status st = engine.Compute(view, c, train_up, with_loss, grads);
    if (!st.ok()) {
      std::fprintf(stderr, "train: %s\n", st.ToString().c_str());
      std::exit(1);
    }
  };
  auto train = [&] { train_with(opt, {}); };
  auto score = [&] {
    absl::Status st = engine.Compute(view, opt, {}, {o.lp, a.logprob_only ? nullptr : o.ent, nullptr, nullptr}, {});
    if (!st.ok()) {
      std::fprintf(stderr, "score: %s\n", st.ToString().c_str());
      std::exit(1);
    }
  };
  if (!a.score_only) train();
  score();
  CHECK_CUDA(cudaDeviceSynchronize());
  const int64_t free_after_calls = FreeBytes();
  std::vector<float> lh(s.N);
  CHECK_CUDA(cudaMemcpy(lh.data(), o.loss, s.N * 4, cudaMemcpyDeviceToHost));
  double mean_loss = 0;
  for (float x : lh) mean_loss += x;
  mean_loss /= in.valid;
  const double train_ms = a.score_only ? 0.0 : MedianMs(train, a.warmup, a.reps, stream);
  const double score_ms = MedianMs(score, a.warmup, a.reps, stream);
  if (a.top_k > 0) {
    TimeRankings(
        engine, view, o.lp, o.ent, a.logprob_only, s.N, a.top_k, a.warmup, a.reps, stream, score_ms,
        a.score_only ? nullptr : std::function<void(const lce::LceOptions&, const lce::RowOutputs&)>(train_with),
        train_ms);
  }
  const double extra = static_cast<double>(free_after_create - free_after_calls) / (1 << 30);
  Row row{s.N, s.H, s.V, 0, train_ms, score_ms, extra, mean_loss};
  if (a.score_ab) {
    EpilogueAb(engine, s.N, s.H, score, train, o.lp, o.ent, o.loss, o.dh, a.warmup, a.reps, stream, &row);
  }
  return row;
}

// One shape: the floor before and after the engine's runs (clocks drift by a few percent between calls; the
// median of both sets is the floor), the engine over the same weights between them, and its line printed.
Row BenchShape(const BenchArgs& a, const Shape& s, cublasHandle_t cublas, cudaStream_t stream) {
  const Inputs in = MakeInputs(s);
  std::vector<float> floor_ms;
  TimeFloor(cublas, in, s, 5, stream, &floor_ms);
  std::shared_ptr<lce::HeadWeights> head = HeadOf(a, in, s);
  const Outputs o = MakeOutputs(a, s);
  const int64_t free_before = FreeBytes();
  lce::EngineConfig engine_config;
  if (a.workspace_mib > 0) engine_config.workspace_bytes = a.workspace_mib << 20;
  auto created = lce::CreateEngine(lce::Backend::kCuda, head, engine_config);
  if (!created.ok()) {
    std::fprintf(stderr, "engine: %s\n", created.status().ToString().c_str());
    std::exit(1);
  }
  std::unique_ptr<lce::LceEngine> engine = std::move(*created);
  head.reset();
  const int64_t free_after_create = FreeBytes();
  Row row = TimeEngine(a, *engine, in, o, s, free_after_create, stream);
  engine.reset();
  TimeFloor(cublas, in, s, 3, stream, &floor_ms);
  std::sort(floor_ms.begin(), floor_ms.end());
  row.gemm_ms = floor_ms[floor_ms.size() / 2];
  std::printf(
      "N=%ld H=%ld V=%ld: gemm %.3f ms (%.0f TFLOP/s) | train %.2f ms (x%.3f of 3 GEMMs) | score %.2f ms "
      "(x%.3f) | extra %.2f GiB (weight copy %.2f GiB) | mean loss %.4f\n",
      s.N, s.H, s.V, row.gemm_ms, 2.0 * s.N * s.H * s.V / row.gemm_ms / 1e9, row.train_ms,
      row.train_ms / (3 * row.gemm_ms), row.score_ms, row.score_ms / row.gemm_ms, row.extra_gib,
      static_cast<double>(free_before - free_after_create) / (1 << 30), row.loss);
  std::fflush(stdout);
  FreeAll(in, o);
  return row;
}

void PrintTables(const std::vector<Row>& rows, bool score_ab) {
  std::printf("\n| N x H x V | GEMM ms | train ms | train/floor | score ms | score/floor | extra GiB |\n");
  std::printf("| --- | --- | --- | --- | --- | --- | --- |\n");
  for (const Row& r : rows) {
    std::printf("| %ldx%ldx%ld | %.3f | %.2f | %.3f | %.2f | %.3f | %.2f |\n", r.N, r.H, r.V, r.gemm_ms, r.train_ms,
                r.train_ms / (3 * r.gemm_ms), r.score_ms, r.score_ms / r.gemm_ms, r.extra_gib);
  }
  if (!score_ab) return;
  std::printf(
      "\n| N x H x V | GEMM ms | score off ms (/floor) | score on ms (/floor) | train off ms (/3 floors) | "
      "train on ms (/3 floors) | max d logprob, entropy, loss, d_hidden |\n");
  std::printf("| --- | --- | --- | --- | --- | --- | --- |\n");
  for (const Row& r : rows) {
    std::printf(
        "| %ldx%ldx%ld | %.3f | %.3f (%.3f) | %.3f (%.3f) | %.2f (%.3f) | %.2f (%.3f) | %.1e, %.1e, %.1e, %.1e |\n",
        r.N, r.H, r.V, r.gemm_ms, r.off_ms, r.off_ms / r.gemm_ms, r.on_ms, r.on_ms / r.gemm_ms, r.train_off_ms,
        r.train_off_ms / (3 * r.gemm_ms), r.train_on_ms, r.train_on_ms / (3 * r.gemm_ms), r.d_logprob, r.d_entropy,
        r.d_loss, r.d_hidden);
  }
}

void WriteJson(const std::string& path, const std::vector<Row>& rows) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return;
  std::fprintf(f, "[\n");
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    std::fprintf(f,
                 " {\"N\": %ld, \"H\": %ld, \"V\": %ld, \"impl\": \"lce_cuda\", \"gemm_ms\": %.4f, \"train_ms\": %.4f, "
                 "\"score_ms\": %.4f, \"train_over_floor\": %.4f, \"score_over_floor\": %.4f, "
                 "\"extra_gib\": %.3f, \"mean_loss\": %.5f}%s\n",
                 r.N, r.H, r.V, r.gemm_ms, r.train_ms, r.score_ms, r.train_ms / (3 * r.gemm_ms), r.score_ms / r.gemm_ms,
                 r.extra_gib, r.loss, i + 1 < rows.size() ? "," : "");
  }
  std::fprintf(f, "]\n");
  std::fclose(f);
}

}  // namespace

int main(int argc, char** argv) {
  BenchArgs a;
  std::vector<Shape> shapes;
  if (!ParseArgs(argc, argv, &a) || !ParseShapes(a.shapes, &shapes)) return 2;
  PrintDevice(a);
  cudaStream_t stream = nullptr;  // legacy default stream: orders with the engine's syncs
  cublasHandle_t cublas;
  CHECK_CUBLAS(cublasCreate(&cublas));
  if (a.probe_rows > 0) {
    if (shapes.empty()) {
      std::fprintf(stderr, "--probe needs a shape\n");
      return 2;
    }
    Probe(a.probe_rows, shapes.at(0).H, shapes.at(0).V, cublas);
    return 0;
  }
  std::vector<Row> rows;
  for (const Shape& s : shapes) rows.push_back(BenchShape(a, s, cublas, stream));
  PrintTables(rows, a.score_ab);
  if (!a.json.empty()) WriteJson(a.json, rows);
  cublasDestroy(cublas);
  return 0;
}
