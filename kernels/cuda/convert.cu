// fp32 -> head dtype conversion (d_hidden leaves the engine in the head's dtype).
#include "cuda/cuda_check.h"
#include "cuda/dtype_dispatch.cuh"
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

}  // namespace

absl::Status LaunchFloatToDType(const float* src, DType dtype, void* dst, int64_t n, cudaStream_t stream) {
  if (n <= 0) return absl::OkStatus();
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 132 * 16));
  return DispatchDType(dtype, [&](auto tag) -> absl::Status {
    using T = typename decltype(tag)::type;
    FloatToKernel<T><<<blocks, 256, 0, stream>>>(src, static_cast<T*>(dst), n);
    LCE_CUDA_CHECK(cudaGetLastError());
    return absl::OkStatus();
  });
}

}  // namespace lce::cuda
