// Class weights with label smoothing: the loss's smoothing term needs Σ_j w_j z_ij, a weighted sum of the
// row's logits that no tile statistic carries. Without a softcap z is linear in h, so
//   Σ_j w_j z_ij = (h_i · u + Σ_j w_j b_j) / T   with u = Σ_j w_j W_j,
// one pass over the head a call (per vocabulary segment, then the segments in order: each segment's sum
// comes from one rank, so u has the same bits for any group size) and a dot product a row (a fixed order:
// the same bits in any batch). The gradient's term −(ε/V)·w_j needs no sum (write_grad.cu).
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "cuda/cuda_check.h"
#include "cuda/dtype_dispatch.cuh"
#include "cuda/kernels.h"

namespace lce::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kRowThreads = 128;

// Block (x, y): columns first_col + [x·kThreads, +kThreads) of [W | b | 1] weighted by w over global segment
// seg0 + y's rows in this shard, in row order.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    SegmentSumsKernel(const T* __restrict__ w, int64_t hidden, const float* __restrict__ bias,
                      const float* __restrict__ class_weight, int64_t vocab_begin, int64_t shard_rows, int64_t seg0,
                      int64_t first_col, float* __restrict__ seg_sums) {
  const int64_t width = hidden + 2;
  const int64_t k = first_col + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (k >= width) return;
  const int64_t g = seg0 + blockIdx.y;
  const int64_t lo = max(g * kSegment, vocab_begin) - vocab_begin;
  const int64_t hi = min((g + 1) * kSegment, vocab_begin + shard_rows) - vocab_begin;
  float acc = 0.0f;
#pragma unroll 8
  for (int64_t j = lo; j < hi; ++j) {
    const float x = k < hidden ? ToFloat(w[j * hidden + k]) : k == hidden ? (bias != nullptr ? bias[j] : 0.0f) : 1.0f;
    acc = __fadd_rn(acc, __fmul_rn(class_weight[vocab_begin + j], x));
  }
  seg_sums[g * width + k] = acc;
}

// One block a row: packed[r, 2] = (h_r · u + u[H]) / T, each thread's strided share in order, then a fixed tree.
template <typename T>
__global__ void __launch_bounds__(kRowThreads)
    RowSumsKernel(const T* __restrict__ h, int64_t hidden, const float* __restrict__ u, float inv_temp,
                  float* __restrict__ packed) {
  __shared__ float red[kRowThreads / 32];
  const int64_t r = blockIdx.x;
  const T* row = h + r * hidden;
  float acc = 0.0f;
  for (int64_t k = threadIdx.x; k < hidden; k += kRowThreads) {
    acc = __fadd_rn(acc, __fmul_rn(ToFloat(row[k]), u[k]));
  }
  acc = WarpSum(acc);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = red[0];
    for (int i = 1; i < kRowThreads / 32; ++i) s = __fadd_rn(s, red[i]);
    packed[r * kPacked + 2] = __fmul_rn(__fadd_rn(s, u[hidden]), inv_temp);
  }
}

}  // namespace

absl::Status LaunchSmoothingSegmentSums(const void* w, DType dtype, int64_t hidden, const float* bias,
                                        const float* class_weight, int64_t vocab_begin, int64_t shard_rows,
                                        int64_t first_col, float* seg_sums, cudaStream_t stream) {
  if (shard_rows <= 0) return absl::OkStatus();
  const int64_t seg0 = vocab_begin / kSegment;
  const int64_t nseg = (vocab_begin + shard_rows - 1) / kSegment - seg0 + 1;
  if (hidden <= 0 || nseg > 65535 || first_col < 0 || first_col > hidden) {
    return absl::InternalError(
        absl::StrCat("LaunchSmoothingSegmentSums: bad shape hidden=", hidden, " rows=", shard_rows));
  }
  const dim3 grid(static_cast<unsigned>((hidden + 2 - first_col + kThreads - 1) / kThreads),
                  static_cast<unsigned>(nseg));
  return DispatchDType(dtype, [&](auto tag) -> absl::Status {
    using T = typename decltype(tag)::type;
    SegmentSumsKernel<T><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(w), hidden, bias, class_weight,
                                                        vocab_begin, shard_rows, seg0, first_col, seg_sums);
    LCE_CUDA_CHECK(cudaGetLastError());
    return absl::OkStatus();
  });
}

absl::Status LaunchSmoothingRowSums(const void* h, DType dtype, int64_t rows, int64_t hidden, const float* u,
                                    float temperature, float* packed, cudaStream_t stream) {
  if (rows <= 0) return absl::OkStatus();
  if (rows > INT32_MAX || hidden <= 0) {
    return absl::InternalError(absl::StrCat("LaunchSmoothingRowSums: bad shape rows=", rows, " hidden=", hidden));
  }
  return DispatchDType(dtype, [&](auto tag) -> absl::Status {
    using T = typename decltype(tag)::type;
    RowSumsKernel<T><<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(static_cast<const T*>(h), hidden, u,
                                                                              1.0f / temperature, packed);
    LCE_CUDA_CHECK(cudaGetLastError());
    return absl::OkStatus();
  });
}

}  // namespace lce::cuda
