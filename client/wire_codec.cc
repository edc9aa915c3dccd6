#include "wire_codec.h"

#include <cstring>

namespace lce::client {
namespace {

uint16_t ToBf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((b >> 16) | 0x40u);
  b += 0x7fffu + ((b >> 16) & 1u);
  return static_cast<uint16_t>(b >> 16);
}

// fp32 -> IEEE half through the hardware-independent path of the F16C rules.
uint16_t ToFp16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((b >> 16) & 0x8000u);
  const uint32_t a = b & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;
  if (a >= 0x477ff000u) return sign | 0x7c00u;
  if (a < 0x38800000u) {
    if (a < 0x33000000u) return sign;
    const uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u, sh = 126u - e;
    uint32_t h = m >> sh;
    const uint32_t rem = m & ((1u << sh) - 1u), half = 1u << (sh - 1u);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return sign | static_cast<uint16_t>(h);
  }
  uint32_t v = a - 0x38000000u;
  v += 0xfffu + ((v >> 13) & 1u);
  return sign | static_cast<uint16_t>(v >> 13);
}

float FromFp16(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu, bits;
  if (e == 0x1fu) {
    bits = sign | 0x7f800000u | (m << 13);
  } else if (e != 0) {
    bits = sign | ((e + 112u) << 23) | (m << 13);
  } else if (m == 0) {
    bits = sign;
  } else {
    e = 113;
    while ((m & 0x400u) == 0) {
      m <<= 1;
      --e;
    }
    bits = sign | (e << 23) | ((m & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

}  // namespace

std::vector<uint8_t> EncodeFloats(const float* values, int64_t n, v1::DType dtype) {
  if (dtype == v1::DTYPE_FLOAT32) {
    std::vector<uint8_t> out(static_cast<size_t>(n * 4));
    std::memcpy(out.data(), values, out.size());
    return out;
  }
  std::vector<uint8_t> out(static_cast<size_t>(n * 2));
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t h = dtype == v1::DTYPE_BFLOAT16 ? ToBf16(values[i]) : ToFp16(values[i]);
    std::memcpy(out.data() + 2 * i, &h, 2);
  }
  return out;
}

std::vector<float> DecodeFloats(const uint8_t* bytes, int64_t n, v1::DType dtype) {
  std::vector<float> out(static_cast<size_t>(n));
  if (dtype == v1::DTYPE_FLOAT32) {
    std::memcpy(out.data(), bytes, static_cast<size_t>(n * 4));
    return out;
  }
  for (int64_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, bytes + 2 * i, 2);
    if (dtype == v1::DTYPE_BFLOAT16) {
      const uint32_t b = static_cast<uint32_t>(h) << 16;
      std::memcpy(&out[i], &b, 4);
    } else {
      out[i] = FromFp16(h);
    }
  }
  return out;
}

}  // namespace lce::client
