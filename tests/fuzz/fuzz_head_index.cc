// Fuzz target: a saved head's index (<name>.index.json, WriteHeadIndex) as LoadHead reads it. The
// input is the index's text; beside it lie the shard files of a 6 x 4 head saved by one rank and
// by two, which the seeds name. LoadHead runs as one rank and as each of two, capped at 1 MiB a
// shard. Whatever the index says (types, ranges, files), the answer is a status, never an
// exception, a crash or a read outside a file's rows.
#include <fstream>

#include "fuzz_common.h"
#include "head_source.h"

namespace lce::server {
namespace {

std::shared_ptr<HeadWeights> Head() {
  auto w = std::make_shared<HeadWeights>();
  w->shape.vocab_size = 6;
  w->shape.hidden_size = 4;
  w->shape.shard_rows = 6;
  w->shape.dtype = DType::kBFloat16;
  w->shape.has_bias = true;
  w->weight.resize(6 * 4 * 2);
  for (size_t i = 0; i < w->weight.size(); ++i) w->weight[i] = static_cast<uint8_t>(i % 2 ? 0x3e : i);
  w->bias.assign(6, 0.25f);
  return w;
}

// The shards of Head() saved by groups of one and of two ranks, and their indexes.
const std::string& Dir() {
  static const std::string dir = [] {
    const std::string d = fuzz::ScratchDir();
    std::shared_ptr<HeadWeights> full = Head();
    for (int world : {1, 2}) {
      for (int r = 0; r < world; ++r) {
        HeadWeights shard = *full;
        const VocabRange range = VocabShard(6, r, world);
        shard.shape.vocab_begin = range.begin;
        shard.shape.shard_rows = range.end - range.begin;
        shard.weight.assign(full->weight.begin() + range.begin * 8, full->weight.begin() + range.end * 8);
        shard.bias.assign(full->bias.begin() + range.begin, full->bias.begin() + range.end);
        if (!WriteHeadShard(d, world == 1 ? "h1" : "h2", 1, shard, r, world).ok()) std::abort();
      }
      if (!WriteHeadIndex(d, world == 1 ? "h1" : "h2", 1, full->shape, world).ok()) std::abort();
    }
    return d;
  }();
  return dir;
}

void Run(const uint8_t* data, size_t size) {
  const std::string path = Dir() + "/fuzzed.index.json";
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  HeadSource source;
  source.file = path;
  for (auto [rank, world] : {std::pair<int, int>{0, 1}, {0, 2}, {1, 2}}) {
    absl::StatusOr<std::shared_ptr<HeadWeights>> w = LoadHead(source, rank, world, int64_t{1} << 20);
    if (!w.ok()) {
      LCE_FUZZ_CHECK(!w.status().message().empty(), "an error without a message");
      continue;
    }
    const HeadShape& s = (*w)->shape;
    LCE_FUZZ_CHECK(static_cast<int64_t>((*w)->weight.size()) == s.shard_rows * s.hidden_size * DTypeSize(s.dtype),
                   "weight holds %zu bytes for %lld x %lld rows", (*w)->weight.size(),
                   static_cast<long long>(s.shard_rows), static_cast<long long>(s.hidden_size));
    LCE_FUZZ_CHECK(!s.has_bias || static_cast<int64_t>((*w)->bias.size()) == s.shard_rows, "bias holds %zu values",
                   (*w)->bias.size());
  }
}

void WriteSeeds(const std::string& dir) {
  for (const char* name : {"h1", "h2"}) {  // the indexes as WriteHeadIndex wrote them
    std::ifstream in(Dir() + "/" + name + ".index.json");
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    fuzz::WriteSeed(dir, std::string(name) + "_index", text);
  }
  fuzz::WriteSeed(dir, "mixed_types",
                  R"({"vocab_size":"6","hidden_size":4,"dtype":"bf16","shards":[{"file":1,"vocab_begin":0,"vocab_end":6}]})");
  fuzz::WriteSeed(dir, "wrong_cover",
                  R"({"vocab_size":6,"hidden_size":4,"dtype":"bf16","has_bias":true,"shards":[)"
                  R"({"file":"h2-v1-shard-0-of-2.safetensors","vocab_begin":0,"vocab_end":4},)"
                  R"({"file":"h2-v1-shard-1-of-2.safetensors","vocab_begin":4,"vocab_end":6}]})");
}

}  // namespace
}  // namespace lce::server

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  lce::fuzz::MaybeWriteSeeds(lce::server::WriteSeeds);
  lce::server::Dir();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  lce::server::Run(data, size);
  return 0;
}
