// Data-parallel replicas: R tensor-parallel groups (or servers of one rank) of the same size serve one
// head and train it as one job. Rank t of every replica has a link to the other replicas' rank t (a
// communicator over the R of them: NCCL on GPUs, Gloo on CPUs), over which each optimizer step sums
// the replicas' dW shards before the global norm: every replica then takes the same step on the same
// gradient, and the replicas' weights stay the same bits (a collective's sum is computed once and
// copied to every member). The fronts put the job's training calls in one order (dp_job.h).
//
// The replicas meet once, at start, in a directory they all see (--dp-rendezvous):
//   DIR/tp-<t>/  rank t's link (Gloo's file store or NCCL's id; pid files that name dead replicas)
//   DIR/fronts/  the fronts' control link and addresses (dp_job.h)
//   DIR/formed   written once every replica has joined. A replica restarted alone cannot join again
//                (its links would meet stale addresses): it refuses to start, and the job restarts
//                as a whole, in a fresh directory.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "chunk_staging.h"
#include "dp_grad_reducer.h"
#include "tp_communicator.h"

namespace lce::server {

struct DpOptions {
  int size = 1;     // replicas
  int replica = 0;  // this process's replica
  std::string rendezvous;
  std::string host = "127.0.0.1";                    // where the other replicas reach this process
  absl::Duration timeout = absl::Seconds(30);        // a link's collective that takes longer fails
  absl::Duration join_timeout = absl::Seconds(600);  // how long start waits for every replica
};

// The rendezvous directory is trusted with the job's addresses (issue 35, item 7), so it must be
// ours: made here with mode 0700 when missing; else a real directory (not a link) owned by this
// process's uid and writable by no group or other user. PERMISSION_DENIED otherwise, naming it.
absl::Status CheckRendezvousDirectory(const std::string& dir);

// The bootstrap of this replica's link in DIR/`sub` (members are replicas).
TpBootstrap DpBootstrap(const DpOptions& options, const std::string& sub, const std::string& group);
// FAILED_PRECONDITION when the job in DIR has formed already (this process is a replica restarted
// alone). Call before any link is made.
absl::Status CheckDpJobIsNew(const DpOptions& options);
// Marks the job in DIR formed (replica 0's front, once every front has joined).
absl::Status MarkDpJobFormed(const DpOptions& options);

// One rank's link to the same rank of the other replicas.
class DpRank final : public GradReducer {
 public:
  // Rank `tp_rank`'s link: NCCL on `device` when `cuda` (dW in device memory), else Gloo.
  static absl::StatusOr<std::unique_ptr<DpRank>> Join(const DpOptions& options, int tp_rank, bool cuda, int device);

  // GradReducer: agrees with the rank's group and then the other replicas that every rank can step,
  // and sums dW over the replicas. A link that fails takes this replica's training down on all its
  // ranks (health()); the step is then ABORTED on every rank it reached.
  absl::Status Reduce(const absl::Status& ready, HeadTrainer* trainer, TpCommunicator* tp,
                      ChunkStaging* tp_staging) override;

  int replica() const { return options_.replica; }
  int size() const { return options_.size; }
  // OK while this replica's links work; else why not (its training is down until the job restarts).
  absl::Status health() const;

 private:
  DpRank(DpOptions options, std::unique_ptr<TpCommunicator> comm, std::unique_ptr<ChunkStaging> staging)
      : options_(std::move(options)), comm_(std::move(comm)), staging_(std::move(staging)) {}
  // One slot a replica, non-zero where that replica's group cannot step: an all-reduce over the link.
  absl::StatusOr<std::vector<float>> ReplicasNotReady(bool group_ready);
  // dW += the other replicas' dW, in place, in pieces.
  absl::Status SumGrad(HeadTrainer& trainer);
  // Takes this replica's training down for `why`; returns the step's answer.
  absl::Status Lose(const absl::Status& why);

  DpOptions options_;
  std::unique_ptr<TpCommunicator> comm_;
  std::unique_ptr<ChunkStaging> staging_;
  mutable std::mutex mu_;
  absl::Status health_;
};

}  // namespace lce::server
