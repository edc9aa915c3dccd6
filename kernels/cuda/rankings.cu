// Per-row rankings (argmax, top-k): each segment of a logit tile keeps its k best z (larger first, equal
// z: lower id first, a total order), and a row's segment lists are merged into its k best over the
// whole vocabulary (docs/MATH.md, "Rankings"). Selection, k rounds of a block-wide max over what ranks
// after the previous pick: k <= 64 and a segment of 2048 columns keep it cheap beside the GEMM.
#include <cuda_runtime.h>

#include <cfloat>

#include "absl/strings/str_cat.h"
#include "cuda_check.h"
#include "kernels.h"
#include "lce/engine.h"

namespace lce::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = 4;     // warps a block of the merge kernel
constexpr int kSegWarps = 2;  // ...of the segment kernel: a warp's list of kSegment candidates in shared memory

struct Cand {
  float z;
  float id;  // exact below 2^24; −inf: no candidate
};

__device__ __forceinline__ bool Before(Cand a, Cand b) { return a.z > b.z || (a.z == b.z && a.id < b.id); }

__device__ __forceinline__ Cand WarpBest(Cand c) {
  for (int off = 16; off > 0; off /= 2) {
    const Cand o{__shfl_xor_sync(0xffffffffu, c.z, off), __shfl_xor_sync(0xffffffffu, c.id, off)};
    if (Before(o, c)) c = o;
  }
  return c;
}

// A lane's best of its strided share of list[0, n) (taken entries hold id −inf).
__device__ __forceinline__ Cand LaneBest(const Cand* list, int n, int lane) {
  Cand best{-INFINITY, -INFINITY};
  for (int i = lane; i < n; i += 32) {
    const Cand c = list[i];
    if (c.id >= 0.0f && Before(c, best)) best = c;
  }
  return best;
}

// One warp picks the k best of list[0, n) in order into out[0, k) (lane 0 writes): each lane keeps its
// share's best; a round takes the warp's best and only its lane looks again. `list` is the warp's own
// (its picks are marked taken in place).
__device__ void WarpTopK(Cand* list, int n, int k, Cand* out) {
  const int lane = threadIdx.x % 32;
  Cand mine = LaneBest(list, n, lane);
  for (int j = 0; j < k; ++j) {
    const Cand best = WarpBest(mine);
    if (lane == 0) out[j] = best;
    if (best.id < 0.0f) continue;                  // fewer than k candidates: the rest stay −inf
    if (mine.z == best.z && mine.id == best.id) {  // this lane held it
      for (int i = lane; i < n; i += 32) {
        if (list[i].id == best.id) list[i].id = -INFINITY;
      }
      mine = LaneBest(list, n, lane);
    }
    __syncwarp();
  }
}

// One warp a (row, segment of the tile): the segment's z into the warp's shared list, then its top k.
__global__ void SegmentTopKKernel(const float* __restrict__ logits, int64_t ldz, int64_t rows, int64_t v0, int64_t nv,
                                  LogitTransform tf, int k, int64_t vocab_begin, Cand* __restrict__ cand, int64_t slots,
                                  int64_t slot0) {
  __shared__ Cand lists[kSegWarps][kSegment];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t nseg = (nv + kSegment - 1) / kSegment;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kSegWarps + warp;  // (row, segment)
  if (item >= rows * nseg) return;
  const int64_t r = item / nseg, seg = item % nseg, c0 = seg * kSegment;
  const int n = static_cast<int>(nv - c0 < kSegment ? nv - c0 : kSegment);
  const float inv_t = 1.0f / tf.temperature;
  const float first_id = static_cast<float>(vocab_begin + v0 + c0);
  Cand* list = lists[warp];
  for (int i = lane; i < n; i += 32) {
    float a = logits[r * ldz + c0 + i] + (tf.bias != nullptr ? tf.bias[v0 + c0 + i] : 0.0f);
    if (tf.softcap > 0.0f) a = tf.softcap * tanhf(a / tf.softcap);
    list[i] = Cand{a * inv_t, first_id + static_cast<float>(i)};
  }
  __syncwarp();
  WarpTopK(list, n, k, cand + (r * slots + slot0 + (v0 + c0) / kSegment) * k);
}

__global__ void FillKernel(Cand* __restrict__ cand, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) cand[i] = Cand{-INFINITY, -INFINITY};
}

// One warp a row: its slots' candidates (in place in `cand`, which it marks) merged; logprob =
// (z − m) − log S.
__global__ void MergeTopKKernel(Cand* __restrict__ cand, int64_t rows, int64_t slots, int k,
                                const float* __restrict__ info, int32_t* argmax, int32_t* top_tokens,
                                float* top_logprobs) {
  __shared__ Cand picked[kWarps][kMaxTopK];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (r >= rows) return;
  WarpTopK(cand + r * slots * k, static_cast<int>(slots * k), k, picked[warp]);
  __syncwarp();
  const float m = info[r * kRowInfo + kInfoMax], log_s = info[r * kRowInfo + kInfoLogS];
  for (int j = lane; j < k; j += 32) {
    const Cand c = picked[warp][j];
    if (top_tokens != nullptr) top_tokens[r * k + j] = static_cast<int32_t>(c.id);
    if (top_logprobs != nullptr) top_logprobs[r * k + j] = (c.z - m) - log_s;
    if (j == 0 && argmax != nullptr) argmax[r] = static_cast<int32_t>(c.id);
  }
}

}  // namespace

int64_t RankingSlots(int64_t vocab_size, int world) {
  const int64_t per_rank = (vocab_size + int64_t{world} * kSegment - 1) / (int64_t{world} * kSegment) + 2;
  return per_rank * world;
}

absl::Status LaunchFillRankings(float* cand, int64_t rows, int64_t slots, int k, cudaStream_t stream) {
  const int64_t n = rows * slots * k;
  if (n == 0) return absl::OkStatus();
  FillKernel<<<static_cast<unsigned>((n + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      reinterpret_cast<Cand*>(cand), n);
  LCE_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status LaunchSegmentTopK(const float* logits, int64_t ldz, int64_t rows, int64_t v0, int64_t nv,
                               const LogitTransform& tf, int k, int64_t vocab_begin, float* cand, int64_t slots,
                               int64_t slot0, cudaStream_t stream) {
  if (k < 1 || k > kMaxTopK || v0 % kSegment != 0 || rows < 0 || nv < 0) {
    return absl::InvalidArgumentError(absl::StrCat("LaunchSegmentTopK: k ", k, ", v0 ", v0, ", rows ", rows));
  }
  if (rows == 0 || nv == 0) return absl::OkStatus();
  const int64_t items = rows * ((nv + kSegment - 1) / kSegment);
  SegmentTopKKernel<<<static_cast<unsigned>((items + kSegWarps - 1) / kSegWarps), kSegWarps * 32, 0, stream>>>(
      logits, ldz, rows, v0, nv, tf, k, vocab_begin, reinterpret_cast<Cand*>(cand), slots, slot0);
  LCE_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status LaunchMergeTopK(float* cand, int64_t rows, int64_t slots, int k, const float* row_info, int32_t* argmax,
                             int32_t* top_tokens, float* top_logprobs, cudaStream_t stream) {
  if (k < 1 || k > kMaxTopK) return absl::InvalidArgumentError(absl::StrCat("LaunchMergeTopK: k ", k));
  if (rows == 0) return absl::OkStatus();
  MergeTopKKernel<<<static_cast<unsigned>((rows + kWarps - 1) / kWarps), kWarps * 32, 0, stream>>>(
      reinterpret_cast<Cand*>(cand), rows, slots, k, row_info, argmax, top_tokens, top_logprobs);
  LCE_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace lce::cuda
