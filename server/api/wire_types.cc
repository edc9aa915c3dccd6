#include "wire_types.h"

#include "absl/strings/str_cat.h"

namespace lce::server {

v1::DType ToWire(DType d) {
  switch (d) {
    case DType::kFloat32: return v1::DTYPE_FLOAT32;
    case DType::kBFloat16: return v1::DTYPE_BFLOAT16;
    case DType::kFloat16: return v1::DTYPE_FLOAT16;
  }
  return v1::DTYPE_UNSPECIFIED;
}

absl::StatusOr<DType> FromWire(v1::DType d) {
  switch (d) {
    case v1::DTYPE_FLOAT32: return DType::kFloat32;
    case v1::DTYPE_BFLOAT16: return DType::kBFloat16;
    case v1::DTYPE_FLOAT16: return DType::kFloat16;
    default: return absl::InvalidArgumentError(absl::StrCat("dtype must be set (got ", d, ")"));
  }
}

void DescribeHead(const ServedHead& head, v1::HeadDescription* out) {
  const HeadShape& s = head.engine->shape();
  out->set_name(head.name);
  out->set_vocab_size(s.vocab_size);
  out->set_hidden_size(s.hidden_size);
  out->set_dtype(ToWire(s.dtype));
  out->set_version(head.version);
  out->set_has_bias(s.has_bias);
}

}  // namespace lce::server
