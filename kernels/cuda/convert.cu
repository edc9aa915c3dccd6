// fp32 <-> head dtype conversion (d_hidden leaves the engine in the head's dtype; a trainer's fp32
// master weights start from the serving weight).
#include "cuda/cuda_check.h"
#include "cuda/dtype_dispatch.cuh"
#include "cuda/grid_stride.cuh"
#include "cuda/kernels.h"

namespace lce::cuda {
namespace {

template <typename T>
__global__ void FloatToKernel(const float* __restrict__ src, T* __restrict__ dst, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = FromFloat<T>(src[i]);
  }
}

template <typename T>
__global__ void ToFloatKernel(const T* __restrict__ src, float* __restrict__ dst, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = ToFloat<T>(src[i]);
  }
}

}  // namespace

absl::Status LaunchDTypeToFloat(const void* src, DType dtype, float* dst, int64_t n, cudaStream_t stream) {
  if (n <= 0) return absl::OkStatus();
  const unsigned blocks = GridStrideBlocks(n);
  return DispatchDType(dtype, [&](auto tag) -> absl::Status {
    using T = typename decltype(tag)::type;
    ToFloatKernel<T><<<blocks, kGridStrideThreads, 0, stream>>>(static_cast<const T*>(src), dst, n);
    LCE_CUDA_CHECK(cudaGetLastError());
    return absl::OkStatus();
  });
}

absl::Status LaunchFloatToDType(const float* src, DType dtype, void* dst, int64_t n, cudaStream_t stream) {
  if (n <= 0) return absl::OkStatus();
  const unsigned blocks = GridStrideBlocks(n);
  return DispatchDType(dtype, [&](auto tag) -> absl::Status {
    using T = typename decltype(tag)::type;
    FloatToKernel<T><<<blocks, kGridStrideThreads, 0, stream>>>(src, static_cast<T*>(dst), n);
    LCE_CUDA_CHECK(cudaGetLastError());
    return absl::OkStatus();
  });
}

}  // namespace lce::cuda
