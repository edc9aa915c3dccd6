// Where a head's weight comes from: a safetensors file (e.g. lm_head.weight of a Hugging Face
// checkpoint) or a deterministic seeded random head. Under tensor parallelism each rank reads
// only its own vocabulary rows.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

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
  bool seed_bias = false;  // the seeded head has an fp32 bias, all zeros
};

// Parses "VxH", e.g. "32000x512"; INVALID_ARGUMENT when not positive or too large to be a size.
absl::Status ParseSeedShape(const std::string& text, HeadSource& source);

// Loads rank `tp_rank`'s shard (VocabShard) of the head. `file` may also be the index written by
// WriteHeadIndex (".index.json"): then the rows come from whichever shard files hold them, so a
// head saved by a group of one size loads into a group of any size.

// A shard over `max_shard_bytes` of weight (0: the host's memory) is RESOURCE_EXHAUSTED, a shape
// whose size overflows INVALID_ARGUMENT, before anything is allocated.
absl::StatusOr<std::shared_ptr<HeadWeights>> LoadHead(const HeadSource& source, int tp_rank, int tp_size,
                                                      int64_t max_shard_bytes = 0);

// The host's physical memory in bytes: the default cap on a head.
int64_t HostMemoryBytes();

// A head saved by a group of `world` ranks at version `version`:
// <dir>/<name>-v<version>-shard-<r>-of-<world>.safetensors per rank, each with tensor
// "lm_head.weight" [shard rows, H] (and "lm_head.bias" when present), plus <dir>/<name>.index.json
// naming each file's vocabulary range (VocabShard). Each rank writes its own shard; rank 0 writes the
// index last, once every shard is in. Every file is written durably (durable_file.h) and the index's
// rename is the save's commit: a save killed at any point leaves the previous save loadable, whole.
// After the commit, shard files of `name` the new index does not name are removed. Both return the
// path written.
std::string ShardFileName(const std::string& name, int64_t version, int rank, int world);
absl::StatusOr<std::string> WriteHeadShard(const std::string& dir, const std::string& name, int64_t version,
                                           const HeadWeights& shard, int rank, int world);
absl::StatusOr<std::string> WriteHeadIndex(const std::string& dir, const std::string& name, int64_t version,
                                           const HeadShape& shape, int world);

// Called once before the ranks of a save of `name` at `version` by `world` ranks write into `dir`:
// when the save committed there names the very files this one will write (the same version saved
// again over another run's save, e.g. by a restarted group), those files get names of their own
// first (version 0, which no served head has) and an index naming them is committed, so that no
// rank's write replaces a file the committed index names. Otherwise (a new version) nothing to do.
absl::Status ProtectCommittedSave(const std::string& dir, const std::string& name, int64_t version, int world);

// Element (row, col) of the seeded head, as fp32 before rounding to the head's dtype. Shared by
// shards so that every rank generates exactly its rows of the same head.
float SeededHeadValue(uint64_t seed, int64_t row, int64_t col, int64_t hidden);

}  // namespace lce::server
