// Exact conversions between fp32 and the 16-bit float formats (round-to-nearest-even when
// narrowing; NaN stays NaN). Header-only so that hot loops inline them.
#pragma once

#include <cstdint>
#include <algorithm>
#include <cstring>

#include "lce/head.h"

namespace lce {

inline float Bf16ToFloat(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // quiet NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float Fp16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1fu) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t FloatToFp16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;          // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;         // rounds to >= 65520: Inf
  if (abs < 0x38800000u) {                               // result is subnormal or zero
    if (abs < 0x33000000u) return sign;                  // < 2^-25 rounds to zero
    const uint32_t exp = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exp;                   // 14..24
    uint32_t half = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (half & 1u))) ++half;
    return sign | static_cast<uint16_t>(half);
  }
  uint32_t v = abs - 0x38000000u;                        // rebias exponent 127 -> 15
  v += 0xfffu + ((v >> 13) & 1u);
  return sign | static_cast<uint16_t>(v >> 13);
}

// n elements of `dtype` at src -> fp32.
inline void ConvertToFloat(const void* src, DType dtype, int64_t n, float* dst) {
  if (dtype == DType::kFloat32) {
    std::copy_n(static_cast<const float*>(src), n, dst);
    return;
  }
  const auto* s = static_cast<const uint16_t*>(src);
  if (dtype == DType::kBFloat16) {
    for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToFloat(s[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = Fp16ToFloat(s[i]);
  }
}

// n fp32 values -> `dtype` at dst, rounding to nearest even.
inline void ConvertFromFloat(const float* src, int64_t n, DType dtype, void* dst) {
  if (dtype == DType::kFloat32) {
    std::copy_n(src, n, static_cast<float*>(dst));
    return;
  }
  auto* d = static_cast<uint16_t*>(dst);
  if (dtype == DType::kBFloat16) {
    for (int64_t i = 0; i < n; ++i) d[i] = FloatToBf16(src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) d[i] = FloatToFp16(src[i]);
  }
}

}  // namespace lce
