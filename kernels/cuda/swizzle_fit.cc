// The tile scheduler's swizzle width fitted to a call's grid (kernels.h: FittedEpilogueSwizzle).
#include <cstdint>

#include "cuda/kernels.h"
#include "cuda/workspace.h"  // RoundUp

namespace lce::cuda {
namespace {

// CUTLASS's PersistentTileSchedulerSm90Params::get_log_swizzle_size: the width it takes for a maximum of
// `widest` on a grid of blocks_m × blocks_n CTAs.
int CutlassSwizzle(int64_t blocks_m, int64_t blocks_n, int widest) {
  const int64_t least = blocks_m < blocks_n ? blocks_m : blocks_n;
  if (widest >= 8 && least >= 6) return 8;
  if (widest >= 4 && least >= 3) return 4;
  if (widest >= 2 && least >= 2) return 2;
  return 1;
}

}  // namespace

int FittedEpilogueSwizzle(int64_t rows, int64_t cols) {
  // Configuration 4: 128×192 tiles in clusters of two along the rows.
  constexpr int64_t kTileRows = 128, kTileCols = 192, kClusterRows = 2;
  const int64_t blocks_m = RoundUp(rows < 1 ? 1 : rows, kTileRows) / kTileRows;
  const int64_t blocks_n = RoundUp(cols < 1 ? 1 : cols, kTileCols) / kTileCols;
  // The grid each width runs: CTA rows padded to swizzle × cluster rows, column tiles to swizzle.
  const auto tiles = [&](int widest) {
    const int s = CutlassSwizzle(blocks_m, blocks_n, widest);
    return RoundUp(blocks_m, s * kClusterRows) * RoundUp(blocks_n, s);
  };
  int64_t least = tiles(1);
  for (int w : {8, 4, 2}) least = tiles(w) < least ? tiles(w) : least;
  for (int w : {8, 4, 2}) {
    if (tiles(w) * 100 <= least * 103) return w;  // within 3%: the wider group keeps more of h in the L2
  }
  return 1;
}

}  // namespace lce::cuda
