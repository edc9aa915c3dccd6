#include "lce_service.h"

#include <atomic>
#include <optional>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "grpc/grpc.h"
#include "grpc_status.h"
#include "lce/training.h"
#include "one_message_stream.h"
#include "status_macros.h"
#include "streamed_request.h"
#include "wire_types.h"

namespace lce::server {

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
  if (config_.cuda_device < 0) return CreateHostStaging();
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
  const int64_t row_bytes = engine.shape().row_bytes();
  absl::StatusOr<StagedCall> call = StageOnDevice(st, rows, hidden_on_device, row_bytes, engine.shape().vocab_size,
                                                  options.top_k, up, out, grads, d_hidden_on_device);
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
                                                                 int64_t vocab_size, int32_t top_k, const Upstream& up,
                                                                 const RowOutputs& out, const GradOutputs& grads,
                                                                 bool d_hidden_on_device, StagingPlace place) {
  const int64_t n = rows.rows;
  const int64_t r0 = place.row0, cap = std::max(place.capacity, r0 + n);
  // Slots: 0 targets; 1-3 grad_loss, grad_logprob, grad_entropy; 4-7 logprob, entropy, lse, loss;
  // 8 d_hidden; 9 hidden; 10 class weights; 11-14 z_loss, argmax, top_tokens, top_logprobs. Copies
  // are queued, then waited for once (each wait is a GPU bubble).
  const auto start = std::chrono::steady_clock::now();
  // A per-row buffer of `per_row` bytes a row at row r0 of `cap`; (per_row 0: `bytes` as they are).
  auto place_in = [&](int slot, int64_t per_row, int64_t bytes = 0) -> absl::StatusOr<uint8_t*> {
    absl::StatusOr<void*> d = st.Buffer(slot, per_row > 0 ? cap * per_row : bytes);
    if (!d.ok()) return d.status();
    return static_cast<uint8_t*>(*d) + r0 * per_row;
  };
  auto up_array = [&](int slot, const void* host, int64_t per_row, int64_t bytes = 0) -> absl::StatusOr<void*> {
    if (host == nullptr) return nullptr;
    absl::StatusOr<uint8_t*> d = place_in(slot, per_row, bytes);
    if (!d.ok()) return d.status();
    LCE_RETURN_IF_ERROR(st.UploadAsync(*d, host, per_row > 0 ? n * per_row : bytes));
    return static_cast<void*>(*d);
  };
  absl::StatusOr<void*> hidden =
      hidden_on_device ? absl::StatusOr<void*>(const_cast<void*>(rows.hidden)) : up_array(9, rows.hidden, row_bytes);
  absl::StatusOr<void*> targets = up_array(0, rows.targets, 4);
  absl::StatusOr<void*> gl = up_array(1, up.grad_loss, 4);
  absl::StatusOr<void*> glp = up_array(2, up.grad_logprob, 4);
  absl::StatusOr<void*> gen = up_array(3, up.grad_entropy, 4);
  absl::StatusOr<void*> cw = up_array(10, rows.class_weight, 0, rows.class_weight != nullptr ? vocab_size * 4 : 0);
  for (const auto* r : {&hidden, &targets, &gl, &glp, &gen, &cw}) {
    if (!r->ok()) return r->status();
  }
  StagedCall call;
  call.outs = out;  // every output pointer replaced by its device buffer below
  const int64_t k = std::max<int32_t>(top_k, 1);
  struct Out {
    int slot;
    void** ptr;
    int64_t per_row;
  };
  for (Out o :
       {Out{4, reinterpret_cast<void**>(&call.outs.logprob), 4},
        Out{5, reinterpret_cast<void**>(&call.outs.entropy), 4}, Out{6, reinterpret_cast<void**>(&call.outs.lse), 4},
        Out{7, reinterpret_cast<void**>(&call.outs.loss), 4}, Out{11, reinterpret_cast<void**>(&call.outs.z_loss), 4},
        Out{12, reinterpret_cast<void**>(&call.outs.argmax), 4},
        Out{13, reinterpret_cast<void**>(&call.outs.top_tokens), k * 4},
        Out{14, reinterpret_cast<void**>(&call.outs.top_logprobs), k * 4}}) {
    if (*o.ptr == nullptr) continue;
    absl::StatusOr<uint8_t*> d = place_in(o.slot, o.per_row);
    if (!d.ok()) return d.status();
    call.downloads.push_back({*o.ptr, *d, n * o.per_row});
    *o.ptr = *d;
  }
  call.grads.d_weight = grads.d_weight;  // the request's pending dW (the trainer's): device memory already
  call.grads.d_bias = grads.d_bias;
  call.grads.d_weight_pending = grads.d_weight_pending;
  call.grads.d_weight_fresh = grads.d_weight_fresh;
  if (grads.d_hidden != nullptr) {
    if (d_hidden_on_device) {
      call.grads.d_hidden = grads.d_hidden;
    } else {
      absl::StatusOr<uint8_t*> d = place_in(8, row_bytes);
      if (!d.ok()) return d.status();
      call.grads.d_hidden = *d;
      call.host_d_hidden = grads.d_hidden;
      call.d_hidden_bytes = n * row_bytes;
    }
  }
  call.rows = RowsView{*hidden, static_cast<const int32_t*>(*targets), n,
                       st.device() ? MemorySpace::kDevice : MemorySpace::kHost, rows.targets_checked};
  call.rows.class_weight = static_cast<const float*>(*cw);
  call.up = Upstream{up.mode, static_cast<const float*>(*gl), static_cast<const float*>(*glp),
                     static_cast<const float*>(*gen)};
  absl::Status s = st.Sync();
  CountStaging(start);
  if (!s.ok()) return s;
  return call;
}

absl::Status LceService::UnstageFromDevice(ChunkStaging& st, const StagedCall& call) {
  const auto start = std::chrono::steady_clock::now();
  absl::Status s = [&] {
    for (const StagedCall::Download& d : call.downloads) {
      LCE_RETURN_IF_ERROR(st.DownloadAsync(d.host, d.device, d.bytes));
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

namespace {

std::string Authorization(grpc::ServerContext* ctx) {
  const auto& md = ctx->client_metadata();
  auto it = md.find("authorization");
  return it == md.end() ? std::string() : std::string(it->second.data(), it->second.size());
}

}  // namespace

absl::Status LceService::Authenticate(grpc::ServerContext* ctx, Access access) const {
  if (!config_.auth.enabled()) return absl::OkStatus();
  return config_.auth.Check(Authorization(ctx), access);
}

std::string LceService::ClientToken(grpc::ServerContext* ctx) const {
  // Without tokens any header passes: one that named a new client each time would dodge every cap.
  return config_.auth.enabled() ? Authorization(ctx) : std::string();
}

int64_t LceService::StreamsPerClient() const {
  if (config_.max_streams_per_client != 0) return config_.max_streams_per_client;
  return (config_.max_concurrent_streams + 1) / 2;  // 0 (no limit) stays 0
}

grpc::Status LceService::GetInfo(grpc::ServerContext* ctx, const v1::GetInfoRequest* req, v1::GetInfoResponse* resp) {
  return Recorded("GetInfo", ctx, [&] { return GetInfoBody(ctx, req, resp); });
}

absl::Status LceService::GetInfoBody(grpc::ServerContext* ctx, const v1::GetInfoRequest* req,
                                     v1::GetInfoResponse* resp) {
  LCE_RETURN_IF_ERROR(Authenticate(ctx, Access::kScoring));
  absl::StatusOr<std::shared_ptr<const ServedHead>> head = heads_->Get(req->head());
  if (!head.ok()) return head.status();
  DescribeHead(**head, resp->mutable_head());
  for (const auto& h : heads_->List()) DescribeHead(*h, resp->add_heads());
  resp->set_backend(std::string((*head)->engine->backend()));
  resp->set_tp_size(config_.tp_size);
  resp->set_max_message_bytes(config_.max_message_bytes);
  resp->set_max_rows_per_request(config_.limits.max_rows_per_request);
  resp->set_server_version(LCE_SERVE_VERSION);
  resp->set_data_port(data_port_);
  resp->set_data_plane_tls(data_plane_tls_);
  const EngineInvariance inv = (*head)->engine->invariance();
  for (const std::string& o : inv.across_batches) resp->mutable_invariance()->add_across_batches(o);
  for (const std::string& o : inv.across_tp_sizes) resp->mutable_invariance()->add_across_tp_sizes(o);
  return absl::OkStatus();
}

LceService::LceService(std::shared_ptr<HeadStore> heads, ServiceConfig config)
    : heads_(std::move(heads)),
      config_(config),
      regions_(config.cuda_device),
      batcher_(config.batching, config.metrics) {
  const google::protobuf::ServiceDescriptor* service =
      v1::StreamRequest::descriptor()->file()->FindServiceByName("LceService");
  for (RpcKind rpc : {RpcKind::kScore, RpcKind::kForwardBackward, RpcKind::kBackward, RpcKind::kPolicyLoss}) {
    // The generated service numbers its methods in the proto's order, as the descriptor does.
    const int index = service->FindMethodByName(std::string(RpcName(rpc)))->index();
    MarkMethodStreamed(index, new grpc::internal::BidiStreamingHandler<LceService, grpc::ByteBuffer, grpc::ByteBuffer>(
                                  [rpc](LceService* self, grpc::ServerContext* ctx, ParsingStream::Raw* raw) {
                                    return self->ServeStream(rpc, ctx, raw);
                                  },
                                  this));
  }
  using CallStreamer = grpc::ServerUnaryStreamer<v1::CallRequest, v1::CallResponse>;
  MarkMethodStreamed(service->FindMethodByName("Call")->index(),
                     new grpc::internal::StreamedUnaryHandler<v1::CallRequest, v1::CallResponse>(
                         [this](grpc::ServerContext* ctx, CallStreamer* call) { return ServeCall(ctx, call); }));
}

grpc::Status LceService::ServeStream(RpcKind rpc, grpc::ServerContext* ctx, ParsingStream::Raw* raw) {
  return Recorded(RpcName(rpc), ctx, [&] {
    ParsingStream stream(raw);
    return RunStream(rpc, ctx, &stream);
  });
}

grpc::Status LceService::ServeCall(grpc::ServerContext* ctx,
                                   grpc::ServerUnaryStreamer<v1::CallRequest, v1::CallResponse>* call) {
  static constexpr std::pair<v1::CallMethod, RpcKind> kMethods[] = {
      {v1::CALL_SCORE, RpcKind::kScore},
      {v1::CALL_FORWARD_BACKWARD, RpcKind::kForwardBackward},
      {v1::CALL_BACKWARD, RpcKind::kBackward},
      {v1::CALL_POLICY_LOSS, RpcKind::kPolicyLoss}};
  v1::CallRequest req;
  if (!call->Read(&req)) {
    if (ctx->IsCancelled()) return ToGrpcStatus(absl::CancelledError("client cancelled"));
    return ToGrpcStatus(absl::InvalidArgumentError("the message is not a CallRequest: it does not parse as protobuf"));
  }
  for (const auto& [method, rpc] : kMethods) {
    if (req.method() != method) continue;
    // Counted under the streamed RPC's name: the same work, whichever way it came.
    return Recorded(RpcName(rpc), ctx, [&, rpc = rpc] {
      v1::CallResponse resp;
      OneMessageStream stream(&req, &resp);
      absl::Status s = RunStream(rpc, ctx, &stream, /*one_message=*/true);
      // Sent with the status in one batch, as a plain unary answer is.
      if (s.ok() && !call->Write(resp, grpc::WriteOptions().set_last_message())) {
        return absl::CancelledError("client went away");
      }
      return s;
    });
  }
  return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
      "CallRequest.method ", req.method(), " is not a computation (set CALL_SCORE, CALL_FORWARD_BACKWARD, ",
      "CALL_BACKWARD or CALL_POLICY_LOSS)")));
}

void LceService::RecountRegions() {
  if (config_.metrics == nullptr) return;
  const RegionRegistry::Counts c = regions_.counts();
  config_.metrics->regions.WithLabels({"host"}).Set(static_cast<double>(c.shm));
  config_.metrics->regions.WithLabels({"device"}).Set(static_cast<double>(c.device));
  config_.metrics->regions.WithLabels({"server"}).Set(static_cast<double>(c.server));
}

grpc::Status LceService::OpenSession(grpc::ServerContext* ctx,
                                     grpc::ServerReaderWriter<v1::SessionResponse, v1::SessionRequest>* stream) {
  return Recorded("OpenSession", ctx, [&] { return OpenSessionBody(ctx, stream); });
}

absl::Status LceService::OpenSessionBody(grpc::ServerContext* ctx,
                                         grpc::ServerReaderWriter<v1::SessionResponse, v1::SessionRequest>* stream) {
  LCE_RETURN_IF_ERROR(Authenticate(ctx, Access::kScoring));
  // Sessions are capped per client: each may hold server memory and mapped regions. A client is its
  // host, its token and, on loopback, its uid (client_shares.h): one local user's sessions no longer
  // lock out every other local user (issue 35, item 10).
  const ClientShares::Grant share =
      client_sessions_.Acquire(ctx->peer(), ClientToken(ctx), config_.max_sessions_per_peer);
  if (share.ticket == 0) {
    if (config_.metrics != nullptr) config_.metrics->rejections.WithLabels({"sessions_per_peer"}).Increment();
    return absl::ResourceExhaustedError(absl::StrCat("client ", share.client, " already holds ",
                                                     config_.max_sessions_per_peer,
                                                     " sessions, the most one client may (--max-sessions-per-peer)"));
  }
  absl::Cleanup end_share = [this, &share] { client_sessions_.Release(share.ticket); };
  const RegionRegistry::Peer peer_identity = RegionRegistry::IdentifyPeer(ctx->peer());
  const RegionRegistry::SessionKeys keys = regions_.OpenSession(peer_identity.uid);
  const std::string& session = keys.id;
  auto count_regions = [this] { RecountRegions(); };
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
  resp.set_session_secret(keys.secret);
  resp.set_shm_socket(shm_socket_);
  if (!stream->Write(resp)) return absl::CancelledError("client went away");
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
  if (ctx->IsCancelled()) return absl::CancelledError("session cancelled");
  return absl::OkStatus();
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

absl::Status LceService::WithinLimit(grpc::ServerContext* ctx, const RequestStream& stream, const ClientWait& limit,
                                     const std::function<bool()>& wait, bool* done) {
  // Arming wakes the watchdog's thread: worth it only for a wait on the client.
  if (limit.seconds <= 0 || !stream.WaitsOnClient()) {
    *done = wait();
    return absl::OkStatus();
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
  if (watchdog_.Disarm(ticket)) return absl::OkStatus();
  return absl::DeadlineExceededError(limit.message);
}

absl::Status LceService::ReadHeader(RpcKind rpc, grpc::ServerContext* ctx, RequestStream* stream,
                                    std::optional<RequestPlan>* plan, std::optional<HeadStore::Use>* head_use) {
  v1::StreamRequest msg;
  bool got = false;
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status g = WithinLimit(
      ctx, *stream, HeaderWait(), [&] { return stream->Read(&msg); }, &got);
  if (RequestWork* work = RequestWork::Current(); work != nullptr) {
    work->read_wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  if (!g.ok()) return g;
  if (!got) {
    if (ctx->IsCancelled()) return absl::CancelledError("client cancelled");
    LCE_RETURN_IF_ERROR(stream->ReadError());
    return absl::InvalidArgumentError("empty request: expected a header message first");
  }
  if (!msg.has_header()) {
    return absl::InvalidArgumentError("the first message of a request must be a header");
  }
  absl::StatusOr<RequestPlan> p =
      ValidateAndUse(StreamRequestValidator(rpc, *heads_, config_.limits), msg.header(), *head_use);
  if (!p.ok()) return p.status();
  plan->emplace(*std::move(p));
  return absl::OkStatus();
}

absl::Status LceService::RunStream(RpcKind rpc, grpc::ServerContext* ctx, RequestStream* stream, bool one_message) {
  LCE_RETURN_IF_ERROR(Authenticate(ctx, Access::kScoring));
  StreamedRequest request(*this, rpc, ctx, stream, one_message);
  return request.Run();
}

}  // namespace lce::server
