// 2-D tensors in files, for lce_cli's get-grad and update-weights: NumPy .npy, safetensors, or raw
// little-endian bytes. bf16 in .npy is uint16 bits ('<u2'), as the Python client takes it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "lce/v1/lce.pb.h"

namespace lce::client {

// The whole file; NOT_FOUND naming it when it cannot be opened.
absl::StatusOr<std::string> ReadWholeFile(const std::string& path);

enum class TensorFormat { kNpy, kSafetensors, kRaw };

// `format` ("npy", "safetensors", "raw"), or "" to tell it from the path's extension (.npy,
// .safetensors, .raw/.bin/.f32); INVALID_ARGUMENT naming the path when neither says.
absl::StatusOr<TensorFormat> ParseTensorFormat(const std::string& format, const std::string& path);

struct Tensor2D {
  v1::DType dtype = v1::DTYPE_FLOAT32;
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> bytes;  // rows * cols elements of dtype, little-endian, row-major
};

// Writes rows x cols elements of `dtype` (safetensors: as tensor `name`).
absl::Status WriteTensorFile(const std::string& path, TensorFormat format, const std::string& name, v1::DType dtype,
                             int64_t rows, int64_t cols, absl::Span<const uint8_t> bytes);

// Reads a 2-D tensor, or a 1-D one [n] as n x 1 (a bias, class weights). safetensors: tensor `name`,
// or with "" the file's only tensor. raw: elements of `raw_dtype`, `raw_cols` a row.
// INVALID_ARGUMENT for a file that is not what it says; NOT_FOUND for one that cannot be opened.
absl::StatusOr<Tensor2D> ReadTensorFile(const std::string& path, TensorFormat format, const std::string& name,
                                        v1::DType raw_dtype, int64_t raw_cols);

// A vector [n] (or n x 1) of values from `path`, its format told by its name (.npy; .safetensors: the
// file's only tensor; .raw: little-endian fp32), fp16 and bf16 widened: a bias, class weights.
// INVALID_ARGUMENT naming the file for one that is not such a vector; NOT_FOUND for one that cannot
// be opened.
absl::StatusOr<std::vector<float>> ReadVectorFile(const std::string& path);

}  // namespace lce::client
