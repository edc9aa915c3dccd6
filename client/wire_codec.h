// Encoding fp32 values into the wire's 16-bit formats (round to nearest even) and back, for the
// CLI's generated batches and printed answers.
#pragma once

#include <cstdint>
#include <vector>

#include "lce/v1/lce.pb.h"

namespace lce::client {

// n fp32 values -> bytes of `dtype`, little-endian.
std::vector<uint8_t> EncodeFloats(const float* values, int64_t n, v1::DType dtype);
// bytes of `dtype` -> fp32 values.
std::vector<float> DecodeFloats(const uint8_t* bytes, int64_t n, v1::DType dtype);

}  // namespace lce::client
