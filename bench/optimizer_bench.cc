// OptimizerStep on one GPU against its HBM floor: the CUDA HeadTrainer's AdamW step (fp32 masters,
// moments and dW read, masters and moments written, the serving weight written in the same pass:
// 16 + 12 + 2 = 30 bytes a parameter for a 16-bit head) and its gradient norm, on a V×H head.
//   copy   cudaMemcpyAsync device to device of --copy-mib MiB: the bandwidth the floor assumes
//          (read + write bytes over the time)
//   norm   GradSquaredNorm (the clip's squared norm: 4 B/param read)
//   adamw  Step (the AdamW kernel, launched and waited for)
//   step   norm then Step: what OptimizerStep runs on a rank of one (plus the RPC's few µs)
//   pending  a training request's pending dW: AcquirePending (unzeroed: the engine writes it) then
//          CommitPending into a non-zero dW (docs/MATH.md, "When dW is committed")
// Median of --reps after --warmup (the first step also makes the masters). Wall clock around each
// call (every trainer call is complete when it returns).
//
// Usage: lce_optimizer_bench [--vocab 151936] [--hidden 4096] [--dtype bf16] [--reps 20] [--warmup 3]
//                            [--copy-mib 4096] [--device 0]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench_check.h"
#include "lce/engine.h"
#include "lce/training.h"

namespace {

struct Args {
  int64_t vocab = 151936, hidden = 4096, copy_mib = 4096;
  int reps = 20, warmup = 3, device = 0;
  std::string dtype = "bf16";
};

Args Parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--vocab") a.vocab = std::atoll(v.c_str());
    else if (k == "--hidden") a.hidden = std::atoll(v.c_str());
    else if (k == "--dtype") a.dtype = v;
    else if (k == "--reps") a.reps = std::atoi(v.c_str());
    else if (k == "--warmup") a.warmup = std::atoi(v.c_str());
    else if (k == "--copy-mib") a.copy_mib = std::atoll(v.c_str());
    else if (k == "--device") a.device = std::atoi(v.c_str());
    else {
      std::fprintf(stderr, "unknown flag %s\n", k.c_str());
      std::exit(2);
    }
  }
  return a;
}

double MedianMs(const std::function<void()>& f, int warmup, int reps) {
  for (int i = 0; i < warmup; ++i) f();
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

template <typename T>
T OrDie(absl::StatusOr<T> s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, std::string(s.status().message()).c_str());
    std::exit(1);
  }
  return *std::move(s);
}

// Device-to-device copy bandwidth in bytes/s (read + write).
double CopyBandwidth(int64_t bytes, int warmup, int reps) {
  void *a = nullptr, *b = nullptr;
  CHECK_CUDA(cudaMalloc(&a, bytes));
  CHECK_CUDA(cudaMalloc(&b, bytes));
  CHECK_CUDA(cudaMemset(a, 1, bytes));
  const double ms = MedianMs([&] {
    CHECK_CUDA(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, 0));
    CHECK_CUDA(cudaStreamSynchronize(0));
  }, warmup, reps);
  CHECK_CUDA(cudaFree(a));
  CHECK_CUDA(cudaFree(b));
  return 2.0 * static_cast<double>(bytes) / (ms * 1e-3);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace lce;
  const Args a = Parse(argc, argv);
  CHECK_CUDA(cudaSetDevice(a.device));
  const DType dtype = OrDie(ParseDType(a.dtype), "--dtype");
  const int64_t n = a.vocab * a.hidden;
  const double copy_bw = CopyBandwidth(a.copy_mib << 20, a.warmup, a.reps);

  auto weights = std::make_shared<HeadWeights>();
  weights->shape = {a.vocab, a.hidden, dtype, 0, a.vocab, false};
  weights->weight.assign(static_cast<size_t>(n * DTypeSize(dtype)), 0x3c);  // small finite values
  EngineConfig config;
  config.device = a.device;
  std::shared_ptr<LceEngine> engine = OrDie(CreateEngine(Backend::kCuda, weights, config), "engine");
  std::unique_ptr<HeadTrainer> trainer = OrDie(CreateHeadTrainer(engine, weights, nullptr), "trainer");
  CHECK_CUDA(cudaMemset(trainer->grad(), 0x3c, static_cast<size_t>(n) * 4));  // dW ≈ 0.0115 everywhere
  if (absl::Status s = trainer->PrepareStep(); !s.ok()) {
    std::fprintf(stderr, "optimizer state: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  AdamWParams p;
  p.lr = 1e-5f;
  p.weight_decay = 0.01f;
  double sq = 0;
  const double norm_ms = MedianMs([&] { sq = OrDie(trainer->GradSquaredNorm(), "norm"); }, a.warmup, a.reps);
  const double adamw_ms = MedianMs([&] { OrDie(trainer->Step(p, 0.5f), "step"); }, a.warmup, a.reps);
  const double step_ms = MedianMs([&] {
    sq = OrDie(trainer->GradSquaredNorm(), "norm");
    OrDie(trainer->Step(p, ClipScale(std::sqrt(sq), 1.0f)), "step");
  }, a.warmup, a.reps);

  // A training request's pending dW (docs/MATH.md, "When dW is committed"): the buffer handed out
  // unzeroed (the request's first engine call writes it) and committed into a non-zero dW (12 B/param);
  // the old in-place path's rollback copy took 8 B/param, and its first product read dW (4 B/param),
  // which the fresh buffer's does not.
  uint64_t id = 1;
  const double pending_ms = MedianMs([&] {
    OrDie(trainer->AcquirePending(id, /*zeroed=*/false), "pending");
    if (absl::Status s = trainer->CommitPending(id++, 0.5f); !s.ok()) OrDie(absl::StatusOr<int>(s), "commit");
  }, a.warmup, a.reps);
  const double copy4_ms = static_cast<double>(n) * 8.0 / copy_bw * 1e3;
  const double bytes_per_param = 28.0 + static_cast<double>(DTypeSize(dtype));
  const double floor_ms = bytes_per_param * static_cast<double>(n) / copy_bw * 1e3;
  std::printf("head %ldx%ld %s: %.3g params, %.0f B/param\n", static_cast<long>(a.vocab), static_cast<long>(a.hidden),
              DTypeName(dtype), static_cast<double>(n), bytes_per_param);
  std::printf("device copy bandwidth   %8.1f GB/s (read + write, %ld MiB)\n", copy_bw / 1e9, static_cast<long>(a.copy_mib));
  std::printf("HBM floor of the step   %8.3f ms\n", floor_ms);
  std::printf("norm (4 B/param)        %8.3f ms\n", norm_ms);
  std::printf("adamw kernel            %8.3f ms   %.2fx the floor   %.1f GB/s\n", adamw_ms, adamw_ms / floor_ms,
              bytes_per_param * static_cast<double>(n) / (adamw_ms * 1e-3) / 1e9);
  std::printf("OptimizerStep (norm + adamw) %8.3f ms   %.2fx the floor\n", step_ms, step_ms / floor_ms);
  std::printf("pending dW (commit) %8.3f ms   floor %.3f ms (12 B/param); the old rollback copy's floor %.3f ms\n",
              pending_ms, 1.5 * copy4_ms, copy4_ms);
  std::printf("{\"vocab\": %ld, \"hidden\": %ld, \"dtype\": \"%s\", \"copy_gbps\": %.1f, \"floor_ms\": %.3f, "
              "\"norm_ms\": %.3f, \"adamw_ms\": %.3f, \"step_ms\": %.3f, \"pending_ms\": %.3f}\n",
              static_cast<long>(a.vocab), static_cast<long>(a.hidden), DTypeName(dtype), copy_bw / 1e9, floor_ms,
              norm_ms, adamw_ms, step_ms, pending_ms);
  return 0;
}
