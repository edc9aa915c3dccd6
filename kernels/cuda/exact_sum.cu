// d_hidden's leaves summed in the fixed point of exact_fixed.h (issue 36: TP-size invariance by default). One GPU:
// LaunchExactLeafSum, every term of an element in registers (the ordered sum's bytes). A group: each rank's largest
// exponent a element (LaunchLeafCodes), a uint8 max all-reduce, each rank's integers at that scale
// (LaunchFixedLeafSum), an int32 sum all-reduce, one rounding (LaunchFixedToFloat): the bits one GPU gives.
// `total_terms` is the element's terms over every place (the head's leaves, plus one for the target's term): it sets
// the scale, so it must be the same everywhere.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "cuda/cuda_check.h"
#include "cuda/exact_fixed.h"
#include "cuda/grid_stride.cuh"
#include "cuda/kernels.h"
#include "leaf_plan.h"

namespace lce::cuda {
namespace {

// The fast loss path's (and the general path's, with the target apart) finish as terms of the sum:
// s_r · P_l for each leaf's partial and −t_r · W[y_r] where the target is in the shard, so that a
// group's ranks add the same terms one GPU does (the rank holding W[y_r] adds the target's).
struct Finish {
  const float* info = nullptr;  // [rows, kRowInfo] (kInfoScale, kInfoTarget); null: the partials as they are
  const int32_t* y = nullptr;
  int32_t ignore_index = 0;
  const __nv_bfloat16* w = nullptr;
  int64_t vocab_begin = 0, shard_rows = 0, hidden = 0;
};

// A shard's leaves (at most kMaxLeaves, leaf_plan.h) and the target's term: an element's terms in registers, each
// slot past the call's leaves a zero that the code and the sum still spend instructions on.
constexpr int kMaxTerms = kMaxLeaves + 1;

struct Terms {
  const float* parts;
  int leaves;
  int64_t n;
  Finish f;
  // Element i's terms into x[0, kMaxTerms): each leaf's (scaled by s_r with a finish), the target's last, zeros
  // between (a zero adds nothing to the code or the sum). The row's index, scale and target read once.
  __device__ __forceinline__ void Load(int64_t i, float (&x)[kMaxTerms]) const {
    float scale = 1.0f;
    int64_t r = 0, col = 0;
    if (f.info != nullptr) {
      r = n < (int64_t{1} << 32) ? static_cast<int64_t>(static_cast<uint32_t>(i) / static_cast<uint32_t>(f.hidden))
                                 : i / f.hidden;
      col = i - r * f.hidden;
      scale = f.info[r * kRowInfo + kInfoScale];
    }
#pragma unroll
    for (int j = 0; j < kMaxTerms - 1; ++j) {
      const float p = j < leaves ? parts[j * n + i] : 0.0f;
      x[j] = f.info != nullptr ? scale * p : p;
    }
    x[kMaxTerms - 1] = 0.0f;
    if (f.info == nullptr) return;
    const int32_t y = f.y[r];
    const int64_t local = y == f.ignore_index ? -1 : static_cast<int64_t>(y) - f.vocab_begin;
    const float t = f.info[r * kRowInfo + kInfoTarget];
    if (local >= 0 && local < f.shard_rows && t != 0.0f)
      x[kMaxTerms - 1] = -t * __bfloat162float(f.w[local * f.hidden + col]);
  }
};

// An element's code: the largest of its terms' (exact_fixed.h).
__device__ __forceinline__ int ElementCode(const float (&x)[kMaxTerms]) {
  int code = 0;
#pragma unroll
  for (int j = 0; j < kMaxTerms; ++j) code = exact::MaxCode(code, exact::Code(x[j]));
  return code;
}

// An element's terms as integers on its code's grid, summed (0 where the code is zero or non-finite).
__device__ __forceinline__ int32_t ElementFixed(const float (&x)[kMaxTerms], int code, int log2_terms) {
  int32_t sum = 0;
  if (code != 0 && code != exact::kNonFinite) {
    const int s = exact::Shift(code, log2_terms);
#pragma unroll
    for (int j = 0; j < kMaxTerms; ++j) sum += exact::Fixed(x[j], s);
  }
  return sum;
}

__global__ void ExactLeafSumKernel(float* __restrict__ dst, Terms terms, int log2_terms) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < terms.n; i += int64_t{gridDim.x} * blockDim.x) {
    float x[kMaxTerms];
    terms.Load(i, x);
    const int code = ElementCode(x);
    dst[i] = exact::ToFloat(ElementFixed(x, code, log2_terms), code, log2_terms);
  }
}

__global__ void LeafCodesKernel(uint8_t* __restrict__ codes, Terms terms) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < terms.n; i += int64_t{gridDim.x} * blockDim.x) {
    float x[kMaxTerms];
    terms.Load(i, x);
    codes[i] = static_cast<uint8_t>(ElementCode(x));
  }
}

// This rank's terms of an element at the group's scale (its code, after the byte max all-reduce).
__global__ void FixedLeafSumKernel(int32_t* __restrict__ q, const uint8_t* __restrict__ codes, Terms terms,
                                   int log2_terms) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < terms.n; i += int64_t{gridDim.x} * blockDim.x) {
    float x[kMaxTerms];
    terms.Load(i, x);
    q[i] = ElementFixed(x, codes[i], log2_terms);
  }
}

__global__ void FixedToFloatKernel(float* __restrict__ dst, const int32_t* __restrict__ q,
                                   const uint8_t* __restrict__ codes, int64_t n, int log2_terms) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    dst[i] = exact::ToFloat(q[i], codes[i], log2_terms);
  }
}

absl::Status CheckTerms(int leaves, int total_terms, const char* what) {
  if (leaves < 1 || total_terms < leaves || total_terms > (1 << 20)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", leaves, " leaves of ", total_terms, " terms"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Terms> MakeTerms(const float* parts, int leaves, int64_t n, const DhFinish& finish) {
  if (leaves < 0 || leaves > kMaxTerms - 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("d_hidden's exact sum: ", leaves, " leaves in a shard (at most ", kMaxTerms - 1, ")"));
  }
  if (finish.info != nullptr && (finish.hidden <= 0 || n % finish.hidden != 0 || finish.weight == nullptr)) {
    return absl::InvalidArgumentError("d_hidden's exact sum: a finish needs whole rows of hidden and the weight");
  }
  Finish f;
  f.info = finish.info;
  f.y = finish.targets;
  f.ignore_index = finish.ignore_index;
  f.w = static_cast<const __nv_bfloat16*>(finish.weight);
  f.vocab_begin = finish.vocab_begin;
  f.shard_rows = finish.shard_rows;
  f.hidden = finish.hidden;
  return Terms{parts, leaves, n, f};
}

}  // namespace

absl::Status LaunchExactLeafSum(float* dst, const float* parts, int leaves, int total_terms, int64_t n,
                                const DhFinish& finish, cudaStream_t stream) {
  if (absl::Status st = CheckTerms(leaves + 1, total_terms, "LaunchExactLeafSum"); !st.ok()) return st;
  if (n <= 0) return absl::OkStatus();
  absl::StatusOr<Terms> terms = MakeTerms(parts, leaves, n, finish);
  if (!terms.ok()) return terms.status();
  ExactLeafSumKernel<<<GridStrideBlocks(n), kGridStrideThreads, 0, stream>>>(dst, *terms, exact::CeilLog2(total_terms));
  LCE_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status LaunchLeafCodes(uint8_t* codes, const float* parts, int leaves, int64_t n, const DhFinish& finish,
                             cudaStream_t stream) {
  if (leaves < 0) return absl::InvalidArgumentError("LaunchLeafCodes: negative leaf count");
  if (n <= 0) return absl::OkStatus();
  absl::StatusOr<Terms> terms = MakeTerms(parts, leaves, n, finish);
  if (!terms.ok()) return terms.status();
  LeafCodesKernel<<<GridStrideBlocks(n), kGridStrideThreads, 0, stream>>>(codes, *terms);
  LCE_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status LaunchFixedLeafSum(int32_t* q, const uint8_t* codes, const float* parts, int leaves, int total_terms,
                                int64_t n, const DhFinish& finish, cudaStream_t stream) {
  if (absl::Status st = CheckTerms(leaves + 1, total_terms, "LaunchFixedLeafSum"); !st.ok()) return st;
  if (n <= 0) return absl::OkStatus();
  absl::StatusOr<Terms> terms = MakeTerms(parts, leaves, n, finish);
  if (!terms.ok()) return terms.status();
  FixedLeafSumKernel<<<GridStrideBlocks(n), kGridStrideThreads, 0, stream>>>(q, codes, *terms,
                                                                             exact::CeilLog2(total_terms));
  LCE_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status LaunchFixedToFloat(float* dst, const int32_t* q, const uint8_t* codes, int total_terms, int64_t n,
                                cudaStream_t stream) {
  if (absl::Status st = CheckTerms(1, total_terms, "LaunchFixedToFloat"); !st.ok()) return st;
  if (n <= 0) return absl::OkStatus();
  FixedToFloatKernel<<<GridStrideBlocks(n), kGridStrideThreads, 0, stream>>>(dst, q, codes, n,
                                                                             exact::CeilLog2(total_terms));
  LCE_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace lce::cuda
