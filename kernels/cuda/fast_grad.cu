// Fast loss path (bf16 heads, GradMode::kLoss, no softcap, no label smoothing): the backward products
// run on q = exp(z − c_row) as TileStats stored it; the per-row factor s_r and the target term
// t_r·1[j = y_r] are applied here, around the GEMMs, on [rows, hidden] data only:
//   d_hidden = s ⊙ (q · W) − t ⊙ W[y]         dW += qᵀ · (s ⊙ h) − scatter(t ⊙ h → rows y)
#include <cuda_bf16.h>

#include <cub/device/device_radix_sort.cuh>

#include "absl/status/statusor.h"
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

// Key of row r for the target scatter's order: its target's row in the shard, or `shard_rows` (sorted last,
// skipped) where it adds nothing here.
__global__ void TargetKeysKernel(int64_t rows, const float* __restrict__ info, const int32_t* __restrict__ targets,
                                 int32_t ignore_index, int64_t vocab_begin, int64_t shard_rows,
                                 int32_t* __restrict__ keys, int32_t* __restrict__ order) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  const int32_t y = targets[r];
  const int64_t local = y == ignore_index ? -1 : static_cast<int64_t>(y) - vocab_begin;
  const bool here = local >= 0 && local < shard_rows && info[r * kRowInfo + kInfoTarget] != 0.0f;
  keys[r] = static_cast<int32_t>(here ? local : shard_rows);
  order[r] = static_cast<int32_t>(r);
}

// One writer a target row: the block at sorted position p leads the run of rows sharing its key (the first
// position of the run) and adds −t·h of each of them, in row order, to dW's row. Rows share no dW row
// across runs, so no atomics, and the sum's order is fixed by the rows alone.
__global__ void ScatterSortedKernel(float* __restrict__ dw, int64_t rows, int64_t hidden,
                                    const float* __restrict__ info, const __nv_bfloat16* __restrict__ h,
                                    const int32_t* __restrict__ keys, const int32_t* __restrict__ order,
                                    int64_t shard_rows) {
  const int64_t p = blockIdx.y;
  const int32_t key = keys[p];
  if (key >= shard_rows || (p > 0 && keys[p - 1] == key)) return;
  int64_t end = p + 1;
  while (end < rows && keys[end] == key) ++end;
  float* out = dw + static_cast<int64_t>(key) * hidden;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < hidden;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float acc = out[c];
#pragma unroll 4
    for (int64_t q = p; q < end; ++q) {
      const int64_t r = order[q];
      acc += -info[r * kRowInfo + kInfoTarget] * __bfloat162float(h[r * hidden + c]);
    }
    out[c] = acc;
  }
}

int64_t ArrayBytes(int64_t rows) { return (rows * static_cast<int64_t>(sizeof(int32_t)) + 255) / 256 * 256; }

absl::StatusOr<size_t> SortBytes(int64_t rows) {
  size_t bytes = 0;
  LCE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const int32_t*>(nullptr),
                                                 static_cast<int32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                                 static_cast<int32_t*>(nullptr), static_cast<int>(rows), 0, 32));
  return bytes;
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

int64_t TargetOrderBytes(int64_t rows) {
  absl::StatusOr<size_t> sort = SortBytes(rows);
  return 4 * ArrayBytes(rows) + (sort.ok() ? static_cast<int64_t>(*sort) : 0);
}

absl::Status LaunchScatterTargetDW(float* d_weight, int64_t rows, int64_t hidden, const float* row_info,
                                   const void* h, const int32_t* targets, int32_t ignore_index,
                                   int64_t vocab_begin, int64_t shard_rows, void* scratch, int64_t scratch_bytes,
                                   cudaStream_t stream) {
  if (rows <= 0) return absl::OkStatus();
  LCE_CUDA_CHECK(CheckRows(rows, hidden, "LaunchScatterTargetDW"));
  absl::StatusOr<size_t> sort_bytes = SortBytes(rows);
  if (!sort_bytes.ok()) return sort_bytes.status();
  const int64_t need = 4 * ArrayBytes(rows) + static_cast<int64_t>(*sort_bytes);  // TargetOrderBytes(rows)
  if (shard_rows >= (int64_t{1} << 30) || scratch_bytes < need) {
    return absl::InternalError(absl::StrCat("LaunchScatterTargetDW: scratch of ", scratch_bytes, " bytes for ", rows,
                                            " rows (", need, " needed), shard rows ", shard_rows));
  }
  // Scratch: keys and rows in, keys and rows sorted, the sort's own.
  uint8_t* base = static_cast<uint8_t*>(scratch);
  const auto array = [&](int i) { return reinterpret_cast<int32_t*>(base + i * ArrayBytes(rows)); };
  int32_t *keys = array(0), *order = array(1), *sorted_keys = array(2), *sorted_order = array(3);
  TargetKeysKernel<<<static_cast<unsigned>((rows + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      rows, row_info, targets, ignore_index, vocab_begin, shard_rows, keys, order);
  LCE_CUDA_CHECK(cudaGetLastError());
  // A radix sort is stable: rows sharing a target stay in row order. Only the bits a key can use.
  int bits = 1;
  while ((int64_t{1} << bits) <= shard_rows) ++bits;
  size_t sort_size = *sort_bytes;
  LCE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(array(4), sort_size, keys, sorted_keys, order, sorted_order,
                                                 static_cast<int>(rows), 0, bits, stream));
  ScatterSortedKernel<<<Grid(rows, hidden), kThreads, 0, stream>>>(
      d_weight, rows, hidden, row_info, static_cast<const __nv_bfloat16*>(h), sorted_keys, sorted_order, shard_rows);
  LCE_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace lce::cuda
