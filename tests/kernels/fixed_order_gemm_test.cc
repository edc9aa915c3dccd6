// The CPU engine's GEMM: float64-close, and every element the same bits whatever the shape it is
// computed in, the thread count and the instruction set (the engine's invariance rests on it).
#include "cpu/fixed_order_gemm.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace lce::cpu {
namespace {

struct Problem {
  int64_t m, n, k;
  std::vector<float> a, b, c0;
};

Problem Make(int64_t m, int64_t n, int64_t k, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  Problem p{m, n, k, {}, {}, {}};
  for (int64_t i = 0; i < m * k; ++i) p.a.push_back(normal(rng));
  for (int64_t i = 0; i < k * n; ++i) p.b.push_back(normal(rng));
  for (int64_t i = 0; i < m * n; ++i) p.c0.push_back(normal(rng));
  return p;
}

// C = C0 + A·B with A row-major [m, k].
std::vector<float> Product(const Problem& p, int threads) {
  std::vector<float> c = p.c0;
  FixedOrderGemm(p.m, p.n, p.k, {p.a.data(), p.k, 1}, p.b.data(), p.n, c.data(), p.n, true, threads);
  return c;
}

TEST(FixedOrderGemm, MatchesFloat64) {
  const Problem p = Make(37, 83, 600, 1);  // ragged in every dimension, k past one depth block
  const std::vector<float> c = Product(p, 2);
  for (int64_t i = 0; i < p.m; ++i) {
    for (int64_t j = 0; j < p.n; ++j) {
      double ref = p.c0[i * p.n + j], mag = std::abs(ref);
      for (int64_t q = 0; q < p.k; ++q) {
        ref += static_cast<double>(p.a[i * p.k + q]) * p.b[q * p.n + j];
        mag += std::abs(static_cast<double>(p.a[i * p.k + q]) * p.b[q * p.n + j]);
      }
      EXPECT_NEAR(c[i * p.n + j], ref, 1e-6 * mag) << i << "," << j;
    }
  }
}

TEST(FixedOrderGemm, AnElementIsTheSameBitsInAnyShapeThreadCountAndIsa) {
  const Problem p = Make(50, 70, 700, 2);
  const std::vector<float> whole = Product(p, 2);
  for (const char* isa : {"avx512", "avx2", "scalar"}) {
    if (!UseFixedOrderGemmIsaForTesting(isa)) {
      std::printf("[  NOTE    ] this CPU has no %s: not compared\n", isa);
      continue;
    }
    EXPECT_EQ(std::memcmp(Product(p, 1).data(), whole.data(), whole.size() * 4), 0) << isa;
    // Row 23 alone, and columns 5..6 alone (a sub-matrix with its own leading dimensions).
    std::vector<float> row(p.c0.begin() + 23 * p.n, p.c0.begin() + 24 * p.n);
    FixedOrderGemm(1, p.n, p.k, {p.a.data() + 23 * p.k, p.k, 1}, p.b.data(), p.n, row.data(), p.n, true, 2);
    EXPECT_EQ(std::memcmp(row.data(), whole.data() + 23 * p.n, p.n * 4), 0) << isa;
    std::vector<float> cols(p.m * 2);
    for (int64_t i = 0; i < p.m; ++i) std::memcpy(&cols[i * 2], &p.c0[i * p.n + 5], 8);
    FixedOrderGemm(p.m, 2, p.k, {p.a.data(), p.k, 1}, p.b.data() + 5, p.n, cols.data(), 2, true, 2);
    for (int64_t i = 0; i < p.m; ++i) {
      EXPECT_EQ(std::memcmp(&cols[i * 2], &whole[i * p.n + 5], 8), 0) << isa << " row " << i;
    }
  }
  UseFixedOrderGemmIsaForTesting(FixedOrderGemmIsa());
}

TEST(FixedOrderGemm, SplittingTheDepthAccumulatesTheSameChain) {
  // C + A[:, :k1]·B[:k1] then + A[:, k1:]·B[k1:] is the same chain as one call over all of k.
  const Problem p = Make(20, 40, 300, 3);
  const std::vector<float> whole = Product(p, 2);
  std::vector<float> c = p.c0;
  const int64_t k1 = 113;
  FixedOrderGemm(p.m, p.n, k1, {p.a.data(), p.k, 1}, p.b.data(), p.n, c.data(), p.n, true, 2);
  FixedOrderGemm(p.m, p.n, p.k - k1, {p.a.data() + k1, p.k, 1}, p.b.data() + k1 * p.n, p.n, c.data(), p.n,
                 true, 2);
  EXPECT_EQ(std::memcmp(c.data(), whole.data(), whole.size() * 4), 0);
}

}  // namespace
}  // namespace lce::cpu
