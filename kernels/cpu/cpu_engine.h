// Internal: the CPU backend (fixed-order GEMMs, OpenMP), used by engine_factory.cc.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "lce/engine.h"

namespace lce {

absl::StatusOr<std::unique_ptr<LceEngine>> CreateCpuEngine(std::shared_ptr<const HeadWeights> weights,
                                                           const EngineConfig& config);

}  // namespace lce
