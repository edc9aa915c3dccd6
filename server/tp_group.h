// Tensor parallelism over a vocabulary-sharded head: rank 0 (the front) serves the public API and,
// for every engine call, broadcasts a small control block and the chunk's rows to its peers; then
// every rank runs the same engine call on its shard, the engine's collectives combining the
// per-row partials and d_hidden. The service sees an ordinary LceEngine. Chunks are staged where
// the communicator moves data: host memory (Gloo) or device memory (NCCL).
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "chunk_staging.h"
#include "lce/engine.h"
#include "lce/training.h"
#include "tp_communicator.h"

namespace lce::server {

// Rank 0's view of the group, as an LceEngine whose shape() is its shard's (vocab_size is the
// whole head's). `on_failure` runs once, on the first collective failure.
class TpFrontEngine final : public LceEngine {
 public:
  TpFrontEngine(std::shared_ptr<LceEngine> local, TpCommunicator* comm, std::unique_ptr<ChunkStaging> staging,
                std::function<void(const absl::Status&)> on_failure)
      : local_(std::move(local)), comm_(comm), staging_(std::move(staging)), on_failure_(std::move(on_failure)) {}

  std::string_view backend() const override { return local_->backend(); }
  const HeadShape& shape() const override { return local_->shape(); }
  EngineMemory memory() const override { return local_->memory(); }
  EngineInvariance invariance() const override { return local_->invariance(); }
  absl::Status Compute(const RowsView& rows, const LceOptions& options, const Upstream& upstream,
                       const RowOutputs& outputs, const GradOutputs& grads) override;

  // Tells the peers to exit their loops. Call once, when the front shuts down.
  absl::Status StopPeers();

  // Training the sharded head (CPU groups; each rank owns the gradient and optimizer state of its
  // shard). True when this group supports it.
  bool trainable() const { return !staging_->device(); }
  absl::Status ZeroGradPeers();
  // One AdamW step on every rank under the group lock: the global gradient norm is the square root
  // of the all-reduced sum of the ranks' squared norms (`local_sq_norm` is the front's);
  // `step_front(scale)` steps the front's own shard and returns its new engine, which replaces the
  // local one before any other call runs. Returns the global norm (before clipping).
  absl::StatusOr<double> Step(const AdamWParams& params, float max_grad_norm, double local_sq_norm,
                              const std::function<absl::StatusOr<std::shared_ptr<LceEngine>>(float)>& step_front);
  // Each peer's gradient shard, in rank order: sink(first_row, rows, data).
  absl::Status FetchPeerGrads(const std::function<absl::Status(int64_t, int64_t, const float*)>& sink);
  // Every peer writes its shard of the current weight (head_source.h, WriteHeadShard).
  absl::Status SaveShards(const std::string& dir, const std::string& name);

 private:
  absl::Status ComputeLocked(const RowsView& rows, const LceOptions& options, const Upstream& upstream,
                             const RowOutputs& outputs, const GradOutputs& grads);
  absl::Status Fail(absl::Status s);

  std::shared_ptr<LceEngine> local_;
  TpCommunicator* comm_;
  std::unique_ptr<ChunkStaging> staging_;
  std::function<void(const absl::Status&)> on_failure_;
  std::mutex mu_;  // one call at a time across the whole group
  bool failed_ = false;
};

// Builds the engine of a new weight version (a peer after an optimizer step).
using EngineFactory = std::function<absl::StatusOr<std::shared_ptr<LceEngine>>(std::shared_ptr<const HeadWeights>)>;

// A peer's loop: runs the calls the front broadcasts until it says stop (OK) or the group fails
// (UNAVAILABLE). The peer owns its shard's gradient and optimizer state.
absl::Status RunTpPeer(std::shared_ptr<const HeadWeights> weights, std::shared_ptr<LceEngine> engine,
                       const EngineFactory& make_engine, TpCommunicator& comm, ChunkStaging& staging);

}  // namespace lce::server
