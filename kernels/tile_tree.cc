#include "tile_tree.h"

#include "lce/head.h"

namespace lce {

std::vector<TileTreeNode> RankSubtrees(int64_t vocab_size, int rank, int world) {
  const VocabRange range = VocabShard(vocab_size, rank, world);
  const int64_t tile = VocabTile(vocab_size);
  std::vector<TileTreeNode> stack;
  for (int64_t t = range.begin / tile; t * tile < range.end; ++t) {
    PushTreeNode(stack, TileTreeNode{0, t}, [](TileTreeNode&, TileTreeNode&) {});
  }
  return stack;
}

int TileTreeRootLevel(int64_t tiles) {
  int level = 0;
  while ((int64_t{1} << level) < tiles) ++level;
  return level;
}

}  // namespace lce
