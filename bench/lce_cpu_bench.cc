// CPU engine against its floor: the same call's GEMMs run by OpenBLAS (one sgemm for a score, three
// for a train step: logits, d_hidden, dW), on the same threads. Prints one line per op:
//   op rows hidden vocab  engine_ms  floor_ms  ratio
// Usage: lce_cpu_bench [--rows=N] [--hidden=H] [--vocab=V] [--dtype=bf16|fp32] [--iters=K]
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "lce/engine.h"
#include "lce/numeric.h"

namespace {

struct Args {
  int64_t rows = 256, hidden = 512, vocab = 32000;
  lce::DType dtype = lce::DType::kBFloat16;
  int iters = 3;
};

Args Parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    auto val = [&](const char* name) -> const char* {
      const std::string p = std::string("--") + name + "=";
      return s.rfind(p, 0) == 0 ? argv[i] + p.size() : nullptr;
    };
    if (const char* v = val("rows")) a.rows = std::atoll(v);
    else if (const char* v = val("hidden")) a.hidden = std::atoll(v);
    else if (const char* v = val("vocab")) a.vocab = std::atoll(v);
    else if (const char* v = val("iters")) a.iters = std::atoi(v);
    else if (const char* v = val("dtype")) a.dtype = std::strcmp(v, "fp32") == 0 ? lce::DType::kFloat32 : lce::DType::kBFloat16;
    else { std::fprintf(stderr, "unknown argument %s\n", argv[i]); std::exit(2); }
  }
  return a;
}

template <class F>
double BestMs(int iters, F&& f) {
  double best = 1e30;
  for (int i = 0; i < iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = Parse(argc, argv);
  const int64_t N = a.rows, H = a.hidden, V = a.vocab;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  auto head = std::make_shared<lce::HeadWeights>();
  head->shape = {V, H, a.dtype, 0, V, false};
  std::vector<float> w(V * H), h(N * H);
  for (float& x : w) x = normal(rng) / std::sqrt(static_cast<float>(H));
  for (float& x : h) x = normal(rng);
  head->weight.resize(V * H * lce::DTypeSize(a.dtype));
  lce::ConvertFromFloat(w.data(), V * H, a.dtype, head->weight.data());
  std::vector<uint8_t> hidden(N * H * lce::DTypeSize(a.dtype)), dh(hidden.size());
  lce::ConvertFromFloat(h.data(), N * H, a.dtype, hidden.data());
  std::vector<int32_t> y(N);
  for (int64_t i = 0; i < N; ++i) y[i] = static_cast<int32_t>(rng() % V);
  auto engine = lce::CreateEngine(lce::Backend::kCpu, head, lce::EngineConfig{});
  if (!engine.ok()) {
    std::fprintf(stderr, "%s\n", engine.status().ToString().c_str());
    return 1;
  }
  std::vector<float> lp(N), ent(N), loss(N), dw(V * H, 0.0f), z(N * V), dhf(N * H);
  const lce::RowsView rows{hidden.data(), y.data(), N, lce::MemorySpace::kHost};
  const double score = BestMs(a.iters, [&] {
    (void)(*engine)->Compute(rows, {}, {}, {lp.data(), ent.data(), nullptr, nullptr}, {});
  });
  lce::Upstream up;
  up.mode = lce::GradMode::kLoss;
  const double train = BestMs(a.iters, [&] {
    (void)(*engine)->Compute(rows, {}, up, {lp.data(), ent.data(), nullptr, loss.data()}, {dh.data(), dw.data()});
  });
  const int n = static_cast<int>(N), hh = static_cast<int>(H), v = static_cast<int>(V);
  auto logits = [&] { cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, v, hh, 1.0f, h.data(), hh, w.data(), hh, 0.0f, z.data(), v); };
  const double floor_score = BestMs(a.iters, logits);
  const double floor_train = BestMs(a.iters, [&] {
    logits();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, hh, v, 1.0f, z.data(), v, w.data(), hh, 0.0f, dhf.data(), hh);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, v, hh, n, 1.0f, z.data(), v, h.data(), hh, 1.0f, dw.data(), hh);
  });
  std::printf("op     rows hidden  vocab  engine_ms  floor_ms  ratio\n");
  std::printf("score %5lld %6lld %6lld %10.1f %9.1f %6.2f\n", (long long)N, (long long)H, (long long)V, score, floor_score, score / floor_score);
  std::printf("train %5lld %6lld %6lld %10.1f %9.1f %6.2f\n", (long long)N, (long long)H, (long long)V, train, floor_train, train / floor_train);
  return 0;
}
