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
  double off_ms = NAN, on_ms = NAN, d_logprob = NAN, d_entropy = NAN;  // --epi-ab: score
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
  std::printf("N=%ld H=%ld V=%ld: switch off/on: score %.3f / %.3f ms (rounds %.3f/%.3f, %.3f/%.3f), train %.3f / "
              "%.3f ms (rounds %.3f/%.3f, %.3f/%.3f) | max |d logprob| %.2e |d entropy| %.2e |d loss| %.2e "
              "|d d_hidden| %.2e\n",
              row->N, row->H, row->V, row->off_ms, row->on_ms, s_ms[0][0], s_ms[0][1], s_ms[1][0], s_ms[1][1], row->train_off_ms,
              row->train_on_ms, t_ms[0][0], t_ms[0][1], t_ms[1][0], t_ms[1][1], row->d_logprob, row->d_entropy,
              row->d_loss, row->d_hidden);
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
  const float one = 1.0f, zero = 0.0f;
  struct G { const char* name; cublasOperation_t ta, tb; int64_t m, n, k; const void* A; int64_t lda; const void* B; int64_t ldb; int64_t ldc; };
  const G gs[3] = {{"dW whole  NT", CUBLAS_OP_N, CUBLAS_OP_T, H, V, R, h, H, da, lds, H},
                   {"dW slice  NT", CUBLAS_OP_N, CUBLAS_OP_T, H, slice, R, h, H, da, lds, H},
                   {"fwd tile  TN", CUBLAS_OP_T, CUBLAS_OP_N, tile, R, H, w, H, h, H, tile}};
  cublasLtHandle_t lt;
  CHECK_CUBLAS(cublasLtCreate(&lt));
  void* ws;
  const size_t ws_bytes = 32 << 20;
  CHECK_CUDA(cudaMalloc(&ws, ws_bytes));
  for (const G& g : gs) {
    if (g.n == 0) continue;  // R < 256: the engine times no slice (it takes the heuristic's first)
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
    // cuBLASLt candidates, fp32 out, beta as the engine uses it (1 for dW, 0 for the forward).
    const float* beta = g.ta == CUBLAS_OP_N ? &one : &zero;
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
        CHECK_CUBLAS(cublasLtMatmul(lt, desc, &one, g.A, la, g.B, lb, beta, c, lc, c, lc, &res[i].algo, ws, ws_bytes,
                                    nullptr));
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
  std::fflush(stdout);
  cublasLtDestroy(lt);
  for (void* p : {static_cast<void*>(h), static_cast<void*>(da), static_cast<void*>(w), static_cast<void*>(c), ws}) cudaFree(p);
}

}  // namespace

int main(int argc, char** argv) {
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
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--shapes") shapes = next();
    else if (a == "--json") json = next();
    else if (a == "--reps") reps = std::atoi(next().c_str());
    else if (a == "--warmup") warmup = std::atoi(next().c_str());
    else if (a == "--epi-ab") score_ab = true;
    else if (a == "--score-logprob-only") logprob_only = true;
    else if (a == "--score-only") score_only = true;
    else if (a == "--probe") probe_rows = std::atoll(next().c_str());
    else if (a == "--workspace-mib")
      workspace_mib = std::atoll(next().c_str());
    else if (a == "--bias")
      with_bias = true;
    else if (a == "--class-weights")
      class_weights = true;
    else if (a == "--label-smoothing")
      label_smoothing = std::strtof(next().c_str(), nullptr);
    else if (a == "--softcap")
      softcap = std::strtof(next().c_str(), nullptr);
    else if (a == "--top-k")
      top_k = std::atoi(next().c_str());
    else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf(
      "device: %s (%d SMs)  score: %s  bias %d, class weights %d, label smoothing %g, softcap %g  "
      "LCE_CUDA_VOCAB_TILE=%s LCE_CUDA_MAX_ROWS=%s\n",
      prop.name, prop.multiProcessorCount, logprob_only ? "logprob only" : "logprob + entropy", with_bias ? 1 : 0,
      class_weights ? 1 : 0, label_smoothing, softcap,
      std::getenv("LCE_CUDA_VOCAB_TILE") ? std::getenv("LCE_CUDA_VOCAB_TILE") : "-",
      std::getenv("LCE_CUDA_MAX_ROWS") ? std::getenv("LCE_CUDA_MAX_ROWS") : "-");
  cudaStream_t stream = nullptr;  // legacy default stream: orders with the engine's syncs
  cublasHandle_t cublas;
  CHECK_CUBLAS(cublasCreate(&cublas));
  std::vector<Row> rows;
  if (probe_rows > 0) {
    int64_t N = 0, H = 0, V = 0;
    std::sscanf(shapes.c_str(), "%ldx%ldx%ld", &N, &H, &V);
    Probe(probe_rows, H, V, cublas);
    return 0;
  }
  size_t pos = 0;
  while (pos < shapes.size()) {
    size_t end = shapes.find(',', pos);
    if (end == std::string::npos) end = shapes.size();
    const std::string s = shapes.substr(pos, end - pos);
    pos = end + 1;
    int64_t N = 0, H = 0, V = 0;
    if (std::sscanf(s.c_str(), "%ldx%ldx%ld", &N, &H, &V) != 3) {
      std::fprintf(stderr, "bad shape %s\n", s.c_str());
      return 2;
    }
    __nv_bfloat16 *h = nullptr, *w = nullptr, *dh = nullptr, *logits = nullptr;
    int32_t* t = nullptr;
    float *g = nullptr, *dw = nullptr, *lp = nullptr, *ent = nullptr, *loss = nullptr;
    CHECK_CUDA(cudaMalloc(&h, N * H * 2));
    CHECK_CUDA(cudaMalloc(&w, V * H * 2));
    CHECK_CUDA(cudaMalloc(&t, N * 4));
    CHECK_CUDA(cudaMalloc(&g, N * 4));
    NormalBf16<<<4096, 256>>>(h, N * H, 0.5f, 1);
    NormalBf16<<<4096, 256>>>(w, V * H, 1.0f / std::sqrt(static_cast<float>(H)), 2);
    Targets<<<256, 256>>>(t, g, N, V, 3);
    CHECK_CUDA(cudaGetLastError());
    std::vector<float> gh(N);
    CHECK_CUDA(cudaMemcpy(gh.data(), g, N * 4, cudaMemcpyDeviceToHost));
    double valid = 0;
    for (float x : gh) valid += x;
    for (float& x : gh) x = x / static_cast<float>(valid);
    CHECK_CUDA(cudaMemcpy(g, gh.data(), N * 4, cudaMemcpyHostToDevice));

    // Floor: one bf16 GEMM [N,H]x[H,V] -> [N,V] bf16.
    CHECK_CUDA(cudaMalloc(&logits, N * V * 2));
    const float one = 1.0f, zero = 0.0f;
    auto gemm = [&] {
      CHECK_CUBLAS(cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(V), static_cast<int>(N),
                                static_cast<int>(H), &one, w, CUDA_R_16BF, static_cast<int>(H), h, CUDA_R_16BF,
                                static_cast<int>(H), &zero, logits, CUDA_R_16BF, static_cast<int>(V),
                                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    };
    // The floor is timed before and after the engine's runs (clocks drift by a few percent between
    // calls); the median of both sets is the floor.
    std::vector<float> floor_ms;
    MedianMs(gemm, 5, 20, stream, &floor_ms);
    CHECK_CUDA(cudaDeviceSynchronize());
    CHECK_CUDA(cudaFree(logits));

    // Engine over the same weights.
    auto head = std::make_shared<lce::HeadWeights>();
    head->shape.vocab_size = V;
    head->shape.hidden_size = H;
    head->shape.dtype = lce::DType::kBFloat16;
    head->shape.shard_rows = V;
    head->weight.resize(V * H * 2);
    CHECK_CUDA(cudaMemcpy(head->weight.data(), w, V * H * 2, cudaMemcpyDeviceToHost));
    float *db = nullptr, *cw = nullptr;
    if (with_bias) {
      head->shape.has_bias = true;
      std::mt19937 rng(5);
      std::normal_distribution<float> normal(0.0f, 0.1f);
      for (int64_t j = 0; j < V; ++j) head->bias.push_back(normal(rng));
      CHECK_CUDA(cudaMalloc(&db, V * 4));
      CHECK_CUDA(cudaMemset(db, 0, V * 4));
    }
    if (class_weights) {
      std::vector<float> host_cw(V);
      for (int64_t j = 0; j < V; ++j) host_cw[j] = 0.5f + static_cast<float>(j % 101) / 100.0f;
      CHECK_CUDA(cudaMalloc(&cw, V * 4));
      CHECK_CUDA(cudaMemcpy(cw, host_cw.data(), V * 4, cudaMemcpyHostToDevice));
    }
    CHECK_CUDA(cudaMalloc(&dh, N * H * 2));
    CHECK_CUDA(cudaMalloc(&dw, V * H * 4));
    CHECK_CUDA(cudaMemset(dw, 0, V * H * 4));
    CHECK_CUDA(cudaMalloc(&lp, N * 4));
    CHECK_CUDA(cudaMalloc(&ent, N * 4));
    CHECK_CUDA(cudaMalloc(&loss, N * 4));
    CHECK_CUDA(cudaDeviceSynchronize());
    const int64_t free0 = FreeBytes();
    lce::EngineConfig engine_config;
    if (workspace_mib > 0) engine_config.workspace_bytes = workspace_mib << 20;
    auto created = lce::CreateEngine(lce::Backend::kCuda, head, engine_config);
    if (!created.ok()) {
      std::fprintf(stderr, "engine: %s\n", created.status().ToString().c_str());
      return 1;
    }
    std::unique_ptr<lce::LceEngine> engine = std::move(*created);
    head.reset();
    const int64_t free1 = FreeBytes();
    lce::RowsView view{h, t, N, lce::MemorySpace::kDevice};
    view.class_weight = cw;
    lce::LceOptions opt;
    opt.label_smoothing = label_smoothing;
    opt.softcap = softcap;
    lce::Upstream train_up;
    train_up.mode = lce::GradMode::kLoss;
    train_up.grad_loss = g;
    // The training step with `o` and row outputs `out` (its loss added), as the timed one.
    auto train_with = [&](const lce::LceOptions& o, const lce::RowOutputs& out) {
      lce::GradOutputs grads{dh, dw};
      grads.d_bias = db;
      lce::RowOutputs with_loss = out;
      with_loss.loss = loss;
      lce::LceOptions call = o;
      call.label_smoothing = label_smoothing;
      call.softcap = softcap;
      absl::Status st = engine->Compute(view, call, train_up, with_loss, grads);
      if (!st.ok()) {
        std::fprintf(stderr, "train: %s\n", st.ToString().c_str());
        std::exit(1);
      }
    };
    auto train = [&] { train_with(opt, {}); };
    auto score = [&] {
      absl::Status st = engine->Compute(view, opt, {}, {lp, logprob_only ? nullptr : ent, nullptr, nullptr}, {});
      if (!st.ok()) {
        std::fprintf(stderr, "score: %s\n", st.ToString().c_str());
        std::exit(1);
      }
    };
    if (!score_only) train();
    score();
    CHECK_CUDA(cudaDeviceSynchronize());
    const int64_t free2 = FreeBytes();
    std::vector<float> lh(N);
    CHECK_CUDA(cudaMemcpy(lh.data(), loss, N * 4, cudaMemcpyDeviceToHost));
    double mean_loss = 0;
    for (float x : lh) mean_loss += x;
    mean_loss /= valid;
    const double train_ms = score_only ? 0.0 : MedianMs(train, warmup, reps, stream);
    const double score_ms = MedianMs(score, warmup, reps, stream);
    if (top_k > 0) {
      TimeRankings(
          *engine, view, lp, ent, logprob_only, N, top_k, warmup, reps, stream, score_ms,
          score_only ? nullptr : std::function<void(const lce::LceOptions&, const lce::RowOutputs&)>(train_with),
          train_ms);
    }
    const double extra = static_cast<double>(free1 - free2) / (1 << 30);
    Row row{N, H, V, 0, train_ms, score_ms, extra, mean_loss};
    if (score_ab) EpilogueAb(*engine, N, H, score, train, lp, ent, loss, dh, warmup, reps, stream, &row);
    engine.reset();
    CHECK_CUDA(cudaMalloc(&logits, N * V * 2));
    MedianMs(gemm, 3, 20, stream, &floor_ms);
    CHECK_CUDA(cudaDeviceSynchronize());
    CHECK_CUDA(cudaFree(logits));
    std::sort(floor_ms.begin(), floor_ms.end());
    const double gemm_ms = floor_ms[floor_ms.size() / 2];
    row.gemm_ms = gemm_ms;
    rows.push_back(row);
    std::printf("N=%ld H=%ld V=%ld: gemm %.3f ms (%.0f TFLOP/s) | train %.2f ms (x%.3f of 3 GEMMs) | score %.2f ms "
                "(x%.3f) | extra %.2f GiB (weight copy %.2f GiB) | mean loss %.4f\n",
                N, H, V, gemm_ms, 2.0 * N * H * V / gemm_ms / 1e9, train_ms, train_ms / (3 * gemm_ms), score_ms,
                score_ms / gemm_ms, extra, static_cast<double>(free0 - free1) / (1 << 30), mean_loss);
    std::fflush(stdout);
    for (void* p : {static_cast<void*>(h), static_cast<void*>(w), static_cast<void*>(t), static_cast<void*>(g),
                    static_cast<void*>(dh), static_cast<void*>(dw), static_cast<void*>(lp), static_cast<void*>(ent),
                    static_cast<void*>(loss), static_cast<void*>(db), static_cast<void*>(cw)}) {
      CHECK_CUDA(cudaFree(p));
    }
  }
  std::printf("\n| N x H x V | GEMM ms | train ms | train/floor | score ms | score/floor | extra GiB |\n");
  std::printf("| --- | --- | --- | --- | --- | --- | --- |\n");
  for (const Row& r : rows) {
    std::printf("| %ldx%ldx%ld | %.3f | %.2f | %.3f | %.2f | %.3f | %.2f |\n", r.N, r.H, r.V, r.gemm_ms, r.train_ms,
                r.train_ms / (3 * r.gemm_ms), r.score_ms, r.score_ms / r.gemm_ms, r.extra_gib);
  }
  if (score_ab) {
    std::printf("\n| N x H x V | GEMM ms | score off ms (/floor) | score on ms (/floor) | train off ms (/3 floors) | "
                "train on ms (/3 floors) | max d logprob, entropy, loss, d_hidden |\n");
    std::printf("| --- | --- | --- | --- | --- | --- | --- |\n");
    for (const Row& r : rows) {
      std::printf("| %ldx%ldx%ld | %.3f | %.3f (%.3f) | %.3f (%.3f) | %.2f (%.3f) | %.2f (%.3f) | %.1e, %.1e, %.1e, %.1e |\n",
                  r.N, r.H, r.V, r.gemm_ms, r.off_ms, r.off_ms / r.gemm_ms, r.on_ms, r.on_ms / r.gemm_ms,
                  r.train_off_ms, r.train_off_ms / (3 * r.gemm_ms), r.train_on_ms, r.train_on_ms / (3 * r.gemm_ms),
                  r.d_logprob, r.d_entropy, r.d_loss, r.d_hidden);
    }
  }
  if (!json.empty()) {
    FILE* f = std::fopen(json.c_str(), "w");
    if (f != nullptr) {
      std::fprintf(f, "[\n");
      for (size_t i = 0; i < rows.size(); ++i) {
        const Row& r = rows[i];
        std::fprintf(f,
                     " {\"N\": %ld, \"H\": %ld, \"V\": %ld, \"impl\": \"lce_cuda\", \"gemm_ms\": %.4f, \"train_ms\": %.4f, "
                     "\"score_ms\": %.4f, \"train_over_floor\": %.4f, \"score_over_floor\": %.4f, "
                     "\"extra_gib\": %.3f, \"mean_loss\": %.5f}%s\n",
                     r.N, r.H, r.V, r.gemm_ms, r.train_ms, r.score_ms, r.train_ms / (3 * r.gemm_ms),
                     r.score_ms / r.gemm_ms, r.extra_gib, r.loss, i + 1 < rows.size() ? "," : "");
      }
      std::fprintf(f, "]\n");
      std::fclose(f);
    }
  }
  cublasDestroy(cublas);
  return 0;
}
