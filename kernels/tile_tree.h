// d_hidden's canonical summation tree over the head's vocabulary tiles (docs/MATH.md, "Order of
// reductions"). Node (level, index) covers tiles [index·2^level, (index+1)·2^level) of the head's T
// tiles; its value is left + right, or left alone where the right child starts past T. A rank holds
// whole tiles, so its tiles decompose into whole subtrees; summing the subtrees of every rank over
// the same tree gives the same additions in the same order for any group size, one GPU included.
// Both engines use this structure; each keeps its values its own way.
#pragma once

#include <cstdint>
#include <vector>

namespace lce {

struct TileTreeNode {
  int level = 0;
  int64_t index = 0;
};

// Pushes a tile's node onto a stack of subtrees over consecutive tiles and joins siblings, so the
// stack ends as the dyadic decomposition of the tiles pushed. `join(left, right)` adds right's value
// into left's before right is popped. Node: anything with `level` and `index`.
template <typename Node, typename Join>
void PushTreeNode(std::vector<Node>& stack, Node node, Join join) {
  stack.push_back(std::move(node));
  while (stack.size() >= 2) {
    Node& right = stack.back();
    Node& left = stack[stack.size() - 2];
    if (left.level != right.level || (left.index & 1) != 0 || right.index != left.index + 1) break;
    join(left, right);
    ++left.level;
    left.index >>= 1;
    stack.pop_back();
  }
}

// The subtrees rank `rank` of `world` holds over the head's tiles (VocabShard's), in tile order.
std::vector<TileTreeNode> RankSubtrees(int64_t vocab_size, int rank, int world);

// The root's level: the least L with 2^L >= tiles.
int TileTreeRootLevel(int64_t tiles);

}  // namespace lce
