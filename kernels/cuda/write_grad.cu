// Backward elementwise kernel: the compact forward copy (z − m of its column group) becomes dL/da in the head's
// dtype, in place, ready for the d_hidden and dW products.
#include <climits>

#include "absl/strings/str_cat.h"
#include "cuda/cuda_check.h"
#include "cuda/dtype_dispatch.cuh"
#include "cuda/kernels.h"

namespace lce::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWeightedRows = 4;  // rows a block row covers with class weights (their weights read once)

// One row's kVec columns from c0 (n of them in range): dz from the stored z − m_group, in place. w: label
// smoothing's per-column weights (class weights), or null (all 1).
template <typename T, typename S, int kVec>
__device__ __forceinline__ void WriteGradVector(S* store, int64_t lds, int64_t r, int c0, int n,
                                                const float* __restrict__ part, int64_t ngroup, int group_cols,
                                                const float* __restrict__ info, const int32_t* __restrict__ targets,
                                                int32_t ignore_index, int64_t vocab_begin, const float* w,
                                                float softcap, float temperature, bool target_apart) {
  const float* in = info + r * kRowInfo;
  const float m = in[kInfoMax], log_s = in[kInfoLogS], A = in[kInfoA], B = in[kInfoB], C = in[kInfoC],
              D = in[kInfoD];
  const float m_group = part[(r * ngroup + c0 / group_cols) * 4];
  const float group_shift = m_group - m;  // 0 in the group of the row max; exact near it (Sterbenz)
  const float inv_temp = 1.0f / temperature;
  const float t_over_s = softcap > 0.0f ? temperature / softcap : 0.0f;
  const int32_t y = targets[r];
  const int64_t ylocal = y == ignore_index || target_apart ? -1 : static_cast<int64_t>(y) - vocab_begin;
  S* src = store + r * lds + c0;
  T* dst = reinterpret_cast<T*>(src);
  union {
    uint4 u;
    S s[kVec];
  } vin;
  union {
    uint4 u;
    T t[kVec];
  } vout;
  if (n == kVec) {
    vin.u = *reinterpret_cast<const uint4*>(src);
  } else {
    for (int j = 0; j < n; ++j) vin.s[j] = src[j];
  }
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    // z − m and p from the stored z − m_group without forming z or lse (kernels.h, RowInfoSlot).
    const float zm = group_shift + ToFloat(vin.s[j]);
    const float p = expf(zm - log_s);
    // Label smoothing's −(ε/V)·w_j (w_j = 1 without class weights).
    float dz = A * p + B * p * zm - (w != nullptr ? D * w[j] : D);
    if (c0 + j == ylocal) dz -= C;
    float da = dz * inv_temp;
    if (softcap > 0.0f) {
      const float t = (m_group + ToFloat(vin.s[j])) * t_over_s;
      da *= 1.0f - t * t;
    }
    vout.t[j] = FromFloat<T>(da);
  }
  if (n == kVec) {
    *reinterpret_cast<uint4*>(dst) = vout.u;
  } else {
    for (int j = 0; j < n; ++j) dst[j] = vout.t[j];
  }
}

// S: storage type (half for 16-bit heads, float for fp32); T: output type; VEC elements = 16 bytes. A block
// row covers one row, or with class weights (kWeighted) kWeightedRows: their columns' weights read once for all.
template <typename T, typename S, bool kWeighted>
__global__ void __launch_bounds__(kThreads)
    WriteGradKernel(S* store, int64_t lds, int64_t rows, int v0, int nv, const float* __restrict__ part, int64_t ngroup,
                    int group_cols, const float* __restrict__ info, const int32_t* __restrict__ targets,
                    int32_t ignore_index, int64_t vocab_begin, const float* __restrict__ class_weight, float softcap,
                    float temperature, bool target_apart) {
  constexpr int kVec = 16 / sizeof(S);
  static_assert(sizeof(T) == sizeof(S));
  static_assert(kSegment % kVec == 0);  // and group_cols % kVec == 0 (checked at launch): one group a vector
  const int c0 = v0 + (blockIdx.x * kThreads + threadIdx.x) * kVec;
  if (c0 >= nv) return;
  const int n = min(kVec, nv - c0);
  constexpr int kRows = kWeighted ? kWeightedRows : 1;
  float w[kVec];
  if constexpr (kWeighted) {
    for (int j = 0; j < kVec; ++j) w[j] = j < n ? class_weight[vocab_begin + c0 + j] : 0.0f;
  }
  for (int k = 0; k < kRows; ++k) {
    const int64_t r = static_cast<int64_t>(blockIdx.y) * kRows + k;
    if (r >= rows) return;
    WriteGradVector<T, S, kVec>(store, lds, r, c0, n, part, ngroup, group_cols, info, targets, ignore_index,
                                vocab_begin, kWeighted ? w : nullptr, softcap, temperature, target_apart);
  }
}

}  // namespace

absl::Status LaunchWriteGrad(DType dtype, void* store, int64_t lds, int64_t rows, int64_t v0, int64_t nc,
                             const float* part, int64_t ngroup, int group_cols, const float* row_info,
                             const int32_t* targets, int32_t ignore_index, int64_t vocab_begin,
                             const float* class_weight, float softcap, float temperature, bool target_apart,
                             cudaStream_t stream) {
  if (rows <= 0 || nc <= 0) return absl::OkStatus();
  const int64_t nv = v0 + nc;  // columns [v0, nv) are processed
  if (lds % 8 != 0 || lds < nv || rows > 65535 || v0 % kSegment != 0 || group_cols <= 0 || group_cols % 8 != 0 ||
      kSegment % group_cols != 0 || (nv + group_cols - 1) / group_cols > ngroup || nv > INT32_MAX) {
    return absl::InternalError(absl::StrCat("LaunchWriteGrad: bad shape rows=", rows, " v0=", v0, " nc=", nc,
                                            " lds=", lds));
  }
  return DispatchDType(dtype, [&](auto tag) -> absl::Status {
    using T = typename decltype(tag)::type;
    using S = std::conditional_t<sizeof(T) == 4, float, __half>;
    constexpr int kVec = 16 / sizeof(S);
    const unsigned col_blocks = static_cast<unsigned>((nc + kThreads * kVec - 1) / (kThreads * kVec));
    if (class_weight == nullptr) {
      WriteGradKernel<T, S, false><<<dim3(col_blocks, static_cast<unsigned>(rows)), kThreads, 0, stream>>>(
          static_cast<S*>(store), lds, rows, static_cast<int>(v0), static_cast<int>(nv), part, ngroup, group_cols,
          row_info, targets, ignore_index, vocab_begin, nullptr, softcap, temperature, target_apart);
    } else {
      WriteGradKernel<T, S, true><<<dim3(col_blocks, static_cast<unsigned>((rows + kWeightedRows - 1) / kWeightedRows)),
                                    kThreads, 0, stream>>>(
          static_cast<S*>(store), lds, rows, static_cast<int>(v0), static_cast<int>(nv), part, ngroup, group_cols,
          row_info, targets, ignore_index, vocab_begin, class_weight, softcap, temperature, target_apart);
    }
    LCE_CUDA_CHECK(cudaGetLastError());
    return absl::OkStatus();
  });
}

}  // namespace lce::cuda
