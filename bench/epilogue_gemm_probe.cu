// The epilogue-statistics GEMM alone (kernels/cuda/epilogue_stats_gemm.cu), by kernel configuration, swizzle and
// raster: for each shape N×H×V it times LaunchEpilogueStatsGemm for a score's plain statistics (full: logprob +
// entropy; lp: logprob only; skip: the mainloop alone, timing_skip, results wrong), rounds interleaved, against one
// cublasGemmEx of the same product (bf16 out: lce_bench's floor), and checks a few rows' log-sum-exp (folded on the
// host from each configuration's tile partials) against the first configuration's. Under ncu, one launch a run
// (--rounds 1 --reps 1 --warmup 1 --no-floor; the kernel to profile is the third device_kernel launch).
//   epilogue_gemm_probe --shapes 8192x4096x128256,... --configs 1,2 --swizzles 1,4 --raster 1 --modes full,lp,skip
// Configurations are EpilogueStatsArgs::config's (0–5; 4 is the engine's for large calls); swizzle 0 and raster 0 are
// the engine's automatic choices (its order, on which the kernel's cycles depend: bench/NOTES.md e19, e23).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "bench_check.h"
#include "cuda/kernels.h"

namespace {

// Uniform on [−a, a] with a = scale·√3 (the variance of N(0, scale²)), from a hash of the index.
__global__ void FillUniformBf16(__nv_bfloat16* out, int64_t n, float scale, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 0x9e3779b1u ^ static_cast<uint32_t>(i >> 32) ^ seed * 0x85ebca6bu;
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    out[i] = __float2bfloat16(scale * 1.7320508f * (2.0f * (x >> 8) * (1.0f / 16777216.0f) - 1.0f));
  }
}

std::vector<std::string> Split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string t; std::getline(ss, t, ',');) out.push_back(t);
  return out;
}

struct Flags {
  std::string shapes = "8192x4096x128256,16384x2048x151936", configs = "4", modes = "full,lp,skip", swizzles = "0";
  int reps = 10, rounds = 3, warmup = 2, raster = 0;
  bool floor = true, floor_only = false;
};

bool Parse(int argc, char** argv, Flags& f) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto val = [&] { return std::string(i + 1 < argc ? argv[++i] : ""); };
    if (a == "--shapes")
      f.shapes = val();
    else if (a == "--configs")
      f.configs = val();
    else if (a == "--modes")
      f.modes = val();
    else if (a == "--swizzles")
      f.swizzles = val();
    else if (a == "--raster")
      f.raster = std::atoi(val().c_str());
    else if (a == "--reps")
      f.reps = std::atoi(val().c_str());
    else if (a == "--rounds")
      f.rounds = std::atoi(val().c_str());
    else if (a == "--warmup")
      f.warmup = std::atoi(val().c_str());
    else if (a == "--no-floor")
      f.floor = false;
    else if (a == "--floor-only")
      f.floor_only = true;
    else {
      std::fprintf(stderr, "unknown flag %s\n", a.c_str());
      return false;
    }
  }
  return true;
}

// One shape's operands and outputs on the device.
struct Problem {
  int64_t n = 0, h = 0, v = 0;
  __nv_bfloat16 *hidden = nullptr, *weight = nullptr;
  int32_t* targets = nullptr;
  float *tile_part = nullptr, *packed = nullptr;

  explicit Problem(const std::string& shape) {
    if (std::sscanf(shape.c_str(), "%ldx%ldx%ld", &n, &h, &v) != 3 || n <= 0 || h <= 0 || v <= 0) {
      std::fprintf(stderr, "bad shape %s (NxHxV)\n", shape.c_str());
      std::exit(2);
    }
    CHECK_CUDA(cudaMalloc(&hidden, n * h * 2));
    CHECK_CUDA(cudaMalloc(&weight, v * h * 2));
    FillUniformBf16<<<1024, 256>>>(hidden, n * h, 0.5f, 1);
    FillUniformBf16<<<1024, 256>>>(weight, v * h, 1.0f / std::sqrt(static_cast<float>(h)), 2);
    std::vector<int32_t> y(n);
    for (int64_t r = 0; r < n; ++r) y[r] = static_cast<int32_t>((r * 2654435761ULL) % v);
    CHECK_CUDA(cudaMalloc(&targets, n * 4));
    CHECK_CUDA(cudaMemcpy(targets, y.data(), n * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMalloc(&tile_part, n * ((v + 127) / 128) * 16));  // the narrowest tiles' count
    CHECK_CUDA(cudaMalloc(&packed, n * lce::cuda::kPacked * 4));
  }
  ~Problem() {
    cudaFree(hidden);
    cudaFree(weight);
    cudaFree(targets);
    cudaFree(tile_part);
    cudaFree(packed);
  }
  double Flops() const { return 2.0 * n * h * v; }

  lce::cuda::EpilogueStatsArgs Args(int config, const std::string& mode, int swizzle, int raster) const {
    lce::cuda::EpilogueStatsArgs a;
    a.hidden = hidden;
    a.weight = weight;
    a.rows = n;
    a.cols = v;
    a.hidden_size = h;
    a.targets = targets;
    a.tile_part = tile_part;
    a.packed = packed;
    a.config = config;
    const int tile = lce::cuda::EpilogueStatsTileCols(config);
    a.ntile = (v + tile - 1) / tile;
    a.entropy = mode == "full";
    a.timing_skip = mode == "skip";
    a.swizzle = swizzle;
    a.raster = raster;
    return a;
  }
};

// Mean milliseconds of `reps` calls of fn after `warmup`.
template <class Fn>
double TimeMs(int warmup, int reps, Fn fn) {
  cudaEvent_t t0, t1;
  CHECK_CUDA(cudaEventCreate(&t0));
  CHECK_CUDA(cudaEventCreate(&t1));
  for (int i = 0; i < warmup; ++i) fn();
  CHECK_CUDA(cudaEventRecord(t0));
  for (int i = 0; i < reps; ++i) fn();
  CHECK_CUDA(cudaEventRecord(t1));
  CHECK_CUDA(cudaEventSynchronize(t1));
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, t0, t1));
  CHECK_CUDA(cudaEventDestroy(t0));
  CHECK_CUDA(cudaEventDestroy(t1));
  return ms / reps;
}

void Launch(const lce::cuda::EpilogueStatsArgs& a) {
  const absl::Status st = lce::cuda::LaunchEpilogueStatsGemm(a, nullptr);
  if (!st.ok()) {
    std::fprintf(stderr, "config %d: %s\n", a.config, st.ToString().c_str());
    std::exit(1);
  }
}

// cuBLAS's product of the same shape, bf16 out: the floor.
double FloorMs(const Problem& p, const Flags& f, cublasHandle_t cublas) {
  __nv_bfloat16* out;
  CHECK_CUDA(cudaMalloc(&out, p.n * p.v * 2));
  const float one = 1.0f, zero = 0.0f;
  const double ms = TimeMs(f.warmup, f.reps, [&] {
    CHECK_CUBLAS(cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, p.v, p.n, p.h, &one, p.weight, CUDA_R_16BF, p.h,
                              p.hidden, CUDA_R_16BF, p.h, &zero, out, CUDA_R_16BF, p.v, CUBLAS_COMPUTE_32F,
                              CUBLAS_GEMM_DEFAULT));
  });
  CHECK_CUDA(cudaFree(out));
  return ms;
}

// Rows 0, n/3 and n − 1: their log-sum-exp from each configuration's tile partials, against the first's, and
// their target logit written (every target lies in the head).
void CheckRows(const Problem& p, const Flags& f, const std::string& shape) {
  std::vector<double> first;
  for (const std::string& c : Split(f.configs)) {
    const lce::cuda::EpilogueStatsArgs a = p.Args(std::atoi(c.c_str()), "full", 0, f.raster);
    CHECK_CUDA(cudaMemset(p.packed, 0, p.n * lce::cuda::kPacked * 4));
    Launch(a);
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<float> tp(a.ntile * 4);
    std::vector<double> lse;
    bool target_missing = false;
    for (int64_t r : {int64_t{0}, p.n / 3, p.n - 1}) {
      CHECK_CUDA(cudaMemcpy(tp.data(), p.tile_part + r * a.ntile * 4, a.ntile * 16, cudaMemcpyDeviceToHost));
      double m = -INFINITY, sum = 0;
      for (int64_t t = 0; t < a.ntile; ++t) m = std::fmax(m, tp[t * 4]);
      for (int64_t t = 0; t < a.ntile; ++t) sum += tp[t * 4 + 1] * std::exp(tp[t * 4] - m);
      lse.push_back(m + std::log(sum));
      float pk[lce::cuda::kPacked];
      CHECK_CUDA(cudaMemcpy(pk, p.packed + r * lce::cuda::kPacked, sizeof(pk), cudaMemcpyDeviceToHost));
      target_missing |= pk[3] == 0.0f;
    }
    if (first.empty()) first = lse;
    double d = 0;
    for (size_t i = 0; i < lse.size(); ++i) d = std::fmax(d, std::fabs(lse[i] - first[i]));
    std::printf("%s config %d: ntile %ld, lse of rows 0, n/3, n-1: %.6f %.6f %.6f (max |diff| to the first %.2e)%s\n",
                shape.c_str(), a.config, a.ntile, lse[0], lse[1], lse[2], d,
                target_missing ? " TARGET LOGIT MISSING" : "");
  }
}

void TimeRounds(const Problem& p, const Flags& f, const std::string& shape, double floor_ms) {
  for (int round = 0; round < f.rounds; ++round) {
    for (const std::string& c : Split(f.configs)) {
      for (const std::string& sw : Split(f.swizzles)) {
        for (const std::string& mode : Split(f.modes)) {
          const lce::cuda::EpilogueStatsArgs a = p.Args(std::atoi(c.c_str()), mode, std::atoi(sw.c_str()), f.raster);
          const double ms = TimeMs(f.warmup, f.reps, [&] { Launch(a); });
          std::printf("round %d %s config %d swizzle %s raster %d %-4s %.3f ms (%.3f floor, %.0f TFLOP/s)\n", round,
                      shape.c_str(), a.config, sw.c_str(), f.raster, mode.c_str(), ms,
                      floor_ms > 0 ? ms / floor_ms : 0.0, p.Flops() / ms / 1e9);
        }
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  if (!Parse(argc, argv, f)) return 2;
  cublasHandle_t cublas;
  CHECK_CUBLAS(cublasCreate(&cublas));
  for (const std::string& shape : Split(f.shapes)) {
    const Problem p(shape);
    double floor_ms = 0;
    if (f.floor || f.floor_only) {
      floor_ms = FloorMs(p, f, cublas);
      std::printf("%s floor %.3f ms (%.0f TFLOP/s)\n", shape.c_str(), floor_ms, p.Flops() / floor_ms / 1e9);
    }
    if (f.floor_only) continue;
    CheckRows(p, f, shape);
    TimeRounds(p, f, shape, floor_ms);
  }
  CHECK_CUBLAS(cublasDestroy(cublas));
  return 0;
}
