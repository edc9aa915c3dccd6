// Elementwise fixed-order steps: an ordered sum of partials (the smoothing sums' segments) and a fill.
#include <algorithm>

#include "cuda/cuda_check.h"
#include "cuda/grid_stride.cuh"
#include "cuda/kernels.h"

namespace lce::cuda {
namespace {

__global__ void OrderedSumKernel(float* dst, const float* parts, int count, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    float acc = parts[i];
    for (int s = 1; s < count; ++s) acc = __fadd_rn(acc, parts[s * n + i]);  // left to right, never contracted
    dst[i] = acc;
  }
}

__global__ void FillFloatsKernel(float* dst, float value, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    dst[i] = value;
  }
}

}  // namespace

absl::Status LaunchOrderedSum(float* dst, const float* parts, int count, int64_t n, cudaStream_t stream) {
  if (n <= 0) return absl::OkStatus();
  if (count < 1) return absl::InternalError("ordered sum of no partials");
  OrderedSumKernel<<<GridStrideBlocks(n), kGridStrideThreads, 0, stream>>>(dst, parts, count, n);
  LCE_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status LaunchFillFloats(float* dst, float value, int64_t n, cudaStream_t stream) {
  if (n <= 0) return absl::OkStatus();
  FillFloatsKernel<<<GridStrideBlocks(n), kGridStrideThreads, 0, stream>>>(dst, value, n);
  LCE_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace lce::cuda
