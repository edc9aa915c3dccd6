// Conversions between the engine's types and the lce.v1 wire types.
#pragma once

#include "absl/status/statusor.h"
#include "head_store.h"
#include "lce/head.h"
#include "lce/v1/lce.pb.h"

namespace lce::server {

v1::DType ToWire(DType d);
absl::StatusOr<DType> FromWire(v1::DType d);  // INVALID_ARGUMENT for DTYPE_UNSPECIFIED
void DescribeHead(const ServedHead& head, v1::HeadDescription* out);

}  // namespace lce::server
