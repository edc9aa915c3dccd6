// The LM-head weight an engine serves: W [vocab, hidden] (one vocabulary shard of it under tensor
// parallelism) and an optional fp32 bias.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace lce {

enum class DType : uint8_t { kFloat32, kBFloat16, kFloat16 };

inline constexpr int64_t DTypeSize(DType d) { return d == DType::kFloat32 ? 4 : 2; }
const char* DTypeName(DType d);  // "fp32", "bf16", "fp16"
absl::StatusOr<DType> ParseDType(std::string_view name);

struct HeadShape {
  int64_t vocab_size = 0;   // V of the whole head (all shards)
  int64_t hidden_size = 0;  // H
  DType dtype = DType::kBFloat16;
  int64_t vocab_begin = 0;  // first global vocabulary row this shard holds
  int64_t shard_rows = 0;   // rows this shard holds (== vocab_size when not sharded)
  bool has_bias = false;

  int64_t vocab_end() const { return vocab_begin + shard_rows; }
  // Bytes of one row of H values in dtype: a hidden state, a d_hidden row or a weight row.
  int64_t row_bytes() const { return hidden_size * DTypeSize(dtype); }
};

// Host copy of a head shard. `weight` holds shard_rows * hidden_size elements of `dtype`,
// row-major, little-endian; `bias` is empty or holds shard_rows floats.
struct HeadWeights {
  HeadShape shape;
  std::vector<uint8_t> weight;
  std::vector<float> bias;
};

// rows x cols elements of `element_bytes` each, in bytes. INVALID_ARGUMENT naming `what` when a
// factor is negative or the product does not fit in int64 (a shape from a client or a file must
// never wrap to a small allocation).
absl::StatusOr<int64_t> TensorBytes(int64_t rows, int64_t cols, int64_t element_bytes, std::string_view what);

// Checks sizes and ranges of a HeadWeights against its shape.
absl::Status ValidateHeadWeights(const HeadWeights& head);

// The vocabulary is cut into tiles at fixed global offsets, multiples of VocabTile(V), which depends
// on V alone: min(1536, ⌈V/64⌉) rows (the last tile may be shorter). 1536 is the CUDA engine's reduction
// segment, so that from V = 98304 up its segments too sit at fixed global offsets. Engines fold a row's
// per-tile partials in global tile order, so the tiles, unlike the shards, never move with the group size.
int64_t VocabTile(int64_t vocab_size);
int64_t VocabTileCount(int64_t vocab_size);

// Contiguous range [begin, end) of vocabulary rows that rank `rank` of `world` owns: whole tiles,
// ⌈T/world⌉ of them for the last T % world ranks and ⌊T/world⌋ for the rest (T = VocabTileCount), so that
// the last rank's ⌈T/world⌉ include the short last tile. Empty when the group has more ranks than tiles.
struct VocabRange {
  int64_t begin;
  int64_t end;
};
VocabRange VocabShard(int64_t vocab_size, int rank, int world);

}  // namespace lce
