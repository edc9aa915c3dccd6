#include "head_source.h"

#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <set>
#include <fstream>
#include <new>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "durable_file.h"
#include "lce/numeric.h"
#include "nlohmann/json.hpp"
#include "safetensors.h"
#include "status_macros.h"

namespace lce::server {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

void StoreAs(DType dtype, float v, uint8_t* dst) {
  switch (dtype) {
    case DType::kFloat32: std::memcpy(dst, &v, 4); return;
    case DType::kBFloat16: { const uint16_t b = FloatToBf16(v); std::memcpy(dst, &b, 2); return; }
    case DType::kFloat16: { const uint16_t b = FloatToFp16(v); std::memcpy(dst, &b, 2); return; }
  }
}

// After a save's commit: shard files of head `name` in `dir` (any version or group size) that the
// new index does not name. Best effort: one that cannot be removed only takes space.
void RemoveStaleShards(const std::string& dir, const std::string& name, const std::set<std::string>& keep) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    // <name>-v<digits>-shard-...safetensors: exactly this head's (not "<name>-v2"'s, say).
    const std::string file = entry.path().filename().string();
    const std::string prefix = name + "-v";
    if (file.rfind(prefix, 0) != 0 || keep.count(file) != 0) continue;
    size_t i = prefix.size();
    while (i < file.size() && file[i] >= '0' && file[i] <= '9') ++i;
    const bool ours = i > prefix.size() && file.compare(i, 7, "-shard-") == 0 && file.size() > 12 &&
                      file.compare(file.size() - 12, 12, ".safetensors") == 0;
    if (ours) std::filesystem::remove(entry.path(), ec);
  }
}

bool IsIndex(const std::string& path) {
  const std::string suffix = ".index.json";
  return path.size() > suffix.size() && path.compare(path.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The shards listed by an index written by WriteHeadIndex.
struct IndexedShard {
  std::string file;
  int64_t begin, end;
};
struct HeadIndex {
  int64_t vocab_size = 0, hidden_size = 0;
  DType dtype = DType::kBFloat16;
  bool has_bias = false;
  std::vector<IndexedShard> shards;
};

// Every field is looked up with a check: a missing key read through a const json's operator[] is
// undefined behaviour in nlohmann::json (tests/fuzz/fuzz_head_index found an index whose shard
// lacked "vocab_end" reading freed memory).
absl::StatusOr<HeadIndex> ReadIndex(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not an lce-serve head index (", why, ")"));
  };
  if (j.is_discarded() || !j.is_object()) return bad("not a JSON object");
  auto integer = [](const nlohmann::json& o, const char* key, int64_t* out) {
    auto it = o.find(key);
    if (it == o.end() || !it->is_number_integer()) return false;
    *out = it->get<int64_t>();
    return true;
  };
  HeadIndex idx;
  if (!integer(j, "vocab_size", &idx.vocab_size) || !integer(j, "hidden_size", &idx.hidden_size)) {
    return bad("vocab_size and hidden_size must be integers");
  }
  auto dtype = j.find("dtype");
  if (dtype == j.end() || !dtype->is_string()) return bad("dtype must be a string");
  absl::StatusOr<DType> d = ParseDType(dtype->get<std::string>());
  if (!d.ok()) return bad("dtype must be fp32, bf16 or fp16");  // not quoted: no text of the file in errors
  idx.dtype = *d;
  auto bias = j.find("has_bias");
  if (bias != j.end() && !bias->is_boolean()) return bad("has_bias must be true or false");
  idx.has_bias = bias != j.end() && bias->get<bool>();
  auto shards = j.find("shards");
  if (shards == j.end() || !shards->is_array()) return bad("shards must be an array");
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  int64_t next = 0;
  for (const nlohmann::json& sj : *shards) {
    IndexedShard sh{};
    auto file = sj.is_object() ? sj.find("file") : sj.end();
    if (!sj.is_object() || file == sj.end() || !file->is_string() || !integer(sj, "vocab_begin", &sh.begin) ||
        !integer(sj, "vocab_end", &sh.end)) {
      return bad("each shard needs a file name and integer vocab_begin and vocab_end");
    }
    // A plain name in the index's directory: an index (planted in a shared directory, say) cannot
    // make the server read a file elsewhere.
    if (!IsPlainFileName(file->get<std::string>())) return bad("shard files must be plain names in its directory");
    sh.file = (dir / file->get<std::string>()).string();
    if (sh.begin != next || sh.end <= sh.begin) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": shards must cover the vocabulary in order"));
    }
    next = sh.end;
    idx.shards.push_back(sh);
  }
  if (next != idx.vocab_size) return absl::InvalidArgumentError(absl::StrCat(path, ": shards do not cover the vocabulary"));
  return idx;
}

// Appends rows [begin, end) of `tensor` gathered from the indexed shard files to `out`. Each file's
// tensor must be what the index says: its rows, `cols` wide, of `dtype`.
absl::Status GatherRows(const HeadIndex& idx, const std::string& tensor, DType dtype, int64_t cols, int64_t begin,
                        int64_t end, std::vector<uint8_t>& out) {
  for (const IndexedShard& sh : idx.shards) {
    const int64_t lo = std::max(begin, sh.begin), hi = std::min(end, sh.end);
    if (lo >= hi) continue;
    absl::StatusOr<SafetensorsEntry> e = ReadSafetensorsEntry(sh.file, tensor);
    if (!e.ok()) return e.status();
    if (e->rows != sh.end - sh.begin || e->cols != cols || e->dtype != dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          sh.file, ": '", tensor, "' is ", e->rows, "x", e->cols, " ", DTypeName(e->dtype), ", but the index says ",
          sh.end - sh.begin, "x", cols, " ", DTypeName(dtype), " (vocabulary rows [", sh.begin, ", ", sh.end, "))"));
    }
    absl::StatusOr<std::vector<uint8_t>> rows = ReadSafetensorsRows(sh.file, *e, lo - sh.begin, hi - sh.begin);
    if (!rows.ok()) return rows.status();
    out.insert(out.end(), rows->begin(), rows->end());
  }
  return absl::OkStatus();
}

// A head's name becomes part of file names: it may not leave the save's directory.
absl::Status CheckSaveName(const std::string& name) {
  if (!IsPlainFileName(name)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot save head '", name, "' under its name: a head saved to files needs a name without '/'"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::string> WriteHeadShard(const std::string& dir, const std::string& name, int64_t version,
                                           const HeadWeights& w, int rank, int world) {
  LCE_RETURN_IF_ERROR(CheckSaveName(name));
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::PermissionDeniedError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  const std::string path = (std::filesystem::path(dir) / ShardFileName(name, version, rank, world)).string();
  std::vector<SafetensorsTensor> tensors = {{"lm_head.weight", w.shape.dtype, {w.shape.shard_rows, w.shape.hidden_size},
                                             w.weight.data(), static_cast<int64_t>(w.weight.size())}};
  if (w.shape.has_bias) {
    tensors.push_back({"lm_head.bias", DType::kFloat32, {w.shape.shard_rows},
                       reinterpret_cast<const uint8_t*>(w.bias.data()), static_cast<int64_t>(w.bias.size() * 4)});
  }
  LCE_RETURN_IF_ERROR(WriteSafetensors(path, tensors));
  return path;
}

absl::StatusOr<std::string> WriteHeadIndex(const std::string& dir, const std::string& name, int64_t version,
                                           const HeadShape& shape, int world) {
  LCE_RETURN_IF_ERROR(CheckSaveName(name));
  nlohmann::ordered_json index = {{"format", "lce-serve sharded head"},
                                  {"tensor", "lm_head.weight"},
                                  {"vocab_size", shape.vocab_size},
                                  {"hidden_size", shape.hidden_size},
                                  {"dtype", DTypeName(shape.dtype)},
                                  {"has_bias", shape.has_bias},
                                  {"version", version},
                                  {"shards", nlohmann::ordered_json::array()}};
  std::set<std::string> named;
  for (int r = 0; r < world; ++r) {
    const VocabRange range = VocabShard(shape.vocab_size, r, world);
    named.insert(ShardFileName(name, version, r, world));
    index["shards"].push_back(
        {{"file", ShardFileName(name, version, r, world)}, {"vocab_begin", range.begin}, {"vocab_end", range.end}});
  }
  const std::string path = (std::filesystem::path(dir) / (name + ".index.json")).string();
  const std::string text = index.dump(1) + "\n";
  if (absl::Status s = WriteFileDurably(path, [&](int fd) { return WriteAll(fd, text.data(), text.size(), path); });
      !s.ok()) {
    return s;
  }
  RemoveStaleShards(dir, name, named);
  return path;
}

absl::Status ProtectCommittedSave(const std::string& dir, const std::string& name, int64_t version, int world) {
  namespace fs = std::filesystem;
  LCE_RETURN_IF_ERROR(CheckSaveName(name));
  const std::string path = (fs::path(dir) / (name + ".index.json")).string();
  std::ifstream in(path);
  if (!in) return absl::OkStatus();  // no save yet
  nlohmann::ordered_json index = nlohmann::ordered_json::parse(in, nullptr, false);
  auto shards = index.is_object() ? index.find("shards") : index.end();
  if (shards == index.end() || !shards->is_array()) return absl::OkStatus();  // nothing loadable to keep
  std::set<std::string> ours;
  for (int r = 0; r < world; ++r) ours.insert(ShardFileName(name, version, r, world));
  // Only plain names (IsPlainFileName): an index planted in a shared directory names no file
  // elsewhere for us to copy into it.
  auto file_of = [](const nlohmann::ordered_json& s) {
    auto f = s.is_object() ? s.find("file") : s.end();
    const std::string file = f != s.end() && f->is_string() ? f->get<std::string>() : std::string();
    return IsPlainFileName(file) ? file : std::string();
  };
  if (std::none_of(shards->begin(), shards->end(), [&](const auto& s) { return ours.count(file_of(s)) != 0; })) {
    return absl::OkStatus();
  }
  const int n = static_cast<int>(shards->size());
  for (int k = 0; k < n; ++k) {
    const std::string file = file_of((*shards)[k]);
    if (file.empty()) return absl::OkStatus();  // an index that does not load: nothing to keep
    const std::string moved = ShardFileName(name, 0, k, n);
    LCE_RETURN_IF_ERROR(LinkDurably(dir, file, moved));
    (*shards)[k]["file"] = moved;
  }
  const std::string text = index.dump(1) + "\n";
  return WriteFileDurably(path, [&](int fd) { return WriteAll(fd, text.data(), text.size(), path); });
}

std::string ShardFileName(const std::string& name, int64_t version, int rank, int world) {
  return absl::StrCat(name, "-v", version, "-shard-", rank, "-of-", world, ".safetensors");
}

float SeededHeadValue(uint64_t seed, int64_t row, int64_t col, int64_t hidden) {
  const uint64_t idx = static_cast<uint64_t>(row) * static_cast<uint64_t>(hidden) + static_cast<uint64_t>(col);
  const uint64_t a = SplitMix64(seed * 0x100000001b3ull ^ (2 * idx));
  const uint64_t b = SplitMix64(seed * 0x100000001b3ull ^ (2 * idx + 1));
  const double u1 = (static_cast<double>(a >> 11) + 1.0) / 9007199254740993.0;  // (0, 1]
  const double u2 = static_cast<double>(b >> 11) / 9007199254740992.0;          // [0, 1)
  const double normal = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
  return static_cast<float>(normal / std::sqrt(static_cast<double>(hidden)));
}

absl::Status ParseSeedShape(const std::string& text, HeadSource& source) {
  std::vector<std::string> parts = absl::StrSplit(text, 'x');
  int64_t v = 0, h = 0;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &v) || !absl::SimpleAtoi(parts[1], &h) || v <= 0 ||
      h <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("seeded head shape must be VxH (e.g. 32000x512), got '",
                                                   text, "'"));
  }
  // Even in fp32 the head's size must be a number (the memory cap is checked when it is loaded).
  if (absl::StatusOr<int64_t> b = TensorBytes(v, h, 4, "seeded head"); !b.ok()) return b.status();
  source.seed_vocab = v;
  source.seed_hidden = h;
  return absl::OkStatus();
}

int64_t HostMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page <= 0) return INT64_MAX;
  int64_t bytes = 0;
  return __builtin_mul_overflow(static_cast<int64_t>(pages), static_cast<int64_t>(page), &bytes) ? INT64_MAX : bytes;
}

namespace {

// The head's whole shape, from the source's header alone (no weights read yet).
absl::StatusOr<HeadShape> SourceShape(const HeadSource& source) {
  HeadShape shape;
  if (source.file.empty()) {
    if (source.seed_vocab <= 0 || source.seed_hidden <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("no head: give --head-file or --seed-head=VxH (a seeded head needs a "
                                                     "positive shape, got ", source.seed_vocab, "x", source.seed_hidden, ")"));
    }
    shape.vocab_size = source.seed_vocab;
    shape.hidden_size = source.seed_hidden;
    shape.dtype = source.dtype;
    shape.has_bias = source.seed_bias;
  } else if (IsIndex(source.file)) {
    absl::StatusOr<HeadIndex> idx = ReadIndex(source.file);
    if (!idx.ok()) return idx.status();
    shape.vocab_size = idx->vocab_size;
    shape.hidden_size = idx->hidden_size;
    shape.dtype = idx->dtype;
  } else {
    absl::StatusOr<SafetensorsEntry> entry = ReadSafetensorsEntry(source.file, source.tensor);
    if (!entry.ok()) return entry.status();
    if (entry->cols <= 1) {
      return absl::InvalidArgumentError(absl::StrCat(source.file, ": '", source.tensor,
                                                     "' must be a 2-D [vocab, hidden] tensor"));
    }
    shape.vocab_size = entry->rows;
    shape.hidden_size = entry->cols;
    shape.dtype = entry->dtype;
  }
  if (shape.vocab_size <= 0 || shape.hidden_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("head shape must be positive, got ", shape.vocab_size, "x", shape.hidden_size));
  }
  return shape;
}

// Refuses a shard whose weight would not fit: INVALID_ARGUMENT when its size is not even a number,
// RESOURCE_EXHAUSTED over `max_shard_bytes` (0: the host's memory).
absl::Status CheckShardSize(const HeadShape& shape, int64_t max_shard_bytes) {
  absl::StatusOr<int64_t> bytes = TensorBytes(shape.shard_rows, shape.hidden_size, DTypeSize(shape.dtype), "head shard");
  if (!bytes.ok()) return bytes.status();
  const int64_t cap = max_shard_bytes > 0 ? max_shard_bytes : HostMemoryBytes();
  if (*bytes > cap) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "head shard of ", shape.shard_rows, "x", shape.hidden_size, " ", DTypeName(shape.dtype), " needs ", *bytes,
        " bytes, over this server's limit of ", cap,
        " (--max-head-bytes; by default the GPU's memory on CUDA, the host's otherwise)"));
  }
  return absl::OkStatus();
}

void FillSeeded(const HeadSource& source, HeadWeights& head) {
  const HeadShape& shape = head.shape;
  const int64_t es = DTypeSize(shape.dtype);
  head.weight.resize(static_cast<size_t>(shape.shard_rows * shape.hidden_size * es));
  for (int64_t r = 0; r < shape.shard_rows; ++r) {
    for (int64_t c = 0; c < shape.hidden_size; ++c) {
      StoreAs(shape.dtype, SeededHeadValue(source.seed, shape.vocab_begin + r, c, shape.hidden_size),
              head.weight.data() + (r * shape.hidden_size + c) * es);
    }
  }
  if (shape.has_bias) head.bias.assign(static_cast<size_t>(shape.shard_rows), 0.0f);
}

absl::Status ReadIndexed(const HeadSource& source, HeadWeights& head) {
  absl::StatusOr<HeadIndex> idx = ReadIndex(source.file);
  if (!idx.ok()) return idx.status();
  HeadShape& shape = head.shape;
  if (absl::Status s = GatherRows(*idx, "lm_head.weight", shape.dtype, shape.hidden_size, shape.vocab_begin,
                                 shape.vocab_end(), head.weight);
      !s.ok()) {
    return s;
  }
  if (idx->has_bias) {
    std::vector<uint8_t> bias;
    if (absl::Status s = GatherRows(*idx, "lm_head.bias", DType::kFloat32, 1, shape.vocab_begin, shape.vocab_end(), bias);
        !s.ok()) {
      return s;
    }
    head.bias.resize(bias.size() / 4);
    std::memcpy(head.bias.data(), bias.data(), head.bias.size() * 4);
    shape.has_bias = true;
  }
  return absl::OkStatus();
}

absl::Status ReadBias(const HeadSource& source, HeadWeights& head) {
  HeadShape& shape = head.shape;
  absl::StatusOr<SafetensorsEntry> b = ReadSafetensorsEntry(source.file, source.bias_tensor);
  if (!b.ok()) return b.status();
  if (b->rows != shape.vocab_size || b->cols != 1) {
    return absl::InvalidArgumentError(absl::StrCat("bias '", source.bias_tensor, "' must have ",
                                                   shape.vocab_size, " entries"));
  }
  absl::StatusOr<std::vector<uint8_t>> bytes = ReadSafetensorsRows(source.file, *b, shape.vocab_begin, shape.vocab_end());
  if (!bytes.ok()) return bytes.status();
  head.bias.resize(static_cast<size_t>(shape.shard_rows));
  for (int64_t i = 0; i < shape.shard_rows; ++i) {
    const uint8_t* p = bytes->data() + i * DTypeSize(b->dtype);
    uint16_t h16;
    std::memcpy(&h16, p, 2);
    switch (b->dtype) {
      case DType::kFloat32: std::memcpy(&head.bias[i], p, 4); break;
      case DType::kBFloat16: head.bias[i] = Bf16ToFloat(h16); break;
      case DType::kFloat16: head.bias[i] = Fp16ToFloat(h16); break;
    }
  }
  shape.has_bias = true;
  return absl::OkStatus();
}

absl::Status ReadFile(const HeadSource& source, HeadWeights& head) {
  absl::StatusOr<SafetensorsEntry> entry = ReadSafetensorsEntry(source.file, source.tensor);
  if (!entry.ok()) return entry.status();
  absl::StatusOr<std::vector<uint8_t>> rows =
      ReadSafetensorsRows(source.file, *entry, head.shape.vocab_begin, head.shape.vocab_end());
  if (!rows.ok()) return rows.status();
  head.weight = std::move(*rows);
  return source.bias_tensor.empty() ? absl::OkStatus() : ReadBias(source, head);
}

absl::StatusOr<std::shared_ptr<HeadWeights>> LoadCheckedHead(const HeadSource& source, int tp_rank, int tp_size,
                                                             int64_t max_shard_bytes) {
  absl::StatusOr<HeadShape> shape = SourceShape(source);
  if (!shape.ok()) return shape.status();
  if (tp_size < 1 || tp_rank < 0 || tp_rank >= tp_size || tp_size > shape->vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat("bad tensor-parallel rank ", tp_rank, " of ", tp_size));
  }
  const VocabRange range = VocabShard(shape->vocab_size, tp_rank, tp_size);
  shape->vocab_begin = range.begin;
  shape->shard_rows = range.end - range.begin;
  LCE_RETURN_IF_ERROR(CheckShardSize(*shape, max_shard_bytes));
  auto head = std::make_shared<HeadWeights>();
  head->shape = *shape;
  if (source.file.empty()) {
    FillSeeded(source, *head);
  } else if (absl::Status s = IsIndex(source.file) ? ReadIndexed(source, *head) : ReadFile(source, *head); !s.ok()) {
    return s;
  }
  LCE_RETURN_IF_ERROR(ValidateHeadWeights(*head));
  return head;
}

}  // namespace

absl::StatusOr<std::shared_ptr<HeadWeights>> LoadHead(const HeadSource& source, int tp_rank, int tp_size,
                                                      int64_t max_shard_bytes) {
  // Nothing may escape to a handler: an allocation the host refuses is a status, as is a JSON
  // value of the wrong type in an index.
  try {
    return LoadCheckedHead(source, tp_rank, tp_size, max_shard_bytes);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("loading the head: the host has not enough memory for it");
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source.file, ": not an lce-serve head index (", e.what(), ")"));
  }
}

}  // namespace lce::server
