// Target validation for targets already in device memory.
#include "cuda/cuda_check.h"
#include "cuda/kernels.h"

namespace lce::cuda {
namespace {

__global__ void CheckTargetsKernel(const int32_t* __restrict__ targets, int64_t rows, int64_t vocab_size,
                                   int32_t ignore_index, unsigned long long* bad) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t y = targets[i];
    if (y != ignore_index && (y < 0 || y >= vocab_size)) {
      atomicMin(bad, static_cast<unsigned long long>(i));
    }
  }
}

}  // namespace

absl::Status LaunchCheckTargets(const int32_t* targets, int64_t rows, int64_t vocab_size, int32_t ignore_index,
                                unsigned long long* bad_row, cudaStream_t stream) {
  if (rows <= 0) return absl::OkStatus();
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((rows + 255) / 256, 1024));
  CheckTargetsKernel<<<blocks, 256, 0, stream>>>(targets, rows, vocab_size, ignore_index, bad_row);
  LCE_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace lce::cuda
