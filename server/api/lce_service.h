// The lce.v1.LceService implementation: translates streamed requests into engine calls on the
// head they name and streams the answers back, chunk by chunk. Validation happens before any math.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "chunk_staging.h"
#include "client_shares.h"
#include "dynamic_batcher.h"
#include "grpc_status.h"
#include "head_store.h"
#include "lce/v1/lce.grpc.pb.h"
#include "region_registry.h"
#include "request_authenticator.h"
#include "request_log.h"
#include "request_stream.h"
#include "request_validator.h"
#include "service_metrics.h"
#include "stream_watchdog.h"
#include "tp_group.h"

namespace lce::server {

class DpJob;  // dp_job.h

struct ServiceConfig {
  RequestLimits limits;
  int64_t max_message_bytes = 64 << 20;
  // Admission: streams beyond this many at once get RESOURCE_EXHAUSTED at once (0: no limit).
  int64_t max_concurrent_streams = 0;
  // ... and beyond this many of one client's (client_shares.h: host, token, a loopback peer's uid),
  // so that one client cannot hold every slot (issue 35, item 8). 0: half of max_concurrent_streams;
  // -1: no cap. Calls (one message each way) hold a slot only while computed, and are not counted.
  int64_t max_streams_per_client = 0;
  // Largest total hidden bytes of one request (0: no limit).
  int64_t max_request_bytes = 0;
  // Waits on a silent client, in seconds (0: no limit); gRPC's sync reads and writes have no
  // deadline of their own. A stream must send its header within the first (it takes no admission
  // slot meanwhile), then send each next message, and read each answer, within the second. Past
  // either, the call ends DEADLINE_EXCEEDED naming the wait.
  double stream_header_timeout_seconds = 10;
  // Sessions (OpenSession) one client (client_shares.h: host, token, a loopback peer's uid) may hold
  // at once (0: no limit); more get RESOURCE_EXHAUSTED.
  int64_t max_sessions_per_peer = 64;
  double stream_idle_timeout_seconds = 60;
  // Largest head shard LoadHead builds, in weight bytes (0: the host's memory).
  int64_t max_head_bytes = 0;
  int tp_size = 1;
  // The GPU of the engine (CUDA backend: one GPU's, or a tensor-parallel group's front's): requests
  // stage their chunks there on their own threads, CUDA IPC regions are opened there, and requests
  // that use them run on device memory. -1: host memory.
  int cuda_device = -1;
  RequestAuthenticator auth;
  // One JSON line per finished RPC on stderr (request_log.h).
  bool log_requests = false;
  // On a GPU engine (cuda_device >= 0, or a CUDA tensor-parallel group's front), streams whose client
  // sends ahead (RequestHeader.sends_ahead) run their engine calls on an EngineCallPipeline: chunk k
  // computes while chunk k+1 is read and staged and chunk k-1 answered.
  bool pipeline_chunks = true;
  // The same on CPU engines. Off in servers: the CPU engine computes on the cores that would do the
  // host work, and its OpenMP teams, made anew for each stream's pipeline thread, measured 5 -> 72 ms
  // for a 1024-row score on two cores. The in-process test server turns it on, so that CI covers the
  // pipelined stream.
  bool pipeline_chunks_on_cpu = false;
  // A pipelined stream's chunks that queue up behind a busy engine go to it together, in calls of up to
  // this many rows (and 64 chunks), staged side by side: at the clients' 512-row chunks each call would
  // re-read and re-write the request's fp32 dW (H200, 16384×4096×151936: 119 ms of engine time in 32
  // calls, 80 ms in 8; bench/RESULTS.md). 0 or 1: one call a chunk.
  int64_t merge_chunk_rows = 2048;
  // Dynamic batching of small Calls (dynamic_batcher.h; --batch-max-rows, --batch-max-delay-us):
  // Scores, and ForwardBackwards and Backwards that do not accumulate dW, of at most max_rows rows
  // whose hidden states are in the message, on engines that give a row the same bits in any batch.
  DynamicBatcher::Options batching;
  // Metrics to update (null: none). Not owned.
  ServiceMetrics* metrics = nullptr;
  // The tensor-parallel group this server fronts (null without one): new heads and versions are
  // served through it, and training RPCs drive the peers through it.
  std::shared_ptr<TpGroup> tp_group;
  // The data-parallel job this server's group is a replica of (null without one): the training RPCs
  // that act on the whole job go through it (dp_job.h).
  std::shared_ptr<DpJob> dp_job;
  // Builds the engine of a new head version (LoadHead; UpdateWeights and OptimizerStep on CPU engines).
  EngineMaker make_engine;
  // Pending weight-gradient contributions (docs/MATH.md, "When dW is committed"): how many a head
  // holds and how long a deferred one waits for CommitGrad.
  PendingGradLimits pending_grads;
  // How long a weight change (OptimizerStep, UpdateWeights, LoadHead over a head) waits for the
  // requests running on the head to end (head_store.h) when the client set no earlier deadline.
  absl::Duration weight_change_wait = absl::Seconds(60);
};

// "OK", "INVALID_ARGUMENT", ...: the label value of a gRPC status code.
std::string StatusCodeName(grpc::StatusCode code);

class LceService final : public v1::LceService::Service {
 public:
  // Score, ForwardBackward, Backward and PolicyLoss are served from their messages' bytes
  // (request_stream.h), so a message that does not parse is an error, not the stream's end.
  LceService(std::shared_ptr<HeadStore> heads, ServiceConfig config);

  grpc::Status GetInfo(grpc::ServerContext* ctx, const v1::GetInfoRequest* req,
                       v1::GetInfoResponse* resp) override;

  // Training RPCs (lce_service_training.cc); admin token.
  grpc::Status LoadHead(grpc::ServerContext* ctx, const v1::LoadHeadRequest* req, v1::HeadDescription* resp) override;
  grpc::Status ZeroGrad(grpc::ServerContext* ctx, const v1::ZeroGradRequest* req, v1::ZeroGradResponse* resp) override;
  grpc::Status GetGrad(grpc::ServerContext* ctx, const v1::GetGradRequest* req,
                       grpc::ServerWriter<v1::TensorChunk>* writer) override;
  grpc::Status OptimizerStep(grpc::ServerContext* ctx, const v1::OptimizerStepRequest* req,
                             v1::OptimizerStepResponse* resp) override;
  grpc::Status UpdateWeights(grpc::ServerContext* ctx, grpc::ServerReader<v1::UpdateWeightsRequest>* reader,
                             v1::HeadDescription* resp) override;
  grpc::Status SaveHead(grpc::ServerContext* ctx, const v1::SaveHeadRequest* req, v1::SaveHeadResponse* resp) override;
  // A deferred request's pending dW added, scaled, or discarded (lce_service_pending.cc); scoring token.
  grpc::Status CommitGrad(grpc::ServerContext* ctx, const v1::CommitGradRequest* req,
                          v1::CommitGradResponse* resp) override;

  // Co-located clients: a session owning shared-memory regions (region_registry.h).
  grpc::Status OpenSession(grpc::ServerContext* ctx,
                           grpc::ServerReaderWriter<v1::SessionResponse, v1::SessionRequest>* stream) override;
  const RegionRegistry& regions() const { return regions_; }
  // lce_regions{kind} from the registry now (after a registration made outside a session's stream:
  // the shm socket's).
  void RecountRegions();
  RegionRegistry& mutable_regions() { return regions_; }
  // The data plane's port, reported by GetInfo (0: none). Set before serving.
  void set_data_port(int port) { data_port_ = port; }
  // GetInfoResponse.data_plane_tls: the data plane speaks TLS.
  void set_data_plane_tls(bool tls) { data_plane_tls_ = tls; }
  // SessionResponse.shm_socket: where co-located clients hand over their memory ("": nowhere).
  void set_shm_socket(const std::string& path) { shm_socket_ = path; }

 private:
  friend class StreamedRequest;  // a streamed request's stages (streamed_request.h)
  absl::Status GetInfoBody(grpc::ServerContext* ctx, const v1::GetInfoRequest* req, v1::GetInfoResponse* resp);
  absl::Status OpenSessionBody(grpc::ServerContext* ctx,
                               grpc::ServerReaderWriter<v1::SessionResponse, v1::SessionRequest>* stream);
  // `one_message`: a Call's stream (answers written inline, no writer thread).
  // Any of the four as one message each way (small requests), through the same stages. Served as a
  // streamed unary call: the request is ours to take the chunk from (no copy), and one that does
  // not parse is INVALID_ARGUMENT (gRPC's own answer would be INTERNAL).
  grpc::Status ServeCall(grpc::ServerContext* ctx, grpc::ServerUnaryStreamer<v1::CallRequest, v1::CallResponse>* call);
  // One of the four streamed computations, its messages as bytes.
  grpc::Status ServeStream(RpcKind rpc, grpc::ServerContext* ctx, ParsingStream::Raw* raw);
  absl::Status RunStream(RpcKind rpc, grpc::ServerContext* ctx, RequestStream* stream, bool one_message = false);
  // Reads the stream's header (within the header timeout) and checks it into *plan, holding the
  // version of its head the request will run on in *head_use.
  absl::Status ReadHeader(RpcKind rpc, grpc::ServerContext* ctx, RequestStream* stream,
                          std::optional<RequestPlan>* plan, std::optional<HeadStore::Use>* head_use);
  // A blocking wait on the client (a read of its next message, or a write it must read) bounded by
  // the watchdog: past `seconds` (0: no limit) the call is cancelled with DEADLINE_EXCEEDED and
  // `message` (the client sees both), counted as lce_admission_rejections_total{reason}.
  struct ClientWait {
    double seconds;
    const char* reason;
    std::string message;
  };
  ClientWait HeaderWait() const;
  ClientWait IdleWait(std::string what) const;
  // Runs `wait` (true/false as gRPC's Read and Write on `stream`) into *done under `limit`: OK, or
  // DEADLINE_EXCEEDED when it ran past the limit (the call is then cancelled). Unbounded where
  // the stream does not wait on its client (RequestStream::WaitsOnClient).
  absl::Status WithinLimit(grpc::ServerContext* ctx, const RequestStream& stream, const ClientWait& limit,
                           const std::function<bool()>& wait, bool* done);

  absl::Status Authenticate(grpc::ServerContext* ctx, Access access) const;
  // The caller's bearer token as part of its identity for per-client caps ("" without tokens).
  std::string ClientToken(grpc::ServerContext* ctx) const;
  // The streams one client may hold (max_streams_per_client resolved; <= 0: no cap).
  int64_t StreamsPerClient() const;
  // Runs one RPC body, counting it in the metrics (requests by code, duration, in flight); its
  // absl::Status becomes the RPC's grpc::Status here.
  template <typename F>
  grpc::Status Recorded(const char* method, grpc::ServerContext* ctx, F&& body);
  // One engine call, after waiting for the engine (one device, one call at a time); the wait is
  // the request's queue time.
  absl::Status RunEngine(const char* method, const char* op, LceEngine& engine, const RowsView& rows,
                         const LceOptions& options, const Upstream& up, const RowOutputs& out, const GradOutputs& grads);
  // One engine call of a GPU engine through the stream's device staging `st`: hidden states that
  // are on the host (bytes, shm) go up, the per-row arrays go up, and the per-row outputs (and a
  // d_hidden that is not in a device region) come back, all on the stream's own thread and CUDA
  // stream. Only the compute holds the engine, so one stream's copies overlap another's compute.
  // rows.hidden is device memory when hidden_on_device (a CUDA IPC region), else host memory.
  absl::Status RunEngineOnDevice(const char* method, const char* op, LceEngine& engine, ChunkStaging& st,
                                 const RowsView& rows, bool hidden_on_device, const LceOptions& options,
                                 const Upstream& up, const RowOutputs& out, const GradOutputs& grads,
                                 bool d_hidden_on_device);
  // RunEngineOnDevice in its three steps, for streams whose calls run on an EngineCallPipeline:
  // StageOnDevice queues the uploads into `st` and waits for them; the call's device views are then
  // ready for the engine; UnstageFromDevice brings the host outputs back (after the call).
  struct StagedCall {
    RowsView rows;
    Upstream up;
    RowOutputs outs;
    GradOutputs grads;
    // The per-row outputs that come back: host destination, device source, bytes.
    struct Download {
      void* host;
      const void* device;
      int64_t bytes;
    };
    std::vector<Download> downloads;
    void* host_d_hidden = nullptr;  // null when d_hidden is written in place on the device
    int64_t d_hidden_bytes = 0;
  };
  // `place`: the call's rows go at row `row0` of buffers sized for `capacity` rows (0: the call's own), so
  // that consecutive chunks staged side by side make one call (StreamedRequest's chunk groups); a group's
  // later chunks must give the same capacity, which keeps the buffers where they are.
  struct StagingPlace {
    int64_t row0, capacity;
  };
  absl::StatusOr<StagedCall> StageOnDevice(ChunkStaging& st, const RowsView& rows, bool hidden_on_device,
                                           int64_t row_bytes, int64_t vocab_size, int32_t top_k, const Upstream& up,
                                           const RowOutputs& out, const GradOutputs& grads, bool d_hidden_on_device,
                                           StagingPlace place = {0, 0});
  absl::Status UnstageFromDevice(ChunkStaging& st, const StagedCall& call);
  // Staging for one stream, reused across streams (allocation is slow, pinned or not): device memory,
  // or host memory on a server without a GPU engine (a CPU engine's merged chunks).
  absl::StatusOr<std::unique_ptr<ChunkStaging>> TakeStaging();
  void ReturnStaging(std::unique_ptr<ChunkStaging> staging);
  // Training (lce_service_training.cc). The header's plan, with the request's hold on its head's
  // version in `use`: validated again when the head changed while the request waited for a change.
  absl::StatusOr<RequestPlan> ValidateAndUse(const StreamRequestValidator& validator, const v1::RequestHeader& header,
                                             std::optional<HeadStore::Use>& use);
  // A request's contribution to its head's dW (lce_service_pending.cc): the pending buffer its engine
  // calls accumulate into (on every rank of a group, under the same id), from its first chunk to its
  // end, where it is committed with scale 1, left waiting for CommitGrad (deferred), or released.
  struct Contribution {
    uint64_t id = 0;
    float* d_weight = nullptr;
    float* d_bias = nullptr;  // in the same buffer, after dW (a head with a bias)
    bool zeroed = false;      // a split request's: every engine call adds to it (none is fresh)
  };
  // `split`, `parts`: RequestHeader.split_id and split_parts (0: a request of its own). The parts of a
  // split request share one contribution; ABORTED when it failed or is gone.
  absl::StatusOr<Contribution> BeginContribution(const ServedHead& head, uint64_t split, int parts);
  // A request's (a split request's part's) end, `ok` or failed: true when the contribution completed
  // here (committed with scale 1, or, `defer`, waiting for CommitGrad under its id, which this part's
  // summary reports; also when it was dropped meanwhile, for CommitGrad to say why). ABORTED for a
  // part that succeeded where another part failed.
  absl::StatusOr<bool> EndContribution(const ServedHead& head, uint64_t id, bool ok, bool defer);
  // EndContribution's work. Hold head.training->mu.
  absl::StatusOr<bool> EndPartLocked(const ServedHead& head, uint64_t id, bool ok, bool defer);
  // dW += scale × contribution `id` on every rank. Hold head.training->mu; `id` out of the book.
  absl::Status CommitContribution(const ServedHead& head, uint64_t id, float scale);
  // Frees contributions that left the book (on every rank) and counts them. Hold head.training->mu.
  void ReleaseContributions(const ServedHead& head, const std::vector<PendingGrads::Dropped>& dropped);
  // A LoadHead's clone source's current weight (null for other sources), and this rank's shard of
  // the source (`clone` for a clone) with the engine serving it.
  absl::StatusOr<std::shared_ptr<const HeadWeights>> CloneWeight(const TpHeadSource& source);
  absl::Status LoadOwnShard(const TpHeadSource& source, std::shared_ptr<const HeadWeights> clone,
                            std::shared_ptr<const HeadWeights>* weights, std::shared_ptr<LceEngine>* engine);
  // This rank's trainer of `head`, made at first use. Hold head.training->mu.
  absl::StatusOr<HeadTrainer*> TrainerOf(const ServedHead& head) const;
  // The exclusive right to change head `name`, once the requests on it have ended.
  absl::StatusOr<HeadStore::Change> BeginWeightChange(grpc::ServerContext* ctx, const std::string& name);
  // Head `name`'s version `version` served by this rank's `shard_engine` (through the group under TP).
  HeadVersion Serve(const std::string& name, int64_t version, std::shared_ptr<LceEngine> shard_engine,
                    std::shared_ptr<const HeadWeights> weights, std::shared_ptr<HeadTraining> training) const;

  std::shared_ptr<HeadStore> heads_;
  ServiceConfig config_;
  StreamWatchdog watchdog_;  // deadlines of the streams' waits on their clients
  std::atomic<int64_t> streams_in_flight_{0};
  ClientShares client_streams_;  // streams in flight by client
  ClientShares client_sessions_;  // open sessions by client
  std::mutex engine_mu_;
  std::mutex staging_pool_mu_;
  std::vector<std::unique_ptr<ChunkStaging>> staging_pool_;  // idle device stagings
  RegionRegistry regions_;
  DynamicBatcher batcher_;
  int data_port_ = 0;
  bool data_plane_tls_ = false;
  std::string shm_socket_;
};

template <typename F>
grpc::Status LceService::Recorded(const char* method, grpc::ServerContext* ctx, F&& body) {
  const std::string request_id = AssignRequestId(ctx);
  RequestWork work;  // its start is the request's
  if (config_.metrics != nullptr) config_.metrics->inflight.Increment();
  grpc::Status s;
  {
    RequestWork::Scope scope(&work);
    s = ToGrpcStatus(body());  // the edge: a body returns absl::Status (or, streamed, a gRPC one)
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - work.start).count();
  if (config_.metrics != nullptr) {
    ServiceMetrics& m = *config_.metrics;
    m.inflight.Decrement();
    m.requests.WithLabels({method, StatusCodeName(s.error_code())}).Increment();
    m.duration.WithLabels({method}).Observe(seconds);
  }
  if (config_.log_requests) LogRequest(request_id, method, ctx, s, seconds, work);
  return s;
}

}  // namespace lce::server
