// One streamed request (Score, ForwardBackward, Backward, PolicyLoss) on the server, from its header
// to its last answer, as named stages (Triton Inference Server's per-request state objects are the
// model):
//   Admit    the header read within its timeout and checked; the head's version held; a stream slot
//   per chunk:
//     Receive  the next message within the idle timeout
//     Accept   the chunk checked, its shared-memory slices resolved, the request's byte budget
//     Prepare  where its outputs go, its upstream gradients, its device staging
//     Compute  the engine call here and Answer; or Group: staged now beside the chunks before it,
//              and the group's one engine call computed and its chunks answered on the pipeline's
//              threads while the next chunks are read (RequestHeader.sends_ahead; streamed_request_groups.cc)
//   Finish   the pipeline drained, the declared counts checked, the summary, the last answers out
// The serial and the pipelined paths share every stage but the engine call's place.
#pragma once

#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "engine_call_pipeline.h"
#include "lce_service.h"
#include "stream_answer_writer.h"

namespace lce::server {

class StreamedRequest {
 public:
  using Stream = RequestStream;
  // `one_message`: a Call (one_message_stream.h), whose answers are written inline.
  StreamedRequest(LceService& service, RpcKind rpc, grpc::ServerContext* ctx, Stream* stream,
                  bool one_message = false);
  // Ends the pipeline (its steps finish first), then lets the queued answers out within the idle
  // timeout, however the request ended.
  ~StreamedRequest();
  StreamedRequest(const StreamedRequest&) = delete;
  StreamedRequest& operator=(const StreamedRequest&) = delete;

  // The whole request; its status is the RPC's. One that fails before its rows are done adds nothing
  // to dW (its pending contribution is released).
  absl::Status Run();

 private:
  // A chunk from its message to its answer. Two exist: on a pipelined stream chunk k computes while
  // chunk k+1 is read and staged.
  struct InFlightChunk {
    v1::StreamRequest msg;  // its message: the engine may read targets and hidden states from it
    v1::StreamResponse resp;
    RegionRegistry::Slice hidden_slice, dh_slice;  // mapped until the chunk is done
    std::vector<float> loss, grad;
    int64_t index = 0, first_row = 0, rows = 0, message_bytes = 0;
    const char* hidden = nullptr;  // its hidden states: in the message or a region
    RowsView view;
    RowOutputs outs;
    Upstream up;
    GradOutputs grads;
    bool device_path = false;  // a GPU engine's call through the stream's staging
    LceService::StagedCall staged;  // the call's views (device ones when staged)
  };
  // One admission slot, held for the life of the stream: one of the server's and, for a stream that
  // waits on its client, one of its client's share (`shares` null: none).
  class StreamSlot {
   public:
    StreamSlot(std::atomic<int64_t>& counter, int64_t limit) : counter_(counter) {
      admitted_ = counter_.fetch_add(1) < limit || limit <= 0;
    }
    ~StreamSlot() {
      counter_.fetch_sub(1);
      if (shares_ != nullptr && client_.ticket != 0) shares_->Release(client_.ticket);
    }
    bool admitted() const { return admitted_; }
    // One of the client's `cap`: false when it holds them all.
    bool TakeClientShare(ClientShares& shares, const std::string& peer, const std::string& token, int64_t cap) {
      client_ = shares.Acquire(peer, token, cap);
      shares_ = &shares;
      return client_.ticket != 0;
    }
    const std::string& client() const { return client_.client; }

   private:
    std::atomic<int64_t>& counter_;
    bool admitted_;
    ClientShares* shares_ = nullptr;
    ClientShares::Grant client_;
  };
  // A pipelined stream's consecutive chunks staged side by side, so that those queued behind a busy
  // engine make one call (Group): up to ServiceConfig::merge_chunk_rows rows and kMaxGroupChunks chunks,
  // in staging slot `slot`.
  static constexpr int64_t kMaxGroupChunks = 64;
  struct ChunkGroup {
    int slot = 0;
    int64_t rows = 0, capacity = 0;
    std::vector<InFlightChunk*> chunks;
  };
  // The stream's device stagings (two when pipelined), back to the service's pool at the end.
  struct StagingLease {
    LceService* service;
    std::unique_ptr<ChunkStaging> held[2];
    ~StagingLease() {
      for (auto& h : held) service->ReturnStaging(std::move(h));
    }
  };

  absl::Status Stages();
  absl::Status Admit();
  // A slot of the server's and of the client's share, or RESOURCE_EXHAUSTED saying which is full.
  absl::Status TakeSlot();
  absl::Status Receive(bool* more);
  absl::Status Accept(InFlightChunk& c);
  absl::Status ResolveRegions(InFlightChunk& c);
  absl::Status Prepare(InFlightChunk& c);
  void PlaceRowOutputs(InFlightChunk& c);
  absl::Status PlaceGradients(InFlightChunk& c);
  void SetUpstream(InFlightChunk& c);
  // Chunk groups (streamed_request_groups.cc): the chunk staged after the open group's rows and submitted
  // at once; the wait for a staging slot; whether a chunk is staged, may share a call, fits the group.
  absl::Status Group(InFlightChunk& c);
  // `group` > 0: the pipeline may merge its call with the group's chunks queued behind it (0: alone).
  absl::Status SubmitChunk(InFlightChunk& c, int64_t group, ChunkStaging* st);
  absl::Status WaitForSlot();
  // A call's error, named after the chunk whose row failed (the call computed `jobs` chunks from `first`).
  absl::Status CallError(int64_t first, int64_t jobs, const absl::Status& s);
  bool Staged(const InFlightChunk& c) const { return c.device_path || merging_; }
  bool Fits(int64_t rows) const {
    return group_.rows + rows <= group_.capacity && static_cast<int64_t>(group_.chunks.size()) < kMaxGroupChunks;
  }
  bool JoinsGroup(const InFlightChunk& c) const;
  // Device-memory hidden states and d_hidden of `c` right after the open group's (first chunk `f`).
  bool FollowsOnDevice(const InFlightChunk& c, const InFlightChunk& f) const;
  // The ring of in-flight chunks: two groups' worth (a chunk's place is free once the group two back is done).
  InFlightChunk& ChunkAt(int64_t index);
  absl::Status Compute(InFlightChunk& c);
  // Dynamic batching (dynamic_batcher.h): may the chunk's call be merged with other requests'; the
  // call through the batcher.
  bool Batchable(const InFlightChunk& c) const;
  absl::Status ComputeBatched(InFlightChunk& c);
  // PolicyLoss: the forward, the loss and its upstream gradients on the host, for the backward.
  absl::Status PolicyForward(InFlightChunk& c);
  absl::Status CallEngine(InFlightChunk& c, const char* what, const Upstream& up, const RowOutputs& outs,
                          const GradOutputs& grads);
  absl::Status Answer(InFlightChunk& c);
  absl::Status WaitOldest();
  absl::Status Finish();
  absl::Status CheckDeclaredCounts() const;
  absl::Status SendSummary();
  // ForwardBackward and PolicyLoss end with a summary, and so does a Backward that adds dW (its
  // pending id, deferred).
  bool SummaryFollows() const { return is_fb_ || is_pl_ || (is_bw_ && plan_->accumulate_weight_grad); }
  absl::Status ChunkError(const InFlightChunk& c, const absl::Status& s) const;
  // The request's pending dW committed (or, deferred, handed to CommitGrad) once its rows are done.
  absl::Status EndContribution();
  // `f()`, its time added to the request log's `acc` when the request is accounted.
  template <typename F>
  auto Timed(double RequestWork::*acc, F&& f);

  LceService& service_;
  const ServiceConfig& config_;
  const RpcKind rpc_;
  grpc::ServerContext* const ctx_;
  Stream* const stream_;
  RequestWork* const work_;
  const bool one_message_;
  const bool is_fb_, is_bw_, is_pl_;
  const char* const method_;
  const char* const op_;

  // Admit's.
  std::optional<RequestPlan> plan_;
  std::optional<HeadStore::Use> head_use_;  // the request runs start to end on this version of its head
  std::optional<StreamSlot> slot_;
  std::optional<StreamRequestValidator> validator_;
  int64_t row_bytes_ = 0, num_seq_ = 0;
  bool pipelined_ = false;
  bool merging_ = false;  // pipelined, with ServiceConfig::merge_chunk_rows > 1

  StagingLease staging_{&service_, {}};
  std::optional<StreamAnswerWriter<v1::StreamResponse>> writer_;
  v1::StreamRequest msg_;
  int64_t rows_seen_ = 0, valid_seen_ = 0, chunk_index_ = 0, bytes_seen_ = 0;
  double loss_sum_ = 0.0;
  PolicyLossSums policy_sums_;
  std::vector<int64_t> seq_seen_;
  std::vector<float> lp_buf_, ent_buf_, u_buf_, e_buf_, w_buf_;
  std::unique_ptr<bool[]> valid_buf_;
  std::vector<std::unique_ptr<InFlightChunk>> ring_;
  ChunkGroup group_;                 // the open group (no chunks: none)
  std::deque<int64_t> submitted_;    // the group of each chunk in the pipeline not yet waited for, oldest first
  int64_t groups_ = 0;               // groups opened (the open one's number)
  // A request that accumulates dW: its pending contribution while it runs (id 0: none), and the id
  // it leaves for CommitGrad when deferred.
  LceService::Contribution contribution_;
  uint64_t deferred_id_ = 0;
  // The stream's last chunk once the client has sent it (-1 before): where no summary follows, its
  // answer goes with the status (a pipelined chunk is usually answered after the client is done).
  std::atomic<int64_t> last_chunk_{-1};
  // Last: destroyed (its steps finished) before everything its steps use.
  std::unique_ptr<EngineCallPipeline> pipeline_;
};

}  // namespace lce::server
