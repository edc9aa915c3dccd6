#include "lce_service.h"

#include <atomic>
#include <optional>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "engine_call_pipeline.h"
#include "grpc/grpc.h"
#include "grpc_status.h"
#include "stream_answer_writer.h"
#include "wire_types.h"
#include "lce/training.h"

namespace lce::server {
namespace {

// The host of a gRPC peer string: "ipv4:10.0.0.1:5000" -> "10.0.0.1", "ipv6:[::1]:5000" -> "[::1]",
// anything else (a Unix socket) as it is.
std::string PeerHost(const std::string& peer) {
  for (const char* scheme : {"ipv4:", "ipv6:"}) {
    if (peer.rfind(scheme, 0) != 0) continue;
    const std::string addr = peer.substr(5);
    const size_t colon = addr.rfind(':');
    return colon == std::string::npos ? addr : addr.substr(0, colon);
  }
  return peer;
}

// Points a repeated float field at `n` new zeroed elements and returns their storage.
float* Grow(google::protobuf::RepeatedField<float>* field, int64_t n) {
  field->Resize(static_cast<int>(n), 0.0f);
  return field->mutable_data();
}

// Holds one admission slot for the life of a stream.
class StreamSlot {
 public:
  StreamSlot(std::atomic<int64_t>& counter, int64_t limit) : counter_(counter) {
    admitted_ = counter_.fetch_add(1) < limit || limit <= 0;
  }
  ~StreamSlot() { counter_.fetch_sub(1); }
  bool admitted() const { return admitted_; }

 private:
  std::atomic<int64_t>& counter_;
  bool admitted_;
};

}  // namespace

std::string StatusCodeName(grpc::StatusCode code) {
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
}

absl::Status LceService::RunEngine(const char* method, const char* op, LceEngine& engine, const RowsView& rows,
                                   const LceOptions& options, const Upstream& up, const RowOutputs& out,
                                   const GradOutputs& grads) {
  const auto t0 = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(engine_mu_);
  const auto t1 = std::chrono::steady_clock::now();
  absl::Status s = engine.Compute(rows, options, up, out, grads);
  const auto t2 = std::chrono::steady_clock::now();
  if (RequestWork* w = RequestWork::Current(); w != nullptr) {
    if (w->engine_calls == 0) w->first_call_start = t1;
    w->last_call_end = t2;
    ++w->engine_calls;
    w->engine_seconds += std::chrono::duration<double>(t2 - t1).count();
    w->queue_seconds += std::chrono::duration<double>(t1 - t0).count();
  }
  if (config_.metrics != nullptr) {
    config_.metrics->queue_wait.WithLabels({method}).Observe(std::chrono::duration<double>(t1 - t0).count());
    config_.metrics->engine_seconds.WithLabels({op, "compute"}).Observe(std::chrono::duration<double>(t2 - t1).count());
  }
  return s;
}

absl::StatusOr<std::unique_ptr<ChunkStaging>> LceService::TakeStaging() {
  {
    std::lock_guard<std::mutex> lock(staging_pool_mu_);
    if (!staging_pool_.empty()) {
      std::unique_ptr<ChunkStaging> s = std::move(staging_pool_.back());
      staging_pool_.pop_back();
      return s;
    }
  }
#ifdef LCE_WITH_CUDA
  return CreateDeviceStaging(config_.cuda_device);
#else
  return absl::UnimplementedError("this build has no CUDA backend");
#endif
}

void LceService::ReturnStaging(std::unique_ptr<ChunkStaging> staging) {
  if (staging == nullptr) return;
  // Each holds device buffers the size of the largest chunk it has seen: keep a few for the next
  // streams, free the rest (a burst of streams must not pin its peak of GPU memory for good).
  constexpr size_t kIdleStagings = 8;
  std::lock_guard<std::mutex> lock(staging_pool_mu_);
  if (staging_pool_.size() < kIdleStagings) staging_pool_.push_back(std::move(staging));
}

absl::Status LceService::RunEngineOnDevice(const char* method, const char* op, LceEngine& engine, ChunkStaging& st,
                                           const RowsView& rows, bool hidden_on_device, const LceOptions& options,
                                           const Upstream& up, const RowOutputs& out, const GradOutputs& grads,
                                           bool d_hidden_on_device) {
  const int64_t row_bytes = engine.shape().hidden_size * DTypeSize(engine.shape().dtype);
  absl::StatusOr<StagedCall> call = StageOnDevice(st, rows, hidden_on_device, row_bytes, up, out, grads, d_hidden_on_device);
  if (!call.ok()) return call.status();
  if (absl::Status s = RunEngine(method, op, engine, call->rows, options, call->up, call->outs, call->grads); !s.ok()) {
    return s;
  }
  return UnstageFromDevice(st, *call);
}

namespace {

// Adds the time since `start` to the request's staging time (request log) when it is accounted,
// and to `*also` (a part of it) when given.
void CountStaging(std::chrono::steady_clock::time_point start, double RequestWork::*also = nullptr) {
  if (RequestWork* work = RequestWork::Current(); work != nullptr) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    work->staging_seconds += s;
    if (also != nullptr) work->*also += s;
  }
}

}  // namespace

absl::StatusOr<LceService::StagedCall> LceService::StageOnDevice(ChunkStaging& st, const RowsView& rows,
                                                                 bool hidden_on_device, int64_t row_bytes,
                                                                 const Upstream& up, const RowOutputs& out,
                                                                 const GradOutputs& grads, bool d_hidden_on_device) {
  const int64_t n = rows.rows;
  // Slots: 0 targets; 1-3 grad_loss, grad_logprob, grad_entropy; 4-7 logprob, entropy, lse, loss;
  // 8 d_hidden; 9 hidden. Copies are queued, then waited for once (each wait is a GPU bubble).
  const auto start = std::chrono::steady_clock::now();
  auto up_array = [&](int slot, const void* host, int64_t bytes) -> absl::StatusOr<void*> {
    if (host == nullptr) return nullptr;
    absl::StatusOr<void*> d = st.Buffer(slot, bytes);
    if (!d.ok()) return d.status();
    if (absl::Status s = st.UploadAsync(*d, host, bytes); !s.ok()) return s;
    return *d;
  };
  absl::StatusOr<void*> hidden = hidden_on_device ? absl::StatusOr<void*>(const_cast<void*>(rows.hidden))
                                                  : up_array(9, rows.hidden, n * row_bytes);
  absl::StatusOr<void*> targets = up_array(0, rows.targets, n * 4);
  absl::StatusOr<void*> gl = up_array(1, up.grad_loss, n * 4);
  absl::StatusOr<void*> glp = up_array(2, up.grad_logprob, n * 4);
  absl::StatusOr<void*> gen = up_array(3, up.grad_entropy, n * 4);
  for (const auto* r : {&hidden, &targets, &gl, &glp, &gen}) {
    if (!r->ok()) return r->status();
  }
  StagedCall call;
  float* host_out[4] = {out.logprob, out.entropy, out.lse, out.loss};
  float* dev_out[4] = {nullptr, nullptr, nullptr, nullptr};
  for (int k = 0; k < 4; ++k) {
    call.host_out[k] = host_out[k];
    if (host_out[k] == nullptr) continue;
    absl::StatusOr<void*> d = st.Buffer(4 + k, n * 4);
    if (!d.ok()) return d.status();
    dev_out[k] = static_cast<float*>(*d);
  }
  call.grads.d_weight = grads.d_weight;  // the head's trainer's dW: device memory already
  if (grads.d_hidden != nullptr) {
    if (d_hidden_on_device) {
      call.grads.d_hidden = grads.d_hidden;
    } else {
      absl::StatusOr<void*> d = st.Buffer(8, n * row_bytes);
      if (!d.ok()) return d.status();
      call.grads.d_hidden = *d;
      call.host_d_hidden = grads.d_hidden;
      call.d_hidden_bytes = n * row_bytes;
    }
  }
  call.rows = RowsView{*hidden, static_cast<const int32_t*>(*targets), n, MemorySpace::kDevice, rows.targets_checked};
  call.up = Upstream{up.mode, static_cast<const float*>(*gl), static_cast<const float*>(*glp),
                     static_cast<const float*>(*gen)};
  call.outs = RowOutputs{dev_out[0], dev_out[1], dev_out[2], dev_out[3]};
  absl::Status s = st.Sync();
  CountStaging(start);
  if (!s.ok()) return s;
  return call;
}

absl::Status LceService::UnstageFromDevice(ChunkStaging& st, const StagedCall& call) {
  const auto start = std::chrono::steady_clock::now();
  absl::Status s = [&] {
    const float* dev_out[4] = {call.outs.logprob, call.outs.entropy, call.outs.lse, call.outs.loss};
    for (int k = 0; k < 4; ++k) {
      if (call.host_out[k] == nullptr) continue;
      if (absl::Status d = st.DownloadAsync(call.host_out[k], dev_out[k], call.rows.rows * 4); !d.ok()) return d;
    }
    if (call.host_d_hidden != nullptr) {
      if (absl::Status d = st.DownloadAsync(call.host_d_hidden, call.grads.d_hidden, call.d_hidden_bytes); !d.ok()) {
        return d;
      }
    }
    return st.Sync();
  }();
  CountStaging(start, &RequestWork::unstage_seconds);
  return s;
}

absl::Status LceService::Authenticate(grpc::ServerContext* ctx, Access access) const {
  if (!config_.auth.enabled()) return absl::OkStatus();
  const auto& md = ctx->client_metadata();
  auto it = md.find("authorization");
  const std::string value = it == md.end() ? std::string() : std::string(it->second.data(), it->second.size());
  return config_.auth.Check(value, access);
}

grpc::Status LceService::GetInfo(grpc::ServerContext* ctx, const v1::GetInfoRequest* req, v1::GetInfoResponse* resp) {
  return Recorded("GetInfo", ctx, [&] { return GetInfoBody(ctx, req, resp); });
}

grpc::Status LceService::GetInfoBody(grpc::ServerContext* ctx, const v1::GetInfoRequest* req, v1::GetInfoResponse* resp) {
  if (absl::Status s = Authenticate(ctx, Access::kScoring); !s.ok()) return ToGrpcStatus(s);
  absl::StatusOr<std::shared_ptr<const ServedHead>> head = heads_->Get(req->head());
  if (!head.ok()) return ToGrpcStatus(head.status());
  DescribeHead(**head, resp->mutable_head());
  for (const auto& h : heads_->List()) DescribeHead(*h, resp->add_heads());
  resp->set_backend(std::string((*head)->engine->backend()));
  resp->set_tp_size(config_.tp_size);
  resp->set_max_message_bytes(config_.max_message_bytes);
  resp->set_max_rows_per_request(config_.limits.max_rows_per_request);
  resp->set_server_version(LCE_SERVE_VERSION);
  resp->set_data_port(data_port_);
  const EngineInvariance inv = (*head)->engine->invariance();
  for (const std::string& o : inv.across_batches) resp->mutable_invariance()->add_across_batches(o);
  for (const std::string& o : inv.across_tp_sizes) resp->mutable_invariance()->add_across_tp_sizes(o);
  return grpc::Status::OK;
}

grpc::Status LceService::Score(grpc::ServerContext* ctx,
                               grpc::ServerReaderWriter<v1::StreamResponse, v1::StreamRequest>* stream) {
  return Recorded("Score", ctx, [&] { return RunStream(RpcKind::kScore, ctx, stream); });
}
grpc::Status LceService::ForwardBackward(grpc::ServerContext* ctx,
                                         grpc::ServerReaderWriter<v1::StreamResponse, v1::StreamRequest>* stream) {
  return Recorded("ForwardBackward", ctx, [&] { return RunStream(RpcKind::kForwardBackward, ctx, stream); });
}
grpc::Status LceService::Backward(grpc::ServerContext* ctx,
                                  grpc::ServerReaderWriter<v1::StreamResponse, v1::StreamRequest>* stream) {
  return Recorded("Backward", ctx, [&] { return RunStream(RpcKind::kBackward, ctx, stream); });
}

grpc::Status LceService::PolicyLoss(grpc::ServerContext* ctx,
                                    grpc::ServerReaderWriter<v1::StreamResponse, v1::StreamRequest>* stream) {
  return Recorded("PolicyLoss", ctx, [&] { return RunStream(RpcKind::kPolicyLoss, ctx, stream); });
}

grpc::Status LceService::OpenSession(grpc::ServerContext* ctx,
                                     grpc::ServerReaderWriter<v1::SessionResponse, v1::SessionRequest>* stream) {
  return Recorded("OpenSession", ctx, [&] { return OpenSessionBody(ctx, stream); });
}

grpc::Status LceService::OpenSessionBody(grpc::ServerContext* ctx,
                                         grpc::ServerReaderWriter<v1::SessionResponse, v1::SessionRequest>* stream) {
  if (absl::Status s = Authenticate(ctx, Access::kScoring); !s.ok()) return ToGrpcStatus(s);
  // Sessions are capped per peer host: each may hold server memory and mapped regions.
  const std::string peer = PeerHost(ctx->peer());
  {
    std::lock_guard<std::mutex> lock(sessions_mu_);
    if (config_.max_sessions_per_peer > 0 && sessions_by_peer_[peer] >= config_.max_sessions_per_peer) {
      if (config_.metrics != nullptr) config_.metrics->rejections.WithLabels({"sessions_per_peer"}).Increment();
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          absl::StrCat("peer ", peer, " already holds ", config_.max_sessions_per_peer,
                                       " sessions, the most one peer may (--max-sessions-per-peer)"));
    }
    ++sessions_by_peer_[peer];
  }
  absl::Cleanup end_peer_session = [this, &peer] {
    std::lock_guard<std::mutex> lock(sessions_mu_);
    if (--sessions_by_peer_[peer] == 0) sessions_by_peer_.erase(peer);
  };
  const std::string session = RegionRegistry::NewSessionId();
  const RegionRegistry::Peer peer_identity = RegionRegistry::IdentifyPeer(ctx->peer());
  auto count_regions = [this] {
    if (config_.metrics == nullptr) return;
    const RegionRegistry::Counts c = regions_.counts();
    config_.metrics->regions.WithLabels({"host"}).Set(static_cast<double>(c.shm));
    config_.metrics->regions.WithLabels({"device"}).Set(static_cast<double>(c.device));
    config_.metrics->regions.WithLabels({"server"}).Set(static_cast<double>(c.server));
  };
  if (config_.metrics != nullptr) config_.metrics->sessions.Increment();
  // Whatever ends the stream (half-close, cancel, disconnect, shutdown), the regions go with it.
  struct Release {
    RegionRegistry& regions;
    const std::string& session;
    ServiceMetrics* metrics;
    std::function<void()> recount;
    ~Release() {
      regions.ReleaseSession(session);
      if (metrics != nullptr) metrics->sessions.Decrement();
      recount();
    }
  } release{regions_, session, config_.metrics, count_regions};
  v1::SessionResponse resp;
  resp.set_session_id(session);
  if (!stream->Write(resp)) return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
  v1::SessionRequest req;
  while (stream->Read(&req)) {
    resp.Clear();
    absl::Status s;
    if (req.has_register_region()) {
      const v1::RegisterRegion& r = req.register_region();
      absl::StatusOr<uint64_t> id = regions_.Register(session, peer_identity, r);
      if (id.ok()) resp.set_region_id(*id);
      s = id.status();
      if (absl::IsResourceExhausted(s) && config_.metrics != nullptr) {
        config_.metrics->rejections.WithLabels({"session_regions"}).Increment();
      }
    } else if (req.has_unregister_region()) {
      s = regions_.Unregister(session, req.unregister_region().region_id());
    } else {
      s = absl::InvalidArgumentError("SessionRequest has neither register_region nor unregister_region");
    }
    count_regions();
    resp.set_code(static_cast<int32_t>(s.code()));
    resp.set_message(std::string(s.message()));
    if (!stream->Write(resp)) break;
  }
  if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "session cancelled");
  return grpc::Status::OK;
}

LceService::ClientWait LceService::HeaderWait() const {
  return {config_.stream_header_timeout_seconds, "header_timeout",
          absl::StrCat("no request header within ", config_.stream_header_timeout_seconds,
                       " s of the stream's start (the server's --stream-header-timeout-seconds)")};
}

LceService::ClientWait LceService::IdleWait(std::string what) const {
  return {config_.stream_idle_timeout_seconds, "idle_timeout",
          absl::StrCat("waited ", config_.stream_idle_timeout_seconds, " s for ", what,
                       " (the server's --stream-idle-timeout-seconds)")};
}

template <typename F>
grpc::Status LceService::WithinLimit(grpc::ServerContext* ctx, const ClientWait& limit, F&& wait, bool* done) {
  if (limit.seconds <= 0) {
    *done = wait();
    return grpc::Status::OK;
  }
  const auto deadline = StreamWatchdog::Clock::now() + std::chrono::duration_cast<StreamWatchdog::Clock::duration>(
                                                           std::chrono::duration<double>(limit.seconds));
  // The handler is blocked in `wait` until Disarm returns, and the action has finished by then:
  // `ctx` and `limit` outlive it. Cancelling with a status (not TryCancel's bare CANCELLED) lets the
  // client see which wait it overran.
  // It is counted before the client can see it.
  const StreamWatchdog::Ticket ticket = watchdog_.Arm(deadline, [this, ctx, &limit] {
    if (config_.metrics != nullptr) config_.metrics->rejections.WithLabels({limit.reason}).Increment();
    grpc_call_cancel_with_status(ctx->c_call(), GRPC_STATUS_DEADLINE_EXCEEDED, limit.message.c_str(), nullptr);
  });
  *done = wait();
  if (watchdog_.Disarm(ticket)) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, limit.message);
}

grpc::Status LceService::ReadHeader(RpcKind rpc, grpc::ServerContext* ctx,
                                    grpc::ServerReaderWriter<v1::StreamResponse, v1::StreamRequest>* stream,
                                    std::optional<RequestPlan>* plan, std::optional<HeadStore::Use>* head_use) {
  v1::StreamRequest msg;
  bool got = false;
  const auto t0 = std::chrono::steady_clock::now();
  grpc::Status g = WithinLimit(ctx, HeaderWait(), [&] { return stream->Read(&msg); }, &got);
  if (RequestWork* work = RequestWork::Current(); work != nullptr) {
    work->read_wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  if (!g.ok()) return g;
  if (!got) {
    if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "client cancelled");
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "empty request: expected a header message first");
  }
  if (!msg.has_header()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "the first message of a request must be a header");
  }
  absl::StatusOr<RequestPlan> p =
      ValidateAndUse(StreamRequestValidator(rpc, *heads_, config_.limits), msg.header(), *head_use);
  if (!p.ok()) return ToGrpcStatus(p.status());
  plan->emplace(*std::move(p));
  return grpc::Status::OK;
}

grpc::Status LceService::RunStream(RpcKind rpc, grpc::ServerContext* ctx,
                                   grpc::ServerReaderWriter<v1::StreamResponse, v1::StreamRequest>* stream) {
  if (absl::Status s = Authenticate(ctx, Access::kScoring); !s.ok()) return ToGrpcStatus(s);
  // The slot is taken once the header is in: a client that opens streams and sends nothing holds
  // none (and is dropped at the header timeout).
  std::optional<RequestPlan> plan;
  std::optional<HeadStore::Use> head_use;  // the request runs start to end on this version of its head
  if (grpc::Status g = ReadHeader(rpc, ctx, stream, &plan, &head_use); !g.ok()) return g;
  StreamSlot slot(streams_in_flight_, config_.max_concurrent_streams);
  if (!slot.admitted()) {
    if (config_.metrics != nullptr) config_.metrics->rejections.WithLabels({"concurrent_streams"}).Increment();
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrCat("server is at its limit of ", config_.max_concurrent_streams,
                                     " concurrent streams; retry later"));
  }
  StreamRequestValidator validator(rpc, *heads_, config_.limits);
  v1::StreamRequest msg;
  RequestWork* work = RequestWork::Current();
  // Time spent in `f`, added to `*acc` (request log), when the request is being accounted.
  auto timed = [work](double RequestWork::*acc, auto&& f) {
    if (work == nullptr) return f();
    const auto t0 = std::chrono::steady_clock::now();
    auto r = f();
    work->*acc += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return r;
  };
  LceEngine& engine = *plan->head->engine;
  const HeadShape& shape = engine.shape();
  const bool is_fb = rpc == RpcKind::kForwardBackward;
  const bool is_bw = rpc == RpcKind::kBackward;
  const bool is_pl = rpc == RpcKind::kPolicyLoss;
  const int64_t row_bytes = shape.hidden_size * DTypeSize(shape.dtype);
  const int64_t num_seq = static_cast<int64_t>(plan->sequence_valid_tokens.size());
  const char* method = RpcName(rpc);
  const char* op = is_fb ? "forward_backward" : is_bw ? "backward" : is_pl ? "policy_loss" : "score";

  // The stream's device stagings (GPU engines; two when calls are pipelined, one a chunk in flight),
  // back to the pool when the stream ends.
  struct StagingLease {
    LceService* service;
    std::unique_ptr<ChunkStaging> held[2];
    ~StagingLease() {
      for (auto& h : held) service->ReturnStaging(std::move(h));
    }
  } staging{this, {}};
  // Pipelined streams (RequestHeader.sends_ahead): calls and answers on threads of their own, on
  // GPU engines where the client sends ahead (a client waiting for an answer before it sends more
  // would wait for ever on a server reading ahead), except PolicyLoss's (host work between its two
  // calls) and those that accumulate the weight gradient (the training lock).
  const bool pipelined = (config_.cuda_device >= 0 ? config_.pipeline_chunks : config_.pipeline_chunks_on_cpu) &&
                         plan->sends_ahead && !is_pl && !plan->accumulate_weight_grad;
  // Answers leave from their own thread while the next chunk computes (two in flight at most); a
  // pipelined stream's finish thread writes them itself.
  StreamAnswerWriter<v1::StreamResponse> writer(stream, 2, /*own_thread=*/!pipelined);
  // However the stream ends, the answers still queued go out within the idle timeout: a client that
  // stops reading must not hold the handler (and its slot) in the writer's last writes.
  absl::Cleanup finish_writer = [&] {
    bool drained = false;
    (void)WithinLimit(ctx, IdleWait("the client to read the last answers"), [&] { return writer.Finish(); }, &drained);
  };
  int64_t rows_seen = 0, valid_seen = 0, chunk_index = 0, bytes_seen = 0;
  double loss_sum = 0.0;
  PolicyLossSums policy_sums;
  std::vector<int64_t> seq_seen(static_cast<size_t>(num_seq), 0);
  std::vector<float> lp_buf, ent_buf, u_buf, e_buf, w_buf;
  std::unique_ptr<bool[]> valid_buf;
  // A chunk from its message to its answer. Two exist: on a pipelined stream chunk k computes while
  // chunk k+1 is read and staged.
  struct InFlightChunk {
    v1::StreamRequest msg;  // its message: the engine may read targets and hidden states from it
    v1::StreamResponse resp;
    RegionRegistry::Slice hidden_slice, dh_slice;  // mapped until the chunk is done
    std::vector<float> loss, grad;
    int64_t index = 0, first_row = 0, rows = 0, message_bytes = 0;
    StagedCall staged;    // the call's views (device ones when staged)
  };
  InFlightChunk chunks[2];
  auto chunk_error = [](const InFlightChunk& c, const absl::Status& s) {
    return ToGrpcStatus(absl::Status(s.code(), absl::StrCat("chunk ", c.index, " (rows ", c.first_row, "..",
                                                            c.first_row + c.rows - 1, "): ", s.message())));
  };
  // The stream's last chunk once the client has sent it (-1 before): where no summary follows, its
  // answer goes with the status (a pipelined chunk is usually answered after the client is done).
  std::atomic<int64_t> last_chunk{-1};
  // After its engine call: sums, metrics, and the answer on its way.
  auto answer = [&](InFlightChunk& c) -> grpc::Status {
    v1::ChunkResult* out = c.resp.mutable_chunk();
    if (is_fb || is_pl) {
      for (float l : c.loss) loss_sum += l;
      if (plan->want_loss) out->mutable_loss()->Add(c.loss.begin(), c.loss.end());
    }
    if (config_.metrics != nullptr) {
      config_.metrics->tokens.WithLabels({op}).Increment(static_cast<double>(c.rows));
      config_.metrics->bytes_received.Increment(static_cast<double>(c.message_bytes));
      config_.metrics->bytes_sent.Increment(static_cast<double>(c.resp.ByteSizeLong()));
    }
    // A client that shrank its shm object meanwhile had the server compute on zeros: no answer.
    for (const auto& [slice, what] : {std::pair{&c.hidden_slice, "hidden_region"}, {&c.dh_slice, "d_hidden_region"}}) {
      if (absl::Status s = RegionRegistry::CheckIntact(*slice, what); !s.ok()) {
        return ToGrpcStatus(absl::Status(s.code(), absl::StrCat("chunk ", c.index, ": ", s.message())));
      }
    }
    c.hidden_slice = {};
    c.dh_slice = {};
    const bool last = !(is_fb || is_pl) && c.index == last_chunk.load();
    bool written = false;
    grpc::Status g = WithinLimit(ctx, IdleWait("the client to read an answer"), [&] {
      return timed(&RequestWork::write_wait_seconds,
                   [&] { return last ? writer.PushLast(std::move(c.resp)) : writer.Push(std::move(c.resp)); });
    }, &written);
    if (!g.ok()) return g;
    if (!written) return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
    c.resp = v1::StreamResponse();
    return grpc::Status::OK;
  };
  // The pipeline is declared after everything its steps use, so that it is destroyed (its steps
  // finished) first, whichever way the stream ends. Its threads start now, while the first chunk is
  // on its way.
  std::optional<EngineCallPipeline> pipeline;
  if (pipelined) pipeline.emplace(work);
  // Waits for the oldest pipelined chunk to be computed and answered.
  auto wait_oldest = [&]() -> grpc::Status {
    const InFlightChunk& c = chunks[(chunk_index - pipeline->outstanding()) % 2];
    absl::Status s = pipeline->WaitOldest();
    return s.ok() ? grpc::Status::OK : chunk_error(c, s);
  };
  // The client's next message, within the idle timeout; `more` is false at the stream's end.
  bool more = false;
  auto read_next = [&] {
    return WithinLimit(ctx,
                       IdleWait(chunk_index == 0 ? std::string("the first chunk")
                                                 : absl::StrCat("the message after chunk ", chunk_index - 1)),
                       [&] { return timed(&RequestWork::read_wait_seconds, [&] { return stream->Read(&msg); }); },
                       &more);
  };
  for (;;) {
    if (grpc::Status g = read_next(); !g.ok()) return g;
    if (!more) break;
    if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "client cancelled");
    if (msg.has_header()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("repeated header (message ", chunk_index + 1, "): a request has exactly one"));
    }
    if (!msg.has_chunk()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("message ", chunk_index + 1, " is neither a header nor a chunk"));
    }
    if (chunk_index == 0 && work != nullptr) work->first_chunk_wait_seconds = work->read_wait_seconds;
    // The slot's last chunk (two back) must be done before this one takes its place.
    if (pipeline.has_value() && pipeline->outstanding() > 1) {
      if (grpc::Status g = wait_oldest(); !g.ok()) return g;
    }
    InFlightChunk& c = chunks[chunk_index % 2];
    c.msg.Swap(&msg);
    const v1::RowChunk& chunk = c.msg.chunk();
    absl::StatusOr<int64_t> rows = validator.ValidateChunk(*plan, chunk, chunk_index, rows_seen);
    if (!rows.ok()) {
      if (rows.status().code() == absl::StatusCode::kResourceExhausted && config_.metrics != nullptr) {
        config_.metrics->rejections.WithLabels({"request_rows"}).Increment();
      }
      return ToGrpcStatus(rows.status());
    }
    const int64_t n = *rows;
    c.index = chunk_index;
    c.first_row = rows_seen;
    c.rows = n;
    c.message_bytes = static_cast<int64_t>(c.msg.ByteSizeLong());
    // Co-located clients: hidden states read from, and d_hidden written to, shared-memory regions
    // of the request's session (checked: owner, bounds, size). The slices stay mapped until the
    // chunk is done.
    const char* hidden_ptr = chunk.hidden().data();
    c.hidden_slice = {};
    c.dh_slice = {};
    if (chunk.has_hidden_region() || chunk.has_d_hidden_region()) {
      const auto& md = ctx->client_metadata();
      auto it = md.find("lce-session");
      const std::string session = it == md.end() ? std::string() : std::string(it->second.data(), it->second.size());
      auto fail = [&](const absl::Status& e) {
        return ToGrpcStatus(absl::Status(e.code(), absl::StrCat("chunk ", chunk_index, ": ", e.message())));
      };
      if (chunk.has_hidden_region()) {
        absl::StatusOr<RegionRegistry::Slice> r = regions_.Resolve(session, chunk.hidden_region(), n * row_bytes, "hidden_region");
        if (!r.ok()) return fail(r.status());
        c.hidden_slice = *std::move(r);
        hidden_ptr = reinterpret_cast<const char*>(c.hidden_slice.bytes.data());
      }
      if (chunk.has_d_hidden_region()) {
        if (!(is_fb || is_bw || is_pl)) return fail(absl::InvalidArgumentError("d_hidden_region: Score returns no d_hidden"));
        absl::StatusOr<RegionRegistry::Slice> r = regions_.Resolve(session, chunk.d_hidden_region(), n * row_bytes, "d_hidden_region");
        if (!r.ok()) return fail(r.status());
        c.dh_slice = *std::move(r);
        if (c.dh_slice.device && !c.hidden_slice.device) {
          return fail(absl::InvalidArgumentError(
              "d_hidden_region is device memory (CUDA IPC) but the hidden states are not: put both on the GPU"));
        }
        // The engine reads hidden after it starts writing d_hidden: the two must not share bytes.
        const uint8_t* hp = reinterpret_cast<const uint8_t*>(hidden_ptr);
        const uint8_t* dp = c.dh_slice.bytes.data();
        if (c.dh_slice.device == c.hidden_slice.device && hp < dp + n * row_bytes && dp < hp + n * row_bytes) {
          return fail(absl::InvalidArgumentError("d_hidden_region overlaps the chunk's hidden states"));
        }
      }
    }
    const bool on_device = c.hidden_slice.device;
    bytes_seen += n * row_bytes;
    if (config_.max_request_bytes > 0 && bytes_seen > config_.max_request_bytes) {
      if (config_.metrics != nullptr) config_.metrics->rejections.WithLabels({"request_bytes"}).Increment();
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          absl::StrCat("chunk ", chunk_index, ": request exceeds ", config_.max_request_bytes,
                                       " bytes of hidden states, the server's limit per request"));
    }
    int64_t valid = 0;
    for (int32_t y : chunk.targets()) valid += y != plan->options.ignore_index ? 1 : 0;

    c.resp.Clear();
    v1::ChunkResult* out = c.resp.mutable_chunk();
    out->set_first_row(rows_seen);
    out->set_rows(n);
    RowOutputs row_out;
    if (plan->want_logprobs) row_out.logprob = Grow(out->mutable_logprobs(), n);
    if (plan->want_entropy) row_out.entropy = Grow(out->mutable_entropy(), n);
    c.loss.clear();
    if (is_fb) {
      c.loss.assign(n, 0.0f);
      row_out.loss = c.loss.data();
    }
    Upstream up;
    GradOutputs grads;
    if (c.dh_slice.hold != nullptr) {
      grads.d_hidden = c.dh_slice.bytes.data();
    } else if (is_fb || is_bw || is_pl) {
      std::string* dh = out->mutable_d_hidden();
      dh->resize(static_cast<size_t>(n * row_bytes));
      grads.d_hidden = dh->data();
    }
    // ValidateChunk checked every target: the engine need not check them again.
    RowsView view{hidden_ptr, chunk.targets().data(), n, MemorySpace::kHost, /*targets_checked=*/true};
    // A GPU engine of one rank gets every chunk in device memory, copied on this stream's thread
    // (outside the engine's lock); its dW lives on the device too.
    const bool device_path = on_device || config_.cuda_device >= 0;
    rows_seen += n;
    valid_seen += valid;
    ++chunk_index;
    const int slot = static_cast<int>(c.index % 2);
    if (device_path) {
      for (int k = 0; k < (pipelined ? 2 : 1); ++k) {
        if (staging.held[k] != nullptr) continue;
        absl::StatusOr<std::unique_ptr<ChunkStaging>> st = TakeStaging();
        if (!st.ok()) return ToGrpcStatus(st.status());
        staging.held[k] = *std::move(st);
      }
    }
    if (is_fb) {
      up.mode = GradMode::kLoss;
      if (plan->reduction == v1::REDUCTION_NONE) {
        up.grad_loss = chunk.grad_loss_size() > 0 ? chunk.grad_loss().data() : nullptr;
      } else if (plan->reduction == v1::REDUCTION_MEAN) {
        const float g = plan->declared_valid_tokens > 0 ? 1.0f / static_cast<float>(plan->declared_valid_tokens) : 0.0f;
        c.grad.assign(n, g);
        up.grad_loss = c.grad.data();
      }
    } else if (is_bw) {
      up.mode = GradMode::kGeneric;
      up.grad_logprob = chunk.grad_logprob_size() > 0 ? chunk.grad_logprob().data() : nullptr;
      up.grad_entropy = chunk.grad_entropy_size() > 0 ? chunk.grad_entropy().data() : nullptr;
    }
    if (pipelined) {
      // Stage this chunk (its uploads overlap the previous chunk's compute) and queue its call; its
      // outputs come back and its answer leaves on the pipeline's second thread.
      if (device_path) {
        absl::StatusOr<StagedCall> staged = StageOnDevice(*staging.held[slot], view, on_device, row_bytes, up, row_out,
                                                          grads, c.dh_slice.device);
        if (!staged.ok()) return chunk_error(c, staged.status());
        c.staged = *staged;
      } else {
        c.staged = StagedCall{view, up, row_out, grads};
      }
      ChunkStaging* st = device_path ? staging.held[slot].get() : nullptr;
      pipeline->Submit(
          [this, method, op, &engine, &c, &options = plan->options] {
            return RunEngine(method, op, engine, c.staged.rows, options, c.staged.up, c.staged.outs, c.staged.grads);
          },
          [this, st, &c, &answer]() -> absl::Status {
            if (st != nullptr) {
              if (absl::Status s = UnstageFromDevice(*st, c.staged); !s.ok()) return s;
            }
            const grpc::Status g = answer(c);
            return absl::Status(static_cast<absl::StatusCode>(g.error_code()), g.error_message());
          });
      continue;
    }
    // Unpipelined: compute here.
    auto compute = [&](const char* what, const Upstream& u, const RowOutputs& o, const GradOutputs& g) {
      return device_path ? RunEngineOnDevice(method, what, engine, *staging.held[0], view, on_device, plan->options, u,
                                             o, g, c.dh_slice.device)
                         : RunEngine(method, what, engine, view, plan->options, u, o, g);
    };
    absl::Status s;
    if (is_pl) {
      // Forward for logprob and entropy, the policy loss and its upstream gradients on the host,
      // then the generic backward (which recomputes the logits tile by tile).
      lp_buf.assign(n, 0.0f);
      ent_buf.assign(n, 0.0f);
      s = compute("policy_forward", Upstream{}, {lp_buf.data(), ent_buf.data(), nullptr, nullptr}, {});
      if (s.ok()) {
        w_buf.assign(n, 0.0f);
        valid_buf.reset(new bool[n]);
        for (int64_t i = 0; i < n; ++i) {
          const int32_t sid = chunk.sequence_ids_size() > 0 ? chunk.sequence_ids(static_cast<int>(i)) : 0;
          valid_buf[i] = chunk.targets(static_cast<int>(i)) != plan->options.ignore_index;
          if (!valid_buf[i]) continue;
          ++seq_seen[sid];
          w_buf[i] = AggregationWeight(plan->aggregation, plan->sequence_valid_tokens[sid], plan->total_valid_tokens, num_seq);
        }
        c.loss.assign(n, 0.0f);
        u_buf.assign(n, 0.0f);
        e_buf.assign(n, 0.0f);
        PolicyLossRows(n, plan->policy, lp_buf.data(), ent_buf.data(), chunk.old_logprobs().data(),
                       chunk.advantages().data(), chunk.ref_logprobs_size() > 0 ? chunk.ref_logprobs().data() : nullptr,
                       w_buf.data(), valid_buf.get(), c.loss.data(), u_buf.data(), e_buf.data(), &policy_sums);
        if (plan->want_logprobs) std::copy(lp_buf.begin(), lp_buf.end(), row_out.logprob);
        if (plan->want_entropy) std::copy(ent_buf.begin(), ent_buf.end(), row_out.entropy);
        up = Upstream{GradMode::kGeneric, nullptr, u_buf.data(), e_buf.data()};
      }
    }
    if (s.ok()) {
      const RowOutputs second = is_pl ? RowOutputs{} : row_out;
      if (plan->accumulate_weight_grad) {
        std::lock_guard<std::mutex> lock(plan->head->training->mu);
        absl::StatusOr<HeadTrainer*> trainer = TrainerOf(*plan->head);
        if (trainer.ok()) grads.d_weight = (*trainer)->grad();
        s = trainer.ok() ? compute(op, up, second, grads) : trainer.status();
      } else {
        s = compute(op, up, second, grads);
      }
    }
    if (!s.ok()) return chunk_error(c, s);
    if (grpc::Status g = answer(c); !g.ok()) return g;
  }
  last_chunk.store(chunk_index - 1);
  if (pipeline.has_value()) pipeline->Close();  // its threads end with the last chunk
  while (pipeline.has_value() && pipeline->outstanding() > 0) {
    if (grpc::Status g = wait_oldest(); !g.ok()) return g;
  }
  if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "client cancelled");
  if (rows_seen == 0) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "request has a header but no rows");
  }
  // A part of a split request (header.partial) carries the whole request's counts: the client checks
  // that its parts add up.
  const bool partial = plan->partial;
  if (is_fb && !partial && plan->reduction == v1::REDUCTION_MEAN && plan->declared_valid_tokens != valid_seen) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("header.num_valid_tokens declared ", plan->declared_valid_tokens,
                                     " but the request has ", valid_seen,
                                     " non-ignored rows; the returned d_hidden is wrong, discard it"));
  }
  if (is_pl && !partial) {
    for (int64_t q = 0; q < num_seq; ++q) {
      if (seq_seen[q] != plan->sequence_valid_tokens[q]) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            absl::StrCat("policy.sequence_valid_tokens[", q, "] declared ", plan->sequence_valid_tokens[q],
                                         " but the request has ", seq_seen[q],
                                         " non-ignored rows in that sequence; discard the returned d_hidden"));
      }
    }
  }
  if (is_fb || is_pl) {
    v1::StreamResponse resp;
    v1::RequestSummary* sum = resp.mutable_summary();
    sum->set_rows(rows_seen);
    sum->set_valid_tokens(valid_seen);
    sum->set_head_version(plan->head->version);
    if (is_fb) {
      // The mean's denominator is the declared count; for a whole request it equals valid_seen.
      const int64_t denom = partial ? plan->declared_valid_tokens : valid_seen;
      sum->set_loss(plan->reduction == v1::REDUCTION_MEAN ? (denom > 0 ? loss_sum / denom : 0.0) : loss_sum);
    } else {
      const double t = std::max<int64_t>(policy_sums.tokens, 1);
      sum->set_loss(policy_sums.loss);
      sum->set_clip_fraction(policy_sums.clipped / t);
      sum->set_approx_kl(policy_sums.approx_kl / t);
      sum->set_mean_entropy(policy_sums.entropy / t);
      sum->set_mean_ratio(policy_sums.ratio / t);
      sum->set_mean_kl(policy_sums.kl / t);
    }
    bool written = false;
    grpc::Status g =
        WithinLimit(ctx, IdleWait("the client to read an answer"), [&] { return writer.PushLast(std::move(resp)); }, &written);
    if (!g.ok()) return g;
    if (!written) return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
  }
  bool drained = false;
  grpc::Status g = WithinLimit(ctx, IdleWait("the client to read the last answers"), [&] {
    return timed(&RequestWork::drain_seconds, [&] { return writer.Finish(); });
  }, &drained);
  if (!g.ok()) return g;
  if (!drained) return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
  return grpc::Status::OK;
}

}  // namespace lce::server
