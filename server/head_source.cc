#include "head_source.h"

#include <cmath>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "lce/numeric.h"
#include "safetensors.h"

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

}  // namespace

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
  source.seed_vocab = v;
  source.seed_hidden = h;
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<HeadWeights>> LoadHead(const HeadSource& source, int tp_rank, int tp_size) {
  auto head = std::make_shared<HeadWeights>();
  HeadShape& shape = head->shape;
  if (source.file.empty()) {
    if (source.seed_vocab <= 0 || source.seed_hidden <= 0) {
      return absl::InvalidArgumentError("no head: give --head-file or --seed-head=VxH");
    }
    shape.vocab_size = source.seed_vocab;
    shape.hidden_size = source.seed_hidden;
    shape.dtype = source.dtype;
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
  if (tp_size < 1 || tp_rank < 0 || tp_rank >= tp_size || tp_size > shape.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat("bad tensor-parallel rank ", tp_rank, " of ", tp_size));
  }
  const VocabRange range = VocabShard(shape.vocab_size, tp_rank, tp_size);
  shape.vocab_begin = range.begin;
  shape.shard_rows = range.end - range.begin;
  const int64_t es = DTypeSize(shape.dtype);

  if (source.file.empty()) {
    head->weight.resize(static_cast<size_t>(shape.shard_rows * shape.hidden_size * es));
    for (int64_t r = 0; r < shape.shard_rows; ++r) {
      for (int64_t c = 0; c < shape.hidden_size; ++c) {
        StoreAs(shape.dtype, SeededHeadValue(source.seed, range.begin + r, c, shape.hidden_size),
                head->weight.data() + (r * shape.hidden_size + c) * es);
      }
    }
  } else {
    absl::StatusOr<SafetensorsEntry> entry = ReadSafetensorsEntry(source.file, source.tensor);
    if (!entry.ok()) return entry.status();
    absl::StatusOr<std::vector<uint8_t>> rows = ReadSafetensorsRows(source.file, *entry, range.begin, range.end);
    if (!rows.ok()) return rows.status();
    head->weight = std::move(*rows);
    if (!source.bias_tensor.empty()) {
      absl::StatusOr<SafetensorsEntry> b = ReadSafetensorsEntry(source.file, source.bias_tensor);
      if (!b.ok()) return b.status();
      if (b->rows != shape.vocab_size || b->cols != 1) {
        return absl::InvalidArgumentError(absl::StrCat("bias '", source.bias_tensor, "' must have ",
                                                       shape.vocab_size, " entries"));
      }
      absl::StatusOr<std::vector<uint8_t>> bytes = ReadSafetensorsRows(source.file, *b, range.begin, range.end);
      if (!bytes.ok()) return bytes.status();
      head->bias.resize(static_cast<size_t>(shape.shard_rows));
      for (int64_t i = 0; i < shape.shard_rows; ++i) {
        const uint8_t* p = bytes->data() + i * DTypeSize(b->dtype);
        uint16_t h16;
        std::memcpy(&h16, p, 2);
        switch (b->dtype) {
          case DType::kFloat32: std::memcpy(&head->bias[i], p, 4); break;
          case DType::kBFloat16: head->bias[i] = Bf16ToFloat(h16); break;
          case DType::kFloat16: head->bias[i] = Fp16ToFloat(h16); break;
        }
      }
      shape.has_bias = true;
    }
  }
  if (absl::Status s = ValidateHeadWeights(*head); !s.ok()) return s;
  return head;
}

}  // namespace lce::server
