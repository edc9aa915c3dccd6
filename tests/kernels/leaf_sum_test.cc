// d_hidden's canonical leaves and their fixed-point sum (issue 36): the plan every group size shares
// (kernels/leaf_plan.h) and the fixed-point arithmetic the CUDA kernels run (kernels/cuda/exact_fixed.h,
// host and device alike), checked here on the host: the same bits for any split of the leaves over ranks
// and any order, within the fixed point's rounding bound.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "cuda/exact_fixed.h"
#include "leaf_plan.h"

namespace lce {
namespace {

TEST(LeafPlan, EveryGroupSizesShardIsWholeLeaves) {
  for (int64_t V : {int64_t{151936}, int64_t{128256}, int64_t{152064}, int64_t{201088}, int64_t{262144},
                    int64_t{140001}, int64_t{9001}, int64_t{300}, int64_t{5}}) {
    const std::vector<int64_t> b = LeafBounds(V);
    ASSERT_GE(b.size(), 2u);
    EXPECT_EQ(b.front(), 0);
    EXPECT_EQ(b.back(), V);
    EXPECT_TRUE(std::is_sorted(b.begin(), b.end()) && std::adjacent_find(b.begin(), b.end()) == b.end());
    for (int k : kLeafGroupSizes) {
      if (k > VocabTileCount(V)) continue;
      for (int r = 0; r < k; ++r) {
        const VocabRange shard = VocabShard(V, r, k);
        EXPECT_TRUE(std::binary_search(b.begin(), b.end(), shard.begin)) << V << " k " << k << " rank " << r;
        EXPECT_TRUE(std::binary_search(b.begin(), b.end(), shard.end)) << V << " k " << k << " rank " << r;
        const std::vector<VocabRange> leaves = ShardLeaves(V, shard);
        int64_t at = 0;
        for (const VocabRange& l : leaves) {
          EXPECT_EQ(l.begin, at);
          EXPECT_GT(l.end, l.begin);
          at = l.end;
        }
        EXPECT_EQ(at, shard.end - shard.begin) << V << " k " << k << " rank " << r;
      }
    }
  }
  // V = 151936 (99 tiles of 1536, the last short): k = 2 and 4 cut at tiles 49; 24, 49, 74: four leaves.
  EXPECT_EQ(LeafBounds(151936), (std::vector<int64_t>{0, 24 * 1536, 49 * 1536, 74 * 1536, 151936}));
}

// The exact sum keeps an element's terms in kMaxLeaves + 1 registers (exact_sum.cu): no vocabulary has more
// leaves, and 4q + 2 tiles reach the bound (74 tiles: k = 2 cuts at 37, k = 4 at 18, 36, 55).
TEST(LeafPlan, NoVocabularyHasMoreThanMaxLeaves) {
  EXPECT_EQ(LeafBounds(74 * 1536), (std::vector<int64_t>{0, 18 * 1536, 36 * 1536, 37 * 1536, 55 * 1536, 74 * 1536}));
  size_t most = 0;
  for (int64_t tiles = 1; tiles <= 300; ++tiles) {
    for (int64_t V : {tiles * 1536, tiles * 1536 - 777}) {
      if (V > 0) most = std::max(most, LeafBounds(V).size() - 1);
    }
  }
  EXPECT_EQ(most, static_cast<size_t>(kMaxLeaves));
}

// The element's sum as one GPU makes it (every term in one place) and as a group of ranks does (each
// rank its share of the terms: codes max-reduced, integers summed).
float OneGpu(const std::vector<float>& terms, int total) {
  using namespace cuda::exact;
  const int h = CeilLog2(total);
  int code = 0;
  for (float x : terms) code = MaxCode(code, Code(x));
  int32_t q = 0;
  if (code != 0 && code != kNonFinite) {
    for (float x : terms) q += Fixed(x, Shift(code, h));
  }
  return ToFloat(q, code, h);
}

float Group(const std::vector<float>& terms, const std::vector<size_t>& cuts, int total) {
  using namespace cuda::exact;
  const int h = CeilLog2(total);
  int code = 0;
  for (size_t r = 0; r + 1 < cuts.size(); ++r) {
    int mine = 0;
    for (size_t i = cuts[r]; i < cuts[r + 1]; ++i) mine = MaxCode(mine, Code(terms[i]));
    code = MaxCode(code, mine);  // the uint8 max all-reduce
  }
  int32_t q = 0;
  for (size_t r = cuts.size() - 1; r-- > 0;) {  // ranks' integers in reverse: any order is exact
    int32_t mine = 0;
    if (code != 0 && code != kNonFinite) {
      for (size_t i = cuts[r]; i < cuts[r + 1]; ++i) mine += Fixed(terms[i], Shift(code, h));
    }
    q += mine;  // the int32 sum all-reduce
  }
  return ToFloat(q, code, h);
}

uint32_t Bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

TEST(FixedPointLeafSum, SameBitsForAnySplitAndOrderWithinTheRoundingBound) {
  std::mt19937_64 rng(3600);
  std::uniform_real_distribution<double> unit(-1.0, 1.0);
  std::uniform_int_distribution<int> expo(-40, 12);
  for (int trial = 0; trial < 20000; ++trial) {
    const int L = 1 + trial % 11;
    std::vector<float> terms(static_cast<size_t>(L));
    for (float& x : terms) x = static_cast<float>(std::ldexp(unit(rng), expo(rng)));
    if (trial % 7 == 0) terms[0] = -terms[L - 1];  // cancellation
    if (trial % 11 == 0) terms[static_cast<size_t>(trial) % L] = 0.0f;
    if (trial % 13 == 0) terms[0] = std::ldexp(1.0f, -140);  // subnormal
    const float want = OneGpu(terms, L);
    // Every split into contiguous ranks, and a shuffled order.
    for (size_t k = 1; k <= terms.size(); ++k) {
      std::vector<size_t> cuts;
      for (size_t r = 0; r <= k; ++r) cuts.push_back(r * terms.size() / k);
      ASSERT_EQ(Bits(Group(terms, cuts, L)), Bits(want)) << "trial " << trial << " ranks " << k;
    }
    std::vector<float> shuffled = terms;
    std::shuffle(shuffled.begin(), shuffled.end(), rng);
    ASSERT_EQ(Bits(OneGpu(shuffled, L)), Bits(want)) << "trial " << trial << " shuffled";
    // Within half an ulp of the exact sum plus the fixed point's rounding of each term (half its grid step).
    long double exact = 0;
    float largest = 0;
    for (float x : terms) exact += x, largest = std::max(largest, std::fabs(x));
    int e = 0;
    std::frexp(largest, &e);
    const long double bound = std::ldexp(1.0L, e - 31 + cuda::exact::CeilLog2(L)) * L +
                              std::fabs(static_cast<long double>(want)) * std::ldexp(1.0L, -24);
    ASSERT_LE(std::fabs(static_cast<long double>(want) - exact), bound) << "trial " << trial;
  }
}

TEST(FixedPointLeafSum, ZerosAndNonFiniteTerms) {
  EXPECT_EQ(Bits(OneGpu({0.0f, 0.0f, -0.0f}, 3)), Bits(0.0f));
  EXPECT_TRUE(std::isnan(OneGpu({1.0f, NAN, 2.0f}, 3)));
  EXPECT_TRUE(std::isnan(OneGpu({1.0f, INFINITY}, 2)));
  // The largest finite terms: 2^128 > |x|, summed without overflow of the integers (fp32 overflows to inf).
  const float big = 3.0e38f;
  EXPECT_TRUE(std::isinf(OneGpu({big, big}, 2)));
  EXPECT_EQ(OneGpu({big, -big, 1.0f}, 3), 0.0f);  // 1 is below the scale's last bit next to 3e38: rounded away
}

}  // namespace
}  // namespace lce
