// A head's bias gradient on the GPU: dB[j] = Σ_r dL/da_rj over a row block, from the copy the backward
// products read (dA, or the fast loss path's q = exp(z − c) with its per-row factor s_r) and the target's
// term kept apart (−t_r at column y_r). One thread a column, the rows in order: the same bits every run.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/cuda_check.h"
#include "cuda/dtype_dispatch.cuh"
#include "cuda/kernels.h"

namespace lce::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    BiasGradKernel(float* __restrict__ d_bias, float beta, const T* __restrict__ stored, int64_t lds, int64_t rows,
                   int64_t shard_rows, const float* __restrict__ info, bool scale, bool target,
                   const int32_t* __restrict__ targets, int32_t ignore_index, int64_t vocab_begin) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (j >= shard_rows) return;
  const int64_t global = vocab_begin + j;
  float acc = beta == 0.0f ? 0.0f : beta * d_bias[j];  // a fresh buffer's contents are not read
  for (int64_t r = 0; r < rows; ++r) {
    const float s = scale ? info[r * kRowInfo + kInfoScale] : 1.0f;
    acc = __fadd_rn(acc, __fmul_rn(s, ToFloat(stored[r * lds + j])));
    if (target && targets[r] != ignore_index && targets[r] == global) {
      acc = __fsub_rn(acc, info[r * kRowInfo + kInfoTarget]);
    }
  }
  d_bias[j] = acc;
}

}  // namespace

absl::Status LaunchBiasGrad(float* d_bias, float beta, const void* stored, DType dtype, int64_t lds, int64_t rows,
                            int64_t shard_rows, const float* row_info, bool scale, bool target, const int32_t* targets,
                            int32_t ignore_index, int64_t vocab_begin, cudaStream_t stream) {
  if (shard_rows <= 0) return absl::OkStatus();
  if (lds < shard_rows) return absl::InternalError("LaunchBiasGrad: leading dimension below the shard's columns");
  const unsigned blocks = static_cast<unsigned>((shard_rows + kThreads - 1) / kThreads);
  return DispatchDType(dtype, [&](auto tag) -> absl::Status {
    using T = typename decltype(tag)::type;
    BiasGradKernel<T><<<blocks, kThreads, 0, stream>>>(d_bias, beta, static_cast<const T*>(stored), lds, rows,
                                                       shard_rows, row_info, scale, target, targets, ignore_index,
                                                       vocab_begin);
    LCE_CUDA_CHECK(cudaGetLastError());
    return absl::OkStatus();
  });
}

}  // namespace lce::cuda
