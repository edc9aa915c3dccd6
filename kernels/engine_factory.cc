// Backend selection: the one place that knows which engines this build has.
#include "absl/strings/str_cat.h"
#include "cpu/cpu_engine.h"
#include "lce/engine.h"
#ifdef LCE_WITH_CUDA
#include "cuda/cuda_engine.h"
#endif

namespace lce {

bool CudaAvailable() {
#ifdef LCE_WITH_CUDA
  return cuda::DeviceAvailable();
#else
  return false;
#endif
}

absl::StatusOr<std::unique_ptr<LceEngine>> CreateEngine(Backend backend,
                                                        std::shared_ptr<const HeadWeights> weights,
                                                        const EngineConfig& config) {
  if (weights == nullptr) return absl::InvalidArgumentError("no head weights");
  if (absl::Status s = ValidateHeadWeights(*weights); !s.ok()) return s;
  if (weights->shape.shard_rows == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "this rank's vocabulary shard is empty: a head of ", weights->shape.vocab_size, " rows has ",
        VocabTileCount(weights->shape.vocab_size), " tiles of ", VocabTile(weights->shape.vocab_size),
        ", fewer than the group's ranks"));
  }
  if (backend == Backend::kAuto) backend = CudaAvailable() ? Backend::kCuda : Backend::kCpu;
  if (backend == Backend::kCpu) return CreateCpuEngine(std::move(weights), config);
#ifdef LCE_WITH_CUDA
  return cuda::CreateCudaEngine(std::move(weights), config);
#else
  return absl::FailedPreconditionError("this build has no CUDA backend (nvcc was not found at build time)");
#endif
}

}  // namespace lce
