#include "cpu/fixed_order_gemm.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <string_view>

namespace lce::cpu {
namespace {

using RowsFn = void (*)(int64_t, int64_t, int64_t, int64_t, StridedMatrix, const float*, int64_t,
                        float*, int64_t, bool);

#if defined(__clang__)  // clang has no GCC target pragmas (the sanitizer and fuzz builds use clang)
#pragma clang attribute push(__attribute__((target("avx512f,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,fma")
#endif
namespace avx512 {
struct Vec {
  using T = __m512;
  static constexpr int kLanes = 16;
  static T Load(const float* p) { return _mm512_loadu_ps(p); }
  static void Store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T Zero() { return _mm512_setzero_ps(); }
  static T Broadcast(float x) { return _mm512_set1_ps(x); }
  static T Fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
};
constexpr int kRowsPerTile = 8;
#include "cpu/fixed_order_gemm_tile.inc"
}  // namespace avx512
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#if defined(__clang__)  // clang has no GCC target pragmas (the sanitizer and fuzz builds use clang)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif
namespace avx2 {
struct Vec {
  using T = __m256;
  static constexpr int kLanes = 8;
  static T Load(const float* p) { return _mm256_loadu_ps(p); }
  static void Store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static T Zero() { return _mm256_setzero_ps(); }
  static T Broadcast(float x) { return _mm256_set1_ps(x); }
  static T Fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
};
constexpr int kRowsPerTile = 6;
#include "cpu/fixed_order_gemm_tile.inc"
}  // namespace avx2
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace scalar {
// Without an FMA unit: std::fma (and __builtin_fmaf, a libm call here) round once, as the hardware
// instruction does: slow, but the same bits.
struct Vec {
  using T = float;
  static constexpr int kLanes = 1;
  static T Load(const float* p) { return *p; }
  static void Store(float* p, T v) { *p = v; }
  static T Zero() { return 0.0f; }
  static T Broadcast(float x) { return x; }
  static T Fma(T a, T b, T c) { return std::fma(a, b, c); }
};
constexpr int kRowsPerTile = 4;
#include "cpu/fixed_order_gemm_tile.inc"
}  // namespace scalar

struct Isa {
  RowsFn rows;
  const char* name;
};

bool Supported(const Isa& isa) {
  __builtin_cpu_init();
  if (isa.rows == avx512::Rows) return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
  if (isa.rows == avx2::Rows) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return true;
}

constexpr Isa kIsas[] = {{avx512::Rows, "avx512"}, {avx2::Rows, "avx2"}, {scalar::Rows, "scalar"}};

Isa& Chosen() {
  static Isa chosen = [] {
    for (const Isa& isa : kIsas) {
      if (Supported(isa)) return isa;
    }
    return kIsas[2];
  }();
  return chosen;
}

}  // namespace

const char* FixedOrderGemmIsa() { return Chosen().name; }

bool UseFixedOrderGemmIsaForTesting(const char* name) {
  for (const Isa& isa : kIsas) {
    if (std::string_view(isa.name) == name && Supported(isa)) {
      Chosen() = isa;
      return true;
    }
  }
  return false;
}

void FixedOrderGemm(int64_t m, int64_t n, int64_t k, StridedMatrix a, const float* b, int64_t ldb,
                    float* c, int64_t ldc, bool accumulate, int threads) {
  if (m <= 0 || n <= 0) return;
  const RowsFn rows = Chosen().rows;
  // Whole 48-row slabs per thread (a multiple of every tile height), so the work splits evenly.
  constexpr int64_t kSlab = 48;
  const int64_t slabs = (m + kSlab - 1) / kSlab;
  const int nthreads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, slabs)));
#pragma omp parallel num_threads(nthreads)
  {
    const int t = omp_get_thread_num();
    const int64_t s0 = slabs * t / nthreads, s1 = slabs * (t + 1) / nthreads;
    const int64_t i0 = s0 * kSlab, i1 = std::min(m, s1 * kSlab);
    if (i0 < i1) rows(i0, i1, n, k, a, b, ldb, c, ldc, accumulate);
  }
}

}  // namespace lce::cpu
