// Per-row kernels between the forward tiles and the backward: merge the segment partials, rescale
// them for the cross-rank sum (tensor parallel), and turn them into outputs and backward coefficients.
#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "cuda/cuda_check.h"
#include "cuda/dtype_dispatch.cuh"
#include "cuda/kernels.h"

namespace lce::cuda {
namespace {

constexpr int kThreads = 128;

// A partial (m_p, S_p, Q_p, ·) rescaled to the max m and added to S and Q: the fold's and the merge's one step.
__device__ __forceinline__ void AddRescaled(const float4& v, float m, float& S, float& Q) {
  const float d = v.x - m;
  const float scale = expf(d);
  S += v.y * scale;
  Q += (v.z + d * v.y) * scale;
}

// A row's segments, a warp a row: lane l folds segments l, l + 32, ... in order, then the lanes' folds combine
// over a fixed butterfly. The order depends on nseg alone (the same bits in any batch, and for any TP group: a
// group merges the same global segments). A thread a row gave 4096-row calls 32 blocks on 132 SMs, with
// neighbouring threads' loads nseg · 16 B apart (38 us at 4096 rows x 131 segments, H200, ncu).
// (WarpSum's xor butterfly leaves every lane the same bits: a + b == b + a at each step.)
__global__ void MergeSegmentsKernel(const float4* __restrict__ part, int64_t nseg, int64_t rows,
                                    float* __restrict__ m_local, float* __restrict__ m_out,
                                    float* __restrict__ packed) {
  const int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (r >= rows) return;  // the whole warp: r is the warp's
  const float4* p = part + r * nseg;
  float m = -INFINITY;
  for (int64_t t = lane; t < nseg; t += 32) m = fmaxf(m, p[t].x);
  m = WarpMax(m);
  float S = 0.0f, Q = 0.0f, sum_z = 0.0f;
  for (int64_t t = lane; t < nseg; t += 32) {
    const float4 v = p[t];
    AddRescaled(v, m, S, Q);
    sum_z += v.w;
  }
  S = WarpSum(S);
  Q = WarpSum(Q);
  sum_z = WarpSum(sum_z);
  if (lane != 0) return;
  m_local[r] = m;
  m_out[r] = m;
  packed[r * kPacked + 0] = S;
  packed[r * kPacked + 1] = Q;
  packed[r * kPacked + 2] = sum_z;
}

// Folds a segment's n <= kPer tile partials (m, S, Q, Σz) in order into one: the max, then S and Q rescaled to it.
// Each tile's partials are loaded once into registers, all loads in flight before the first use (a loop over a
// run-time count read each twice, one at a time: 159 us at 16384 rows x 99 segments of 8 tiles, H200, ncu).
template <int kPer>
__device__ float4 FoldTiles(const float4* __restrict__ p, int n) {
  float4 v[kPer];
#pragma unroll
  for (int t = 0; t < kPer; ++t) v[t] = t < n ? p[t] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  float m = -INFINITY, sum_z = 0.0f;
#pragma unroll
  for (int t = 0; t < kPer; ++t) {
    if (t < n) {
      m = fmaxf(m, v[t].x);
      sum_z += v[t].w;
    }
  }
  float S = 0.0f, Q = 0.0f;
#pragma unroll
  for (int t = 0; t < kPer; ++t) {
    if (t < n) AddRescaled(v[t], m, S, Q);
  }
  return make_float4(m, S, Q, sum_z);
}

// One thread per (row, segment): the segment's kPer tiles (fewer in a ragged last segment) folded in order.
template <int kPer>
__global__ void FoldTilePartialsKernel(const float4* __restrict__ tile_part, int64_t ntile, int64_t rows,
                                       float4* __restrict__ part, int64_t nseg) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * nseg) return;
  const int64_t r = i / nseg, s = i % nseg;
  const int n = static_cast<int>(ntile - s * kPer < kPer ? ntile - s * kPer : kPer);
  part[i] = FoldTiles<kPer>(tile_part + r * ntile + s * kPer, n);
}

__global__ void RescaleKernel(const float* __restrict__ m_local, const float* __restrict__ m, int64_t rows,
                              float* __restrict__ packed) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  float* pk = packed + r * kPacked;
  const float S = pk[0];
  if (S > 0.0f) {
    const float d = m_local[r] - m[r];
    const float scale = expf(d);
    pk[1] = (pk[1] + d * S) * scale;
    pk[0] = S * scale;
  } else {
    pk[0] = 0.0f;
    pk[1] = 0.0f;
  }
}

__global__ void FinalizeKernel(FinalizeArgs a, const float* __restrict__ m, const float* __restrict__ packed,
                               float* __restrict__ info, unsigned long long* bad_row) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= a.rows) return;
  const float* pk = packed + r * kPacked;
  const float S = pk[0], Q = pk[1], sum_z = pk[2], zy = pk[3];
  const float mm = m[r];
  const float log_s = logf(S);
  const float lse = mm + log_s;
  if (!isfinite(lse) || !isfinite(sum_z) || !isfinite(Q)) atomicMin(bad_row, static_cast<unsigned long long>(r));
  const float mean_pz = Q / S;  // Σ p (z − m)
  const int32_t y = a.targets[r];
  const bool ignored = y == a.ignore_index;
  const float logprob = ignored ? 0.0f : zy - lse;
  const float eps = a.label_smoothing;
  if (a.lse != nullptr) a.lse[r] = lse;
  if (a.logprob != nullptr) a.logprob[r] = logprob;
  if (a.entropy != nullptr) a.entropy[r] = log_s - mean_pz;
  const float w_y = (a.class_weight != nullptr && !ignored) ? a.class_weight[y] : 1.0f;
  const float z_loss = ignored ? 0.0f : a.z_loss * lse * lse;
  if (a.z_loss_out != nullptr) a.z_loss_out[r] = z_loss;
  // With class weights and smoothing, sum_z is Σ_j w_j z_j and the smoothing term (ε/V)·Σ_j w_j·(lse − z_j).
  const bool weighted_smoothing = a.class_weight_sum != nullptr && eps > 0.0f;
  const float w_sum = weighted_smoothing ? *a.class_weight_sum : 0.0f;
  const float inv_v = 1.0f / static_cast<float>(a.vocab_size);
  if (a.loss != nullptr) {
    const float smooth = weighted_smoothing ? eps * inv_v * (w_sum * lse - sum_z)
                                            : eps * (lse - sum_z / static_cast<float>(a.vocab_size));
    a.loss[r] = ignored ? 0.0f : -(1.0f - eps) * w_y * logprob + smooth + z_loss;
  }
  float A = 0.0f, B = 0.0f, C = 0.0f, D = 0.0f;
  if (a.grad == GradKind::kLoss) {
    if (!ignored) {
      const float g = a.grad_loss != nullptr ? a.grad_loss[r] : 1.0f;
      // (1−ε)·w_y + ε·W/V with W = Σ_j w_j (V without class weights); D·w_j in LaunchWriteGrad.
      A = weighted_smoothing          ? g * ((1.0f - eps) * w_y + eps * w_sum * inv_v + 2.0f * a.z_loss * lse)
          : a.class_weight != nullptr ? g * (w_y + 2.0f * a.z_loss * lse)
                                      : g * (1.0f + 2.0f * a.z_loss * lse);
      C = g * (1.0f - eps) * w_y;
      D = g * eps / static_cast<float>(a.vocab_size);
    }
  } else if (a.grad == GradKind::kGeneric) {
    const float u = (ignored || a.grad_logprob == nullptr) ? 0.0f : a.grad_logprob[r];
    const float e = a.grad_entropy != nullptr ? a.grad_entropy[r] : 0.0f;
    A = -u + e * mean_pz;
    B = -e;
    C = -u;
  }
  float* in = info + r * kRowInfo;
  in[kInfoMax] = mm;
  in[kInfoLogS] = log_s;
  in[kInfoA] = A;
  in[kInfoB] = B;
  in[kInfoC] = C;
  in[kInfoD] = D;
  if (a.row_c != nullptr) {
    const float inv_t = 1.0f / a.temperature;
    in[kInfoScale] = A == 0.0f ? 0.0f : A * expf((a.row_c[r] - mm) - log_s) * inv_t;
    in[kInfoTarget] = C * inv_t;
  } else if (a.target_apart) {
    // z_y · T / softcap = tanh of the target's capped logit (WriteGrad's t at the target's column).
    const float t = a.softcap > 0.0f ? zy * a.temperature / a.softcap : 0.0f;
    in[kInfoScale] = 1.0f;
    in[kInfoTarget] = C / a.temperature * (1.0f - t * t);
  }
}

__global__ void SpreadPartialsKernel(const float* __restrict__ part, int64_t nseg, int64_t seg_begin,
                                     const float* __restrict__ packed, const int32_t* __restrict__ targets,
                                     int32_t ignore_index, int64_t vocab_begin, int64_t vocab_end, int64_t rows,
                                     float* __restrict__ part_global, int64_t nseg_global, float* __restrict__ zy) {
  const int64_t r = blockIdx.y;
  const int64_t s = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  if (s < nseg_global) {
    float* g = part_global + (r * nseg_global + s) * 4;
    const int64_t local = s - seg_begin;
    if (local >= 0 && local < nseg) {
      const float* p = part + (r * nseg + local) * 4;
      g[0] = isnan(p[0]) ? INFINITY : p[0];
      g[1] = p[1];
      g[2] = p[2];
      g[3] = p[3];
    } else {
      g[0] = g[1] = g[2] = g[3] = -INFINITY;
    }
  }
  if (s == 0) {
    const int32_t y = targets[r];
    zy[r] = y != ignore_index && y >= vocab_begin && y < vocab_end ? packed[r * kPacked + 3] : -INFINITY;
  }
}

__global__ void TakeTargetsKernel(const float* __restrict__ zy, int64_t rows, float* __restrict__ packed) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r < rows) packed[r * kPacked + 3] = zy[r] == -INFINITY ? 0.0f : zy[r];
}

unsigned Blocks(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

}  // namespace

absl::Status LaunchMergeSegments(const float* part, int64_t nseg, int64_t rows, float* m_local, float* m, float* packed,
                                 cudaStream_t stream) {
  if (rows <= 0) return absl::OkStatus();
  if (nseg <= 0 || reinterpret_cast<uintptr_t>(part) % 16 != 0) {
    return absl::InternalError(absl::StrCat("LaunchMergeSegments: nseg=", nseg, " or part not 16-byte aligned"));
  }
  MergeSegmentsKernel<<<Blocks(rows * 32), kThreads, 0, stream>>>(reinterpret_cast<const float4*>(part), nseg, rows,
                                                                  m_local, m, packed);
  LCE_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status LaunchFoldTilePartials(const float* tile_part, int64_t ntile, int tile_cols, int64_t rows, float* part,
                                    int64_t nseg, cudaStream_t stream) {
  if (rows <= 0) return absl::OkStatus();
  if (tile_cols <= 0 || kSegment % tile_cols != 0 || nseg <= 0 || ntile <= (nseg - 1) * (kSegment / tile_cols) ||
      ntile > nseg * (kSegment / tile_cols) || reinterpret_cast<uintptr_t>(tile_part) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(part) % 16 != 0) {
    return absl::InternalError(
        absl::StrCat("LaunchFoldTilePartials: ntile=", ntile, " tile_cols=", tile_cols, " nseg=", nseg));
  }
  const auto* in = reinterpret_cast<const float4*>(tile_part);
  auto* out = reinterpret_cast<float4*>(part);
  const unsigned blocks = Blocks(rows * nseg);
  switch (kSegment / tile_cols) {  // the epilogue's tiles of 256, 192 and 128 columns
    case 6: FoldTilePartialsKernel<6><<<blocks, kThreads, 0, stream>>>(in, ntile, rows, out, nseg); break;
    case 8: FoldTilePartialsKernel<8><<<blocks, kThreads, 0, stream>>>(in, ntile, rows, out, nseg); break;
    case 12: FoldTilePartialsKernel<12><<<blocks, kThreads, 0, stream>>>(in, ntile, rows, out, nseg); break;
    default:
      return absl::InternalError(absl::StrCat("LaunchFoldTilePartials: no fold for ", tile_cols, "-column tiles"));
  }
  LCE_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status LaunchSpreadPartials(const float* part, int64_t nseg, int64_t seg_begin, const float* packed,
                                  const int32_t* targets, int32_t ignore_index, int64_t vocab_begin, int64_t vocab_end,
                                  int64_t rows, float* part_global, int64_t nseg_global, float* zy,
                                  cudaStream_t stream) {
  if (rows <= 0) return absl::OkStatus();
  if (rows > 65535 || seg_begin < 0 || seg_begin + nseg > nseg_global) {
    return absl::InternalError(absl::StrCat("LaunchSpreadPartials: rows=", rows, " segments [", seg_begin, ", ",
                                            seg_begin + nseg, ") of ", nseg_global));
  }
  const dim3 grid(Blocks(nseg_global), static_cast<unsigned>(rows));
  SpreadPartialsKernel<<<grid, kThreads, 0, stream>>>(part, nseg, seg_begin, packed, targets, ignore_index, vocab_begin,
                                                      vocab_end, rows, part_global, nseg_global, zy);
  LCE_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status LaunchTakeGatheredTargets(const float* zy, int64_t rows, float* packed, cudaStream_t stream) {
  if (rows <= 0) return absl::OkStatus();
  TakeTargetsKernel<<<Blocks(rows), kThreads, 0, stream>>>(zy, rows, packed);
  LCE_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status LaunchRescalePartials(const float* m_local, const float* m, int64_t rows, float* packed,
                                   cudaStream_t stream) {
  if (rows <= 0) return absl::OkStatus();
  RescaleKernel<<<Blocks(rows), kThreads, 0, stream>>>(m_local, m, rows, packed);
  LCE_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status LaunchFinalizeRows(const FinalizeArgs& args, const float* m, const float* packed, float* row_info,
                                unsigned long long* bad_row, cudaStream_t stream) {
  if (args.rows <= 0) return absl::OkStatus();
  if (args.vocab_size <= 0 || args.targets == nullptr) {
    return absl::InternalError("LaunchFinalizeRows: bad arguments");
  }
  FinalizeKernel<<<Blocks(args.rows), kThreads, 0, stream>>>(args, m, packed, row_info, bad_row);
  LCE_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace lce::cuda
