#include "lce/head.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace lce {

const char* DTypeName(DType d) {
  switch (d) {
    case DType::kFloat32: return "fp32";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat16: return "fp16";
  }
  return "?";
}

absl::StatusOr<DType> ParseDType(std::string_view name) {
  if (name == "fp32" || name == "float32" || name == "F32") return DType::kFloat32;
  if (name == "bf16" || name == "bfloat16" || name == "BF16") return DType::kBFloat16;
  if (name == "fp16" || name == "float16" || name == "F16") return DType::kFloat16;
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype '", std::string(name), "' (fp32, bf16, fp16)"));
}

absl::StatusOr<int64_t> TensorBytes(int64_t rows, int64_t cols, int64_t element_bytes, std::string_view what) {
  int64_t elements = 0, bytes = 0;
  if (rows < 0 || cols < 0 || element_bytes < 0 || __builtin_mul_overflow(rows, cols, &elements) ||
      __builtin_mul_overflow(elements, element_bytes, &bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(std::string(what), ": ", rows, " x ", cols, " elements of ", element_bytes,
                                                   " bytes is not a valid size (negative, or over 2^63 bytes)"));
  }
  return bytes;
}

absl::Status ValidateHeadWeights(const HeadWeights& head) {
  const HeadShape& s = head.shape;
  if (s.vocab_size <= 0 || s.hidden_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("head shape must be positive, got V=", s.vocab_size, " H=", s.hidden_size));
  }
  if (s.vocab_begin < 0 || s.shard_rows <= 0 || s.vocab_end() > s.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat("head shard [", s.vocab_begin, ", ", s.vocab_end(),
                                                   ") is not inside [0, ", s.vocab_size, ")"));
  }
  const absl::StatusOr<int64_t> want = TensorBytes(s.shard_rows, s.hidden_size, DTypeSize(s.dtype), "head shard");
  if (!want.ok()) return want.status();
  if (static_cast<int64_t>(head.weight.size()) != *want) {
    return absl::InvalidArgumentError(
        absl::StrCat("head weight holds ", head.weight.size(), " bytes, shape needs ", *want));
  }
  if (s.has_bias != !head.bias.empty() ||
      (s.has_bias && static_cast<int64_t>(head.bias.size()) != s.shard_rows)) {
    return absl::InvalidArgumentError(absl::StrCat("head bias holds ", head.bias.size(),
                                                   " values, shard has ", s.shard_rows, " rows"));
  }
  return absl::OkStatus();
}

int64_t VocabTile(int64_t vocab_size) {
  return std::clamp<int64_t>((vocab_size + 63) / 64, 1, 1536);  // 1536: cuda::kSegment (kernels/cuda/kernels.h)
}

int64_t VocabTileCount(int64_t vocab_size) {
  const int64_t tile = VocabTile(vocab_size);
  return (vocab_size + tile - 1) / tile;
}

VocabRange VocabShard(int64_t vocab_size, int rank, int world) {
  const int64_t tiles = VocabTileCount(vocab_size);
  const int64_t base = tiles / world;
  const int64_t extra = tiles % world;
  // The last `extra` ranks take a tile more: the last of them holds the head's short last tile, so that a
  // group of two with an odd T is within a short tile of even (151936 rows: 75264 / 76672, not 76800 / 75136).
  const int64_t more_from = world - extra;
  const int64_t first = rank * base + std::max<int64_t>(0, rank - more_from);
  const int64_t tile = VocabTile(vocab_size);
  const int64_t begin = std::min(vocab_size, first * tile);
  return {begin, std::min(vocab_size, (first + base + (rank >= more_from ? 1 : 0)) * tile)};
}

}  // namespace lce
