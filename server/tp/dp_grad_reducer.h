// How data-parallel replicas (dp_rank.h) take part in an optimizer step: StepShard (tp_group.h) hands
// each rank's dW to a GradReducer before the global norm, on a server of one rank and on every rank
// of a tensor-parallel group alike.
#pragma once

#include "absl/status/status.h"
#include "chunk_staging.h"
#include "lce/training.h"
#include "tp_communicator.h"

namespace lce::server {

class GradReducer {
 public:
  virtual ~GradReducer() = default;
  // Called on every rank of every replica with this rank's readiness to step (`trainer` is valid when
  // `ready` is OK): sums dW over the replicas in place, and returns whether the step goes on, the same
  // on every rank of every replica. `tp` and `tp_staging` are the rank's tensor-parallel group (null
  // on a server of one rank). A lost replica is ABORTED here, never UNAVAILABLE or INTERNAL, which
  // would fail the tensor-parallel group: the replica's own group is sound and keeps scoring.
  virtual absl::Status Reduce(const absl::Status& ready, HeadTrainer* trainer, TpCommunicator* tp,
                              ChunkStaging* tp_staging) = 0;
};

}  // namespace lce::server
