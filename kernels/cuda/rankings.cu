// Per-row rankings (argmax, top-k), larger z first, equal z: lower id first (a total order), over the
// whole vocabulary (docs/MATH.md, "Rankings"). On the logit-tile path each segment of a tile keeps its
// k best; on the epilogue GEMM's path each row's candidates (the columns at or above a threshold set
// by a first pass over a sample of columns) keep theirs. Then a row's lists are merged into its k
// best. Selection: k rounds of a warp-wide max over what ranks after the previous pick.
#include <cuda_runtime.h>

#include <cfloat>
#include <climits>

#include "absl/strings/str_cat.h"
#include "cuda_check.h"
#include "kernels.h"
#include "lce/engine.h"

namespace lce::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = 4;     // warps a block of the lists' selections (a warp a row)
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

// A lane's kKeep best of its strided share of list[0, n) among the entries that rank after `after`
// (placeholders, id −inf, are never taken), best first, and whether its share has more. Eight loads in
// flight at a time: the lists are in global memory (the epilogue GEMM's candidates, the merge's slots),
// where one load after another would wait out the latency each time. raw: the epilogue GEMM's
// (v, id as int bits) pairs, read as z = v / T and a float id.
constexpr int kKeep = 4;
struct LaneBest {
  Cand c[kKeep];
  bool more = false;
};
__device__ __forceinline__ Cand AsCand(Cand c, bool raw, float inv_t) {
  return raw ? Cand{c.z * inv_t, static_cast<float>(__float_as_int(c.id))} : c;
}
__device__ __forceinline__ void Keep(LaneBest& l, Cand x, Cand after, int& qualifying) {
  if (!(x.id >= 0.0f) || !Before(after, x)) return;
  ++qualifying;
  if (!Before(x, l.c[kKeep - 1])) return;
  l.c[kKeep - 1] = x;
#pragma unroll
  for (int u = kKeep - 1; u > 0; --u) {
    if (Before(l.c[u], l.c[u - 1])) {
      const Cand t = l.c[u];
      l.c[u] = l.c[u - 1];
      l.c[u - 1] = t;
    }
  }
}
__device__ LaneBest LaneBestAfter(const Cand* list, int n, Cand after, bool raw, float inv_t) {
  constexpr int kBatch = 8;
  LaneBest l;
#pragma unroll
  for (int u = 0; u < kKeep; ++u) l.c[u] = Cand{-INFINITY, -INFINITY};
  int qualifying = 0;
  int i = threadIdx.x % 32;
  for (; i + 32 * (kBatch - 1) < n; i += 32 * kBatch) {
    Cand c[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) c[u] = list[i + 32 * u];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) Keep(l, AsCand(c[u], raw, inv_t), after, qualifying);
  }
  for (; i < n; i += 32) Keep(l, AsCand(list[i], raw, inv_t), after, qualifying);
  l.more = qualifying > kKeep;
  return l;
}

// One warp picks the k best of list[0, n) in order into out[0, k) (lane 0 writes): each lane keeps
// its share's kKeep best; a round takes the warp's best from the lanes' heads, the lane that held it
// moves on to its next, and looks at its share again (for what ranks after its last pick) only when
// its kept ones run out and its share has more: the list is read about once, never written.
__device__ void WarpTopK(const Cand* list, int n, int k, Cand* out, bool raw = false, float inv_t = 1.0f) {
  const Cand first{INFINITY, -INFINITY};  // ranks before every entry
  LaneBest mine = LaneBestAfter(list, n, first, raw, inv_t);
  for (int j = 0; j < k; ++j) {
    const Cand best = WarpBest(mine.c[0]);
    if (threadIdx.x % 32 == 0) out[j] = best;
    if (best.id < 0.0f) continue;                            // fewer than k candidates: the rest stay −inf
    if (mine.c[0].z == best.z && mine.c[0].id == best.id) {  // this lane held it
#pragma unroll
      for (int u = 0; u + 1 < kKeep; ++u) mine.c[u] = mine.c[u + 1];
      mine.c[kKeep - 1] = Cand{-INFINITY, -INFINITY};
      if (mine.c[0].id < 0.0f && mine.more) mine = LaneBestAfter(list, n, best, raw, inv_t);
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

// The smallest v with v · inv_t >= z (fp32 products round monotonically): the threshold on v that
// keeps every column whose z reaches z.
__device__ float SmallestVReaching(float z, float inv_t) {
  float t = z / inv_t;
  for (int step = 0; step < 64 && t * inv_t < z; ++step) t = nextafterf(t, INFINITY);
  for (int step = 0; step < 64 && nextafterf(t, -INFINITY) * inv_t >= z; ++step) t = nextafterf(t, -INFINITY);
  return t;
}

// One warp a row: the k-th best z of the row's sample (the first pass's columns) gives a threshold
// below the k-th best of the whole shard (k columns reach it); fewer than k in the sample: −inf.
__global__ void ThresholdKernel(Cand* __restrict__ list, const unsigned* __restrict__ count, int64_t cap, int64_t rows,
                                int k, float inv_t, float* __restrict__ thr) {
  __shared__ Cand picked[kWarps][kMaxTopK];
  const int warp = threadIdx.x / 32;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (r >= rows) return;
  const int n = static_cast<int>(count[r] < cap ? count[r] : cap);
  WarpTopK(list + r * cap, n, k, picked[warp], true, inv_t);
  __syncwarp();
  const Cand kth = picked[warp][k - 1];
  if (threadIdx.x % 32 == 0) thr[r] = kth.id < 0.0f ? -INFINITY : SmallestVReaching(kth.z, inv_t);
}

// One warp a row: its list's k best into this rank's slot; a row whose list overflowed is marked in
// `overflowed` (its slot stays −inf) for the fallback.
__global__ void SelectKernel(Cand* __restrict__ list, const unsigned* __restrict__ count, int64_t cap, int64_t rows,
                             int k, float inv_t, Cand* __restrict__ cand, int64_t slots, int64_t slot0,
                             unsigned char* __restrict__ overflowed) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (r >= rows) return;
  const bool over = count[r] > cap;
  if (threadIdx.x % 32 == 0) overflowed[r] = over ? 1 : 0;
  if (over) return;
  WarpTopK(list + r * cap, static_cast<int>(count[r]), k, cand + (r * slots + slot0) * k, true, inv_t);
}

// One warp a row: the k best of its `from` slots of k (src [rows, from, k]) into slot slot0 of cand.
__global__ void ReduceSlotsKernel(const Cand* __restrict__ src, int64_t from, int64_t rows, int k,
                                  Cand* __restrict__ cand, int64_t slots, int64_t slot0) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (r >= rows) return;
  WarpTopK(src + r * from * k, static_cast<int>(from * k), k, cand + (r * slots + slot0) * k);
}

// One warp a row: the best of its tiles' maxima (the lowest tile, hence id, of equal ones) into its slot.
__global__ void TileArgmaxKernel(const float* __restrict__ tile_part, const int32_t* __restrict__ tile_arg,
                                 int64_t ntile, int tile_cols, int64_t rows, int64_t vocab_begin,
                                 Cand* __restrict__ cand, int64_t slots, int64_t slot0) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (r >= rows) return;
  Cand best{-INFINITY, INFINITY};  // after any tile, even one whose max is −inf
  for (int64_t t = threadIdx.x % 32; t < ntile; t += 32) {
    const int32_t col = tile_arg[r * ntile + t];
    if (col < 0 || col >= tile_cols) continue;  // no column held the max (NaN)
    const Cand c{tile_part[(r * ntile + t) * 4], static_cast<float>(vocab_begin + t * tile_cols + col)};
    if (Before(c, best)) best = c;
  }
  best = WarpBest(best);
  if (threadIdx.x % 32 == 0 && best.id != INFINITY) cand[r * slots + slot0] = best;
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

absl::Status LaunchRankThreshold(float* list, const unsigned* count, int64_t cap, int64_t rows, int k,
                                 float temperature, float* thr, cudaStream_t stream) {
  if (k < 1 || k > kMaxTopK || cap < 1 || !(temperature > 0.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("LaunchRankThreshold: k ", k, ", cap ", cap));
  }
  if (rows == 0) return absl::OkStatus();
  ThresholdKernel<<<static_cast<unsigned>((rows + kWarps - 1) / kWarps), kWarps * 32, 0, stream>>>(
      reinterpret_cast<Cand*>(list), count, cap, rows, k, 1.0f / temperature, thr);
  LCE_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status LaunchRankSelect(float* list, const unsigned* count, int64_t cap, int64_t rows, int k, float temperature,
                              float* cand, int64_t slots, int64_t slot0, unsigned char* overflowed,
                              cudaStream_t stream) {
  if (k < 1 || k > kMaxTopK || cap < 1 || slot0 < 0 || slot0 >= slots || !(temperature > 0.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("LaunchRankSelect: k ", k, ", cap ", cap, ", slot ", slot0));
  }
  if (rows == 0) return absl::OkStatus();
  SelectKernel<<<static_cast<unsigned>((rows + kWarps - 1) / kWarps), kWarps * 32, 0, stream>>>(
      reinterpret_cast<Cand*>(list), count, cap, rows, k, 1.0f / temperature, reinterpret_cast<Cand*>(cand), slots,
      slot0, overflowed);
  LCE_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status LaunchReduceSlots(const float* src, int64_t from, int64_t rows, int k, float* cand, int64_t slots,
                               int64_t slot0, cudaStream_t stream) {
  if (k < 1 || k > kMaxTopK || from < 1 || from * k > INT_MAX || slot0 < 0 || slot0 >= slots) {
    return absl::InvalidArgumentError(absl::StrCat("LaunchReduceSlots: k ", k, ", from ", from, ", slot ", slot0));
  }
  if (rows == 0) return absl::OkStatus();
  ReduceSlotsKernel<<<static_cast<unsigned>((rows + kWarps - 1) / kWarps), kWarps * 32, 0, stream>>>(
      reinterpret_cast<const Cand*>(src), from, rows, k, reinterpret_cast<Cand*>(cand), slots, slot0);
  LCE_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status LaunchTileArgmax(const float* tile_part, const int32_t* tile_arg, int64_t ntile, int tile_cols,
                              int64_t rows, int64_t vocab_begin, float* cand, int64_t slots, int64_t slot0,
                              cudaStream_t stream) {
  if (ntile < 1 || tile_cols < 1 || slot0 < 0 || slot0 >= slots || rows < 0) {
    return absl::InvalidArgumentError(absl::StrCat("LaunchTileArgmax: ntile ", ntile, ", slot ", slot0));
  }
  if (rows == 0) return absl::OkStatus();
  TileArgmaxKernel<<<static_cast<unsigned>((rows + kWarps - 1) / kWarps), kWarps * 32, 0, stream>>>(
      tile_part, tile_arg, ntile, tile_cols, rows, vocab_begin, reinterpret_cast<Cand*>(cand), slots, slot0);
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
