// The data-parallel job as its fronts run it (dp_rank.h has the replicas and their links).
//
// The training calls that act on the whole job -- ZeroGrad, OptimizerStep, LoadHead, UpdateWeights,
// SaveHead -- are taken by any replica's front, which relays the call to replica 0's front, the
// job's sequencer. The sequencer applies calls one at a time: it calls the same RPC on every
// replica's front, itself included (SaveHead: only the front the client called, whose replica
// writes), with the client's credentials and two marks, the job's secret (no client can make one
// replica act alone) and the call's sequence number; each front then drives its own group as a
// server without replicas would. Why RPCs between fronts: any front may receive a call, and a front
// cannot wait on a collective whose root it does not know, so the call itself must travel. Why one
// sequencer: two calls received by two fronts at once must reach every replica in the same order, or
// the replicas' collectives would pair up wrong.
//
// A call that changes weights then meets on the fronts' control link (Gloo over TCP, host memory,
// patient enough for a front's requests on the head to drain) so that no replica changes unless
// every replica can (DpCall::Ready); an optimizer step's dW sum runs on every rank's own link.
// A replica that dies or stops answering takes the job's training down: the sequencer answers that
// call, and every later one, UNAVAILABLE naming it; every replica keeps scoring.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "dp_rank.h"
#include "grpcpp/server_context.h"
#include "lce/engine.h"
#include "lce/v1/lce.grpc.pb.h"

namespace lce::server {

struct DpJobOptions {
  DpOptions dp;
  // How long a front waits for the requests on a head to drain before a change
  // (ServiceConfig::weight_change_wait): the control link waits as long for the slowest front.
  absl::Duration change_wait = absl::Seconds(60);
  // This front's TLS files (empty cert: plaintext). With TLS the fronts call each other over TLS,
  // trusting `tls_ca`, and present this front's certificate where fronts require client certificates.
  std::string tls_cert, tls_key, tls_client_ca, tls_ca;
};

// DIR/fronts/front-<replica>.addr: a front's address, and the HMAC-SHA256 of it (and the replica)
// under the job's secret. A front calls another only at an address whose signature checks, so
// that a file planted in the directory cannot draw the job's calls, with the clients' tokens and
// the secret, elsewhere (issue 35, item 7). Reading: NOT_FOUND while none is published,
// PERMISSION_DENIED for one this job did not sign.
absl::Status PublishFrontAddress(const DpOptions& dp, int replica, const std::string& address, const std::string& secret);
absl::StatusOr<std::string> ReadFrontAddress(const DpOptions& dp, int replica, const std::string& secret);

// What a training call does in the job: whether every replica applies it (else only the front the
// client called), and whether the fronts meet before it changes weights.
struct DpCallKind {
  bool everywhere = true;
  bool meets = false;
};
inline DpCallKind KindOf(const v1::ZeroGradRequest&) { return {true, false}; }
inline DpCallKind KindOf(const v1::OptimizerStepRequest&) { return {true, true}; }
inline DpCallKind KindOf(const v1::LoadHeadRequest&) { return {true, true}; }
inline DpCallKind KindOf(const v1::SaveHeadRequest&) { return {false, false}; }

// The next message of a client's UpdateWeights stream: false at its end; an error where the wait
// ran out or the server refused the stream (LceService::UpdateWeights bounds each read).
using UpdateReader = std::function<absl::StatusOr<bool>(v1::UpdateWeightsRequest*)>;

// One front's call of an RPC on replica `replica`'s front; its answer stays with the caller.
using FrontCall = std::function<grpc::Status(int replica, v1::LceService::Stub& stub, grpc::ClientContext& ctx)>;

class DpJob {
 public:
  // This front's place in the job: meets the other fronts on the control link (DIR/fronts), checks
  // that every replica serves the same head shape on the same TP size, and shares the job's secret.
  static absl::StatusOr<std::shared_ptr<DpJob>> Join(const DpJobOptions& options, DpRank* front_rank,
                                                     const HeadShape& shape, int tp_size);
  // Where the other fronts reach this one (--dp-host and the gRPC port), once it serves.
  absl::Status Publish(int port);

  int replica() const { return options_.dp.replica; }
  int size() const { return options_.dp.size; }
  DpRank* front_rank() const { return front_rank_; }
  // Whether `ctx` claims to be the sequencer's forward (Route checks its mark).
  bool IsForward(grpc::ServerContext* ctx) const;

  // The call's route: nullopt when `ctx` is the sequencer's forward (apply it here, as call `*seq`);
  // else the job's answer, from the sequencer (`take(replica)` keeps that replica's answer).
  std::optional<absl::Status> Route(grpc::ServerContext* ctx, DpCallKind kind, const FrontCall& call,
                                    const std::function<void(int)>& take, int64_t* seq);
  // The fronts' meeting before call `seq` changes weights: OK when every front's `mine` is OK.
  absl::Status Meet(int64_t seq, const absl::Status& mine);

 private:
  struct Answer {
    absl::Status status;   // the front's answer (FromGrpcStatus), or why it could not be called
    bool reached = false;  // the front's handler answered (not the transport)
    bool dropped = false;  // cancelled by the sequencer once another replica was lost
    // A front that did not answer, or whose replica (links or group) is down.
    bool lost() const {
      return !status.ok() && !dropped && (!reached || status.code() == absl::StatusCode::kUnavailable);
    }
  };
  using Marks = std::map<std::string, std::string>;
  DpJob(DpJobOptions options, DpRank* front_rank, std::unique_ptr<TpCommunicator> control)
      : options_(std::move(options)), front_rank_(front_rank), control_(std::move(control)) {}
  absl::Status ShareSecret();
  bool Marked(grpc::ServerContext* ctx, const char* key, std::string* value) const;
  absl::StatusOr<v1::LceService::Stub*> Front(int replica);
  Answer CallFront(int replica, grpc::ServerContext* ctx, const Marks& marks, const FrontCall& call,
                   grpc::ClientContext& c);
  absl::Status Relay(grpc::ServerContext* ctx, const FrontCall& call);
  absl::Status Sequence(grpc::ServerContext* ctx, DpCallKind kind, int origin, const FrontCall& call);
  // Why the job's training is down after a call (empty: it is not).
  std::vector<std::string> LostReplicas(const std::vector<int>& replicas, const std::vector<Answer>& answers);
  absl::Status Combine(DpCallKind kind, const std::vector<int>& replicas, const std::vector<Answer>& answers);
  absl::Status CheckShapes(const HeadShape& shape, int tp_size);
  absl::Status LoseControl(const absl::Status& why);

  DpJobOptions options_;
  DpRank* front_rank_;
  std::unique_ptr<TpCommunicator> control_;
  std::unique_ptr<ChunkStaging> control_staging_ = CreateHostStaging();
  std::string secret_;  // the job's; only the fronts know it
  std::mutex sequence_mu_;  // the sequencer applies one call at a time
  int64_t sequence_ = 0;
  absl::Status down_;       // the sequencer's: why the job's training is down
  std::mutex meet_mu_;
  absl::Status control_health_;
  std::mutex fronts_mu_;
  std::map<int, std::unique_ptr<v1::LceService::Stub>> fronts_;
};

// One training RPC at a front of a data-parallel job; without a job it does nothing. Made first in
// each training RPC, after authentication:
//   DpCall dp = DpCall::Route(config_.dp_job.get(), ctx, &v1::LceService::Stub::ZeroGrad, *req, resp);
//   if (dp.answered()) return dp.answer();   // a client's call: the job answered it
//   ...                                      // the sequencer's forward: this replica's part
class DpCall {
 public:
  template <typename Req, typename Resp>
  using UnaryRpc = grpc::Status (v1::LceService::Stub::*)(grpc::ClientContext*, const Req&, Resp*);

  template <typename Req, typename Resp>
  static DpCall Route(DpJob* job, grpc::ServerContext* ctx, UnaryRpc<Req, Resp> rpc, const Req& req, Resp* resp) {
    if (job == nullptr) return DpCall();
    std::vector<Resp> answers(static_cast<size_t>(job->size()));
    return DpCall(job, ctx, KindOf(req), [&](int replica, v1::LceService::Stub& stub, grpc::ClientContext& c) {
      return (stub.*rpc)(&c, req, &answers[replica]);
    }, [&](int replica) { *resp = std::move(answers[replica]); });
  }
  // UpdateWeights: a client's stream is read whole through `next`, before any front is called (a
  // read that fails is the call's answer), then sent on.
  static DpCall RouteUpdate(DpJob* job, grpc::ServerContext* ctx, const UpdateReader& next, v1::HeadDescription* resp);

  DpCall() = default;
  DpCall(DpCall&& other) noexcept { *this = std::move(other); }
  DpCall& operator=(DpCall&& other) noexcept;
  DpCall(const DpCall&) = delete;
  // A forward that answers before Ready (e.g. its head is missing here) still meets the other fronts.
  ~DpCall();

  bool answered() const { return answer_.has_value(); }
  absl::Status answer() const { return *answer_; }
  // In a call that changes weights: meets every replica's front, with `mine` this front's outcome so
  // far (e.g. its wait for the head's requests to drain). OK when every replica can go on; else
  // nothing changes anywhere. Without a job: `mine`.
  absl::Status Ready(const absl::Status& mine);
  // This rank's part in an optimizer step (null without a job).
  GradReducer* reducer() const { return job_ != nullptr ? job_->front_rank() : nullptr; }
  // The job's dW is the sum of the replicas' dW: after a step that keeps dW, replica 0 keeps the sum
  // and the others zero theirs, so that the next step sums each accumulation once.
  bool ZeroesGradAfterStep() const { return job_ != nullptr && job_->replica() != 0; }

 private:
  DpCall(DpJob* job, grpc::ServerContext* ctx, DpCallKind kind, const FrontCall& call, const std::function<void(int)>& take);

  DpJob* job_ = nullptr;
  std::optional<absl::Status> answer_;
  int64_t seq_ = 0;
  bool must_meet_ = false;  // a forward that changes weights, not yet met
};

}  // namespace lce::server
