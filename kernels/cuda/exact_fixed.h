// The fixed point of d_hidden's leaf sum (exact_sum.cu), host and device alike so that the CPU tests check
// the same arithmetic the kernels run. A term x of an element is rounded to round(x · 2^s) in int32 with
// s = 30 − ⌈log2 L⌉ − E, E the smallest integer with |term| < 2^E over all the element's terms (in every
// place that holds some) and L their count: each term is rounded on one grid the element's terms share
// (within 2^(E−31) — the sum's error at most L · 2^(E−31), under 2^−24 of the largest term for L ≤ 8,
// while the terms themselves are fp32 products of thousands of columns), and the integers then add
// exactly, in any order and any grouping, and the sum rounds to fp32 once. int32 rather than int64: a
// group all-reduces as many bytes as fp32 partials, plus a byte of code an element.
#pragma once

#include <math.h>

#include <cstdint>

#if defined(__CUDACC__)
#define LCE_HD __host__ __device__ __forceinline__
#else
#define LCE_HD inline
#endif

namespace lce::cuda::exact {

// One byte a code, so that a group all-reduces them with max: 0 every term zero; kNonFinite a term inf or
// NaN (the sum is NaN); else max(E, kMinExp) − kMinExp + 1 (E ≤ 128: 1..254). E clamped at −125 still keeps
// terms far below the largest, which the grid rounds away anyway.
inline constexpr int kMinExp = -125;
inline constexpr int kNonFinite = 255;

LCE_HD int CeilLog2(int n) {
  int b = 0;
  while ((1 << b) < n) ++b;
  return b;
}

LCE_HD int Code(float x) {
#if defined(__CUDA_ARCH__)
  // frexpf's exponent from the bits (the kernels' hot loop): field − 126 for a normal x, below kMinExp for a
  // subnormal one (clamped to kMinExp either way): the code the host's frexpf below gives.
  const unsigned bits = __float_as_uint(x) & 0x7fffffffu;
  const int field = static_cast<int>(bits >> 23);
  if (field == 255) return kNonFinite;
  if (bits == 0) return 0;
  const int e = field == 0 ? kMinExp : field - 126;
#else
  if (!(fabsf(x) <= 3.402823466e38f)) return kNonFinite;  // inf or NaN
  if (x == 0.0f) return 0;
  int e = 0;
  (void)frexpf(x, &e);  // x = m · 2^e, 0.5 ≤ |m| < 1: |x| < 2^e
#endif
  return (e < kMinExp ? kMinExp : e) - kMinExp + 1;
}

LCE_HD int MaxCode(int a, int b) { return a > b ? a : b; }

// The scale's exponent s for an element's code (not 0 or kNonFinite) and its terms' count.
LCE_HD int Shift(int code, int log2_terms) { return 30 - log2_terms - (code - 1 + kMinExp); }

// round(x · 2^s): x · 2^s exact in double, rounded to the nearest integer (ties to even); |result| ≤
// 2^(30 − ⌈log2 L⌉), so L of them sum within int32.
LCE_HD int32_t Fixed(float x, int s) {
#if defined(__CUDA_ARCH__)
  // The same integer in fp32 (the double's ldexp and llrint are slow on the GPU): s ∈ [−101, 155] in two
  // power-of-two steps of at most 2^78 each, exact wherever the result can round to a nonzero integer (an
  // intermediate below the normal range only where |x · 2^s| < 2^−40), then rounded to nearest even.
  const int s1 = s / 2, s2 = s - s1;
  const float v = (x * __int_as_float((s1 + 127) << 23)) * __int_as_float((s2 + 127) << 23);
  return __float2int_rn(v);
#else
  return static_cast<int32_t>(llrint(ldexp(static_cast<double>(x), s)));
#endif
}

// The sum q / 2^s in fp32: int32 to fp32 rounds once (to nearest even), the power of 2 is exact unless the
// result is subnormal (then it rounds again, the same way everywhere).
LCE_HD float ToFloat(int32_t q, int code, int log2_terms) {
  if (code == kNonFinite) return NAN;
  if (code == 0) return 0.0f;
  return ldexpf(static_cast<float>(q), -Shift(code, log2_terms));
}

}  // namespace lce::cuda::exact

#undef LCE_HD
