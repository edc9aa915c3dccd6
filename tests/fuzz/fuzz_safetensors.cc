// Fuzz target: a safetensors file as LoadHead reads it (--head-file, LoadHead's safetensors_file):
// the input is the whole file. ReadSafetensorsEntry for the weight and the bias, ReadSafetensorsRows
// over the rows it reports, and LoadHead of the file as one rank and as each of two ranks, capped
// at 1 MiB a shard (the cap LoadHead applies before it allocates).
#include <unistd.h>

#include <fstream>

#include "fuzz_common.h"
#include "head_source.h"
#include "nlohmann/json.hpp"
#include "safetensors.h"

namespace lce::server {
namespace {

std::string FilePath() {
  static const std::string path = fuzz::ScratchDir() + "/head.safetensors";
  return path;
}

void Run(const uint8_t* data, size_t size) {
  const std::string path = FilePath();
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  for (const char* tensor : {"lm_head.weight", "lm_head.bias"}) {
    absl::StatusOr<SafetensorsEntry> e = ReadSafetensorsEntry(path, tensor);
    if (!e.ok()) continue;
    LCE_FUZZ_CHECK(e->rows > 0 && e->cols > 0, "shape %lld x %lld", static_cast<long long>(e->rows),
                   static_cast<long long>(e->cols));
    const uint64_t bytes = static_cast<uint64_t>(e->rows) * static_cast<uint64_t>(e->cols) * DTypeSize(e->dtype);
    LCE_FUZZ_CHECK(e->data_offset + bytes <= size, "entry ends at %llu, past the file's %zu bytes",
                   static_cast<unsigned long long>(e->data_offset + bytes), size);
    for (auto [b, end] : {std::pair<int64_t, int64_t>{0, e->rows}, {e->rows - 1, e->rows}, {0, 1}}) {
      absl::StatusOr<std::vector<uint8_t>> rows = ReadSafetensorsRows(path, *e, b, end);
      LCE_FUZZ_CHECK(rows.ok(), "rows [%lld, %lld) of a checked entry: %s", static_cast<long long>(b),
                     static_cast<long long>(end), std::string(rows.status().message()).c_str());
    }
    (void)ReadSafetensorsRows(path, *e, -1, e->rows + 1);
  }
  HeadSource source;
  source.file = path;
  source.bias_tensor = size > 0 && data[size - 1] % 2 == 1 ? "lm_head.bias" : "";
  for (auto [rank, world] : {std::pair<int, int>{0, 1}, {0, 2}, {1, 2}}) {
    absl::StatusOr<std::shared_ptr<HeadWeights>> w = LoadHead(source, rank, world, int64_t{1} << 20);
    if (!w.ok()) continue;
    const HeadShape& s = (*w)->shape;
    LCE_FUZZ_CHECK(static_cast<int64_t>((*w)->weight.size()) == s.shard_rows * s.hidden_size * DTypeSize(s.dtype),
                   "weight bytes");
  }
}

void WriteSeeds(const std::string& dir) {
  const std::string tmp = fuzz::ScratchDir() + "/seed.safetensors";
  auto put = [&](const std::string& name, const std::vector<SafetensorsTensor>& tensors) {
    if (!WriteSafetensors(tmp, tensors).ok()) std::exit(1);
    std::ifstream in(tmp, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    fuzz::WriteSeed(dir, name, bytes);
  };
  std::vector<uint8_t> w(6 * 4 * 4);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<uint8_t>(i % 2 ? 0x3e : i);
  std::vector<uint8_t> b(6 * 4, 0);
  put("bf16_weight", {{"lm_head.weight", DType::kBFloat16, {6, 4}, w.data(), 6 * 4 * 2}});
  put("f16_weight_bias", {{"lm_head.weight", DType::kFloat16, {6, 4}, w.data(), 6 * 4 * 2},
                          {"lm_head.bias", DType::kFloat32, {6}, b.data(), 6 * 4}});
  put("f32_weight", {{"lm_head.weight", DType::kFloat32, {6, 4}, w.data(), 6 * 4 * 4}});
  // A header as Hugging Face writes it: __metadata__ first, the tensor not at offset 0.
  nlohmann::ordered_json h = {{"__metadata__", {{"format", "pt"}}},
                              {"other", {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {0, 8}}}},
                              {"lm_head.weight", {{"dtype", "BF16"}, {"shape", {6, 4}}, {"data_offsets", {8, 56}}}}};
  std::string text = h.dump();
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) file[static_cast<size_t>(i)] = static_cast<char>(text.size() >> (8 * i));
  file += text + std::string(56, '\x3c');
  fuzz::WriteSeed(dir, "hf_metadata", file);
}

}  // namespace
}  // namespace lce::server

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  lce::fuzz::MaybeWriteSeeds(lce::server::WriteSeeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  lce::server::Run(data, size);
  return 0;
}
