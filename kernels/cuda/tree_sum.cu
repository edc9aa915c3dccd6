// Elementwise steps of d_hidden's canonical tile tree (cuda_engine.cc, DHiddenByTiles): a node's
// value is left + right, and a gathered node buffer starts at −inf so that a max all-reduce copies
// each rank's nodes into every rank's buffer.
#include <algorithm>

#include "cuda/cuda_check.h"
#include "cuda/kernels.h"

namespace lce::cuda {
namespace {

__global__ void AddFloatsKernel(float* dst, const float* a, const float* b, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    dst[i] = __fadd_rn(a[i], b[i]);  // never contracted: the tree's bits
  }
}

__global__ void FillFloatsKernel(float* dst, float value, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    dst[i] = value;
  }
}

unsigned Blocks(int64_t n) { return static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 132 * 16)); }

}  // namespace

absl::Status LaunchAddFloats(float* dst, const float* a, const float* b, int64_t n, cudaStream_t stream) {
  if (n <= 0) return absl::OkStatus();
  AddFloatsKernel<<<Blocks(n), 256, 0, stream>>>(dst, a, b, n);
  LCE_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status LaunchFillFloats(float* dst, float value, int64_t n, cudaStream_t stream) {
  if (n <= 0) return absl::OkStatus();
  FillFloatsKernel<<<Blocks(n), 256, 0, stream>>>(dst, value, n);
  LCE_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace lce::cuda
