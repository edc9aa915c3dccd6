// Fast loss path (bf16 heads, GradMode::kLoss, no softcap, no label smoothing): the backward products
// run on q = exp(z − c_row) as TileStats stored it; the per-row factor s_r and the target term
// t_r·1[j = y_r] are applied here, around the GEMMs, on [rows, hidden] data only:
//   d_hidden = s ⊙ (q · W) − t ⊙ W[y]         dW += qᵀ · (s ⊙ h) − scatter(t ⊙ h → rows y)
#include <cuda_bf16.h>

#include "absl/strings/str_cat.h"
#include "cuda/cuda_check.h"
#include "cuda/kernels.h"

namespace lce::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void ScaleRowsKernel(const __nv_bfloat16* __restrict__ h, int64_t hidden, const float* __restrict__ info,
                                __nv_bfloat16* __restrict__ out) {
  const int64_t r = blockIdx.y;
  const float s = info[r * kRowInfo + kInfoScale];
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < hidden;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[r * hidden + c] = __float2bfloat16_rn(s * __bfloat162float(h[r * hidden + c]));
  }
}

__global__ void FinishDHiddenKernel(float* __restrict__ dh, int64_t hidden, const float* __restrict__ info,
                                    const __nv_bfloat16* __restrict__ w, const int32_t* __restrict__ targets,
                                    int32_t ignore_index, int64_t vocab_begin, int64_t shard_rows) {
  const int64_t r = blockIdx.y;
  const float s = info[r * kRowInfo + kInfoScale];
  const float t = info[r * kRowInfo + kInfoTarget];
  const int32_t y = targets[r];
  const int64_t local = y == ignore_index ? -1 : static_cast<int64_t>(y) - vocab_begin;
  const bool has_target = local >= 0 && local < shard_rows && t != 0.0f;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < hidden;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v = s * dh[r * hidden + c];
    if (has_target) v -= t * __bfloat162float(w[local * hidden + c]);
    dh[r * hidden + c] = v;
  }
}

__global__ void ScatterTargetKernel(float* __restrict__ dw, int64_t hidden, const float* __restrict__ info,
                                    const __nv_bfloat16* __restrict__ h, const int32_t* __restrict__ targets,
                                    int32_t ignore_index, int64_t vocab_begin, int64_t shard_rows) {
  const int64_t r = blockIdx.y;
  const float t = info[r * kRowInfo + kInfoTarget];
  const int32_t y = targets[r];
  const int64_t local = y == ignore_index ? -1 : static_cast<int64_t>(y) - vocab_begin;
  if (local < 0 || local >= shard_rows || t == 0.0f) return;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < hidden;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    atomicAdd(&dw[local * hidden + c], -t * __bfloat162float(h[r * hidden + c]));
  }
}

absl::Status CheckRows(int64_t rows, int64_t hidden, const char* what) {
  if (rows > 65535 || hidden <= 0) {
    return absl::InternalError(absl::StrCat(what, ": bad shape rows=", rows, " hidden=", hidden));
  }
  return absl::OkStatus();
}

dim3 Grid(int64_t rows, int64_t hidden) {
  return dim3(static_cast<unsigned>(std::min<int64_t>((hidden + kThreads - 1) / kThreads, 16)),
              static_cast<unsigned>(rows));
}

}  // namespace

absl::Status LaunchScaleRows(const void* h, int64_t rows, int64_t hidden, const float* row_info, void* h_scaled,
                             cudaStream_t stream) {
  if (rows <= 0) return absl::OkStatus();
  LCE_CUDA_CHECK(CheckRows(rows, hidden, "LaunchScaleRows"));
  ScaleRowsKernel<<<Grid(rows, hidden), kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(h), hidden, row_info,
                                                                static_cast<__nv_bfloat16*>(h_scaled));
  LCE_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status LaunchFinishDHidden(float* dh, int64_t rows, int64_t hidden, const float* row_info, const void* w,
                                 const int32_t* targets, int32_t ignore_index, int64_t vocab_begin,
                                 int64_t shard_rows, cudaStream_t stream) {
  if (rows <= 0) return absl::OkStatus();
  LCE_CUDA_CHECK(CheckRows(rows, hidden, "LaunchFinishDHidden"));
  FinishDHiddenKernel<<<Grid(rows, hidden), kThreads, 0, stream>>>(
      dh, hidden, row_info, static_cast<const __nv_bfloat16*>(w), targets, ignore_index, vocab_begin, shard_rows);
  LCE_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status LaunchScatterTargetDW(float* d_weight, int64_t rows, int64_t hidden, const float* row_info,
                                   const void* h, const int32_t* targets, int32_t ignore_index,
                                   int64_t vocab_begin, int64_t shard_rows, cudaStream_t stream) {
  if (rows <= 0) return absl::OkStatus();
  LCE_CUDA_CHECK(CheckRows(rows, hidden, "LaunchScatterTargetDW"));
  ScatterTargetKernel<<<Grid(rows, hidden), kThreads, 0, stream>>>(
      d_weight, hidden, row_info, static_cast<const __nv_bfloat16*>(h), targets, ignore_index, vocab_begin,
      shard_rows);
  LCE_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace lce::cuda
