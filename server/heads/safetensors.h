// Reading and writing LM-head tensors in the safetensors format (an 8-byte little-endian header
// length, a JSON header, then raw little-endian tensor bytes).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lce/head.h"

namespace lce::server {

// One 2-D tensor entry of a safetensors file.
struct SafetensorsEntry {
  DType dtype;
  int64_t rows = 0;
  int64_t cols = 0;
  uint64_t data_offset = 0;  // absolute file offset of the first byte
};

// Looks `tensor` up in the file's header. 1-D tensors report rows = length, cols = 1.
absl::StatusOr<SafetensorsEntry> ReadSafetensorsEntry(const std::string& path, const std::string& tensor);

// Reads rows [row_begin, row_end) of a 2-D tensor, and nothing else of the file.
absl::StatusOr<std::vector<uint8_t>> ReadSafetensorsRows(const std::string& path,
                                                         const SafetensorsEntry& entry,
                                                         int64_t row_begin, int64_t row_end);

// A tensor to write.
struct SafetensorsTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  const uint8_t* data;
  int64_t bytes;
};

absl::Status WriteSafetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors);

}  // namespace lce::server
