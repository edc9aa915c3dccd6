// lce_cli's tensor files (client/tensor_file.h): .npy, safetensors and raw written and read back in
// each dtype, the format told from the name, and files that are not what they say refused with a
// message naming the file.
#include "tensor_file.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>

#include "gtest/gtest.h"

namespace lce::client {
namespace {

std::string TempPath(const std::string& name) {
  return ::testing::TempDir() + "/lce_tensor_file_" + std::to_string(getpid()) + "_" + name;
}

void WriteText(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

TEST(TensorFile, EachFormatAndDTypeRoundTrips) {
  for (v1::DType dtype : {v1::DTYPE_FLOAT32, v1::DTYPE_FLOAT16, v1::DTYPE_BFLOAT16}) {
    const int64_t rows = 3, cols = 5, es = dtype == v1::DTYPE_FLOAT32 ? 4 : 2;
    std::vector<uint8_t> bytes(static_cast<size_t>(rows * cols * es));
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 7 + 1);
    for (const char* ext : {"npy", "safetensors", "raw"}) {
      const std::string path = TempPath(std::string("t.") + ext);
      absl::StatusOr<TensorFormat> f = ParseTensorFormat("", path);
      ASSERT_TRUE(f.ok()) << f.status();
      ASSERT_TRUE(WriteTensorFile(path, *f, "w", dtype, rows, cols, bytes).ok());
      absl::StatusOr<Tensor2D> t = ReadTensorFile(path, *f, "", dtype, cols);
      ASSERT_TRUE(t.ok()) << ext << ": " << t.status();
      EXPECT_EQ(t->dtype, dtype) << ext;
      EXPECT_EQ(t->rows, rows) << ext;
      EXPECT_EQ(t->cols, cols) << ext;
      EXPECT_EQ(t->bytes, bytes) << ext;
      std::remove(path.c_str());
    }
  }
}

TEST(TensorFile, NpyHeaderIsNumpysVersionOne) {
  const std::string path = TempPath("h.npy");
  std::vector<uint8_t> bytes(2 * 3 * 4, 0);
  ASSERT_TRUE(WriteTensorFile(path, TensorFormat::kNpy, "", v1::DTYPE_FLOAT32, 2, 3, bytes).ok());
  absl::StatusOr<std::string> file = ReadWholeFile(path);
  ASSERT_TRUE(file.ok());
  EXPECT_EQ(file->substr(0, 8), std::string("\x93NUMPY\x01\x00", 8));
  const size_t header = static_cast<unsigned char>((*file)[8]) | static_cast<unsigned char>((*file)[9]) << 8;
  EXPECT_EQ((10 + header) % 64, 0u);
  EXPECT_NE(file->find("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }"), std::string::npos);
  EXPECT_EQ(file->size(), 10 + header + bytes.size());
  std::remove(path.c_str());
}

TEST(TensorFile, SafetensorsTensorsAreChosenByName) {
  const std::string path = TempPath("two.safetensors");
  // Two F32 tensors a [1, 2] and b [2, 1].
  const std::string header = R"({"a":{"dtype":"F32","shape":[1,2],"data_offsets":[0,8]},)"
                             R"("b":{"dtype":"F32","shape":[2,1],"data_offsets":[8,16]}})";
  std::string file(8, '\0');
  file[0] = static_cast<char>(header.size());
  file += header + std::string(16, '\x01');
  WriteText(path, file);
  absl::StatusOr<Tensor2D> b = ReadTensorFile(path, TensorFormat::kSafetensors, "b", v1::DTYPE_FLOAT32, 0);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->rows, 2);
  EXPECT_EQ(b->cols, 1);
  absl::Status none = ReadTensorFile(path, TensorFormat::kSafetensors, "", v1::DTYPE_FLOAT32, 0).status();
  EXPECT_TRUE(absl::IsInvalidArgument(none));
  EXPECT_NE(none.message().find("--tensor"), std::string::npos) << none;
  absl::Status missing = ReadTensorFile(path, TensorFormat::kSafetensors, "c", v1::DTYPE_FLOAT32, 0).status();
  EXPECT_NE(missing.message().find("no tensor 'c'"), std::string::npos) << missing;
  std::remove(path.c_str());
}

TEST(TensorFile, FilesThatAreNotWhatTheySayAreRefused) {
  const std::string path = TempPath("bad.npy");
  auto read = [&](TensorFormat f) { return ReadTensorFile(path, f, "", v1::DTYPE_FLOAT32, 4).status(); };
  WriteText(path, "hello");
  EXPECT_TRUE(absl::IsInvalidArgument(read(TensorFormat::kNpy)));
  EXPECT_TRUE(absl::IsInvalidArgument(read(TensorFormat::kSafetensors)));
  EXPECT_TRUE(absl::IsInvalidArgument(read(TensorFormat::kRaw))) << "5 bytes are not rows of 4 fp32";
  std::vector<uint8_t> bytes(2 * 3 * 4, 0);
  ASSERT_TRUE(WriteTensorFile(path, TensorFormat::kNpy, "", v1::DTYPE_FLOAT32, 2, 3, bytes).ok());
  absl::StatusOr<std::string> file = ReadWholeFile(path);
  WriteText(path, file->substr(0, file->size() - 1));  // one data byte short
  EXPECT_NE(read(TensorFormat::kNpy).message().find(path), std::string::npos) << read(TensorFormat::kNpy);
  std::string f8 = *file;
  f8.replace(f8.find("<f4"), 3, "<f8");
  WriteText(path, f8);
  EXPECT_NE(read(TensorFormat::kNpy).message().find("'<f8'"), std::string::npos) << read(TensorFormat::kNpy);
  std::string three_d = *file;
  three_d.replace(three_d.find("(2, 3)"), 6, "(2,3,1)");
  WriteText(path, three_d);
  EXPECT_NE(read(TensorFormat::kNpy).message().find("not 1-D or 2-D"), std::string::npos) << read(TensorFormat::kNpy);
  std::string scalar = *file;
  scalar.replace(scalar.find("(2, 3)"), 6, "()    ");
  WriteText(path, scalar);
  EXPECT_NE(read(TensorFormat::kNpy).message().find("not 1-D or 2-D"), std::string::npos) << read(TensorFormat::kNpy);
  std::remove(path.c_str());
  EXPECT_TRUE(absl::IsNotFound(read(TensorFormat::kNpy)));
}

// A bias or class weights as PyTorch and NumPy write them, [n]: read as n x 1.
TEST(TensorFile, OneDimensionalTensorsReadAsAColumn) {
  const std::vector<uint8_t> bytes = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  const std::string npy = TempPath("v.npy");
  ASSERT_TRUE(WriteTensorFile(npy, TensorFormat::kNpy, "", v1::DTYPE_FLOAT32, 3, 1, bytes).ok());
  std::string file = *ReadWholeFile(npy);
  file.replace(file.find("(3, 1)"), 6, "(3,)  ");  // numpy's header of np.save(path, np.zeros(3, "<f4"))
  WriteText(npy, file);
  const std::string st = TempPath("v.safetensors");
  const std::string header = R"({"lm_head.bias":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}})";
  WriteText(st, std::string(1, static_cast<char>(header.size())) + std::string(7, '\0') + header +
                    std::string(bytes.begin(), bytes.end()));
  for (auto [path, format] : {std::pair{npy, TensorFormat::kNpy}, std::pair{st, TensorFormat::kSafetensors}}) {
    absl::StatusOr<Tensor2D> t = ReadTensorFile(path, format, "", v1::DTYPE_FLOAT32, 1);
    ASSERT_TRUE(t.ok()) << path << ": " << t.status();
    EXPECT_EQ(t->rows, 3) << path;
    EXPECT_EQ(t->cols, 1) << path;
    EXPECT_EQ(t->bytes, bytes) << path;
    std::remove(path.c_str());
  }
}

TEST(TensorFile, VectorFilesAreWidenedToFloats) {
  const std::vector<float> want = {0.5f, -2.0f, 3.25f};
  const auto* f32 = reinterpret_cast<const uint8_t*>(want.data());
  const std::vector<uint8_t> bf16 = {0x00, 0x3f, 0x00, 0xc0, 0x50, 0x40};  // the same values' bf16 bits
  const std::string raw = TempPath("w.raw"), npy = TempPath("w.npy"), bad = TempPath("w.txt");
  ASSERT_TRUE(WriteTensorFile(raw, TensorFormat::kRaw, "", v1::DTYPE_FLOAT32, 3, 1, absl::MakeConstSpan(f32, 12)).ok());
  ASSERT_TRUE(WriteTensorFile(npy, TensorFormat::kNpy, "", v1::DTYPE_BFLOAT16, 3, 1, bf16).ok());
  for (const std::string& path : {raw, npy}) {
    absl::StatusOr<std::vector<float>> v = ReadVectorFile(path);
    ASSERT_TRUE(v.ok()) << path << ": " << v.status();
    EXPECT_EQ(*v, want) << path;
  }
  ASSERT_TRUE(WriteTensorFile(npy, TensorFormat::kNpy, "", v1::DTYPE_FLOAT32, 1, 3, absl::MakeConstSpan(f32, 12)).ok());
  EXPECT_NE(ReadVectorFile(npy).status().message().find("not a vector"), std::string::npos);
  EXPECT_NE(ReadVectorFile(bad).status().message().find(".npy, .safetensors or .raw"), std::string::npos);
  EXPECT_TRUE(absl::IsNotFound(ReadVectorFile(TempPath("none.npy")).status()));
  std::remove(raw.c_str());
  std::remove(npy.c_str());
}

TEST(TensorFile, FormatIsToldByNameOrFlag) {
  EXPECT_EQ(*ParseTensorFormat("", "g.npy"), TensorFormat::kNpy);
  EXPECT_EQ(*ParseTensorFormat("", "g.safetensors"), TensorFormat::kSafetensors);
  EXPECT_EQ(*ParseTensorFormat("", "g.raw"), TensorFormat::kRaw);
  EXPECT_EQ(*ParseTensorFormat("raw", "g.npy"), TensorFormat::kRaw);
  EXPECT_NE(ParseTensorFormat("", "g.pt").status().message().find("--format"), std::string::npos);
  EXPECT_NE(ParseTensorFormat("pickle", "g").status().message().find("'pickle'"), std::string::npos);
}

}  // namespace
}  // namespace lce::client
