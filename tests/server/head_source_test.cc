#include "head_source.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "lce/numeric.h"
#include "safetensors.h"

namespace lce::server {
namespace {

void ExpectError(const absl::Status& s, absl::StatusCode code, const std::string& words) {
  EXPECT_EQ(s.code(), code) << s;
  EXPECT_NE(s.message().find(words), std::string::npos) << "'" << s.message() << "' lacks '" << words << "'";
}

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
  auto shard = LoadHead(src, 1, 3);  // rows [3, 6): the last rank holds the fourth tile
  ASSERT_TRUE(shard.ok()) << shard.status();
  EXPECT_EQ((*shard)->shape.vocab_size, 10);
  EXPECT_EQ((*shard)->shape.vocab_begin, 3);
  EXPECT_EQ((*shard)->shape.shard_rows, 3);
  const float* got = reinterpret_cast<const float*>((*shard)->weight.data());
  EXPECT_EQ(got[0], 12.0f);
  EXPECT_EQ(got[11], 23.0f);
  EXPECT_EQ((*shard)->bias, (std::vector<float>{-3, -4, -5}));
  src.tensor = "nope";
  ExpectError(LoadHead(src, 0, 1).status(), absl::StatusCode::kNotFound, "no tensor named 'nope'");
  src.tensor = "lm_head.weight";
  ExpectError(LoadHead(src, 2, 2).status(), absl::StatusCode::kInvalidArgument, "bad tensor-parallel rank 2 of 2");
  std::filesystem::remove(path);
}

TEST(HeadSource, BadSeedShape) {
  HeadSource src;
  ExpectError(ParseSeedShape("12x", src), absl::StatusCode::kInvalidArgument, "must be VxH");
  ExpectError(ParseSeedShape("0x4", src), absl::StatusCode::kInvalidArgument, "must be VxH");
  // 2^62 x 4 fp32 elements do not fit in 2^63 bytes.
  ExpectError(ParseSeedShape("4611686018427387904x4", src), absl::StatusCode::kInvalidArgument, "not a valid size");
  ExpectError(LoadHead(HeadSource{}, 0, 1).status(), absl::StatusCode::kInvalidArgument, "no head");
}

// The shape of a seeded head from LoadHead is the client's: its byte size once wrapped (2^61 + 1
// rows) to a tiny allocation that the fill overran.
TEST(HeadSource, HugeSeededHeadIsRefusedBeforeAnyAllocation) {
  HeadSource src;
  src.seed_vocab = (int64_t{1} << 61) + 1;
  src.seed_hidden = 4;
  ExpectError(LoadHead(src, 0, 1).status(), absl::StatusCode::kInvalidArgument, "not a valid size");
  src.seed_vocab = int64_t{1} << 40;
  src.seed_hidden = 1 << 20;  // 2^61 bytes in bf16: a number, but no host has it
  ExpectError(LoadHead(src, 0, 1).status(), absl::StatusCode::kResourceExhausted, "over this server's limit");
}

TEST(HeadSource, TheCapIsOnEachRanksShard) {
  HeadSource src;
  ASSERT_TRUE(ParseSeedShape("103x16", src).ok());  // bf16: 32 bytes a row
  ExpectError(LoadHead(src, 0, 1, /*max_shard_bytes=*/1000).status(), absl::StatusCode::kResourceExhausted,
              "limit of 1000");
  // Rank 0 of 3 holds more than 1000 bytes, rank 0 of 4 less (whatever the tiles of the split).
  const int64_t rows3 = VocabShard(103, 0, 3).end, rows4 = VocabShard(103, 0, 4).end;
  ASSERT_GT(rows3 * 32, 1000);
  ASSERT_LE(rows4 * 32, 1000);
  ExpectError(LoadHead(src, 0, 3, 1000).status(), absl::StatusCode::kResourceExhausted,
              absl::StrCat(rows3, "x16 bf16 needs ", rows3 * 32));
  auto shard = LoadHead(src, 0, 4, 1000);
  ASSERT_TRUE(shard.ok()) << shard.status();
  EXPECT_EQ(static_cast<int64_t>((*shard)->weight.size()), rows4 * 32);
}

// An index whose values have the wrong JSON types is refused (its parser threw before).
TEST(HeadSource, MalformedIndexIsInvalid) {
  const std::string path = (std::filesystem::temp_directory_path() / "hs_bad.index.json").string();
  std::ofstream(path) << R"({"vocab_size":"many","hidden_size":4,"dtype":"bf16","shards":[]})";
  HeadSource src;
  src.file = path;
  ExpectError(LoadHead(src, 0, 1).status(), absl::StatusCode::kInvalidArgument, "not an lce-serve head index");
  std::ofstream(path) << R"({"vocab_size":4,"hidden_size":4,"dtype":"bf16","shards":[{"file":7}]})";
  ExpectError(LoadHead(src, 0, 1).status(), absl::StatusCode::kInvalidArgument, "not an lce-serve head index");
  // A shard without vocab_end: nlohmann's const operator[] on a missing key read freed memory
  // (tests/fuzz/corpus/fuzz_head_index/regress_shard_without_vocab_end).
  std::ofstream(path) << R"({"vocab_size":4,"hidden_size":4,"dtype":"bf16","shards":[{"file":"x","vocab_begin":0}]})";
  ExpectError(LoadHead(src, 0, 1).status(), absl::StatusCode::kInvalidArgument, "integer vocab_begin and vocab_end");
  std::ofstream(path) << R"({"vocab_size":4,"hidden_size":4,"dtype":"bf16","shards":{"file":"x"}})";
  ExpectError(LoadHead(src, 0, 1).status(), absl::StatusCode::kInvalidArgument, "shards must be an array");
  std::ofstream(path) << R"({"vocab_size":4,"hidden_size":4,"dtype":"bf16","has_bias":"yes","shards":[]})";
  ExpectError(LoadHead(src, 0, 1).status(), absl::StatusCode::kInvalidArgument, "has_bias must be true or false");
  std::ofstream(path) << R"([1, 2])";
  ExpectError(LoadHead(src, 0, 1).status(), absl::StatusCode::kInvalidArgument, "not a JSON object");
  std::filesystem::remove(path);
}

// An index whose shard file is not what it says (another hidden size, another dtype) is refused
// with both shapes named, not read as bytes of the wrong shape.
TEST(HeadSource, IndexedShardOfAnotherShapeIsInvalid) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("hs_shape_mismatch_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  HeadSource src;
  ASSERT_TRUE(ParseSeedShape("8x6", src).ok());
  auto w = LoadHead(src, 0, 1);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE(WriteHeadShard(dir.string(), "m", 1, **w, 0, 1).ok());
  HeadShape claimed = (*w)->shape;
  claimed.hidden_size = 3;  // 8 x 6 bf16 has the bytes of 8 x 3 fp32, and of 16 x 3 bf16
  claimed.dtype = DType::kFloat32;
  auto index = WriteHeadIndex(dir.string(), "m", 1, claimed, 1);
  ASSERT_TRUE(index.ok()) << index.status();
  src.file = *index;
  ExpectError(LoadHead(src, 0, 1).status(), absl::StatusCode::kInvalidArgument, "but the index says 8x3 fp32");
  std::filesystem::remove_all(dir);
}

// A truncated or corrupt shard is a clear error at load, naming the file and what is wrong; so is
// a file that is not a regular file.
TEST(HeadSource, TruncatedOrCorruptShardIsAClearError) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("hs_truncated_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  HeadSource a;
  ASSERT_TRUE(ParseSeedShape("103x16", a).ok());
  for (int r = 0; r < 2; ++r) {
    auto shard = LoadHead(a, r, 2);
    ASSERT_TRUE(shard.ok());
    ASSERT_TRUE(WriteHeadShard(dir.string(), "h", 3, **shard, r, 2).ok());
  }
  auto whole = LoadHead(a, 0, 1);
  ASSERT_TRUE(whole.ok());
  auto index = WriteHeadIndex(dir.string(), "h", 3, (*whole)->shape, 2);
  ASSERT_TRUE(index.ok()) << index.status();
  HeadSource saved;
  saved.file = *index;
  ASSERT_TRUE(LoadHead(saved, 0, 1).ok());
  const std::string shard1 = (dir / ShardFileName("h", 3, 1, 2)).string();
  const auto size = fs::file_size(shard1);
  fs::resize_file(shard1, size - 10);
  ExpectError(LoadHead(saved, 0, 1).status(), absl::StatusCode::kInvalidArgument, "truncated?");
  fs::resize_file(shard1, 20);
  ExpectError(LoadHead(saved, 0, 1).status(), absl::StatusCode::kInvalidArgument, "bad safetensors header length");
  {
    std::fstream f(shard1, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(8);
    f << "garbage!";
  }
  fs::resize_file(shard1, size);
  ExpectError(LoadHead(saved, 0, 1).status(), absl::StatusCode::kInvalidArgument, "header is not a JSON object");
  // Not a regular file (a FIFO would block the loader; a device would feed it noise).
  HeadSource dev;
  dev.file = "/dev/zero";
  ExpectError(LoadHead(dev, 0, 1).status(), absl::StatusCode::kInvalidArgument, "not a regular file");
  fs::remove_all(dir);
}

}  // namespace
}  // namespace lce::server
