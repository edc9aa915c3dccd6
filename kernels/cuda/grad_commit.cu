// Committing a pending weight gradient (lce::HeadTrainer::CommitPending): dW += s·P, or dW *= s where
// a pending buffer became dW. Memory-bound: one read of P and one read and write of dW a float.

#include "cuda/cuda_check.h"
#include "cuda/grid_stride.cuh"
#include "cuda/kernels.h"

namespace lce::cuda {
namespace {

// y[i] = fp32(y[i] + fp32(s·x[i])), or fp32(s·y[i]) when x is null (rounded on their own, never
// fused, as the CPU trainer's loop).
__global__ void __launch_bounds__(kGridStrideThreads)
    ScaleAddKernel(float* __restrict__ y, const float* __restrict__ x, float s, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kGridStrideThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kGridStrideThreads + threadIdx.x; i < n; i += stride) {
    y[i] = x != nullptr ? __fadd_rn(y[i], __fmul_rn(s, x[i])) : __fmul_rn(s, y[i]);
  }
}

}  // namespace

absl::Status LaunchScaleAdd(float* y, const float* x, float s, int64_t n, cudaStream_t stream) {
  if (n <= 0) return absl::OkStatus();
  ScaleAddKernel<<<GridStrideBlocks(n), kGridStrideThreads, 0, stream>>>(y, x, s, n);
  LCE_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace lce::cuda
