#include "safetensors.h"

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "gtest/gtest.h"

namespace lce::server {
namespace {

std::string TempPath(const std::string& name) {
  return (std::filesystem::temp_directory_path() / (name + "_" + std::to_string(::getpid()))).string();
}

TEST(Safetensors, WriteThenReadRowRanges) {
  const std::string path = TempPath("st_rows.safetensors");
  std::vector<uint16_t> w(7 * 3);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<uint16_t>(1000 + i);
  std::vector<float> b = {1, 2, 3, 4, 5, 6, 7};
  ASSERT_TRUE(WriteSafetensors(path, {{"lm_head.weight", DType::kBFloat16, {7, 3},
                                       reinterpret_cast<const uint8_t*>(w.data()), 42},
                                      {"lm_head.bias", DType::kFloat32, {7},
                                       reinterpret_cast<const uint8_t*>(b.data()), 28}})
                  .ok());
  absl::StatusOr<SafetensorsEntry> e = ReadSafetensorsEntry(path, "lm_head.weight");
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->rows, 7);
  EXPECT_EQ(e->cols, 3);
  EXPECT_EQ(e->dtype, DType::kBFloat16);
  absl::StatusOr<std::vector<uint8_t>> rows = ReadSafetensorsRows(path, *e, 2, 5);
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), 3u * 3 * 2);
  EXPECT_EQ(0, std::memcmp(rows->data(), w.data() + 6, rows->size()));
  absl::StatusOr<SafetensorsEntry> bias = ReadSafetensorsEntry(path, "lm_head.bias");
  ASSERT_TRUE(bias.ok());
  EXPECT_EQ(bias->rows, 7);
  EXPECT_EQ(bias->cols, 1);
  std::remove(path.c_str());
}

TEST(Safetensors, ErrorsNameTheProblem) {
  EXPECT_EQ(ReadSafetensorsEntry("/nonexistent/x.safetensors", "w").status().code(), absl::StatusCode::kNotFound);
  const std::string path = TempPath("st_bad.safetensors");
  {
    std::ofstream out(path, std::ios::binary);
    const uint64_t len = 1000;
    out.write(reinterpret_cast<const char*>(&len), 8);
    out << "{}";
  }
  absl::StatusOr<SafetensorsEntry> e = ReadSafetensorsEntry(path, "w");
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(e.status().message().find("header length"), std::string::npos) << e.status();
  std::vector<float> w(4);
  ASSERT_TRUE(WriteSafetensors(path, {{"w", DType::kFloat32, {2, 2}, reinterpret_cast<const uint8_t*>(w.data()), 16}}).ok());
  EXPECT_EQ(ReadSafetensorsEntry(path, "missing").status().code(), absl::StatusCode::kNotFound);
  std::remove(path.c_str());
}

// A file with `header` (JSON) and `data_bytes` zero bytes after it.
void WriteRaw(const std::string& path, const std::string& header, size_t data_bytes) {
  std::ofstream out(path, std::ios::binary);
  const uint64_t len = header.size();
  out.write(reinterpret_cast<const char*>(&len), 8);
  out << header << std::string(data_bytes, '\0');
}

void ExpectInvalid(const absl::Status& s, const std::string& words) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find(words), std::string::npos) << "'" << s.message() << "' lacks '" << words << "'";
}

// Crafted headers: a shape whose byte size wraps to match its offsets, values of the wrong JSON
// type (they used to throw out of the parser), offsets that wrap past the file's end.
TEST(Safetensors, CraftedHeadersAreRefusedWithTheirProblem) {
  const std::string path = TempPath("st_crafted.safetensors");
  // (2^61 + 1) x 4 fp32 is 2^67 + 16 bytes: 16 modulo 2^64, as the offsets say.
  WriteRaw(path, R"({"w":{"dtype":"F32","shape":[2305843009213693953,4],"data_offsets":[0,16]}})", 16);
  ExpectInvalid(ReadSafetensorsEntry(path, "w").status(), "not a valid size");
  WriteRaw(path, R"({"w":{"dtype":"F32","shape":["2",2],"data_offsets":[0,16]}})", 16);
  ExpectInvalid(ReadSafetensorsEntry(path, "w").status(), "malformed entry for 'w'");
  WriteRaw(path, R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,"16"]}})", 16);
  ExpectInvalid(ReadSafetensorsEntry(path, "w").status(), "malformed entry for 'w'");
  WriteRaw(path, R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[18446744073709551596,18446744073709551612]}})", 16);
  ExpectInvalid(ReadSafetensorsEntry(path, "w").status(), "do not match its shape or the file");
  WriteRaw(path, R"({"w":{"dtype":"F32","shape":[0,2],"data_offsets":[0,0]}})", 16);
  ExpectInvalid(ReadSafetensorsEntry(path, "w").status(), "dimensions must be positive");
  std::remove(path.c_str());
}

TEST(Safetensors, RowReadsCheckTheirSize) {
  SafetensorsEntry e{DType::kFloat32, int64_t{1} << 62, int64_t{1} << 40, 0};
  ExpectInvalid(ReadSafetensorsRows("/dev/null", e, 0, int64_t{1} << 62).status(), "not a valid size");
}

}  // namespace
}  // namespace lce::server
