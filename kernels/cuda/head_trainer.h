// Internal: the CUDA engine's HeadTrainer (lce/training.h), made by lce::CreateHeadTrainer.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "lce/training.h"

namespace lce::cuda {

// dW, the fp32 master weights and the AdamW moments in the engine's GPU memory; the step is one kernel
// that also rewrites the engine's serving weight in place.
absl::StatusOr<std::unique_ptr<HeadTrainer>> CreateCudaHeadTrainer(std::shared_ptr<LceEngine> engine,
                                                                   std::shared_ptr<const HeadWeights> weights);

}  // namespace lce::cuda
