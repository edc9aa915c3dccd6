// Where a head's weight comes from: a safetensors file (e.g. lm_head.weight of a Hugging Face
// checkpoint) or a deterministic seeded random head. Under tensor parallelism each rank reads
// only its own vocabulary rows.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "lce/head.h"

namespace lce::server {

struct HeadSource {
  // Safetensors source: file and tensor names. The bias tensor is optional.
  std::string file;
  std::string tensor = "lm_head.weight";
  std::string bias_tensor;
  // Seeded source (used when `file` is empty): V x H, N(0, 1/H) entries, rounded to `dtype`.
  int64_t seed_vocab = 0;
  int64_t seed_hidden = 0;
  uint64_t seed = 0;
  DType dtype = DType::kBFloat16;
};

// Parses "VxH", e.g. "32000x512".
absl::Status ParseSeedShape(const std::string& text, HeadSource& source);

// Loads rank `tp_rank`'s shard (VocabShard) of the head.
absl::StatusOr<std::shared_ptr<HeadWeights>> LoadHead(const HeadSource& source, int tp_rank, int tp_size);

// Element (row, col) of the seeded head, as fp32 before rounding to the head's dtype. Shared by
// shards so that every rank generates exactly its rows of the same head.
float SeededHeadValue(uint64_t seed, int64_t row, int64_t col, int64_t hidden);

}  // namespace lce::server
