// C++ client of lce-serve (lce.v1.LceService): cuts a batch of hidden states into chunks, streams
// them, reads the answers concurrently and reassembles them in row order. Depends on the
// generated lce.v1 API and Abseil only.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "grpcpp/security/credentials.h"
#include "lce/v1/lce.grpc.pb.h"

namespace lce::client {

// Private to the library (its .h files under client/).
class HiddenCall;      // hidden_call.h
class WorkerPool;      // worker_pool.h
struct DataPlaneLane;  // part_stream.h: one stream's data-plane sockets
struct PartRequest;    // part_stream.h: what every stream of one request shares
struct RowGrads;       // part_stream.h: a request's per-row upstream gradients
struct PartSummary;    // answer_assembly.h: one stream's summary

// When one stream of a call reached each point (steady_clock, which every process on a host
// shares: a benchmark lines these up with the server's request log, `start_mono_us`).
struct StreamTrace {
  using Time = std::chrono::steady_clock::time_point;
  Time start;             // the stream's work began (its uploaders, over the data plane, start here)
  Time opened;            // the call was created (its initial metadata sent)
  Time first_chunk_sent;  // the first chunk's message was handed to gRPC (its bytes in, data plane)
  Time last_chunk_sent;   // the last one's
  Time first_answer;      // the first answer arrived
  Time last_answer;       // the last answer (or summary) arrived
  Time ended;             // the stream's status arrived (Finish returned)
};

// This library's version: the project's (the server's --version and GetInfo's server_version; the
// Python package's lce_client.__version__).
std::string_view Version();

struct ClientOptions {
  // The server: "host:port". Replicas (data-parallel groups serving one head, or any servers of the
  // same heads): several, comma-separated ("a:50051,b:50051"), or listed in `targets` instead.
  // Scoring calls (Score, Backward, ForwardBackward without accumulate_weight_grad) are spread over
  // the replicas in turn; everything that reads or changes a head's training state (requests with
  // accumulate_weight_grad, LoadHead, ZeroGrad, GetGrad, OptimizerStep, UpdateWeights, SaveHead),
  // GetInfo, Health and co-located sessions (OpenSession, and the requests that name their regions)
  // go to the front: the first target.
  std::string target;
  std::vector<std::string> targets;        // the replicas as a list (then `target` stays empty)
  // "" (default): one channel per target, spread by this client. "round_robin": `target` is one
  // gRPC name whose resolver gives several addresses (dns:///fronts.ns.svc:50051, a Kubernetes
  // headless Service; or ipv4:10.0.0.1:50051,10.0.0.2:50051), and gRPC's round_robin policy spreads
  // scoring calls over them; the front is a second channel with pick_first over the same name (its
  // first address that answers). data_plane needs listed targets (a session lives on one server).
  std::string load_balancing;
  // Scoring calls that fail with UNAVAILABLE (a replica died, or its group lost a rank) are sent
  // again, whole, to the next replica: at most max_attempts in all, attempt k+1 after
  // retry_backoff * 2^(k-1) (at most 1 s). They have no side effects, so a retry is safe; calls to
  // the front are not retried. 1: no retries; 0 (default): 3 over replicas (several targets, or
  // round_robin) and 1 for one server.
  int max_attempts = 0;
  absl::Duration retry_backoff = absl::Milliseconds(50);
  absl::Duration timeout = absl::Minutes(10);  // deadline of each call
  int64_t chunk_bytes = 4 << 20;           // hidden bytes per streamed chunk (at least one row)
  // Hidden bytes of each stream's first chunk (0: chunk_bytes). The server computes a chunk once it
  // has all of it; a smaller first chunk starts the GPU earlier (measured on an H100 host: no gain
  // at 8192x4096, where the wire binds; bench/RESULTS.md).
  int64_t first_chunk_bytes = 0;
  // After a smaller first chunk, each chunk twice the one before up to chunk_bytes (1, 2, 4, 8, 16,
  // 16, ... MiB), so that each arrives while the one before computes: the GPU does not wait for a
  // full chunk after a small first one (the pipeline's fill). Once what is left fits in chunk_bytes,
  // one chunk takes it (each engine call costs ≈0.3 ms beyond its rows: a small remainder was one
  // more). Measured on an H100 over the data plane with pipelined streams, 8192x4096 bf16
  // (bench/RESULTS.md): best for scores with a 4 MiB first chunk and chunk_bytes of 36 MiB (4, 8, 16,
  // 36 MiB: 1.12-1.15x the engine's time in three runs of four); for train, 16 MiB chunks with a
  // 1 MiB first and last did as well or better. Off by default.
  bool grow_chunks = false;
  // Hidden bytes of each stream's last chunk (0: what is left) in calls that return d_hidden.
  // Nothing overlaps the last chunk's compute and answer; a smaller one shortens that tail. Scores
  // ignore it: their last answer is a few floats, and a smaller last chunk only adds an engine call.
  int64_t last_chunk_bytes = 0;
  // A request that fits one chunk (and does not go over the data plane) goes as one LceService.Call:
  // one message each way, no stream to set up and no round trip a message (a few rows: ~0.7 ms less
  // a call). Against a server without Call the client streams. False: always stream.
  bool single_message_calls = true;
  std::shared_ptr<grpc::ChannelCredentials> credentials;  // null: insecure
  std::string bearer_token;                // sent as "authorization: Bearer <token>" when set
  // Sent instead of bearer_token on the training RPCs (LoadHead, ZeroGrad, GetGrad, OptimizerStep,
  // UpdateWeights, SaveHead), which need the server's admin token; empty: bearer_token.
  std::string admin_token;
  int64_t max_message_bytes = 64 << 20;
  // A request with more than 2 * min_stream_bytes of hidden states is split into up to `streams`
  // row ranges, each sent as its own stream (RequestHeader.partial) on its own connection, all at
  // once: one HTTP/2 connection carries about 1 GB/s on loopback, several carry several times that.
  // The answers are the same as over one stream; the parts of one that accumulates dW fill one
  // contribution on the server (RequestHeader.split_id). Requests whose hidden states are in a region
  // are never split (no bytes to carry). 4 (measured on an H200 host, bench/RESULTS.md 2026-11-27
  // session 6: a 16384x4096 bf16 train request 178 -> 138 ms end to end; 1: never split).
  int streams = 4;
  int64_t min_stream_bytes = 8 << 20;
  // HTTP/2 flow-control window per stream for the answers (grpc.http2.lookahead_bytes); 0: gRPC's.
  int64_t http2_window_bytes = 0;
  // Extra integer gRPC channel arguments (transport tuning), e.g. {"grpc.http2.max_frame_size", 16777215}.
  std::vector<std::pair<std::string, int>> channel_args;
  // Remote clients: carry hidden states and d_hidden over the server's data plane (plain TCP beside
  // gRPC, GetInfoResponse.data_port) instead of inside the gRPC messages, which then name slices of
  // server memory as co-located requests name slices of shared memory. Each stream of a request
  // (see `streams`) gets data_plane_sockets sockets per direction, each uploading its share of
  // every chunk in turn; a chunk's message goes once its bytes are in, and its d_hidden is fetched
  // as its answer arrives, so transfer and compute overlap. The first such call
  // opens a session holding two server-memory regions sized to the batch (grown when a batch is
  // larger); calls over the data plane take turns. FAILED_PRECONDITION: the server has no data
  // plane. Batches with hidden_region or d_hidden_region set do not use it.
  bool data_plane = false;
  // Sockets per direction per stream on the data plane: each chunk's bytes are split over them and
  // move at once (one loopback socket carries 2.6–4.5 GB/s on an H100 host, four 9–12 GB/s).
  // Measured best there for 8192×4096 bf16 (bench/RESULTS.md): one stream, 4 sockets; for train a
  // first and last chunk of 1 MiB and 16 MiB chunks, for score growing chunks (see grow_chunks).
  int data_plane_sockets = 4;
  // Streams a request over the data plane is split over (at most `streams`): 1 by default, one stream's chunks
  // merging into the server's largest engine calls. Measured on 4× H200 (bench/RESULTS.md, 2026-11-29 session 21,
  // 16384×4096 bf16 train requests end to end): one GPU 97.9–99.2 ms over 1 stream, 101.5–102.8 over 2 and 105.7–105.8
  // over 4; a TP-4 group 39.5–40.9, 43.7–48.6 and 50.1–51.4.
  int data_plane_streams = 1;
  // A server whose data plane speaks TLS (lce_server --data-plane-tls, GetInfoResponse.data_plane_tls)
  // gets TLS sockets, its certificate checked against this PEM CA file and the target's host ("": the
  // system's CAs). TLS costs throughput: lce_transport_bench --data-plane-tls measures it.
  std::string data_plane_tls_ca;
  // Called after each stream of a call ends, on the thread that ran it (benchmarks: where a call's
  // time goes). Empty: no timestamps are taken.
  std::function<void(const StreamTrace&)> stream_trace;
};

// Where a co-located batch's bytes are: `offset` into region `region_id` of session `session_id`
// (SharedMemorySession::Region::Ref). Rows follow each other from there, row-major.
struct RegionRef {
  std::string session_id;
  uint64_t region_id = 0;
  int64_t offset = 0;
  // The session's secret, sent beside its id (the server opens a session's regions to neither alone).
  // Empty: the secret of the session of that id this client opened (LceClient::OpenSession).
  std::string session_secret;
};

// A batch of rows, borrowed (not copied) for the duration of a call.
struct HiddenBatch {
  v1::DType dtype = v1::DTYPE_BFLOAT16;
  int64_t rows = 0;
  int64_t hidden_size = 0;
  absl::Span<const uint8_t> hidden;   // rows * hidden_size elements of dtype, little-endian
  absl::Span<const int32_t> targets;  // rows
  // Co-located (OpenSession): the server reads the hidden states from this region instead (then
  // `hidden` is not sent and may be empty) ...
  std::optional<RegionRef> hidden_region;
  // ... and writes d_hidden into this one, in place (ForwardBackward/Backward); the result's
  // d_hidden is then empty (Score ignores it). Both regions must belong to one session.
  std::optional<RegionRef> d_hidden_region;
  // Or d_hidden from the wire lands here (rows * hidden_size elements of dtype), not in the
  // result's d_hidden, which is then empty: a caller that owns the destination saves a copy, and,
  // reusing it, the result's allocation and zeroing (tens of ms at 128 MiB: started with the request
  // on a thread of its own, it still adds ~8 ms to a 16384x4096 request on an H200 host).
  absl::Span<uint8_t> d_hidden_out;
};

// A co-located session (lce.v1 OpenSession): shared-memory regions registered with the server, owned
// by this object. Destroying it ends the session (the server unmaps every region) and unmaps and
// unlinks the regions it created. Thread-safe.
class SharedMemorySession {
 public:
  struct Region {
    uint64_t id = 0;
    std::string shm_name;        // "": a memfd (CreateRegion), handed over as a file descriptor
    absl::Span<uint8_t> bytes;   // this process's mapping, writable
    int fd = -1;                 // the memfd, open while the region is (owned by the session)
    std::string session_id;
    std::string session_secret;  // the session's (SharedMemorySession::secret)
    RegionRef Ref(int64_t offset = 0) const { return RegionRef{session_id, id, offset, session_secret}; }
  };

  ~SharedMemorySession();
  SharedMemorySession(const SharedMemorySession&) = delete;
  SharedMemorySession& operator=(const SharedMemorySession&) = delete;

  const std::string& id() const { return session_id_; }
  // The session's secret (SessionResponse.session_secret): proves on the data plane and the shm
  // socket that a connection belongs to this session. Keep it private.
  const std::string& secret() const { return secret_; }
  // The server's shm socket ("": none).
  const std::string& shm_socket() const { return shm_socket_; }
  // Creates shared memory of `bytes` (a memfd: no name another process could open), maps it here and
  // hands it to the server as a file descriptor over its shm socket.
  absl::StatusOr<Region> CreateRegion(int64_t bytes, const std::string& name = "");
  // Unregisters a region created here, unmaps and closes it.
  absl::Status ReleaseRegion(uint64_t region_id);
  // Registers [offset, offset + byte_size) of the file `fd` (a memfd or shm object of this process,
  // opened read-write; this process keeps its descriptor) over the server's shm socket; returns the
  // region id. FAILED_PRECONDITION: the server has no shm socket.
  absl::StatusOr<uint64_t> RegisterFd(int fd, int64_t offset, int64_t byte_size, const std::string& name = "");
  // Registers [offset, offset + byte_size) of an existing shm object by its name; returns the region
  // id. Only servers started with --allow-shm-by-name accept it (PERMISSION_DENIED otherwise).
  absl::StatusOr<uint64_t> Register(const std::string& shm_name, int64_t offset, int64_t byte_size,
                                    const std::string& name = "");
  absl::Status Unregister(uint64_t region_id);
  // Registers [offset, offset + byte_size) of a CUDA allocation of this process by its IPC handle
  // (the 64 bytes of the cudaIpcMemHandle_t that cudaIpcGetMemHandle gave for the allocation; offset
  // counts from the allocation's start). The server reads hidden states and writes d_hidden there
  // on its GPU; keep the allocation alive while registered and synchronize your writes before a
  // request. A server without a GPU engine answers UNIMPLEMENTED. Returns the region id (use it in
  // RegionRef with id()).
  absl::StatusOr<uint64_t> RegisterCudaIpc(absl::string_view ipc_handle, int64_t offset, int64_t byte_size,
                                           const std::string& name = "");
  // Has the server allocate `byte_size` bytes of its own memory for this session (remote clients:
  // fill and drain it over the data plane, ClientOptions.data_plane). FAILED_PRECONDITION: the
  // server has no data plane; RESOURCE_EXHAUSTED: beyond its per-session limit. Returns the region id.
  absl::StatusOr<uint64_t> AllocateServerMemory(int64_t byte_size, const std::string& name = "");
  // Cancels the session stream, as a client that goes away would (the server releases the regions).
  void Cancel() { ctx_.TryCancel(); }

 private:
  friend class LceClient;
  SharedMemorySession() = default;
  absl::StatusOr<v1::SessionResponse> Ask(const v1::SessionRequest& req);
  // Ask for a RegisterRegion request: the new region's id.
  absl::StatusOr<uint64_t> AskRegionId(const v1::SessionRequest& req);
  struct Owned {
    uint64_t id;
    int fd;
    void* addr;
    size_t len;
  };
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionResponse>> stream_;
  std::string session_id_, secret_, shm_socket_;
  std::mutex mu_;
  bool broken_ = false;
  std::vector<Owned> owned_;
};

// Per-row rankings (OUTPUT_ARGMAX, OUTPUT_TOP_K with RequestHeader.top_k = k): argmax [rows];
// top_tokens and top_logprobs [rows, k] row-major, most probable first. Empty when not selected.
struct Rankings {
  std::vector<int32_t> argmax;
  std::vector<int32_t> top_tokens;
  std::vector<float> top_logprobs;
};

struct ScoreResult {
  std::vector<float> logprobs, entropy;
  Rankings rankings;
};

struct ForwardBackwardResult {
  std::vector<float> loss, logprobs, entropy;  // per token, when selected in the header
  std::vector<float> z_loss;                   // per token, with OUTPUT_Z_LOSS
  Rankings rankings;
  std::vector<uint8_t> d_hidden;               // rows * hidden_size elements of the batch's dtype
  double reduced_loss = 0;
  int64_t valid_tokens = 0;
  int64_t head_version = 0;
  // RequestHeader.defer_weight_grad: the pending weight-gradient contributions (one a stream), for
  // CommitGrad.
  std::vector<uint64_t> pending_grads;
};

struct BackwardResult {
  std::vector<uint8_t> d_hidden;
};

// A head's accumulated fp32 gradient dW [rows, cols] (GetGrad), row-major.
struct Gradient {
  int64_t rows = 0, cols = 0;
  std::vector<float> values;
};

// A whole weight [rows, cols] of `dtype` for UpdateWeights, borrowed for the call.
struct WeightTensor {
  v1::DType dtype = v1::DTYPE_BFLOAT16;
  int64_t rows = 0, cols = 0;
  absl::Span<const uint8_t> bytes;  // rows * cols elements of dtype, little-endian, row-major
  absl::Span<const float> bias;     // a head with a bias: its new bias (rows values); empty keeps it
};

class LceClient {
 public:
  static absl::StatusOr<std::unique_ptr<LceClient>> Create(const ClientOptions& options);
  ~LceClient();

  absl::StatusOr<v1::GetInfoResponse> GetInfo(const std::string& head = "");
  // grpc.health.v1 Check of `service` ("" = the server as a whole): true when SERVING.
  absl::StatusOr<bool> Health(const std::string& service = "");

  // `header` carries the options; the client fills hidden_size and dtype from the batch.
  absl::StatusOr<ScoreResult> Score(const HiddenBatch& batch, v1::RequestHeader header);
  // For REDUCTION_MEAN (or unspecified) the client fills num_valid_tokens from the targets when
  // the caller left it unset. grad_loss (REDUCTION_NONE only) is one value per row, or empty.
  absl::StatusOr<ForwardBackwardResult> ForwardBackward(const HiddenBatch& batch, v1::RequestHeader header,
                                                        absl::Span<const float> grad_loss = {});
  absl::StatusOr<BackwardResult> Backward(const HiddenBatch& batch, v1::RequestHeader header,
                                          absl::Span<const float> grad_logprob, absl::Span<const float> grad_entropy);

  // Training the head on the server (the front; ClientOptions.admin_token when set). Heads are
  // named; "" is the server's default head.
  // Adds or replaces a head from a safetensors file on the server, a clone, or a seed.
  absl::StatusOr<v1::HeadDescription> LoadHead(const v1::LoadHeadRequest& request);
  absl::Status ZeroGrad(const std::string& head = "");
  // Adds a deferred request's pending weight gradient (ForwardBackwardResult.pending_grads) times
  // `scale` (its loss's upstream gradient) to the head's dW, or drops it (`discard`). Scoring token.
  absl::Status CommitGrad(const std::string& head, uint64_t pending_grad, float scale = 1.0f, bool discard = false);
  // The gradient accumulated by requests with accumulate_weight_grad, all shards in row order; with
  // `bias`, the bias's gradient dB [vocab, 1] instead of dW (a head with a bias).
  absl::StatusOr<Gradient> GetGrad(const std::string& head = "", bool bias = false);
  // One AdamW step (zero hyper-parameters take the server's defaults: OptimizerStepRequest).
  absl::StatusOr<v1::OptimizerStepResponse> OptimizerStep(const v1::OptimizerStepRequest& request);
  // Replaces the head's weight, streamed in blocks of about chunk_bytes; expected_version != 0
  // applies it only at that version (FAILED_PRECONDITION otherwise).
  absl::StatusOr<v1::HeadDescription> UpdateWeights(const std::string& head, const WeightTensor& weight,
                                                    int64_t expected_version = 0);
  // Writes the head as safetensors into `directory` on the server.
  absl::StatusOr<v1::SaveHeadResponse> SaveHead(const std::string& head, const std::string& directory);

  // Opens a co-located session (server on this host) on the front: see SharedMemorySession and
  // HiddenBatch's hidden_region / d_hidden_region.
  absl::StatusOr<std::unique_ptr<SharedMemorySession>> OpenSession();

  // The replicas' targets, the front first (with load_balancing "round_robin": the one name).
  std::vector<std::string> replica_targets() const;
  int64_t replicas() const { return static_cast<int64_t>(replicas_.size()); }

  // Hidden bytes per streamed chunk (at least one row); changeable between calls, e.g. to cut the
  // same batch differently. Not thread-safe with calls in flight.
  int64_t chunk_bytes() const { return options_.chunk_bytes; }
  void set_chunk_bytes(int64_t bytes) { options_.chunk_bytes = bytes; }

 private:
  explicit LceClient(ClientOptions options);
  struct DataPlane;  // the session, regions and sockets of ClientOptions.data_plane
  struct Replica;    // one server (or round_robin name): its channels, stubs and data plane
  // A streaming call: on the front (training, regions), or spread over the replicas with retries
  // on UNAVAILABLE (StreamOn on each).
  absl::Status Stream(const char* rpc, const HiddenBatch& batch, const v1::RequestHeader& header, const RowGrads& grads,
                      ForwardBackwardResult* out);
  // The call on one replica: its rows split into streams (PartStream each), their answers put
  // together (AnswerAssembly).
  absl::Status StreamOn(Replica& replica, const char* rpc, const HiddenBatch& batch, const v1::RequestHeader& header,
                        const RowGrads& grads, ForwardBackwardResult* out);
  // Prepares the replica's data plane for `parts` streams of `routed` and points `routed` at its
  // server memory (the bytes then travel over `lanes`, one a stream); under DataPlane::mu.
  absl::Status RouteOverDataPlane(Replica& replica, bool wants_d_hidden, size_t parts, HiddenBatch& routed,
                                  std::vector<DataPlaneLane>& lanes);
  void ConnectExtraChannels(Replica& replica);
  // Runs the request's parts at once, one stream each (the first on this thread); the first
  // failure cancels the others.
  absl::Status RunParts(Replica& replica, const PartRequest& request,
                        const std::vector<std::pair<int64_t, int64_t>>& parts, const std::vector<DataPlaneLane>& lanes,
                        std::vector<PartSummary>& summaries);
  // The replica for a scoring call's next attempt: from `start` (the call's turn) on, the first that
  // has not failed this call (`failed`, by index), preferring one whose connection is not known to be
  // down; `start` again once all have failed.
  size_t PickReplica(size_t start, const std::vector<bool>& failed);
  absl::StatusOr<v1::GetInfoResponse> GetInfoOn(Replica& replica, const std::string& head);
  absl::StatusOr<std::unique_ptr<SharedMemorySession>> OpenSessionOn(v1::LceService::Stub& stub);
  // Opens (or reopens, or grows) what the data plane needs for a batch of `hidden_bytes` split in
  // `parts` streams; called under DataPlane::mu.
  absl::Status PrepareDataPlane(Replica& replica, size_t parts, int64_t hidden_bytes, bool d_hidden);
  // A call's deadline and bearer token (the admin token for training RPCs, where one is set).
  void Prepare(grpc::ClientContext* ctx, bool admin = false) const;
  // The session metadata of a batch that names regions: their session's id and secret.
  void AddSessionMetadata(grpc::ClientContext* ctx, const HiddenBatch& batch) const;

  ClientOptions options_;
  // The scoring replicas; replicas_[0] is the front too, except with round_robin, where the front
  // is its own pick_first channel (front_owned_).
  std::vector<std::unique_ptr<Replica>> replicas_;
  std::unique_ptr<Replica> front_owned_;
  Replica* front_ = nullptr;
  std::atomic<uint64_t> next_replica_{0};
  std::atomic<bool> no_call_{false};  // the server has no LceService.Call: requests stream
  // Runs each stream's writer, uploaders and download shares, and a split request's extra streams.
  std::unique_ptr<WorkerPool> workers_;
  // The secrets of the sessions this client opened, by id: for RegionRefs made without one.
  mutable std::mutex secrets_mu_;
  std::map<std::string, std::string> session_secrets_;
};

// Splits `rows` rows of `row_bytes` into at most `streams` contiguous [first, count) ranges of at
// least `min_stream_bytes` each (one range when the batch is smaller than two), each a whole number
// of chunks of `chunk_bytes` where possible.
std::vector<std::pair<int64_t, int64_t>> PlanStreams(int64_t rows, int64_t row_bytes, int64_t chunk_bytes, int streams,
                                                     int64_t min_stream_bytes);

// Plans the chunks of a batch: [first_row, rows) pairs of at most max(1, chunk_bytes / row_bytes) rows;
// with first_chunk_bytes > 0 the first chunk holds at most max(1, first_chunk_bytes / row_bytes), and
// with last_chunk_bytes > 0 the last one at most max(1, last_chunk_bytes / row_bytes) rows (where the
// batch has more rows than those two chunks); with `grow`, each chunk after the first at most twice
// the one before.
std::vector<std::pair<int64_t, int64_t>> PlanChunks(int64_t rows, int64_t row_bytes, int64_t chunk_bytes,
                                                    int64_t first_chunk_bytes = 0, int64_t last_chunk_bytes = 0,
                                                    bool grow = false);

// Bytes per element of a wire dtype (0 for DTYPE_UNSPECIFIED).
int64_t WireDTypeSize(v1::DType dtype);

}  // namespace lce::client
