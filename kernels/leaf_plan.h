// d_hidden's canonical leaves (issue 36): the vocabulary cut at every shard boundary of groups of 1, 2
// and 4 GPUs, so that each shard of each such group is a union of whole leaves. Each
// leaf's partial product dA[:, leaf] · W[leaf, :] is the same bits wherever it is computed (one GEMM
// without split-K, the same algorithm for any row count), and the leaves' sum is exact (exact_sum.cu):
// one GPU and any of those groups give d_hidden the same bits.
#pragma once

#include <cstdint>
#include <vector>

#include "lce/head.h"

namespace lce {

// The group sizes whose shards the leaves respect: 1, 2 and 4 GPUs (four leaves at V = 151936). Eight
// would make ten leaves, each product a quarter as long: with the partials' memory fixed, slices of a
// third the rows, whose products fill 3/4 of an H200 (+9% of a 16384x4096 train step, 2026-11-28).
inline constexpr int kLeafGroupSizes[] = {1, 2, 4};

// The most leaves a vocabulary has: each group size k cuts at k − 1 places, and the cuts of different sizes
// need not meet (T = 4q + 2 tiles: k = 2 cuts at 2q + 1, k = 4 at q, 2q, 3q + 1), so 1 + 0 + 1 + 3 = 5.
inline constexpr int kMaxLeaves = [] {
  int n = 1;
  for (int k : kLeafGroupSizes) n += k - 1;
  return n;
}();

// The leaves' global boundaries, ascending: 0, every boundary of VocabShard(V, r, k) for k in
// kLeafGroupSizes (those with k ≤ the tile count), and V. Leaf i is [bounds[i], bounds[i + 1]).
std::vector<int64_t> LeafBounds(int64_t vocab_size);

// The leaves inside [shard.begin, shard.end) as shard-local ranges; a shard of a group size in
// kLeafGroupSizes is a union of whole leaves.
std::vector<VocabRange> ShardLeaves(int64_t vocab_size, VocabRange shard);

}  // namespace lce
