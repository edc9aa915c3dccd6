// The client's bf16/fp16 wire codec: exact round trips of every 16-bit pattern, round-to-nearest-even
// on ties, overflow, subnormals and NaN; and chunk planning.
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "gtest/gtest.h"
#include "lce/client/lce_client.h"
#include "wire_codec.h"

namespace lce::client {
namespace {

uint16_t Enc(float f, v1::DType dt) {
  std::vector<uint8_t> b = EncodeFloats(&f, 1, dt);
  uint16_t h;
  std::memcpy(&h, b.data(), 2);
  return h;
}

float Dec(uint16_t h, v1::DType dt) {
  uint8_t b[2];
  std::memcpy(b, &h, 2);
  return DecodeFloats(b, 1, dt)[0];
}

float Bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

bool IsNan16(uint16_t h, v1::DType dt) {
  return dt == v1::DTYPE_BFLOAT16 ? (h & 0x7f80) == 0x7f80 && (h & 0x7f) != 0
                                  : (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0;
}

class Codec16 : public ::testing::TestWithParam<v1::DType> {};

TEST_P(Codec16, EveryPatternRoundTripsExactly) {
  const v1::DType dt = GetParam();
  int nans = 0;
  for (uint32_t u = 0; u < 65536; ++u) {
    const uint16_t h = static_cast<uint16_t>(u);
    const float f = Dec(h, dt);
    if (IsNan16(h, dt)) {
      EXPECT_TRUE(std::isnan(f)) << std::hex << u;
      EXPECT_TRUE(IsNan16(Enc(f, dt), dt)) << std::hex << u;
      ++nans;
      continue;
    }
    ASSERT_EQ(Enc(f, dt), h) << "pattern 0x" << std::hex << u << " decodes to " << f;
  }
  EXPECT_GT(nans, 0);
}

// Against a brute-force nearest-value search: the encoding of f is a representable value at least as
// close to f as both neighbours, and on an exact tie the one with the even last bit.
TEST_P(Codec16, RandomValuesRoundToNearestEven) {
  const v1::DType dt = GetParam();
  const float max_finite = dt == v1::DTYPE_BFLOAT16 ? Bits(0x7f7f0000u) : 65504.0f;
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> bits;
  int checked = 0;
  for (int i = 0; i < 200000; ++i) {
    const float f = Bits(bits(rng));
    if (!std::isfinite(f) || std::fabs(f) > max_finite) continue;
    const uint16_t h = Enc(f, dt);
    const double d = std::fabs(static_cast<double>(Dec(h, dt)) - f);
    for (int step : {-1, 1}) {
      const uint16_t n = static_cast<uint16_t>(h + step);
      const float fn = Dec(n, dt);
      if (std::isnan(fn) || std::isinf(fn) || std::signbit(fn) != std::signbit(Dec(h, dt))) continue;
      const double dn = std::fabs(static_cast<double>(fn) - f);
      ASSERT_LE(d, dn) << f << " -> 0x" << std::hex << h << " but 0x" << n << " is closer";
      if (d == dn) ASSERT_EQ(h & 1, 0) << f << ": tie not broken to even";
    }
    ++checked;
  }
  EXPECT_GT(checked, 10000);
}

TEST(Bf16, TiesToEvenAndSpecials) {
  const auto bf = v1::DTYPE_BFLOAT16;
  // 1 + 2^-8 lies halfway between 1 (0x3f80, even) and 1 + 2^-7 (0x3f81): to even, down.
  EXPECT_EQ(Enc(1.0f + 0x1p-8f, bf), 0x3f80);
  // 1 + 2^-7 + 2^-8 lies halfway between 0x3f81 (odd) and 0x3f82: to even, up.
  EXPECT_EQ(Enc(1.0f + 0x1p-7f + 0x1p-8f, bf), 0x3f82);
  // Just above the tie rounds up.
  EXPECT_EQ(Enc(std::nextafter(1.0f + 0x1p-8f, 2.0f), bf), 0x3f81);
  EXPECT_EQ(Enc(-1.0f - 0x1p-8f, bf), 0xbf80);
  EXPECT_EQ(Enc(0.0f, bf), 0x0000);
  EXPECT_EQ(Enc(-0.0f, bf), 0x8000);
  EXPECT_EQ(Enc(std::numeric_limits<float>::infinity(), bf), 0x7f80);
  EXPECT_EQ(Enc(-std::numeric_limits<float>::infinity(), bf), 0xff80);
  EXPECT_EQ(Enc(std::numeric_limits<float>::max(), bf), 0x7f80);  // rounds past the largest bf16
  EXPECT_TRUE(IsNan16(Enc(std::numeric_limits<float>::quiet_NaN(), bf), bf));
  // A NaN whose payload sits only in the low 16 bits must stay a NaN, not become infinity.
  EXPECT_TRUE(IsNan16(Enc(Bits(0x7f800001u), bf), bf));
  // Subnormals keep their top bits.
  EXPECT_EQ(Enc(Bits(0x00010000u), bf), 0x0001);
  EXPECT_EQ(Dec(0x4049, bf), Bits(0x40490000u));
}

TEST(Fp16, TiesToEvenOverflowAndSubnormals) {
  const auto hf = v1::DTYPE_FLOAT16;
  EXPECT_EQ(Enc(1.0f, hf), 0x3c00);
  EXPECT_EQ(Enc(1.0f + 0x1p-11f, hf), 0x3c00);              // tie between 0x3c00 and 0x3c01: even
  EXPECT_EQ(Enc(1.0f + 3 * 0x1p-11f, hf), 0x3c02);          // tie between 0x3c01 and 0x3c02: even
  EXPECT_EQ(Enc(std::nextafter(1.0f + 0x1p-11f, 2.0f), hf), 0x3c01);
  EXPECT_EQ(Enc(65504.0f, hf), 0x7bff);                     // largest finite
  EXPECT_EQ(Enc(65519.0f, hf), 0x7bff);                     // below the tie: stays finite
  EXPECT_EQ(Enc(65520.0f, hf), 0x7c00);                     // the tie: to even, which is infinity
  EXPECT_EQ(Enc(1e9f, hf), 0x7c00);
  EXPECT_EQ(Enc(-1e9f, hf), 0xfc00);
  EXPECT_EQ(Enc(0x1p-24f, hf), 0x0001);                     // smallest subnormal
  EXPECT_EQ(Enc(0x1p-25f, hf), 0x0000);                     // tie between 0 and 2^-24: even (0)
  EXPECT_EQ(Enc(std::nextafter(0x1p-25f, 1.0f), hf), 0x0001);
  EXPECT_EQ(Enc(3 * 0x1p-25f, hf), 0x0002);                 // tie between 1 and 2 ulps: even
  EXPECT_EQ(Enc(0x1p-14f, hf), 0x0400);                     // smallest normal
  EXPECT_EQ(Enc(0x1p-14f - 0x1p-25f, hf), 0x0400);          // tie between 0x03ff and 0x0400: even
  EXPECT_EQ(Enc(-0.0f, hf), 0x8000);
  EXPECT_EQ(Enc(1e-10f, hf), 0x0000);
  EXPECT_EQ(Enc(-1e-10f, hf), 0x8000);
  EXPECT_TRUE(IsNan16(Enc(std::numeric_limits<float>::quiet_NaN(), hf), hf));
  EXPECT_EQ(Dec(0x0001, hf), 0x1p-24f);
  EXPECT_EQ(Dec(0x03ff, hf), 1023 * 0x1p-24f);
  EXPECT_TRUE(std::isinf(Dec(0x7c00, hf)));
}

#ifdef __FLT16_MAX__
// The compiler's own _Float16 conversion (IEEE round-to-nearest-even) as an independent reference.
TEST(Fp16, MatchesCompilerFloat16) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 200000; ++i) {
    const float f = Bits(bits(rng));
    if (std::isnan(f)) continue;
    const _Float16 r = static_cast<_Float16>(f);
    uint16_t want;
    std::memcpy(&want, &r, 2);
    ASSERT_EQ(Enc(f, v1::DTYPE_FLOAT16), want) << f;
  }
}
#endif

INSTANTIATE_TEST_SUITE_P(Wire, Codec16, ::testing::Values(v1::DTYPE_BFLOAT16, v1::DTYPE_FLOAT16),
                         [](const auto& info) { return std::string(v1::DType_Name(info.param)); });

TEST(Fp32, PassesBytesThrough) {
  const std::vector<float> v = {1.5f, -0.0f, 3e38f, Bits(0x7fc01234u), 1e-45f};
  const std::vector<uint8_t> b = EncodeFloats(v.data(), static_cast<int64_t>(v.size()), v1::DTYPE_FLOAT32);
  ASSERT_EQ(b.size(), v.size() * 4);
  EXPECT_EQ(std::memcmp(b.data(), v.data(), b.size()), 0);
  const std::vector<float> back = DecodeFloats(b.data(), static_cast<int64_t>(v.size()), v1::DTYPE_FLOAT32);
  EXPECT_EQ(std::memcmp(back.data(), v.data(), b.size()), 0);
}

TEST(Wire, LittleEndianLayout) {
  const std::vector<float> v = {1.0f, -2.0f};
  const std::vector<uint8_t> b = EncodeFloats(v.data(), 2, v1::DTYPE_BFLOAT16);
  EXPECT_EQ(b, (std::vector<uint8_t>{0x80, 0x3f, 0x00, 0xc0}));
  EXPECT_EQ(WireDTypeSize(v1::DTYPE_FLOAT32), 4);
  EXPECT_EQ(WireDTypeSize(v1::DTYPE_BFLOAT16), 2);
  EXPECT_EQ(WireDTypeSize(v1::DTYPE_FLOAT16), 2);
  EXPECT_EQ(WireDTypeSize(v1::DTYPE_UNSPECIFIED), 0);
}

// ---- chunk planning ----

void ExpectTiles(const std::vector<std::pair<int64_t, int64_t>>& plan, int64_t rows, int64_t max_rows) {
  int64_t next = 0;
  for (auto [first, n] : plan) {
    EXPECT_EQ(first, next);
    EXPECT_GE(n, 1);
    EXPECT_LE(n, max_rows);
    next = first + n;
  }
  EXPECT_EQ(next, rows);
}

TEST(PlanChunks, CutsAtChunkBytesWithAtLeastOneRow) {
  // 10 rows of 100 bytes, 350-byte chunks: 3 rows each, the last one 1.
  auto p = PlanChunks(10, 100, 350);
  ASSERT_EQ(p.size(), 4u);
  EXPECT_EQ(p.back(), (std::pair<int64_t, int64_t>{9, 1}));
  ExpectTiles(p, 10, 3);
  // Exact multiple.
  p = PlanChunks(12, 100, 400);
  ASSERT_EQ(p.size(), 3u);
  ExpectTiles(p, 12, 4);
  // Rows larger than a chunk: one row per chunk.
  p = PlanChunks(5, 1000, 10);
  ASSERT_EQ(p.size(), 5u);
  ExpectTiles(p, 5, 1);
  // Everything fits in one chunk.
  p = PlanChunks(7, 8, 4 << 20);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0], (std::pair<int64_t, int64_t>{0, 7}));
  // No rows: no chunks.
  EXPECT_TRUE(PlanChunks(0, 100, 1000).empty());
}

TEST(PlanChunks, ASmallerFirstChunkThenFullOnes) {
  auto p = PlanChunks(10, 100, 400, 100);
  ASSERT_EQ(p.size(), 4u);
  EXPECT_EQ(p[0], std::make_pair(int64_t{0}, int64_t{1}));
  EXPECT_EQ(p[1], std::make_pair(int64_t{1}, int64_t{4}));
  EXPECT_EQ(p[3], std::make_pair(int64_t{9}, int64_t{1}));
  // never more than a full chunk, never less than a row
  EXPECT_EQ(PlanChunks(10, 100, 400, 4000)[0].second, 4);
  EXPECT_EQ(PlanChunks(10, 100, 400, 1)[0].second, 1);
}

TEST(PlanChunks, ASmallerLastChunkWhereTheRowsAllowIt) {
  auto p = PlanChunks(20, 100, 600, 100, 200);  // 1, 6, 6, 5, then the last 2 rows
  ASSERT_EQ(p.size(), 5u);
  EXPECT_EQ(p[0], std::make_pair(int64_t{0}, int64_t{1}));
  EXPECT_EQ(p[3], std::make_pair(int64_t{13}, int64_t{5}));
  EXPECT_EQ(p[4], std::make_pair(int64_t{18}, int64_t{2}));
  ExpectTiles(PlanChunks(20, 100, 600, 0, 200), 20, 6);
  // Too few rows for a first and a last chunk: no separate last one.
  EXPECT_EQ(PlanChunks(3, 100, 600, 100, 200).size(), 2u);
  EXPECT_EQ(PlanChunks(1, 100, 600, 0, 100).size(), 1u);
}

TEST(PlanChunks, GrowingFromTheFirstChunk) {
  // 1, 2, 4, then 6-row chunks (the cap), the last 2 rows apart.
  auto p = PlanChunks(30, 100, 600, 100, 200, /*grow=*/true);
  const std::vector<std::pair<int64_t, int64_t>> want = {{0, 1}, {1, 2}, {3, 4}, {7, 6}, {13, 6}, {19, 6}, {25, 3}, {28, 2}};
  EXPECT_EQ(p, want);
  // Without a smaller first chunk there is nothing to grow from.
  EXPECT_EQ(PlanChunks(30, 100, 600, 0, 0, true), PlanChunks(30, 100, 600));
  std::mt19937 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t rows = 1 + rng() % 3000, chunk = 100 * (1 + rng() % 64);
    const auto g = PlanChunks(rows, 100, chunk, 100 * (1 + rng() % 8), 100 * (rng() % 4), true);
    ExpectTiles(g, rows, chunk / 100);
    // Each grown chunk at most doubles the one before, but the one that takes what is left.
    const size_t grown_end = g.size() - (g.size() > 1 && g.back().first + g.back().second == rows &&
                                                 g.back().second < g[g.size() - 2].second
                                             ? 1
                                             : 0);
    for (size_t k = 1; k + 1 < grown_end; ++k) EXPECT_LE(g[k].second, 2 * g[k - 1].second);
  }
  // 8192 rows of 8 KiB: a 2 MiB first chunk doubles to what is left once it fits in 34 MiB (5 engine
  // calls, not 256, 512, 1024, 2048, 4096 and a last 256); a 32 MiB cap leaves the small remainder.
  auto sizes = [](const std::vector<std::pair<int64_t, int64_t>>& plan) {
    std::vector<int64_t> n;
    for (const auto& c : plan) n.push_back(c.second);
    return n;
  };
  EXPECT_EQ(sizes(PlanChunks(8192, 8192, 34 << 20, 2 << 20, 0, true)), (std::vector<int64_t>{256, 512, 1024, 2048, 4352}));
  EXPECT_EQ(sizes(PlanChunks(8192, 8192, 32 << 20, 2 << 20, 0, true)),
            (std::vector<int64_t>{256, 512, 1024, 2048, 4096, 256}));
  EXPECT_EQ(sizes(PlanChunks(8192, 8192, 36 << 20, 4 << 20, 0, true)), (std::vector<int64_t>{512, 1024, 2048, 4608}));
}

TEST(PlanChunks, RandomShapesTileTheRows) {
  std::mt19937 rng(3);
  for (int i = 0; i < 500; ++i) {
    const int64_t rows = rng() % 5000, row_bytes = 1 + rng() % 20000, chunk = 1 + rng() % (1 << 20);
    ExpectTiles(PlanChunks(rows, row_bytes, chunk), rows, std::max<int64_t>(1, chunk / row_bytes));
    ExpectTiles(PlanChunks(rows, row_bytes, chunk, rng() % (1 << 20), rng() % (1 << 20)), rows,
                std::max<int64_t>(1, chunk / row_bytes));
  }
}

}  // namespace
}  // namespace lce::client
