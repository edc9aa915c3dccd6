// Tensor parallelism over a vocabulary-sharded head: rank 0 (the front) serves the public API and,
// for every engine call, broadcasts a small control block and the chunk's rows to its peers; then
// every rank runs the same engine call on its shard, the engine's collectives combining the
// per-row partials and d_hidden. The service sees an ordinary LceEngine. Chunks are staged where
// the communicator moves data: host memory (Gloo) or device memory (NCCL).
#pragma once

#include <functional>
#include <memory>
#include <mutex>

#include "absl/status/status.h"
#include "chunk_staging.h"
#include "lce/engine.h"
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
  absl::Status Compute(const RowsView& rows, const LceOptions& options, const Upstream& upstream,
                       const RowOutputs& outputs, const GradOutputs& grads) override;

  // Tells the peers to exit their loops. Call once, when the front shuts down.
  absl::Status StopPeers();

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

// A peer's loop: runs the calls the front broadcasts until it says stop (OK) or the group fails
// (UNAVAILABLE).
absl::Status RunTpPeer(LceEngine& engine, TpCommunicator& comm, ChunkStaging& staging);

}  // namespace lce::server
