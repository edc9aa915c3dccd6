#include "leaf_plan.h"

#include <algorithm>

namespace lce {

std::vector<int64_t> LeafBounds(int64_t vocab_size) {
  std::vector<int64_t> b = {0, vocab_size};
  const int64_t tiles = VocabTileCount(vocab_size);
  for (int k : kLeafGroupSizes) {
    if (k > tiles) continue;
    for (int r = 1; r < k; ++r) b.push_back(VocabShard(vocab_size, r, k).begin);
  }
  std::sort(b.begin(), b.end());
  b.erase(std::unique(b.begin(), b.end()), b.end());
  return b;
}

std::vector<VocabRange> ShardLeaves(int64_t vocab_size, VocabRange shard) {
  std::vector<VocabRange> out;
  const std::vector<int64_t> b = LeafBounds(vocab_size);
  for (size_t i = 0; i + 1 < b.size(); ++i) {
    const int64_t lo = std::max(b[i], shard.begin), hi = std::min(b[i + 1], shard.end);
    if (lo < hi) out.push_back({lo - shard.begin, hi - shard.begin});
  }
  return out;
}

}  // namespace lce
