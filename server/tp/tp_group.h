// Tensor parallelism over vocabulary-sharded heads: rank 0 (the front) serves the public API and,
// for every engine call and every training operation, broadcasts a small control block (naming the
// head and its version) and then the operation's data to its peers; every rank then does the same
// work on its shard, the engine's collectives combining the per-row partials and d_hidden. Chunks and
// pieces of shards are staged where the communicator moves data: host memory (Gloo) or device memory
// (NCCL); the code is the same for both. Each rank keeps its shard's gradient and optimizer state
// (a HeadTrainer in its engine's memory). Heads change only while no request runs on them
// (head_store.h), so every rank serves one version of each head and a request sees one version
// from start to end on every rank.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "chunk_staging.h"
#include "dp_grad_reducer.h"
#include "head_source.h"
#include "lce/engine.h"
#include "lce/training.h"
#include "tp_communicator.h"

namespace lce::server {

enum class TpOp : uint32_t;  // the operations the front sends its peers (tp_group.cc)

// Where LoadHead takes a head from, on every rank: rows of a safetensors file (or a saved index), a
// seeded head, or this rank's shard of another head it holds.
struct TpHeadSource {
  HeadSource source;      // file or seeded (LoadHead in head_source.h)
  std::string clone_of;   // non-empty: a clone of this head
};

// One optimizer step of a shard: the global gradient norm (before clipping) and the engine serving
// the new weight.
struct ShardStep {
  double grad_norm = 0;
  std::shared_ptr<LceEngine> engine;
};

// One AdamW step of this rank's shard with the scale of the global norm, the same on every rank of a
// group (comm and staging null: a server of one rank): the global norm comes from one all-reduce of
// the ranks' per-tile squared norms (lce/training.h: the same bits for any group size); a rank that
// cannot step (its optimizer state does not fit) fails the step on every rank before any weight
// changes. INTERNAL: the step failed after this rank's state changed (a group must then restart). With
// `dp` (data-parallel replicas), dW is first summed over the replicas.
absl::StatusOr<ShardStep> StepShard(absl::StatusOr<HeadTrainer*> trainer, int64_t vocab_size, TpCommunicator* comm,
                                    ChunkStaging* staging, const AdamWParams& params, float max_grad_norm,
                                    GradReducer* dp = nullptr);

// All-reduces n floats of host memory through `staging` (device memory for NCCL).
absl::Status AllReduceFloats(TpCommunicator& comm, ChunkStaging& staging, float* values, int n, ReduceOp op);

// A rank's shard of `source`: LoadHead's rows (at most max_shard_bytes of weight, 0: the host's
// memory), or `clone(name)`, the current weight of a head it holds.
absl::StatusOr<std::shared_ptr<const HeadWeights>> LoadShard(
    const TpHeadSource& source, int rank, int world,
    const std::function<absl::StatusOr<std::shared_ptr<const HeadWeights>>(const std::string&)>& clone,
    int64_t max_shard_bytes = 0);

// Rows of a tensor split by vocabulary over a group (VocabShard: a weight, a bias, their gradients),
// moved between the front (rank 0) and its peers in rank order, in pieces of at most piece_bytes (a
// bounded staging buffer; a row at least), each broadcast by its owner. Every rank calls its part
// with the same sizes.
constexpr int64_t kShardPieceBytes = int64_t{64} << 20;
// Scatter: the front sends each peer its rows of `all` (every row, `row_bytes` each); each peer's
// ReceiveRows puts its own into `mine` (its shard's rows) while the others' go by.
absl::Status ScatterRows(TpCommunicator& comm, ChunkStaging& staging, int64_t vocab_size, const uint8_t* all,
                         int64_t row_bytes, int64_t piece_bytes = kShardPieceBytes);
absl::Status ReceiveRows(TpCommunicator& comm, ChunkStaging& staging, int64_t vocab_size, uint8_t* mine,
                         int64_t row_bytes, int64_t piece_bytes = kShardPieceBytes);
// Gather: each peer's SendRows broadcasts `mine` (its shard's rows, `cols` floats each, in the
// staging's memory space) in its turn; the front's GatherRows hands each piece to sink(first_row,
// rows, data). The first sink error stops the sinking, not the transfer, and is returned.
absl::Status GatherRows(TpCommunicator& comm, ChunkStaging& staging, int64_t vocab_size, int64_t cols,
                        const std::function<absl::Status(int64_t, int64_t, const float*)>& sink,
                        int64_t piece_bytes = kShardPieceBytes);
absl::Status SendRows(TpCommunicator& comm, ChunkStaging& staging, int64_t vocab_size, int64_t cols, float* mine,
                      int64_t piece_bytes = kShardPieceBytes);

// The group as rank 0 drives it: one operation at a time across the whole group. The front's own
// part of each operation is the caller's (`front_part`), run between the control block and the
// group's agreement on the outcome. `on_failure` runs once, on the first failure that leaves the
// group unusable (a collective that failed, or ranks whose shards no longer agree).
class TpGroup {
 public:
  TpGroup(TpCommunicator* comm, std::unique_ptr<ChunkStaging> staging, std::function<void(const absl::Status&)> on_failure)
      : comm_(comm), staging_(std::move(staging)), on_failure_(std::move(on_failure)) {}

  int size() const { return comm_->world_size(); }

  // An engine call of head `head` at `version` on every rank; `local` is the front's shard engine.
  // grads.d_weight (when set) is the front's trainer's dW, in the staging's memory space.
  absl::Status Compute(const std::string& head, int64_t version, LceEngine& local, const RowsView& rows,
                       const LceOptions& options, const Upstream& upstream, const RowOutputs& outputs,
                       const GradOutputs& grads);
  // Tells the peers to exit their loops. Call once, when the front shuts down.
  absl::Status StopPeers();

  // Zeroes the peers' dW of `head` (the front zeroes its own); CommitPending and ReleasePending do
  // the trainer's (lce/training.h) on the peers, whose pending buffers Compute filled under the same
  // id (GradOutputs::d_weight_pending).
  absl::Status ZeroGrad(const std::string& head);
  absl::Status CommitPending(const std::string& head, uint64_t id, float scale);
  absl::Status ReleasePending(const std::string& head, uint64_t id);
  // StepShard on every rank; `version` is the head's new version; `dp`: the front's, when replicas.
  absl::StatusOr<ShardStep> Step(const std::string& head, int64_t version, int64_t vocab_size,
                                 absl::StatusOr<HeadTrainer*> front, const AdamWParams& params, float max_grad_norm,
                                 GradReducer* dp = nullptr);
  // The peers' dW shards (or of pending contribution `pending`; with `bias`, their dB shards: one float
  // a row), in rank order, to sink(first_row, rows, data) in pieces. A sink error stops the sinking,
  // not the transfer (the peers finish theirs), and is returned.
  absl::Status GatherPeerGrads(const std::string& head, const HeadShape& shape,
                               const std::function<absl::Status(int64_t, int64_t, const float*)>& sink,
                               uint64_t pending = 0, bool bias = false);
  // Every rank writes its shard of `head`'s current weight, at `version`, into `dir` (head_source.h,
  // WriteHeadShard).
  absl::Status Save(const std::string& head, int64_t version, const std::string& dir,
                    const std::function<absl::Status()>& front_part);
  // Every rank loads its shard of `source` as head `head` at `version` and keeps it only if every rank
  // could (the front's part loads the front's shard).
  absl::Status Load(const std::string& head, int64_t version, const TpHeadSource& source,
                    const std::function<absl::Status()>& front_part);
  // Every rank serves its rows of `full` (the whole [vocab, hidden] weight, host memory, and the whole
  // [vocab] bias unless empty: then each rank keeps its own) as `head`'s `version` (the front's part
  // serves the front's rows).
  absl::Status Update(const std::string& head, int64_t version, const HeadWeights& full,
                      const std::function<absl::Status()>& front_part);

 private:
  // Runs `op` under the group lock; a failure that leaves the group unusable (UNAVAILABLE from a
  // collective, INTERNAL from ranks that no longer agree) marks it failed.
  template <typename T, typename F>
  T Locked(F&& op);
  absl::Status ComputeLocked(const std::string& head, int64_t version, LceEngine& local, const RowsView& rows,
                             const LceOptions& o, const Upstream& up, const RowOutputs& outputs, const GradOutputs& grads);
  // ComputeLocked's inputs as this rank's engine takes them, after they went to the peers.
  struct SharedInputs {
    RowsView rows;
    Upstream up;
  };
  absl::StatusOr<SharedInputs> ShareInputs(const HeadShape& shape, const RowsView& rows, const Upstream& up);
  absl::Status ComputeStaged(LceEngine& local, const RowsView& view, const LceOptions& o, const Upstream& up,
                             const RowOutputs& outputs, const GradOutputs& grads);
  absl::Status Fail(absl::Status s);
  // An operation on the peers' dW of `head` (ZeroGrad, CommitPending, ReleasePending).
  absl::Status GradOp(const std::string& head, TpOp op, uint64_t pending = 0, float scale = 1);

  TpCommunicator* comm_;
  std::unique_ptr<ChunkStaging> staging_;
  std::function<void(const absl::Status&)> on_failure_;
  std::mutex mu_;  // one operation at a time across the whole group
  bool failed_ = false;
  absl::Status failure_;  // what made it fail
};

// Rank 0's engine of one head version, as requests call it: every call runs on the whole group. Its
// shape() is the front's shard's (vocab_size is the whole head's).
class TpFrontEngine final : public LceEngine {
 public:
  TpFrontEngine(std::shared_ptr<TpGroup> group, std::string head, int64_t version, std::shared_ptr<LceEngine> local)
      : group_(std::move(group)), head_(std::move(head)), version_(version), local_(std::move(local)) {}

  std::string_view backend() const override { return local_->backend(); }
  const HeadShape& shape() const override { return local_->shape(); }
  EngineMemory memory() const override { return local_->memory(); }
  EngineInvariance invariance() const override { return local_->invariance(); }
  absl::Status Compute(const RowsView& rows, const LceOptions& options, const Upstream& upstream,
                       const RowOutputs& outputs, const GradOutputs& grads) override {
    return group_->Compute(head_, version_, *local_, rows, options, upstream, outputs, grads);
  }

 private:
  std::shared_ptr<TpGroup> group_;
  std::string head_;
  int64_t version_;
  std::shared_ptr<LceEngine> local_;
};

// A peer's first head: the one every rank loads at start (version 1).
struct PeerHeadStart {
  std::string name;
  std::shared_ptr<const HeadWeights> weights;
  std::shared_ptr<LceEngine> engine;
};

// A peer's loop: runs the operations the front broadcasts until it says stop (OK) or the group fails
// (UNAVAILABLE; or another error where this rank can no longer follow the front). `dp`: this rank's
// part in data-parallel replicas' steps (null: none).
absl::Status RunTpPeer(PeerHeadStart first, const EngineMaker& make_engine, TpCommunicator& comm, ChunkStaging& staging,
                       GradReducer* dp = nullptr);

}  // namespace lce::server
