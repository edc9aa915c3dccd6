// Grid size of the element-wise kernels that stride over n elements with 256-thread blocks: enough blocks
// for every element, at most 16 a multiprocessor of an H100/H200 (the loop covers the rest).
#pragma once

#include <algorithm>
#include <cstdint>

namespace lce::cuda {

inline constexpr int kGridStrideThreads = 256;  // the block size those kernels are launched with

inline unsigned GridStrideBlocks(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>((n + kGridStrideThreads - 1) / kGridStrideThreads, 132 * 16));
}

}  // namespace lce::cuda
