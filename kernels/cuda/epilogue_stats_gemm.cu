// The score path's GEMM with the softmax statistics in its epilogue (sm_90a, CUTLASS 4.2 templates).
//
// logits[r, c] = h[r, :] · W[c, :] through CUTLASS's TMA warp-specialized mainloop (the sm90 collective
// builder; A = h [rows, H], B = W [cols, H], both K-major, bf16, fp32 accumulate, persistent grid, no
// split-K or stream-K), then an epilogue of our own (RowStatsEpilogue, run by CUTLASS's adapter for
// epilogues without a pipeline of their own) that reads the fp32 accumulator tile in registers and writes, per
// row and per column tile of the CTA, the partials (m, S, Q, Σz) of z = transform(logit) and the
// target logit. For a training call it also writes the compact copy the backward reads, where the
// logit-tile path wrote fp32 logits and read them back: z − m_tile in fp16 (m_tile: the row's max over
// the CTA's column tile, the m of its partials) for the general backward, or exp(z − c_row) in bf16 for
// the fast loss path (c_row: the max of the row's first columns, from a first pass over them (1024 columns in
// whole tiles), + kExpLift; a tile whose max passes c_row by more than kExpHeadroom raises the overflow flag), staged
// through shared memory for whole-sector stores. A logit's bits depend only on its row and column
// (fixed tile shape, fixed K order), and each tile's partials only on its rows' logits: batch invariant.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <bitset>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "cuda/cuda_check.h"
#include "cuda/kernels.h"

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

namespace lce::cuda {
namespace {

using namespace cute;

constexpr float kLog2e = 1.4426950408889634f;  // exp(x) = 2^(x·log2 e): the epilogue's exponentials are exp2
constexpr int kMaxDevices = 64;  // AllowSharedMemory remembers devices below this; others set it every call

// What the epilogue needs besides the accumulators (host and device alike).
struct StatsParams {
  const int32_t* targets = nullptr;
  const float* bias = nullptr;  // indexed by shard column, or null
  const float* sum_weight = nullptr;  // indexed by shard column, or null: Σz becomes Σ_j w_j z_j
  float softcap = 0.0f;
  float inv_softcap = 0.0f;
  float inv_temp = 1.0f;
  int32_t ignore_index = -100;
  int64_t vocab_begin = 0;
  float* tile_part = nullptr;  // [rows, ntile, 4]
  float* packed = nullptr;     // [rows, kPacked]; slot 3 gets z_y
  int64_t ntile = 0;
  void* store = nullptr;  // [rows, lds]: z − m_tile (fp16) or exp(z − c_row) (bf16) for the backward; null: score
  int64_t lds = 0;
  const float* first = nullptr;  // exp mode: m of the row's first segment at first[4·r]; null: z − m_tile
  float* row_c = nullptr;        // exp mode: c_row written here
  unsigned* overflow = nullptr;  // exp mode: set to 1.0f when a tile's max passes c_row by kExpHeadroom
  bool entropy = true;           // Q (the entropy's Σ e·(z − m)); false: Q = 0, a multiply-add a logit saved
  bool timing_skip = false;      // timing aid only: the epilogue does nothing (the mainloop alone)
  // Rankings (the kernels instantiated with a Ranking; EpilogueStatsArgs says what each holds).
  float* rank_list = nullptr;
  unsigned* rank_count = nullptr;
  const float* rank_thr = nullptr;
  int64_t rank_cap = 0;
  float* dump = nullptr;
  int64_t ld_dump = 0;
  int32_t* tile_arg = nullptr;  // kArgmax: [rows, ntile]
};

// The wgmma accumulator fragment ((2, 2, V), MMA_M, MMA_N) viewed as (rows, columns) of this thread:
// ((2, MMA_M), (2, V, MMA_N)). Within a warp, the four lanes of a quad hold one row's columns.
template <class L>
CUTE_HOST_DEVICE constexpr auto RowColView(L l) {
  static_assert(decltype(rank<0>(l))::value == 3 && decltype(rank(l))::value == 3, "not an sm90 accumulator");
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)), make_layout(get<0, 0>(l), get<0, 2>(l), get<2>(l)));
}

__device__ __forceinline__ float QuadMax(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float QuadSum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
// 2^x, flushing results below 2^-126 to 0 (terms that small do not move a sum of terms >= 1).
__device__ __forceinline__ float Exp2Ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// What an epilogue kernel computes beside the statistics, each a kernel of its own so that the
// registers a ranking takes never weigh on calls without it. kCandidates: the rankings' candidates
// (and, with dump, the fallback's logits); kSample: the rankings' first pass instead, each lane's two
// best of a row and nothing else (SampleBest); kArgmax: each row's first column holding its tile max
// (TileArgmax), which is all a ranking of k = 1 needs.
enum class Ranking { kNone, kCandidates, kSample, kArgmax };

// Which of Reduce's variants a kernel holds: every one, chosen per call (kAny), or the plain logits' alone,
// with or without the entropy. The kernels of configurations 1, 2, 4 and 5 come in each (RunReduction): with every
// variant compiled in, ptxas spilled the executed one's transformed logits to local memory and read them
// back for the candidates (1,948 bytes a thread stored, against 200 with the plain one alone), and a top-20
// score took 4-6% longer (H200, bench/RESULTS.md 2026-11-28 session 9); the statistics alone spilled 44
// bytes a thread with every variant, none with the plain one alone. The plain scores' kernels (kPlainScore*, no
// ranking) also leave out the training copy: with its run-time test compiled in, every logit took a select of v or
// e and ptxas stored ~22 of them to local memory a tile (H200 SASS, bench/NOTES.md e23).
enum class Reduction { kAny, kPlainWithEntropy, kPlainLogprobOnly, kPlainScoreWithEntropy, kPlainScoreLogprobOnly };

// The logit transform a Reduce is compiled for: kPlain, none; kBias, a bias and no softcap; kCapped, a
// softcap (and a bias if set); kWeighted, as kCapped with Σz weighted by sum_weight (class weights with
// label smoothing and a softcap: z is not linear in h, so Σ_j w_j z_j comes from the tile itself). Each
// its own code: a run-time softcap test a logit (the one general path that kBias and kCapped replace)
// cost a score with a bias +9–11% (H200, 2026-11-27), its branches splitting the rows' chains.
constexpr int kPlain = 0, kBias = 1, kCapped = 2, kWeighted = 3;
// The call's transform: the epilogue's choice on the device and the launcher's choice of a kernel
// holding the plain reduction alone on the host, one rule for both. sum_weight comes only with a
// softcap (checked at launch).
CUTLASS_HOST_DEVICE int LogitTransform(const StatsParams& p) {
  return p.sum_weight != nullptr ? kWeighted : p.softcap > 0.0f ? kCapped : p.bias != nullptr ? kBias : kPlain;
}

// An epilogue with the interface of cutlass::epilogue::collective::DefaultEpilogue (wrapped by
// detail::Sm90TmaWarpSpecializedAdapter), which reduces the tile instead of storing it.
template <Ranking kRanking, Reduction kReduction = Reduction::kAny>
class RowStatsEpilogue {
  static constexpr bool kRank = kRanking == Ranking::kCandidates;
  static constexpr bool kSample = kRanking == Ranking::kSample;
  static constexpr bool kArgmax = kRanking == Ranking::kArgmax;
  static constexpr bool kScoreOnly =
      kReduction == Reduction::kPlainScoreWithEntropy || kReduction == Reduction::kPlainScoreLogprobOnly;

 public:
  using EpilogueSchedule = cutlass::gemm::EpilogueDefault;
  using DispatchPolicy = EpilogueSchedule;
  // The kernel asks for C and D types and strides; nothing is read from or written to C or D.
  using ElementC = float;
  using ElementD = float;
  using StrideC = cute::Stride<int64_t, cute::Int<1>, int64_t>;
  using StrideD = StrideC;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  using ThreadEpilogueOp = void;  // named by GemmUniversalAdapter, used by nothing here
  // The backward's copy goes out through shared memory, a slice per consumer warp: the accumulator gives
  // a row's four lanes 4-byte pieces 16 bytes apart, which stored directly fill half of each 32-byte
  // sector they touch; staged, a warp writes 8 rows × 64 columns as 16-byte pieces, 128 contiguous
  // bytes a row. A slice row has 4 words of padding so that the 32 lanes' writes hit 32 banks.
  static constexpr int kChunkCols = 64;
  static constexpr int kSliceWords = kChunkCols / 2 + 4;
  static constexpr int kProducerWarps = 4;  // warp group 0, the producer's: a consumer warp's slice is warp − 4
  static constexpr int kConsumerWarps = 8;  // two consumer warp groups
  struct SharedStorage {
    alignas(16) uint32_t slice[kConsumerWarps][8 * kSliceWords];
  };
  using TensorStorage = SharedStorage;
  using Arguments = StatsParams;
  using Params = StatsParams;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.tile_part != nullptr && args.packed != nullptr && args.targets != nullptr;
  }

  CUTLASS_HOST_DEVICE explicit RowStatsEpilogue(Params const& p, SharedStorage const& = SharedStorage()) : p_(p) {}

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem, BlockShapeMNK, BlockCoordMNKL blk_coord,
                                 cute::Tensor<FrgEngine, FrgLayout> const& acc, TiledMma tiled_mma, ResidueMNK,
                                 int thread_idx, char* smem) {
    static_assert(is_static<BlockShapeMNK>::value && is_static<FrgLayout>::value);
    constexpr int kBM = decltype(size<0>(BlockShapeMNK{}))::value;
    constexpr int kBN = decltype(size<1>(BlockShapeMNK{}))::value;
    const int M = static_cast<int>(get<0>(problem));
    const int N = static_cast<int>(get<1>(problem));
    const int n_tile = static_cast<int>(get<1>(blk_coord));
    const int m0 = static_cast<int>(get<0>(blk_coord)) * kBM;
    const int n0 = n_tile * kBN;
    // A cluster's padding tile has nothing of the problem in it; timing_skip times the mainloop alone.
    if (m0 >= M || n0 >= N || p_.timing_skip) return;
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor coords = thr_mma.partition_C(make_identity_tensor(make_shape(Int<kBM>{}, Int<kBN>{})));
    // Reduced in place: the kernel gives each tile a fragment of its own, dead after the epilogue, so the
    // transformed logits and the exponentials live in its registers.
    auto& frg = const_cast<cute::Tensor<FrgEngine, FrgLayout>&>(acc);
    Tensor a = make_tensor(frg.data(), RowColView(frg.layout()));
    Tensor c = make_tensor(coords.data(), RowColView(coords.layout()));
    if constexpr (kSample) return SampleBest(a, c, M, N, m0, n0);
    if constexpr (kRank) {
      if (p_.dump != nullptr) return Dump(a, c, M, N, m0, n0);
    }
    const int tf = LogitTransform(p_);
    uint32_t* slice = reinterpret_cast<SharedStorage*>(smem)->slice[threadIdx.x / 32 - kProducerWarps];
    if (n0 + kBN <= N) {
      ReduceAs<false, kBN>(tf, a, c, M, N, m0, n0, n_tile, slice);
    } else {
      ReduceAs<true, kBN>(tf, a, c, M, N, m0, n0, n_tile, slice);
    }
  }

 private:
  template <bool kRagged, int kBN, class TA, class TC>
  CUTLASS_DEVICE void ReduceAs(int tf, TA& a, TC const& c, int M, int N, int m0, int n0, int n_tile,
                               uint32_t* slice) const {
    // The plain kernels instantiate the plain Reduce alone (the switch below is not compiled into them).
    if constexpr (kReduction == Reduction::kPlainWithEntropy || kReduction == Reduction::kPlainScoreWithEntropy) {
      (void)tf;
      return Reduce<kRagged, kPlain, true, kBN>(a, c, M, N, m0, n0, n_tile, slice);
    } else if constexpr (kReduction == Reduction::kPlainLogprobOnly ||
                         kReduction == Reduction::kPlainScoreLogprobOnly) {
      (void)tf;
      return Reduce<kRagged, kPlain, false, kBN>(a, c, M, N, m0, n0, n_tile, slice);
    } else {
      switch (tf) {
        case kWeighted: return Reduce<kRagged, kWeighted, true, kBN>(a, c, M, N, m0, n0, n_tile, slice);
        case kCapped: return Reduce<kRagged, kCapped, true, kBN>(a, c, M, N, m0, n0, n_tile, slice);
        case kBias: return Reduce<kRagged, kBias, true, kBN>(a, c, M, N, m0, n0, n_tile, slice);
        default:
          if (p_.entropy) return Reduce<kRagged, kPlain, true, kBN>(a, c, M, N, m0, n0, n_tile, slice);
          return Reduce<kRagged, kPlain, false, kBN>(a, c, M, N, m0, n0, n_tile, slice);
      }
    }
  }
  // kRagged: the tile runs past the last column (masked to −inf, left out of Σz). kTf: the transform. kQ: Q computed
  // (else 0: the call returns no entropy). The reduction runs on v = softcap(logit + bias), z = v / T: with c = log2(e)
  // / T, m = max(v) / T, S = Σ 2^(v·c − max v·c) (one multiply-add a logit, the same with or without Q, so that S and
  // the logprob are the same bits either way), Q = Σ e·(z − m) = (Σ e·(v − max v)) / T, Σz = (Σ v) / T (also what makes
  // a row with an infinite logit non-finite). The epilogue does not overlap the products in the cooperative schedule,
  // and with two warps a scheduler its time is latency: the thread's rows therefore go through each phase together,
  // without a branch between them (their dependent chains interleave; a warp none of whose rows is in the batch skips
  // the tile), and the target's load is used only after the exponentials where the call keeps v (score), before them
  // where they overwrite it (the training copy). v lives in the accumulator fragment. Each row's sums keep their column
  // order: the same bits as row by row.
  template <bool kRagged, int kTf, bool kQ, int kBN, class TA, class TC>
  CUTLASS_DEVICE void Reduce(TA& a, TC const& c, int M, int N, int m0, int n0, int n_tile, uint32_t* slice) const {
    constexpr int kRows = decltype(size<0>(a))::value;
    constexpr int kCols = decltype(size<1>(a))::value;
    const float scale = kLog2e * p_.inv_temp;
    const bool lead = (threadIdx.x & 3) == 0;
    // The fast loss path's copy exp(z − c_row) is each e below times exp(m − c_row), a factor of the
    // row: v keeps e, so the copy costs a multiply a logit instead of a second exponential.
    const bool exp_copy = !kScoreOnly && p_.store != nullptr && p_.first != nullptr;
    int row[kRows];
    int32_t y[kRows];
    // Rankings: a column of row i is a candidate where v >= thr[i] (thr: −FLT_MAX in the first pass,
    // which takes every finite v; +inf past the batch), loaded beside the target. n[i] counts them in
    // the first loop; the candidates themselves are found again where they are written, so that no
    // mask lives on (the accumulators leave no registers to spare).
    float thr[kRows];
    unsigned n[kRows];
    bool any_live = false;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) {
      row[i] = m0 + static_cast<int>(get<0>(c(i, 0)));
      any_live |= row[i] < M;
      y[i] = row[i] < M ? __ldg(p_.targets + row[i]) : p_.ignore_index;
      if constexpr (kRank) {
        n[i] = 0;
        thr[i] = row[i] >= M ? INFINITY : p_.rank_thr != nullptr ? __ldg(p_.rank_thr + row[i]) : -FLT_MAX;
      }
    }
    if (!__any_sync(0xffffffffu, any_live)) return;  // the warp's rows all past the batch (a few-row tile)
    float mx[kRows], mx_odd[kRows], sum_v[kRows];
    const float* bias = kTf != kPlain && p_.bias != nullptr ? StageBias<kBN>(n0, N, slice) : nullptr;
    Transform<kRagged, kTf>(a, c, N, n0, bias, thr, n, mx, mx_odd, sum_v);
    if (bias != nullptr) __syncwarp();  // every lane's bias read before StoreCopy stages into the slice
    // The candidates' places, taken before the max's shuffles, and the candidates written before the
    // exponentials (which overwrite v for the training copy). Written after them, the emission's code
    // got interleaved with theirs and spilled (~18 KB a thread of spill loads). One atomic a row's quad
    // instead of a lane's measured slower (2%, the shuffles' registers).
    unsigned at[kRows];
    if constexpr (kRank) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kRows; ++i) at[i] = n[i] > 0 && row[i] < M ? atomicAdd(p_.rank_count + row[i], n[i]) : 0u;
    }
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) mx[i] = QuadMax(fmaxf(mx[i], mx_odd[i]));
    if constexpr (kArgmax) TileArgmax<kBN>(a, c, row, M, mx, n_tile, lead);
    if (exp_copy) TargetLogit<kBN>(a, c, row, y, M, n0, N);
    if constexpr (kRank) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kRows; ++i) EmitCandidates<kRagged>(a, c, i, row[i], M, N, n0, n[i], at[i]);
    }
    float s[kRows], q[kRows];
    Exponentials<kRagged, kQ>(a, mx, scale, exp_copy, s, q);
    if (!exp_copy) TargetLogit<kBN>(a, c, row, y, M, n0, N);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) {
      s[i] = QuadSum(s[i]);
      if constexpr (kQ) q[i] = QuadSum(q[i]);
      sum_v[i] = QuadSum(sum_v[i]);
    }
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) {
      if (exp_copy) {  // every lane of the warp: the copy is staged
        StoreCopy<kRagged, true, kCols>(a, c, i, row[i], M, n0, N, mx[i], n_tile == 0 && lead, slice);
      } else if (!kScoreOnly && p_.store != nullptr) {
        StoreCopy<kRagged, false, kCols>(a, c, i, row[i], M, n0, N, mx[i], false, slice);
      }
      if (row[i] < M && lead) {
        *reinterpret_cast<float4*>(p_.tile_part + (static_cast<int64_t>(row[i]) * p_.ntile + n_tile) * 4) =
            make_float4(mx[i] * p_.inv_temp, s[i], q[i] * p_.inv_temp, sum_v[i] * p_.inv_temp);
      }
    }
  }
  // The tile's bias, kBN values, into the warp's slice (two 16-byte loads a lane; 0 past N) instead of a
  // scattered 4-byte global load a logit. Alone it measured no faster (the bias's cost was the run-time
  // softcap test, see ReduceAs); kept as the cheaper of the two.
  template <int kBN>
  CUTLASS_DEVICE const float* StageBias(int n0, int N, uint32_t* slice) const {
    static_assert(kBN <= 8 * kSliceWords && kBN % 64 == 0);
    float* staged = reinterpret_cast<float*>(slice);
    __syncwarp();  // the slice's last readers (the previous tile's StoreCopy) are done
    CUTLASS_PRAGMA_UNROLL
    for (int k = (threadIdx.x & 31) * 4; k < kBN; k += 128) {
      const int col = n0 + k;
      float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (col + 3 < N) {
        v = __ldg(reinterpret_cast<const float4*>(p_.bias + col));  // the shard's bias is 16-byte aligned
      } else {
        float* e = &v.x;
        for (int t = 0; t < 4 && col + t < N; ++t) e[t] = __ldg(p_.bias + col + t);
      }
      *reinterpret_cast<float4*>(staged + k) = v;
    }
    __syncwarp();
    return staged;
  }
  // Reduce's first pass: v = softcap(logit + bias) in place (−inf past N), each row's Σv (kWeighted:
  // Σ w·v), its maxima over the even and the odd columns, and (rankings) its count of columns at or above thr.
  template <bool kRagged, int kTf, class TA, class TC, int kRows>
  CUTLASS_DEVICE void Transform(TA& a, TC const& c, int N, int n0, const float* bias, const float (&thr)[kRows],
                                unsigned (&n)[kRows], float (&mx)[kRows], float (&mx_odd)[kRows],
                                float (&sum_v)[kRows]) const {
    constexpr int kCols = decltype(size<1>(a))::value;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) mx[i] = mx_odd[i] = -INFINITY, sum_v[i] = 0.0f;
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kCols; ++j) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kRows; ++i) {
        const int local = static_cast<int>(get<1>(c(i, j)));
        const int col = n0 + local;
        const bool valid = !kRagged || col < N;
        float x = a(i, j);
        if constexpr (kTf == kBias) x += bias[local];  // 0 past N
        if constexpr (kTf >= kCapped) {
          if (bias != nullptr) x += bias[local];
          x = p_.softcap * tanhf(x * p_.inv_softcap);
        }
        if constexpr (kRank) n[i] += (valid && x >= thr[i]) ? 1u : 0u;
        if (valid) {
          if constexpr (kTf == kWeighted)
            sum_v[i] += x * __ldg(p_.sum_weight + col);
          else
            sum_v[i] += x;
        } else {
          x = -INFINITY;
        }
        a(i, j) = x;
        if (j % 2 == 0) mx[i] = fmaxf(mx[i], x); else mx_odd[i] = fmaxf(mx_odd[i], x);  // exact in any order
      }
    }
  }
  // Reduce's exponentials: each row's S and (kQ) Q over its columns; with exp_copy, v becomes e.
  template <bool kRagged, bool kQ, class TA, int kRows>
  CUTLASS_DEVICE void Exponentials(TA& a, const float (&mx)[kRows], float scale, bool exp_copy, float (&s)[kRows],
                                   float (&q)[kRows]) const {
    constexpr int kCols = decltype(size<1>(a))::value;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) s[i] = q[i] = 0.0f;
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kCols; ++j) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kRows; ++i) {
        const float e = Exp2Ftz(fmaf(a(i, j), scale, -mx[i] * scale));
        s[i] += e;
        if constexpr (kQ) {
          const float u = a(i, j) - mx[i];
          q[i] += (kRagged && e == 0.0f) ? 0.0f : e * u;  // a masked column: 0 · (−inf) must not be NaN
        }
        if (exp_copy) a(i, j) = e;
      }
    }
  }
  // Row i's n candidates (v still in a) as (v, id) pairs at its list's places [at, at + n); none where
  // they pass rank_cap (the count, past the cap, says the row overflowed). The id goes as int bits.
  template <bool kRagged, class TA, class TC>
  CUTLASS_DEVICE void EmitCandidates(TA const& a, TC const& c, int i, int row, int M, int N, int n0, unsigned n,
                                     unsigned at) const {
    if (n == 0 || row >= M || at + n > p_.rank_cap) return;
    const float thr = p_.rank_thr != nullptr ? __ldg(p_.rank_thr + row) : -FLT_MAX;
    float2* out = reinterpret_cast<float2*>(p_.rank_list) + static_cast<int64_t>(row) * p_.rank_cap + at;
    const int id0 = static_cast<int>(p_.vocab_begin) + n0;
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < decltype(size<1>(a))::value; ++j) {
      const int col = static_cast<int>(get<1>(c(i, j)));
      if ((!kRagged || n0 + col < N) && a(i, j) >= thr) *out++ = make_float2(a(i, j), __int_as_float(id0 + col));
    }
  }
  // Each row's first column in the tile whose v is the tile's max mx (v still in a) into
  // tile_arg[row · ntile + n_tile], kBN where none is (a row of NaN): the lowest column, so that ties go
  // to the lowest id as in every ranking. Three instructions a logit, no branch.
  template <int kBN, class TA, class TC, int kRows>
  CUTLASS_DEVICE void TileArgmax(TA const& a, TC const& c, const int (&row)[kRows], int M, const float (&mx)[kRows],
                                 int n_tile, bool lead) const {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) {
      int at = kBN;
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < decltype(size<1>(a))::value; ++j) {
        if (a(i, j) == mx[i]) at = min(at, static_cast<int>(get<1>(c(i, j))));
      }
      at = min(at, __shfl_xor_sync(0xffffffffu, at, 1));
      at = min(at, __shfl_xor_sync(0xffffffffu, at, 2));
      if (row[i] < M && lead) p_.tile_arg[static_cast<int64_t>(row[i]) * p_.ntile + n_tile] = at;
    }
  }
  // v = softcap(logit + bias) of one column, on the rankings' side paths (Reduce's Transform is the hot one).
  CUTLASS_DEVICE float TransformedLogit(float logit, int col) const {
    if (p_.bias != nullptr) logit += __ldg(p_.bias + col);
    return p_.softcap > 0.0f ? p_.softcap * tanhf(logit * p_.inv_softcap) : logit;
  }
  // The rankings' first pass: each lane's two best v of each of its rows over its columns of the tile into
  // the row's list, under the ids of two of those columns (distinct entries; only their values are
  // used). The row's k-th best entry is at most the sample's k-th best v, so every column of the shard's
  // k best reaches it; it is close to it (a lane holds more than two of the sample's k best seldom).
  // Written as every column of the sample, it cost the first pass 0.32 ms a 4096-row block at
  // 16384×4096×151936, 4% of a top-20 score (H200, 2026-11-27).
  template <class TA, class TC>
  CUTLASS_DEVICE void SampleBest(TA const& a, TC const& c, int M, int N, int m0, int n0) const {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < decltype(size<0>(a))::value; ++i) {
      const int row = m0 + static_cast<int>(get<0>(c(i, 0)));
      float b0 = -INFINITY, b1 = -INFINITY;
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < decltype(size<1>(a))::value; ++j) {
        const int col = n0 + static_cast<int>(get<1>(c(i, j)));
        if (col >= N) continue;
        const float x = TransformedLogit(a(i, j), col);
        b1 = fmaxf(b1, fminf(b0, x));
        b0 = fmaxf(b0, x);
      }
      const unsigned n = (b0 > -INFINITY ? 1u : 0u) + (b1 > -INFINITY ? 1u : 0u);
      if (row >= M || n == 0) continue;
      const unsigned at = atomicAdd(p_.rank_count + row, n);
      if (at + n > p_.rank_cap) continue;
      float2* out = reinterpret_cast<float2*>(p_.rank_list) + static_cast<int64_t>(row) * p_.rank_cap + at;
      const int id0 = static_cast<int>(p_.vocab_begin) + n0;
      out[0] = make_float2(b0, __int_as_float(id0 + static_cast<int>(get<1>(c(i, 0)))));
      if (n == 2) out[1] = make_float2(b1, __int_as_float(id0 + static_cast<int>(get<1>(c(i, 1)))));
    }
  }
  // The rankings' fallback for rows whose candidates overflowed: every v of the tile into dump.
  template <class TA, class TC>
  CUTLASS_DEVICE void Dump(TA const& a, TC const& c, int M, int N, int m0, int n0) const {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < decltype(size<0>(a))::value; ++i) {
      const int row = m0 + static_cast<int>(get<0>(c(i, 0)));
      if (row >= M) continue;
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < decltype(size<1>(a))::value; ++j) {
        const int col = n0 + static_cast<int>(get<1>(c(i, j)));
        if (col >= N) continue;
        p_.dump[static_cast<int64_t>(row) * p_.ld_dump + col] = TransformedLogit(a(i, j), col);
      }
    }
  }
  // z_y = v_y / T into packed[row·kPacked + 3], from the lane that holds the target's column (v in a).
  template <int kBN, int kRows, class TA, class TC>
  CUTLASS_DEVICE void TargetLogit(TA const& a, TC const& c, const int (&row)[kRows], const int32_t (&y)[kRows],
                                  int M, int n0, int N) const {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) {
      const int64_t local = static_cast<int64_t>(y[i]) - p_.vocab_begin - n0;
      if (row[i] < M && y[i] != p_.ignore_index && local >= 0 && local < kBN && n0 + local < N) {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < decltype(size<1>(a))::value; ++j) {
          if (static_cast<int64_t>(get<1>(c(i, j))) == local) {
            p_.packed[static_cast<int64_t>(row[i]) * kPacked + 3] = a(i, j) * p_.inv_temp;
          }
        }
      }
    }
  }
  // The backward's copy of this thread's columns of the row: z − m_tile = (v − max v) / T in fp16, or
  // (kExp, v holding e = exp(z − m_tile)) exp(z − c_row) = e · exp(m_tile − c_row) in bf16 for the fast
  // loss path. Called by every lane of the warp (rows past the batch included: they stage but do not
  // store). The accumulator's column pairs (j even, j + 1 the next column) run 8 columns apart within a
  // lane, so pairs [16k, 16k + 16) are columns [64k, 64k + 64).
  template <bool kRagged, bool kExp, int kCols, class TA, class TC>
  CUTLASS_DEVICE void StoreCopy(TA const& v, TC const& c, int i, int row, int M, int n0, int N, float mx,
                                bool write_c, uint32_t* slice) const {
    static_assert(kCols % 16 == 0);
    const bool live = row < M;
    float factor = 0.0f;
    if constexpr (kExp) {
      const float c_row = live ? p_.first[static_cast<int64_t>(row) * 4] + kExpLift : 0.0f;
      if (live && write_c) p_.row_c[row] = c_row;
      if (live && !(mx * p_.inv_temp - c_row <= kExpHeadroom) && (threadIdx.x & 3) == 0) {
        atomicExch(p_.overflow, 0x3f800000u);  // 1.0f: all-reducible (max) across ranks
      }
      factor = exp2f(fmaf(mx, p_.inv_temp * kLog2e, -c_row * kLog2e));  // exp(m − c_row)
    }
    const int lane = threadIdx.x & 31;
    // This lane stores slice rows lane/8 and lane/8 + 4; slice row s holds the row of lanes 4s..4s+3.
    int out[2];
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < 2; ++k) out[k] = __shfl_sync(0xffffffffu, row, (lane >> 3) * 4 + 16 * k);
    uint32_t* mine = slice + (lane >> 2) * kSliceWords;
    CUTLASS_PRAGMA_UNROLL
    for (int chunk = 0; chunk < kCols / 16; ++chunk) {
      CUTLASS_PRAGMA_UNROLL
      for (int j = chunk * 16; j < chunk * 16 + 16; j += 2) {
        const int col = static_cast<int>(get<1>(c(i, j))) - chunk * kChunkCols;
        uint32_t word;
        if constexpr (kExp) {
          const __nv_bfloat162 e = __floats2bfloat162_rn(v(i, j) * factor, v(i, j + 1) * factor);
          word = *reinterpret_cast<const uint32_t*>(&e);
        } else {
          const __half2 d = __floats2half2_rn((v(i, j) - mx) * p_.inv_temp, (v(i, j + 1) - mx) * p_.inv_temp);
          word = *reinterpret_cast<const uint32_t*>(&d);
        }
        mine[col / 2] = word;
      }
      __syncwarp();
      const int col = n0 + chunk * kChunkCols + (lane & 7) * 8;
      if (!kRagged || col < N) {  // lds is a multiple of 8 and >= N: a piece past N stays inside the row
        const uint32_t* src = slice + (lane >> 3) * kSliceWords + (lane & 7) * 4;
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < 2; ++k) {
          if (out[k] < M) {
            *reinterpret_cast<uint4*>(static_cast<uint16_t*>(p_.store) + static_cast<int64_t>(out[k]) * p_.lds + col) =
                *reinterpret_cast<const uint4*>(src + k * 4 * kSliceWords);
          }
        }
      }
      __syncwarp();
    }
  }
  Params p_;
};

// One kernel configuration: tile, cluster and schedule, everything else fixed.
template <class TileShape, class ClusterShape, class Schedule, Ranking kRanking = Ranking::kNone,
          Reduction kReduction = Reduction::kAny>
struct StatsGemm {
  using Epilogue =
      cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<RowStatsEpilogue<kRanking, kReduction>>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cutlass::bfloat16_t, cutlass::layout::RowMajor, 8,
      cutlass::bfloat16_t, cutlass::layout::ColumnMajor, 8, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename RowStatsEpilogue<kRanking, kReduction>::SharedStorage))>,
      Schedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static constexpr int kTileCols = decltype(size<1>(TileShape{}))::value;
};

// 0: ping-pong, 128×128 tiles (one consumer warp group's epilogue overlaps the other's products);
// 1: cooperative, 128×256 tiles, clusters of two along the vocabulary (h's tile multicast to both);
// 2: ping-pong, 64×256 tiles, likewise; 3: as 1 in clusters of two along the rows (W's tile multicast);
// 4: ping-pong, 128×192 tiles a consumer warp group in clusters of two along the rows (QuACK's tile and
// pairing: the epilogue of one warp group hides behind the other's products, bench/NOTES.md e19);
// 5: ping-pong, 64×192 tiles in clusters of two along the vocabulary (4's few-row partner).
// 1, 2 and 3 run the same m64n256k16 instructions over the same 64-column k-blocks and reduce the same
// 256-column tiles with the same lanes: one row's partials are the same bits through any of them; 4 and 5
// likewise with m64n192k16 over 192-column tiles.
template <Ranking kRanking = Ranking::kNone, Reduction kReduction = Reduction::kAny>
using Cooperative256With = StatsGemm<Shape<_128, _256, _64>, Shape<_1, _2, _1>,
                                     cutlass::gemm::KernelTmaWarpSpecializedCooperative, kRanking, kReduction>;
template <Ranking kRanking = Ranking::kNone, Reduction kReduction = Reduction::kAny>
using PingPong64x256With = StatsGemm<Shape<_64, _256, _64>, Shape<_1, _2, _1>,
                                     cutlass::gemm::KernelTmaWarpSpecializedPingpong, kRanking, kReduction>;
template <Ranking kRanking = Ranking::kNone, Reduction kReduction = Reduction::kAny>
using PingPong192With = StatsGemm<Shape<_128, _192, _64>, Shape<_2, _1, _1>,
                                  cutlass::gemm::KernelTmaWarpSpecializedPingpong, kRanking, kReduction>;
template <Ranking kRanking = Ranking::kNone, Reduction kReduction = Reduction::kAny>
using PingPong64x192With = StatsGemm<Shape<_64, _192, _64>, Shape<_1, _2, _1>,
                                     cutlass::gemm::KernelTmaWarpSpecializedPingpong, kRanking, kReduction>;
using PingPong128 = StatsGemm<Shape<_128, _128, _64>, Shape<_1, _2, _1>, cutlass::gemm::KernelTmaWarpSpecializedPingpong>;
using Cooperative256 = Cooperative256With<>;
using PingPong64x256 = PingPong64x256With<>;
using Cooperative256RowPairs =
    StatsGemm<Shape<_128, _256, _64>, Shape<_2, _1, _1>, cutlass::gemm::KernelTmaWarpSpecializedCooperative>;

// Lets Kernel use its shared memory (over the 48 KB default) on `device`, once per device.
template <class Kernel>
cudaError_t AllowSharedMemory(int device) {
  static std::mutex mu;
  static std::bitset<kMaxDevices> done;
  std::lock_guard<std::mutex> lock(mu);
  if (device >= 0 && device < kMaxDevices && done[device]) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(cutlass::device_kernel<Kernel>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(Kernel::SharedStorageSize));
  if (err == cudaSuccess && device >= 0 && device < kMaxDevices) done.set(device);
  return err;
}

// The persistent schedule's raster (EpilogueStatsArgs::raster; 0: automatic). CUTLASS's heuristic goes along N
// (a row tile's column tiles in turn) wherever the row tiles are at least as many as the column tiles; with
// neither operand in L2, each wave then reads a W tile (twice an h tile's bytes) for every tile it runs: a TP-4
// rank's score of 32768x8192 rows on a 65536-column shard took 1.6x its GEMM floor (bench/NOTES.md, e18). Along
// M a wave shares its W tiles and reads h tiles, half the bytes; along N only where W's columns fit in L2 and
// h's rows do not (the first passes over a row's first columns). Configuration 4 without the training copy goes
// along N in groups of eight row clusters (its swizzle, SwizzleFor): sixteen row tiles' h stays in L2 while
// they sweep every column tile, QuACK's order, with which a score reads a third less from DRAM and runs 2-6%
// faster than in CUTLASS's (bench/NOTES.md e19) — where those rows' h, 2048 × H × 2 bytes, fits in a third of
// L2 (16 MiB: H <= 4096). At H = 8192 (32 MiB) the two orders measured level (e21; e20's gap was spread).
// Writing the training copy, the same order took a 2816-row block's forward 4.4 -> 6.3 ms (e20): there, too,
// the rule above.
bool QuackOrder(const EpilogueStatsArgs& a) {
  constexpr int64_t kGroupRows = 2048, kL2Third = int64_t{16} << 20;
  return a.config == 4 && a.store == nullptr && kGroupRows * a.hidden_size * 2 <= kL2Third;
}
cutlass::gemm::kernel::detail::RasterOrderOptions RasterFor(const EpilogueStatsArgs& a) {
  using Raster = cutlass::gemm::kernel::detail::RasterOrderOptions;
  if (a.raster == 1) return Raster::AlongM;
  if (a.raster == 2 || (a.raster == 0 && QuackOrder(a))) return Raster::AlongN;
  constexpr int64_t kL2Resident = int64_t{32} << 20;
  const int64_t w_bytes = a.cols * a.hidden_size * 2, h_bytes = a.rows * a.hidden_size * 2;
  return w_bytes <= kL2Resident && h_bytes > w_bytes ? Raster::AlongN : Raster::AlongM;
}
int SwizzleFor(const EpilogueStatsArgs& a) {
  if (a.swizzle > 0) return a.swizzle;
  if (!QuackOrder(a)) return 1;
  return a.swizzle == -1 ? FittedEpilogueSwizzle(a.rows, a.cols) : 8;
}

template <class Config>
absl::Status Run(const EpilogueStatsArgs& a, const StatsParams& sp, cudaStream_t stream) {
  using Gemm = typename Config::Gemm;
  using Kernel = typename Config::Kernel;
  const int M = static_cast<int>(a.rows), N = static_cast<int>(a.cols), K = static_cast<int>(a.hidden_size);
  // Both operands K-major, packed: (row stride K, 1, batch stride).
  typename Kernel::StrideA stride_a{};
  typename Kernel::StrideB stride_b{};
  get<0>(stride_a) = K;
  get<2>(stride_a) = static_cast<int64_t>(M) * K;
  get<0>(stride_b) = K;
  get<2>(stride_b) = static_cast<int64_t>(N) * K;
  int device = 0;
  LCE_CUDA_CHECK(cudaGetDevice(&device));
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  LCE_CUDA_CHECK(cudaDeviceGetAttribute(&hw.sm_count, cudaDevAttrMultiProcessorCount, device));
  typename Kernel::TileSchedulerArguments sched;
  sched.max_swizzle_size = SwizzleFor(a);
  sched.raster_order = RasterFor(a);
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                {M, N, K, 1},
                                {static_cast<const cutlass::bfloat16_t*>(a.hidden), stride_a,
                                 static_cast<const cutlass::bfloat16_t*>(a.weight), stride_b},
                                sp,
                                hw,
                                sched};
  if (Gemm::can_implement(args) != cutlass::Status::kSuccess) {
    return absl::InternalError(absl::StrCat("epilogue-statistics GEMM cannot run rows=", M, " cols=", N, " hidden=", K));
  }
  if (Gemm::get_workspace_size(args) != 0) return absl::InternalError("epilogue-statistics GEMM wants a workspace");
  LCE_CUDA_CHECK(AllowSharedMemory<Kernel>(device));
  // Params straight from the arguments: GemmUniversalAdapter::initialize would also set the kernel's
  // shared-memory attribute again, a driver call on every launch (a few-row score's path is ~0.35 ms).
  typename Kernel::Params params = Kernel::to_underlying_arguments(args, nullptr);
  const cutlass::Status st = Gemm::run(params, stream);
  LCE_CUDA_CHECK(cudaGetLastError());
  if (st != cutlass::Status::kSuccess) return absl::InternalError("epilogue-statistics GEMM: launch failed");
  return absl::OkStatus();
}

// Configuration 1's, 2's, 4's or 5's kernel with kRanking for the call — the statistics alone (kNone), with the
// rankings' candidates (kCandidates; 3 gives 1's bits, 0 has other tiles and keeps the logit-tile path for
// rankings), with the tiles' argmax beside the statistics and the training copy (kArgmax, all a ranking of
// k = 1 needs) — in a kernel per Reduction: the one holding the plain logits' reduction alone, with or
// without the entropy, where the call has no bias, softcap or class weights (the same bits: the same
// Reduce) — and, for the statistics alone without a training copy, one without the copy's code —, else the one
// holding every variant.
template <template <Ranking, Reduction> class Config, Ranking kRanking>
absl::Status RunReduction(const EpilogueStatsArgs& a, const StatsParams& sp, cudaStream_t stream) {
  if (LogitTransform(sp) != kPlain) return Run<Config<kRanking, Reduction::kAny>>(a, sp, stream);
  if constexpr (kRanking == Ranking::kNone) {
    if (sp.store == nullptr) {
      return sp.entropy ? Run<Config<kRanking, Reduction::kPlainScoreWithEntropy>>(a, sp, stream)
                        : Run<Config<kRanking, Reduction::kPlainScoreLogprobOnly>>(a, sp, stream);
    }
  }
  return sp.entropy ? Run<Config<kRanking, Reduction::kPlainWithEntropy>>(a, sp, stream)
                    : Run<Config<kRanking, Reduction::kPlainLogprobOnly>>(a, sp, stream);
}
template <Ranking kRanking>
absl::Status RunFor(const EpilogueStatsArgs& a, const StatsParams& sp, cudaStream_t stream) {
  switch (a.config) {
    case 2: return RunReduction<PingPong64x256With, kRanking>(a, sp, stream);
    case 4: return RunReduction<PingPong192With, kRanking>(a, sp, stream);
    case 5: return RunReduction<PingPong64x192With, kRanking>(a, sp, stream);
    default: return RunReduction<Cooperative256With, kRanking>(a, sp, stream);  // 1, 3 (1's bits)
  }
}
// The rankings' first pass (the same products: a sample column's v is the main pass's bits).
absl::Status RunSampled(const EpilogueStatsArgs& a, const StatsParams& sp, cudaStream_t stream) {
  switch (a.config) {
    case 2: return Run<PingPong64x256With<Ranking::kSample>>(a, sp, stream);
    case 4: return Run<PingPong192With<Ranking::kSample>>(a, sp, stream);
    case 5: return Run<PingPong64x192With<Ranking::kSample>>(a, sp, stream);
    default: return Run<Cooperative256With<Ranking::kSample>>(a, sp, stream);
  }
}

// The configuration that runs a call: the fixed one, else (automatic) the large one's few-row partner of the
// same tile width for rows <= small_rows (so that a row gets the same bits in any batch), the large one above.
int ResolvedConfig(const EpilogueStatsArgs& a) {
  if (a.config >= 0) return a.config;
  if (a.rows > a.small_rows) return a.large_config;
  return a.large_config == 4 ? 5 : a.large_config == 0 ? 0 : 2;
}

}  // namespace

int EpilogueStatsTileCols(int config) {
  static_assert(Cooperative256::kTileCols == PingPong64x256::kTileCols &&
                Cooperative256::kTileCols == Cooperative256RowPairs::kTileCols &&
                PingPong192With<>::kTileCols == PingPong64x192With<>::kTileCols);
  if (config == 4 || config == 5) return PingPong192With<>::kTileCols;
  return config == 0 ? PingPong128::kTileCols : Cooperative256::kTileCols;
}

absl::Status LaunchEpilogueStatsGemm(const EpilogueStatsArgs& args, cudaStream_t stream) {
  if (args.rows <= 0 || args.cols <= 0) return absl::OkStatus();
  EpilogueStatsArgs a = args;
  a.config = ResolvedConfig(args);
  const int64_t tile_cols = EpilogueStatsTileCols(a.config);
  const auto misaligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 != 0; };
  if (a.rows > INT32_MAX || a.cols > INT32_MAX || a.hidden_size <= 0 || a.hidden_size % 8 != 0 || a.config < 0 ||
      a.config > 5 || misaligned(a.hidden) || misaligned(a.weight) || misaligned(a.tile_part) ||
      misaligned(a.tf.bias) || a.targets == nullptr ||
      (a.store != nullptr && (misaligned(a.store) || a.lds % 8 != 0 || a.lds < a.cols)) ||
      (a.first != nullptr && (a.store == nullptr || a.row_c == nullptr || a.overflow == nullptr)) ||
      (a.rank_list != nullptr && (a.rank_count == nullptr || a.rank_cap <= 0 || a.dump != nullptr)) ||
      (a.tile_arg != nullptr && (a.rank_list != nullptr || a.dump != nullptr)) ||
      (a.dump != nullptr && a.ld_dump < a.cols) || a.packed == nullptr ||
      a.ntile != (a.cols + tile_cols - 1) / tile_cols || a.tf.temperature <= 0.0f) {
    return absl::InternalError(absl::StrCat("LaunchEpilogueStatsGemm: bad shape rows=", a.rows, " cols=", a.cols,
                                            " hidden=", a.hidden_size, " ntile=", a.ntile, " config=", a.config));
  }
  if (a.tf.sum_weight != nullptr && !(a.tf.softcap > 0.0f)) {  // kWeighted applies the softcap unasked
    return absl::InternalError("LaunchEpilogueStatsGemm: weighted sums are for a softcap's calls only");
  }
  StatsParams sp;
  sp.targets = a.targets;
  sp.bias = a.tf.bias;
  sp.sum_weight = a.tf.sum_weight;
  sp.softcap = a.tf.softcap;
  sp.inv_softcap = a.tf.softcap > 0.0f ? 1.0f / a.tf.softcap : 0.0f;
  sp.inv_temp = 1.0f / a.tf.temperature;
  sp.ignore_index = a.ignore_index;
  sp.vocab_begin = a.vocab_begin;
  sp.tile_part = a.tile_part;
  sp.packed = a.packed;
  sp.ntile = a.ntile;
  sp.store = a.store;
  sp.lds = a.lds;
  sp.first = a.first;
  sp.row_c = a.row_c;
  sp.overflow = a.overflow;
  sp.entropy = a.entropy;
  sp.timing_skip = a.timing_skip;
  sp.rank_list = a.rank_list;
  sp.rank_count = a.rank_count;
  sp.rank_thr = a.rank_thr;
  sp.rank_cap = a.rank_cap;
  sp.dump = a.dump;
  sp.ld_dump = a.ld_dump;
  sp.tile_arg = a.tile_arg;
  if (a.rank_list != nullptr || a.dump != nullptr || a.tile_arg != nullptr) {
    if (a.config == 0) return absl::InternalError("LaunchEpilogueStatsGemm: no rankings with 128-column tiles");
    if (a.tile_arg != nullptr) {
      return RunFor<Ranking::kArgmax>(a, sp, stream);
    }
    if (a.rank_list != nullptr && a.rank_thr == nullptr) {
      return RunSampled(a, sp, stream);
    }
    return RunFor<Ranking::kCandidates>(a, sp, stream);
  }
  switch (a.config) {
    case 0: return Run<PingPong128>(a, sp, stream);
    case 3: return Run<Cooperative256RowPairs>(a, sp, stream);
    default: return RunFor<Ranking::kNone>(a, sp, stream);  // 1, 2, 4, 5
  }
}

}  // namespace lce::cuda
