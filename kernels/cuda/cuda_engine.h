// Internal: the CUDA backend's entry points, used by engine_factory.cc and the CUDA head trainer only.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "lce/engine.h"

namespace lce::cuda {

// True when a CUDA device can be opened.
bool DeviceAvailable();

// True when this build has the epilogue-statistics GEMM (CUTLASS's headers were found) and `device`
// is an sm_90 that runs it: bf16 heads' forwards then run through it (unless LCE_CUDA_EPILOGUE_STATS=0).
bool EpilogueStatsAvailable(int device);

absl::StatusOr<std::unique_ptr<LceEngine>> CreateCudaEngine(std::shared_ptr<const HeadWeights> weights,
                                                            const EngineConfig& config);

// The device copy of a CUDA engine's weight shard [shard_rows, hidden] in the head's dtype, which the
// head's trainer rewrites in place (head_trainer.h) while no call runs on the engine.
struct EngineWeightOnDevice {
  void* weight = nullptr;
  int device = 0;
  float* bias = nullptr;  // [shard_rows] fp32, for a head with a bias
};
// INVALID_ARGUMENT when `engine` is not a CUDA engine.
absl::StatusOr<EngineWeightOnDevice> WeightOnDevice(LceEngine& engine);

}  // namespace lce::cuda
