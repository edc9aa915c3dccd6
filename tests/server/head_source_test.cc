#include "head_source.h"

#include <filesystem>

#include "gtest/gtest.h"
#include "lce/numeric.h"
#include "safetensors.h"

namespace lce::server {
namespace {

TEST(HeadSource, SeededHeadIsDeterministicAndShardsAgree) {
  HeadSource src;
  ASSERT_TRUE(ParseSeedShape("103x16", src).ok());
  src.seed = 42;
  auto whole = LoadHead(src, 0, 1);
  ASSERT_TRUE(whole.ok()) << whole.status();
  auto again = LoadHead(src, 0, 1);
  EXPECT_EQ((*whole)->weight, (*again)->weight);
  // Shards of 3 ranks concatenate to the whole head.
  std::vector<uint8_t> joined;
  for (int r = 0; r < 3; ++r) {
    auto shard = LoadHead(src, r, 3);
    ASSERT_TRUE(shard.ok());
    const VocabRange range = VocabShard(103, r, 3);
    EXPECT_EQ((*shard)->shape.vocab_begin, range.begin);
    EXPECT_EQ((*shard)->shape.shard_rows, range.end - range.begin);
    joined.insert(joined.end(), (*shard)->weight.begin(), (*shard)->weight.end());
  }
  EXPECT_EQ(joined, (*whole)->weight);
  src.seed = 43;
  EXPECT_NE((*LoadHead(src, 0, 1))->weight, (*whole)->weight);
  // Roughly N(0, 1/H).
  double sum2 = 0;
  const auto* w = reinterpret_cast<const uint16_t*>((*whole)->weight.data());
  for (int i = 0; i < 103 * 16; ++i) sum2 += Bf16ToFloat(w[i]) * Bf16ToFloat(w[i]);
  EXPECT_NEAR(sum2 / (103 * 16), 1.0 / 16, 0.2 / 16);
}

TEST(HeadSource, ShardedFileLoadReadsItsRows) {
  const std::string path = (std::filesystem::temp_directory_path() / "hs_test.safetensors").string();
  std::vector<float> w(10 * 4), b(10);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i);
  for (size_t i = 0; i < b.size(); ++i) b[i] = -static_cast<float>(i);
  ASSERT_TRUE(WriteSafetensors(path, {{"lm_head.weight", DType::kFloat32, {10, 4}, reinterpret_cast<uint8_t*>(w.data()), 160},
                                      {"lm_head.bias", DType::kFloat32, {10}, reinterpret_cast<uint8_t*>(b.data()), 40}})
                  .ok());
  HeadSource src;
  src.file = path;
  src.bias_tensor = "lm_head.bias";
  auto shard = LoadHead(src, 1, 3);  // rows [4, 7)
  ASSERT_TRUE(shard.ok()) << shard.status();
  EXPECT_EQ((*shard)->shape.vocab_size, 10);
  EXPECT_EQ((*shard)->shape.vocab_begin, 4);
  EXPECT_EQ((*shard)->shape.shard_rows, 3);
  const float* got = reinterpret_cast<const float*>((*shard)->weight.data());
  EXPECT_EQ(got[0], 16.0f);
  EXPECT_EQ(got[11], 27.0f);
  EXPECT_EQ((*shard)->bias, (std::vector<float>{-4, -5, -6}));
  src.tensor = "nope";
  EXPECT_EQ(LoadHead(src, 0, 1).status().code(), absl::StatusCode::kNotFound);
  std::filesystem::remove(path);
}

TEST(HeadSource, BadSeedShape) {
  HeadSource src;
  EXPECT_FALSE(ParseSeedShape("12x", src).ok());
  EXPECT_FALSE(ParseSeedShape("0x4", src).ok());
  EXPECT_FALSE(LoadHead(HeadSource{}, 0, 1).ok());
}

}  // namespace
}  // namespace lce::server
