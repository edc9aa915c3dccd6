#include <cmath>

#include "absl/strings/str_cat.h"
#include "lce/engine.h"

namespace lce {

absl::Status ValidateOptions(const LceOptions& o) {
  if (!(o.temperature > 0.0f) || !std::isfinite(o.temperature)) {
    return absl::InvalidArgumentError(absl::StrCat("temperature must be > 0, got ", o.temperature));
  }
  if (!(o.softcap >= 0.0f) || !std::isfinite(o.softcap)) {
    return absl::InvalidArgumentError(absl::StrCat("softcap must be >= 0 (0 = off), got ", o.softcap));
  }
  if (!(o.label_smoothing >= 0.0f && o.label_smoothing < 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("label_smoothing must be in [0, 1), got ", o.label_smoothing));
  }
  // Any finite coefficient: a class-weighted mean whose weights sum below 0 needs a negative one
  // (the client libraries keep the z-loss divided by the valid tokens, as Liger-Kernel does).
  if (!std::isfinite(o.z_loss)) {
    return absl::InvalidArgumentError(absl::StrCat("z_loss must be finite, got ", o.z_loss));
  }
  if (o.top_k < 0 || o.top_k > kMaxTopK) {
    return absl::InvalidArgumentError(absl::StrCat("top_k must be in [0, ", kMaxTopK, "], got ", o.top_k));
  }
  return absl::OkStatus();
}

absl::Status ValidateOutputs(const LceOptions& o, const RowOutputs& out) {
  if (o.top_k == 0 && (out.argmax != nullptr || out.top_tokens != nullptr || out.top_logprobs != nullptr)) {
    return absl::InvalidArgumentError("argmax and top-k outputs need options.top_k >= 1");
  }
  return absl::OkStatus();
}

absl::StatusOr<Backend> ParseBackend(std::string_view name) {
  if (name == "cpu") return Backend::kCpu;
  if (name == "cuda") return Backend::kCuda;
  if (name == "auto") return Backend::kAuto;
  return absl::InvalidArgumentError(absl::StrCat("unknown backend '", std::string(name), "' (cpu, cuda, auto)"));
}

}  // namespace lce
