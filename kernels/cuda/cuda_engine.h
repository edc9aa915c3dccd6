// Internal: the CUDA backend's entry points, used by engine_factory.cc only.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "lce/engine.h"

namespace lce::cuda {

// True when a CUDA device can be opened.
bool DeviceAvailable();

absl::StatusOr<std::unique_ptr<LceEngine>> CreateCudaEngine(std::shared_ptr<const HeadWeights> weights,
                                                            const EngineConfig& config);

}  // namespace lce::cuda
