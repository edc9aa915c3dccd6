// Σ x² of a large fp32 buffer (the gradient's squared norm, for global-norm clipping), in double and
// in a fixed order: a fixed grid of kNormBlocks blocks, each thread a fixed grid-stride set of
// elements, tree reductions of fixed shape, then one block sums the partials in order. The same bits
// for the same buffer on any GPU, whatever else runs.
#include "cuda/cuda_check.h"
#include "cuda/kernels.h"

namespace lce::cuda {
namespace {

constexpr int kThreads = 256;

// Sum over the block's threads of v, in a fixed tree order; the result in thread 0.
__device__ double BlockSum(double v) {
  __shared__ double lanes[kThreads];
  lanes[threadIdx.x] = v;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) lanes[threadIdx.x] += lanes[threadIdx.x + half];
    __syncthreads();
  }
  return lanes[0];
}

__global__ void __launch_bounds__(kThreads) SquaredNormPartials(const float* __restrict__ x, int64_t n,
                                                                double* __restrict__ partials) {
  const int64_t stride = static_cast<int64_t>(kNormBlocks) * kThreads;
  const int64_t vec_n = n / 4;
  double s = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < vec_n; i += stride) {
    const float4 f = reinterpret_cast<const float4*>(x)[i];
    s += static_cast<double>(f.x) * f.x + static_cast<double>(f.y) * f.y + static_cast<double>(f.z) * f.z +
         static_cast<double>(f.w) * f.w;
  }
  for (int64_t i = vec_n * 4 + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    s += static_cast<double>(x[i]) * x[i];
  }
  const double block = BlockSum(s);
  if (threadIdx.x == 0) partials[blockIdx.x] = block;
}

__global__ void __launch_bounds__(kThreads) SumPartials(const double* __restrict__ partials, double* __restrict__ out) {
  double s = 0;
  for (int i = threadIdx.x; i < kNormBlocks; i += kThreads) s += partials[i];
  const double total = BlockSum(s);
  if (threadIdx.x == 0) *out = total;
}

}  // namespace

absl::Status LaunchSquaredNorm(const float* x, int64_t n, double* scratch, double* out, cudaStream_t stream) {
  if (reinterpret_cast<uintptr_t>(x) % 16 != 0) return absl::InvalidArgumentError("the norm's input must be 16-byte aligned");
  SquaredNormPartials<<<kNormBlocks, kThreads, 0, stream>>>(x, n, scratch);
  LCE_CUDA_CHECK(cudaGetLastError());
  SumPartials<<<1, kThreads, 0, stream>>>(scratch, out);
  LCE_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace lce::cuda
