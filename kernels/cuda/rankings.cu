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

struct Cand {
  float z;
  float id;  // exact below 2^24; −inf: no candidate
};

__device__ __forceinline__ bool Before(Cand a, Cand b) { return a.z > b.z || (a.z == b.z && a.id < b.id); }

// The block's best of each thread's `mine` (all threads call it); the result in every thread.
__device__ Cand BlockBest(Cand mine, Cand* shared) {
  for (int off = 16; off > 0; off /= 2) {
    Cand o{__shfl_down_sync(0xffffffffu, mine.z, off), __shfl_down_sync(0xffffffffu, mine.id, off)};
    if (Before(o, mine)) mine = o;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[warp] = mine;
  __syncthreads();
  if (warp == 0) {
    mine = lane < kThreads / 32 ? shared[lane] : Cand{-INFINITY, -INFINITY};
    for (int off = 16; off > 0; off /= 2) {
      Cand o{__shfl_down_sync(0xffffffffu, mine.z, off), __shfl_down_sync(0xffffffffu, mine.id, off)};
      if (Before(o, mine)) mine = o;
    }
    if (lane == 0) shared[kThreads / 32] = mine;
  }
  __syncthreads();
  const Cand best = shared[kThreads / 32];
  __syncthreads();  // shared is reused by the next round
  return best;
}

// k rounds over n values of `z` (ids first_id + i, or ids[i]): out[j] = the j-th in ranking order.
__device__ void SelectTopK(const float* z, const float* ids, float first_id, int n, int k, Cand* out, Cand* shared) {
  Cand prev{INFINITY, -INFINITY};  // everything ranks after it
  for (int j = 0; j < k; ++j) {
    Cand mine{-INFINITY, -INFINITY};
    for (int i = threadIdx.x; i < n; i += kThreads) {
      const Cand c{z[i], ids != nullptr ? ids[i] : first_id + static_cast<float>(i)};
      if (c.id < 0.0f || !Before(prev, c)) continue;  // no candidate, or already picked
      if (Before(c, mine)) mine = c;
    }
    prev = BlockBest(mine, shared);
    if (threadIdx.x == 0) out[j] = prev;
  }
}

// One block a (row, segment of the tile): z of the segment into shared memory, then its top k.
__global__ void SegmentTopKKernel(const float* __restrict__ logits, int64_t ldz, int64_t v0, int64_t nv,
                                  LogitTransform tf, int k, int64_t vocab_begin, Cand* __restrict__ cand, int64_t slots,
                                  int64_t slot0) {
  __shared__ float z[kSegment];
  __shared__ Cand shared[kThreads / 32 + 1];
  const int64_t r = blockIdx.y, seg = blockIdx.x;
  const int64_t c0 = seg * kSegment;
  const int n = static_cast<int>(nv - c0 < kSegment ? nv - c0 : kSegment);
  const float inv_t = 1.0f / tf.temperature;
  for (int i = threadIdx.x; i < n; i += kThreads) {
    float a = logits[r * ldz + c0 + i] + (tf.bias != nullptr ? tf.bias[v0 + c0 + i] : 0.0f);
    if (tf.softcap > 0.0f) a = tf.softcap * tanhf(a / tf.softcap);
    z[i] = a * inv_t;
  }
  __syncthreads();
  Cand* out = cand + (r * slots + slot0 + (v0 + c0) / kSegment) * k;
  SelectTopK(z, nullptr, static_cast<float>(vocab_begin + v0 + c0), n, k, out, shared);
}

__global__ void FillKernel(Cand* __restrict__ cand, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) cand[i] = Cand{-INFINITY, -INFINITY};
}

// One block a row: its slots' candidates merged; logprob = (z − m) − log S.
__global__ void MergeTopKKernel(const Cand* __restrict__ cand, int64_t slots, int k, const float* __restrict__ info,
                                int32_t* argmax, int32_t* top_tokens, float* top_logprobs) {
  extern __shared__ float buf[];  // z then ids of the row's slots · k candidates
  __shared__ Cand shared[kThreads / 32 + 1];
  __shared__ Cand picked[kMaxTopK];
  const int64_t r = blockIdx.x;
  const int n = static_cast<int>(slots * k);
  for (int i = threadIdx.x; i < n; i += kThreads) {
    const Cand c = cand[r * slots * k + i];
    buf[i] = c.z;
    buf[n + i] = c.id;
  }
  __syncthreads();
  SelectTopK(buf, buf + n, 0.0f, n, k, picked, shared);
  __syncthreads();
  const float m = info[r * kRowInfo + kInfoMax], log_s = info[r * kRowInfo + kInfoLogS];
  for (int j = threadIdx.x; j < k; j += kThreads) {
    const Cand c = picked[j];
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
  const dim3 grid(static_cast<unsigned>((nv + kSegment - 1) / kSegment), static_cast<unsigned>(rows));
  SegmentTopKKernel<<<grid, kThreads, 0, stream>>>(logits, ldz, v0, nv, tf, k, vocab_begin,
                                                   reinterpret_cast<Cand*>(cand), slots, slot0);
  LCE_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status LaunchMergeTopK(const float* cand, int64_t rows, int64_t slots, int k, const float* row_info,
                             int32_t* argmax, int32_t* top_tokens, float* top_logprobs, cudaStream_t stream) {
  if (k < 1 || k > kMaxTopK) return absl::InvalidArgumentError(absl::StrCat("LaunchMergeTopK: k ", k));
  if (rows == 0) return absl::OkStatus();
  const size_t smem = static_cast<size_t>(slots * k) * 2 * sizeof(float);
  if (smem > 200 * 1024) return absl::InvalidArgumentError(absl::StrCat("LaunchMergeTopK: ", slots, " slots of ", k));
  if (smem > 48 * 1024) {
    LCE_CUDA_CHECK(
        cudaFuncSetAttribute(MergeTopKKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  }
  MergeTopKKernel<<<static_cast<unsigned>(rows), kThreads, smem, stream>>>(
      reinterpret_cast<const Cand*>(cand), slots, k, row_info, argmax, top_tokens, top_logprobs);
  LCE_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace lce::cuda
