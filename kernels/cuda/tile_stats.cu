// Forward reduction of one fp32 logit tile: per-(row, segment) softmax partials, the target logit,
// and (for the backward) a compact copy of z − m_segment.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "absl/strings/str_cat.h"
#include "cuda/cuda_check.h"
#include "cuda/dtype_dispatch.cuh"
#include "cuda/kernels.h"

namespace lce::cuda {
namespace {

constexpr int kThreads = 192;                             // six warps: a 1536-column segment in two steps
constexpr int kVec = 4;                                   // floats per load
constexpr int kSteps = kSegment / (kThreads * kVec);      // 2 loads per thread
static_assert(kSteps * kThreads * kVec == kSegment);

__device__ __forceinline__ void StoreShifted(__half* dst, const float* v, int n_valid) {
  if (n_valid == 4) {
    __half2 a = __floats2half2_rn(v[0], v[1]);
    __half2 b = __floats2half2_rn(v[2], v[3]);
    uint2 u;
    u.x = *reinterpret_cast<uint32_t*>(&a);
    u.y = *reinterpret_cast<uint32_t*>(&b);
    *reinterpret_cast<uint2*>(dst) = u;
  } else {
    for (int j = 0; j < n_valid; ++j) dst[j] = __float2half_rn(v[j]);
  }
}
__device__ __forceinline__ void StoreShifted(__nv_bfloat16* dst, const float* v, int n_valid) {
  if (n_valid == 4) {
    __nv_bfloat162 a = __floats2bfloat162_rn(v[0], v[1]);
    __nv_bfloat162 b = __floats2bfloat162_rn(v[2], v[3]);
    uint2 u;
    u.x = *reinterpret_cast<uint32_t*>(&a);
    u.y = *reinterpret_cast<uint32_t*>(&b);
    *reinterpret_cast<uint2*>(dst) = u;
  } else {
    for (int j = 0; j < n_valid; ++j) dst[j] = __float2bfloat16_rn(v[j]);
  }
}
__device__ __forceinline__ void StoreShifted(float* dst, const float* v, int n_valid) {
  if (n_valid == 4) {
    *reinterpret_cast<float4*>(dst) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
    for (int j = 0; j < n_valid; ++j) dst[j] = v[j];
  }
}

// The kernel's phases (TileStatsKernel), each inlined: a thread's kSteps × kVec columns of the segment.
using SegmentZ = float[kSteps][kVec];

// z = softcap(logit + bias) / T of the thread's columns (−inf past nv), their max and their sum (weighted
// by sum_weight where it is set).
__device__ __forceinline__ void LoadSegment(const float* __restrict__ row, int c_seg, int64_t v0, int nv,
                                            const LogitTransform& tf, float inv_temp, int tid, SegmentZ& z, float& tmax,
                                            float& tsum_z) {
  const float* __restrict__ bias = tf.bias;
  const float softcap = tf.softcap;
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
    const int c = c_seg + k * (kThreads * kVec) + tid * kVec;
    float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
    if (c < nv) x = *reinterpret_cast<const float4*>(row + c);  // ldz % 4 == 0: in bounds
    const float xs[kVec] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      if (c + j < nv) {
        float a = xs[j] + (bias != nullptr ? bias[v0 + c + j] : 0.0f);
        if (softcap > 0.0f) a = softcap * tanhf(a / softcap);
        const float zz = a * inv_temp;
        z[k][j] = zz;
        tmax = fmaxf(tmax, zz);
        tsum_z += tf.sum_weight != nullptr ? zz * tf.sum_weight[v0 + c + j] : zz;
      } else {
        z[k][j] = -INFINITY;
      }
    }
  }
}

// The segment's max over the block's threads.
__device__ __forceinline__ float BlockMax(float tmax, float (&red)[3][kThreads / 32], float& seg_max) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float wm = WarpMax(tmax);
  if (lane == 0) red[0][warp] = wm;
  __syncthreads();
  if (warp == 0) {
    float v = lane < kThreads / 32 ? red[0][lane] : -INFINITY;
    v = WarpMax(v);
    if (lane == 0) seg_max = v;
  }
  __syncthreads();
  return seg_max;
}

// Row r's target logit into packed, by the one thread that holds its column.
__device__ __forceinline__ void WriteTargetLogit(const SegmentZ& z, int32_t y, int32_t ignore_index,
                                                 int64_t vocab_begin, int64_t v0, int c_seg, int nv, int tid,
                                                 float* __restrict__ packed, int64_t r) {
  if (y == ignore_index) return;
  const int64_t local = static_cast<int64_t>(y) - vocab_begin - v0 - c_seg;
  if (local >= 0 && local < kSegment && c_seg + local < nv) {
    const int within = static_cast<int>(local % (kThreads * kVec));
    if (within / kVec == tid) {
      const int k = static_cast<int>(local / (kThreads * kVec));
      const int j = within % kVec;
#pragma unroll
      for (int kk = 0; kk < kSteps; ++kk)
#pragma unroll
        for (int jj = 0; jj < kVec; ++jj)
          if (kk == k && jj == j) packed[r * kPacked + 3] = z[kk][jj];
    }
  }
}

// Σ e and Σ e·(z − m) of the thread's columns, e = exp(z − m); z becomes z − m.
__device__ __forceinline__ void ExpSums(SegmentZ& z, float m, float& s, float& q) {
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float d = z[k][j] - m;  // -inf for masked columns: exp gives 0
      const float e = expf(d);
      s += e;
      q += e == 0.0f ? 0.0f : e * d;
      z[k][j] = d;
    }
  }
}

// The compact copy of the thread's columns (d = z − m): exp(z − c_row) (kExp; c_row from the row's first
// segment, the overflow flag raised where it leaves no headroom), else z − m_segment.
template <typename S, bool kExp>
__device__ __forceinline__ void StoreCompact(const SegmentZ& d, float m, int64_t r, int c_seg, int64_t v0, int nv,
                                             int tid, S* __restrict__ store, int64_t lds, float* __restrict__ row_c,
                                             unsigned* overflow) {
  if (kExp) {
    const bool first = v0 + c_seg == 0;
    const float c = first ? m + kExpLift : row_c[r];
    if (first && tid == 0) row_c[r] = c;
    if (!first && tid == 0 && !(m - c <= kExpHeadroom)) atomicExch(overflow, 0x3f800000u);  // 1.0f: all-reducible (max)
    const float shift = m - c;
#pragma unroll
    for (int k = 0; k < kSteps; ++k) {
      float e[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) e[j] = expf(d[k][j] + shift);
      const int cc = c_seg + k * (kThreads * kVec) + tid * kVec;
      if (cc < nv) StoreShifted(store + r * lds + v0 + cc, e, min(kVec, nv - cc));
    }
  } else {
    S* dst = store + r * lds + v0;
#pragma unroll
    for (int k = 0; k < kSteps; ++k) {
      const int c = c_seg + k * (kThreads * kVec) + tid * kVec;
      if (c < nv) StoreShifted(dst + c, d[k], min(kVec, nv - c));
    }
  }
}

// The block's sums of s, q and Σz, written with m as partials [index] (4 floats).
__device__ __forceinline__ void WriteSegmentPartials(float m, float s, float q, float tsum_z,
                                                     float (&red)[3][kThreads / 32], float* __restrict__ part,
                                                     int64_t index) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  s = WarpSum(s);
  q = WarpSum(q);
  tsum_z = WarpSum(tsum_z);
  __syncthreads();
  if (lane == 0) {
    red[0][warp] = s;
    red[1][warp] = q;
    red[2][warp] = tsum_z;
  }
  __syncthreads();
  if (warp == 0) {
    float a = lane < kThreads / 32 ? red[0][lane] : 0.0f;
    float b = lane < kThreads / 32 ? red[1][lane] : 0.0f;
    float c = lane < kThreads / 32 ? red[2][lane] : 0.0f;
    a = WarpSum(a);
    b = WarpSum(b);
    c = WarpSum(c);
    if (lane == 0) {
      float* p = part + index * 4;
      p[0] = m;
      p[1] = a;
      p[2] = b;
      p[3] = c;
    }
  }
}

// S: storage element; kExp: store exp(z − c_row) instead of z − m_segment. One block a (row, segment).
template <typename S, bool kExp>
__global__ void __launch_bounds__(kThreads)
    TileStatsKernel(const float* __restrict__ logits, int64_t ldz, int64_t v0, int nv, const LogitTransform tf,
                    float inv_temp, const int32_t* __restrict__ targets, int32_t ignore_index, int64_t vocab_begin,
                    float* __restrict__ part, int64_t nseg, float* __restrict__ packed, S* __restrict__ store,
                    int64_t lds, float* __restrict__ row_c, unsigned* overflow) {
  const int64_t r = blockIdx.y;
  const int c_seg = blockIdx.x * kSegment;  // first tile column of this segment
  const int tid = threadIdx.x;
  __shared__ float red[3][kThreads / 32];
  __shared__ float seg_max;
  float z[kSteps][kVec];
  float tmax = -INFINITY, tsum_z = 0.0f;
  LoadSegment(logits + r * ldz, c_seg, v0, nv, tf, inv_temp, tid, z, tmax, tsum_z);
  const float m = BlockMax(tmax, red, seg_max);
  WriteTargetLogit(z, targets[r], ignore_index, vocab_begin, v0, c_seg, nv, tid, packed, r);
  float s = 0.0f, q = 0.0f;
  ExpSums(z, m, s, q);
  if (store != nullptr) StoreCompact<S, kExp>(z, m, r, c_seg, v0, nv, tid, store, lds, row_c, overflow);
  WriteSegmentPartials(m, s, q, tsum_z, red, part, r * nseg + v0 / kSegment + blockIdx.x);
}

}  // namespace

absl::Status LaunchTileStats(const float* logits, int64_t ldz, int64_t rows, int64_t v0, int64_t nv,
                             const LogitTransform& tf, const int32_t* targets, int32_t ignore_index,
                             int64_t vocab_begin, float* part, int64_t nseg, float* packed, void* store,
                             int64_t lds, StoreMode mode, float* row_c, unsigned* overflow, cudaStream_t stream) {
  if (rows <= 0 || nv <= 0) return absl::OkStatus();
  if (ldz % 4 != 0 || ldz < nv || v0 % kSegment != 0 || rows > 65535 ||
      (store != nullptr && (lds % 8 != 0 || lds < v0 + nv)) || (v0 + nv + kSegment - 1) / kSegment > nseg ||
      (store != nullptr && mode == StoreMode::kExpBf16 &&
       (row_c == nullptr || overflow == nullptr || (v0 == 0 && nv > kSegment)))) {
    return absl::InternalError(absl::StrCat("LaunchTileStats: bad shape rows=", rows, " v0=", v0, " nv=", nv,
                                            " ldz=", ldz, " lds=", lds, " nseg=", nseg));
  }
  const dim3 grid(static_cast<unsigned>((nv + kSegment - 1) / kSegment), static_cast<unsigned>(rows));
  const float inv_temp = 1.0f / tf.temperature;
  const int inv = static_cast<int>(nv);
  switch (mode) {
    case StoreMode::kShiftedFloat:
      TileStatsKernel<float, false><<<grid, kThreads, 0, stream>>>(logits, ldz, v0, inv, tf, inv_temp, targets,
                                                                   ignore_index, vocab_begin, part, nseg, packed,
                                                                   static_cast<float*>(store), lds, row_c, overflow);
      break;
    case StoreMode::kShiftedHalf:
      TileStatsKernel<__half, false><<<grid, kThreads, 0, stream>>>(logits, ldz, v0, inv, tf, inv_temp, targets,
                                                                    ignore_index, vocab_begin, part, nseg, packed,
                                                                    static_cast<__half*>(store), lds, row_c, overflow);
      break;
    case StoreMode::kExpBf16:
      TileStatsKernel<__nv_bfloat16, true>
          <<<grid, kThreads, 0, stream>>>(logits, ldz, v0, inv, tf, inv_temp, targets, ignore_index, vocab_begin, part,
                                          nseg, packed, static_cast<__nv_bfloat16*>(store), lds, row_c, overflow);
      break;
  }
  LCE_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace lce::cuda
