#include "lce/client/lce_client.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <functional>
#include <random>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "answer_assembly.h"
#include "data_plane_connection.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "part_stream.h"
#include "replica.h"
#include "shm_socket_client.h"
#include "worker_pool.h"

namespace lce::client {

std::string_view Version() { return LCE_SERVE_VERSION; }

int64_t WireDTypeSize(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_FLOAT32: return 4;
    case v1::DTYPE_BFLOAT16:
    case v1::DTYPE_FLOAT16: return 2;
    default: return 0;
  }
}

std::vector<std::pair<int64_t, int64_t>> PlanChunks(int64_t rows, int64_t row_bytes, int64_t chunk_bytes,
                                                    int64_t first_chunk_bytes, int64_t last_chunk_bytes, bool grow) {
  const int64_t per = std::max<int64_t>(1, row_bytes > 0 ? chunk_bytes / row_bytes : rows);
  auto edge = [&](int64_t b) {
    return b > 0 ? std::min(per, std::max<int64_t>(1, row_bytes > 0 ? b / row_bytes : rows)) : per;
  };
  const int64_t first = edge(first_chunk_bytes);
  // A smaller last chunk only where the rows go past the first chunk and one more.
  const int64_t last = last_chunk_bytes > 0 && rows > first + edge(last_chunk_bytes) ? edge(last_chunk_bytes) : 0;
  std::vector<std::pair<int64_t, int64_t>> plan;
  for (int64_t r = 0, size = first; r < rows - last;) {
    // Growing: once what is left fits in a full chunk, one chunk takes it (one engine call fewer
    // than a doubling that would leave a small remainder).
    const int64_t left = rows - last - r;
    const int64_t n = grow && r > 0 && left <= per ? left : std::min(size, left);
    plan.emplace_back(r, n);
    r += n;
    size = grow ? std::min(per, 2 * size) : per;
  }
  if (last > 0) plan.emplace_back(rows - last, last);
  return plan;
}

LceClient::LceClient(ClientOptions options)
    : options_(std::move(options)), workers_(std::make_unique<WorkerPool>()) {}

LceClient::~LceClient() = default;

namespace {

// The host of a gRPC target ("host:port", "[v6]:port", "dns:///host:port", "ipv4:host:port").
std::string TargetHost(std::string t) {
  for (const char* scheme : {"dns:///", "dns:", "ipv4:", "ipv6:"}) {
    if (t.rfind(scheme, 0) == 0) {
      t = t.substr(std::strlen(scheme));
      break;
    }
  }
  const size_t colon = t.rfind(':');
  std::string host = colon == std::string::npos ? t : t.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return host;
}

}  // namespace

absl::Status LceClient::PrepareDataPlane(Replica& replica, size_t parts, int64_t hidden_bytes, bool d_hidden) {
  DataPlane& dp = replica.data_plane;
  if (dp.session == nullptr) {
    absl::StatusOr<v1::GetInfoResponse> info = GetInfoOn(replica, "");
    if (!info.ok()) return info.status();
    if (info->data_port() <= 0) {
      return absl::FailedPreconditionError(absl::StrCat("ClientOptions.data_plane: the server at ", replica.target,
                                                        " has no data plane (start lce_server with --data-port)"));
    }
    absl::StatusOr<std::unique_ptr<SharedMemorySession>> session = OpenSessionOn(*replica.stub);
    if (!session.ok()) return session.status();
    dp.session = *std::move(session);
    dp.port = info->data_port();
    dp.tls = info->data_plane_tls();
  }
  // Regions sized to the batch, in whole MiB so that nearby sizes reuse them.
  auto ensure = [&](uint64_t& id, int64_t& size, const char* name) -> absl::Status {
    if (size >= hidden_bytes) return absl::OkStatus();
    if (size > 0) {
      if (absl::Status s = dp.session->Unregister(id); !s.ok()) return s;
      size = 0;
    }
    const int64_t bytes = (hidden_bytes + (1 << 20) - 1) / (1 << 20) * (1 << 20);
    absl::StatusOr<uint64_t> r = dp.session->AllocateServerMemory(bytes, name);
    if (!r.ok()) return r.status();
    id = *r;
    size = bytes;
    return absl::OkStatus();
  };
  if (absl::Status s = ensure(dp.hidden_region, dp.hidden_bytes, "data-plane-hidden"); !s.ok()) return s;
  if (d_hidden) {
    if (absl::Status s = ensure(dp.d_hidden_region, dp.d_hidden_bytes, "data-plane-d-hidden"); !s.ok()) return s;
  }
  const std::string host = TargetHost(replica.target);
  const size_t needed = parts * static_cast<size_t>(options_.data_plane_sockets);
  for (auto* conns : {&dp.up, &dp.down}) {
    if (conns->size() < needed) conns->resize(needed);
    for (size_t i = 0; i < needed; ++i) {
      if ((*conns)[i] != nullptr) continue;
      absl::StatusOr<std::unique_ptr<DataPlaneConnection>> c =
          DataPlaneConnection::Connect(host, dp.port, {dp.session->secret(), dp.tls, options_.data_plane_tls_ca});
      if (!c.ok()) return c.status();
      (*conns)[i] = *std::move(c);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<LceClient>> LceClient::Create(const ClientOptions& options) {
  absl::StatusOr<std::vector<std::string>> targets = ReplicaTargets(options);
  if (!targets.ok()) return targets.status();
  if (options.chunk_bytes <= 0) return absl::InvalidArgumentError("ClientOptions.chunk_bytes must be > 0");
  if (options.first_chunk_bytes < 0) return absl::InvalidArgumentError("ClientOptions.first_chunk_bytes must be >= 0");
  if (options.last_chunk_bytes < 0) return absl::InvalidArgumentError("ClientOptions.last_chunk_bytes must be >= 0");
  if (options.data_plane_sockets < 1 || options.data_plane_sockets > 16) {
    return absl::InvalidArgumentError(
        absl::StrCat("ClientOptions.data_plane_sockets must be in [1, 16], got ", options.data_plane_sockets));
  }
  if (options.streams < 1 || options.streams > 64) {
    return absl::InvalidArgumentError(absl::StrCat("ClientOptions.streams must be in [1, 64], got ", options.streams));
  }
  if (options.data_plane_streams < 1 || options.data_plane_streams > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("ClientOptions.data_plane_streams must be in [1, 64], got ", options.data_plane_streams));
  }
  if (options.max_attempts < 0) {
    return absl::InvalidArgumentError(absl::StrCat("ClientOptions.max_attempts must be >= 0, got ", options.max_attempts));
  }
  const bool round_robin = options.load_balancing == "round_robin";
  if (round_robin && options.data_plane) {
    return absl::InvalidArgumentError(
        "ClientOptions.data_plane needs the replicas listed in target/targets, not a round_robin name (a data-plane "
        "session lives on one server)");
  }
  std::unique_ptr<LceClient> client(new LceClient(options));
  if (options.max_attempts == 0) client->options_.max_attempts = targets->size() > 1 || round_robin ? 3 : 1;
  auto make_replica = [&](const std::string& target, const std::string& lb_policy) {
    auto r = std::make_unique<Replica>();
    r->target = target;
    r->channel = MakeChannel(options, target, 0, lb_policy);
    r->stub = v1::LceService::NewStub(r->channel);
    r->hidden_call = std::make_unique<HiddenCall>(r->channel);
    for (int i = 1; i < options.streams; ++i) {
      r->extra_channels.push_back(MakeChannel(options, target, i, lb_policy));
      r->extra_stubs.push_back(v1::LceService::NewStub(r->extra_channels.back()));
    }
    return r;
  };
  for (const std::string& t : *targets) client->replicas_.push_back(make_replica(t, round_robin ? "round_robin" : ""));
  if (round_robin) {
    client->front_owned_ = make_replica(targets->front(), "pick_first");
    client->front_ = client->front_owned_.get();
  } else {
    client->front_ = client->replicas_.front().get();
  }
  return client;
}

std::vector<std::string> LceClient::replica_targets() const {
  std::vector<std::string> out;
  for (const auto& r : replicas_) out.push_back(r->target);
  return out;
}

void LceClient::Prepare(grpc::ClientContext* ctx, bool admin) const {
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
  const std::string& token = admin && !options_.admin_token.empty() ? options_.admin_token : options_.bearer_token;
  if (!token.empty()) ctx->AddMetadata("authorization", "Bearer " + token);
}

absl::StatusOr<v1::GetInfoResponse> LceClient::GetInfoOn(Replica& replica, const std::string& head) {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  v1::GetInfoRequest req;
  req.set_head(head);
  v1::GetInfoResponse resp;
  grpc::Status s = replica.stub->GetInfo(&ctx, req, &resp);
  if (!s.ok()) return ToAbsl(s);
  return resp;
}

absl::StatusOr<v1::GetInfoResponse> LceClient::GetInfo(const std::string& head) {
  absl::StatusOr<v1::GetInfoResponse> info = GetInfoOn(*front_, head);
  // The front is down: any replica describes the same heads.
  for (size_t i = 0; i < replicas_.size() && absl::IsUnavailable(info.status()); ++i) {
    if (replicas_[i].get() != front_) info = GetInfoOn(*replicas_[i], head);
  }
  return info;
}

absl::StatusOr<bool> LceClient::Health(const std::string& service) {
  auto stub = grpc::health::v1::Health::NewStub(front_->channel);
  grpc::ClientContext ctx;
  Prepare(&ctx);
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  grpc::Status s = stub->Check(&ctx, req, &resp);
  if (!s.ok()) return ToAbsl(s);
  return resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

std::vector<std::pair<int64_t, int64_t>> PlanStreams(int64_t rows, int64_t row_bytes, int64_t chunk_bytes, int streams,
                                                     int64_t min_stream_bytes) {
  const int64_t total = rows * row_bytes;
  int64_t k = std::max<int64_t>(1, streams);
  if (min_stream_bytes > 0) k = std::min<int64_t>(k, total / min_stream_bytes);
  k = std::clamp<int64_t>(k, 1, std::max<int64_t>(1, rows));
  if (k == 1) return {{0, rows}};
  // Whole chunks per part where the batch allows, so that every stream's chunks are full.
  const int64_t chunk_rows = std::max<int64_t>(1, row_bytes > 0 ? chunk_bytes / row_bytes : rows);
  const int64_t chunks = (rows + chunk_rows - 1) / chunk_rows;
  std::vector<std::pair<int64_t, int64_t>> parts;
  if (chunks >= k) {
    int64_t first = 0;
    for (int64_t i = 0; i < k; ++i) {
      const int64_t c = chunks / k + (i < chunks % k ? 1 : 0);
      const int64_t n = std::min(c * chunk_rows, rows - first);
      parts.emplace_back(first, n);
      first += n;
    }
  } else {
    for (int64_t i = 0, first = 0; i < k; ++i) {
      const int64_t n = rows / k + (i < rows % k ? 1 : 0);
      parts.emplace_back(first, n);
      first += n;
    }
  }
  return parts;
}

absl::Status LceClient::Stream(const char* rpc, const HiddenBatch& batch, const v1::RequestHeader& header,
                               const RowGrads& grads, ForwardBackwardResult* out) {
  // Requests that change the head's gradient, or name a session's regions, belong to the front.
  if (header.accumulate_weight_grad() || batch.hidden_region || batch.d_hidden_region) {
    return StreamOn(*front_, rpc, batch, header, grads, out);
  }
  // The rest have no side effects: spread, and sent again whole on UNAVAILABLE.
  std::vector<bool> failed(replicas_.size(), false);
  absl::Duration backoff = options_.retry_backoff;
  const size_t start = static_cast<size_t>(next_replica_.fetch_add(1) % replicas_.size());
  for (int attempt = 1;; ++attempt) {
    const size_t i = PickReplica(start, failed);
    *out = ForwardBackwardResult{};
    absl::Status s = StreamOn(*replicas_[i], rpc, batch, header, grads, out);
    if (!absl::IsUnavailable(s)) return s;
    if (attempt >= options_.max_attempts) {
      return attempt == 1 ? s
                          : absl::Status(s.code(), absl::StrCat(s.message(), " (", rpc, " tried ", attempt, " times over ",
                                                                 replicas_.size(), " replica(s))"));
    }
    failed[i] = true;
    absl::SleepFor(backoff);
    backoff = std::min(2 * backoff, absl::Seconds(1));
  }
}

size_t LceClient::PickReplica(size_t start, const std::vector<bool>& failed) {
  const size_t n = replicas_.size();
  size_t fallback = n;
  for (size_t k = 0; k < n; ++k) {
    const size_t i = (start + k) % n;
    if (failed[i]) continue;
    // A channel in TRANSIENT_FAILURE fails a call at once: go to one that may answer.
    if (replicas_[i]->channel->GetState(false) != GRPC_CHANNEL_TRANSIENT_FAILURE) return i;
    if (fallback == n) fallback = i;
  }
  return fallback != n ? fallback : start;  // all failed this call: start over in turn
}

namespace {

// A split request's id (RequestHeader.split_id): random and non-zero, so that no other request's parts
// join its weight-gradient contribution.
uint64_t NewSplitId() {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  uint64_t id = 0;
  while (id == 0) id = rng();
  return id;
}

// INVALID_ARGUMENT where a batch, its regions and its gradients do not fit together.
absl::Status CheckBatch(const HiddenBatch& batch, const RowGrads& grads) {
  const int64_t row_bytes = batch.hidden_size * WireDTypeSize(batch.dtype);
  if (WireDTypeSize(batch.dtype) == 0) {
    return absl::InvalidArgumentError(absl::StrCat("batch dtype ", v1::DType_Name(batch.dtype), " is not a wire dtype"));
  }
  if (batch.hidden_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("batch hidden_size must be > 0, got ", batch.hidden_size));
  }
  if (batch.hidden_region && batch.d_hidden_region &&
      batch.hidden_region->session_id != batch.d_hidden_region->session_id) {
    return absl::InvalidArgumentError("hidden_region and d_hidden_region must belong to one session");
  }
  if (batch.rows < 0 || (!batch.hidden_region && static_cast<int64_t>(batch.hidden.size()) != batch.rows * row_bytes) ||
      static_cast<int64_t>(batch.targets.size()) != batch.rows) {
    return absl::InvalidArgumentError(absl::StrCat("batch of ", batch.rows, " rows x ", batch.hidden_size,
                                                   " needs ", batch.rows * row_bytes, " hidden bytes and ",
                                                   batch.rows, " targets; got ", batch.hidden.size(), " and ",
                                                   batch.targets.size()));
  }
  for (auto [name, span] : {std::pair{"grad_loss", grads.loss}, std::pair{"grad_logprob", grads.logprob},
                            std::pair{"grad_entropy", grads.entropy}}) {
    if (!span.empty() && static_cast<int64_t>(span.size()) != batch.rows) {
      return absl::InvalidArgumentError(absl::StrCat(name, " has ", span.size(), " values for ", batch.rows, " rows"));
    }
  }
  if (!batch.d_hidden_out.empty() && static_cast<int64_t>(batch.d_hidden_out.size()) != batch.rows * row_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("d_hidden_out has ", batch.d_hidden_out.size(), " bytes; ",
                                                   batch.rows, " rows need ", batch.rows * row_bytes));
  }
  return absl::OkStatus();
}

// The first real error of a request's parts, not the CANCELLED that it caused in the others.
absl::Status FirstError(const std::vector<absl::Status>& results) {
  absl::Status first_error;
  for (const absl::Status& r : results) {
    if (!r.ok() && (first_error.ok() || (absl::IsCancelled(first_error) && !absl::IsCancelled(r)))) first_error = r;
  }
  return first_error;
}

}  // namespace

absl::Status LceClient::StreamOn(Replica& replica, const char* rpc, const HiddenBatch& batch,
                                 const v1::RequestHeader& header, const RowGrads& grads, ForwardBackwardResult* out) {
  if (absl::Status s = CheckBatch(batch, grads); !s.ok()) return s;
  const int64_t row_bytes = batch.hidden_size * WireDTypeSize(batch.dtype);
  const bool hidden_in_region = batch.hidden_region.has_value();
  // Over the data plane: the bytes go through server memory, the messages name slices of it.
  const bool via_data_plane = options_.data_plane && !hidden_in_region && !batch.d_hidden_region && batch.rows > 0;
  const int streams = 1 + static_cast<int>(replica.extra_stubs.size());
  const auto parts = hidden_in_region
                         ? std::vector<std::pair<int64_t, int64_t>>{{0, batch.rows}}
                         : PlanStreams(batch.rows, row_bytes, options_.chunk_bytes,
                                       via_data_plane ? std::min(streams, options_.data_plane_streams) : streams,
                                       options_.min_stream_bytes);
  const bool split = parts.size() > 1;
  const bool wants_d_hidden = std::string(rpc) != "Score";
  // The request then goes out as a region-backed one whose bytes the lanes carry.
  std::unique_lock<std::mutex> data_plane_lock;
  std::vector<DataPlaneLane> lanes;
  HiddenBatch routed = batch;
  if (via_data_plane) {
    data_plane_lock = std::unique_lock<std::mutex>(replica.data_plane.mu);
    if (absl::Status s = RouteOverDataPlane(replica, wants_d_hidden, parts.size(), routed, lanes); !s.ok()) return s;
  }
  if (split) ConnectExtraChannels(replica);
  v1::RequestHeader part_header = header;
  if (split) part_header.set_partial(true);
  // The parts of a split request that accumulates dW fill one contribution on the server, added only
  // when every part succeeds (RequestHeader.split_id).
  if (split && header.accumulate_weight_grad()) {
    part_header.set_split_id(NewSplitId());
    part_header.set_split_parts(static_cast<int32_t>(parts.size()));
  }
  AnswerAssembly assembly(batch.rows, row_bytes, out, batch.d_hidden_out, header.top_k());
  if (wants_d_hidden && !batch.d_hidden_region) assembly.SizeDHiddenAhead();
  const PartRequest request{rpc, routed, part_header, grads, assembly};
  std::vector<PartSummary> summaries(parts.size());
  if (absl::Status s = RunParts(replica, request, parts, lanes, summaries); !s.ok()) {
    if (via_data_plane) replica.data_plane.Reset();
    return s;
  }
  return assembly.Finish(summaries, header, split);
}

absl::Status LceClient::RouteOverDataPlane(Replica& replica, bool wants_d_hidden, size_t parts, HiddenBatch& routed,
                                           std::vector<DataPlaneLane>& lanes) {
  DataPlane& dp = replica.data_plane;
  const int64_t hidden_bytes = routed.rows * routed.hidden_size * WireDTypeSize(routed.dtype);
  if (absl::Status s = PrepareDataPlane(replica, parts, hidden_bytes, wants_d_hidden); !s.ok()) {
    dp.Reset();
    return s;
  }
  routed.hidden_region = RegionRef{dp.session->id(), dp.hidden_region, 0, dp.session->secret()};
  if (wants_d_hidden) routed.d_hidden_region = RegionRef{dp.session->id(), dp.d_hidden_region, 0, dp.session->secret()};
  const size_t k = static_cast<size_t>(options_.data_plane_sockets);
  for (size_t i = 0; i < parts; ++i) {
    DataPlaneLane lane;
    for (size_t j = 0; j < k; ++j) {
      lane.up.push_back(dp.up[i * k + j].get());
      lane.down.push_back(dp.down[i * k + j].get());
    }
    lanes.push_back(std::move(lane));
  }
  return absl::OkStatus();
}

// The first split request connects the extra channels all at once; a connection that fails its
// first attempt is retried here, where a fail-fast call would give up at once.
void LceClient::ConnectExtraChannels(Replica& replica) {
  if (replica.extra_connected.load()) return;
  const auto deadline =
      std::chrono::system_clock::now() +
      std::min<std::chrono::system_clock::duration>(absl::ToChronoSeconds(options_.timeout), std::chrono::seconds(30));
  bool all = true;
  for (auto& ch : replica.extra_channels) all = ch->WaitForConnected(deadline) && all;
  replica.extra_connected = all;
}

absl::Status LceClient::RunParts(Replica& replica, const PartRequest& request,
                                 const std::vector<std::pair<int64_t, int64_t>>& parts,
                                 const std::vector<DataPlaneLane>& lanes, std::vector<PartSummary>& summaries) {
  const StreamEnv env{options_, *workers_, no_call_, [&](grpc::ClientContext* ctx) {
                        Prepare(ctx);
                        AddSessionMetadata(ctx, request.batch);
                      }};
  const bool split = parts.size() > 1;
  std::vector<grpc::ClientContext> contexts(parts.size());
  std::vector<absl::Status> results(parts.size());
  std::atomic<bool> cancelled{false};
  auto run_part = [&](size_t i) {
    v1::LceService::Stub& stub = i == 0 ? *replica.stub : *replica.extra_stubs[i - 1];
    const HiddenCall* hidden_call = i == 0 ? replica.hidden_call.get() : nullptr;
    PartStream part(env, request, parts[i], lanes.empty() ? nullptr : &lanes[i]);
    results[i] = part.Run(stub, hidden_call, contexts[i], &summaries[i]);
    if (split && !results[i].ok()) {  // the server counts rows from the part's start: say where it is
      results[i] = absl::Status(results[i].code(),
                                absl::StrCat("stream ", i + 1, " of ", parts.size(), " (rows ", parts[i].first, "..",
                                             parts[i].first + parts[i].second - 1, " of the request): ",
                                             results[i].message()));
    }
    // One failed part fails the request: stop the others rather than let them run to the end.
    if (!results[i].ok() && !cancelled.exchange(true)) {
      for (size_t j = 0; j < contexts.size(); ++j) {
        if (j != i) contexts[j].TryCancel();
      }
    }
  };
  TaskLatch parts_done(static_cast<int64_t>(parts.size()) - 1);
  for (size_t i = 1; i < parts.size(); ++i) {
    workers_->Run([&, i] {
      run_part(i);
      parts_done.Done();
    });
  }
  run_part(0);
  parts_done.Wait();
  return FirstError(results);
}

absl::StatusOr<ScoreResult> LceClient::Score(const HiddenBatch& batch, v1::RequestHeader header) {
  HiddenBatch b = batch;
  // Score returns no d_hidden: a batch set up for training scores as it is.
  b.d_hidden_region.reset();
  b.d_hidden_out = {};
  ForwardBackwardResult r;
  if (absl::Status s = Stream("Score", b, header, RowGrads{}, &r); !s.ok()) return s;
  return ScoreResult{std::move(r.logprobs), std::move(r.entropy), std::move(r.rankings)};
}

absl::StatusOr<ForwardBackwardResult> LceClient::ForwardBackward(const HiddenBatch& batch, v1::RequestHeader header,
                                                                 absl::Span<const float> grad_loss) {
  const bool mean = header.reduction() == v1::REDUCTION_MEAN || header.reduction() == v1::REDUCTION_UNSPECIFIED;
  if (mean && !header.has_num_valid_tokens()) {
    const int32_t ignore = header.has_ignore_index() ? header.ignore_index() : -100;
    int64_t valid = 0;
    for (int32_t y : batch.targets) valid += y != ignore ? 1 : 0;
    header.set_num_valid_tokens(valid);
  }
  ForwardBackwardResult r;
  if (absl::Status s = Stream("ForwardBackward", batch, header, RowGrads{grad_loss, {}, {}}, &r); !s.ok()) return s;
  return r;
}

absl::StatusOr<BackwardResult> LceClient::Backward(const HiddenBatch& batch, v1::RequestHeader header,
                                                   absl::Span<const float> grad_logprob,
                                                   absl::Span<const float> grad_entropy) {
  ForwardBackwardResult r;
  const RowGrads grads{{}, grad_logprob, grad_entropy};
  if (absl::Status s = Stream("Backward", batch, header, grads, &r); !s.ok()) return s;
  return BackwardResult{std::move(r.d_hidden)};
}

}  // namespace lce::client

namespace lce::client {

absl::StatusOr<std::unique_ptr<SharedMemorySession>> LceClient::OpenSession() { return OpenSessionOn(*front_->stub); }

absl::StatusOr<std::unique_ptr<SharedMemorySession>> LceClient::OpenSessionOn(v1::LceService::Stub& stub) {
  std::unique_ptr<SharedMemorySession> s(new SharedMemorySession());
  // No deadline: a session lives as long as its owner.
  if (!options_.bearer_token.empty()) s->ctx_.AddMetadata("authorization", "Bearer " + options_.bearer_token);
  s->stream_ = stub.OpenSession(&s->ctx_);
  v1::SessionResponse first;
  if (!s->stream_->Read(&first)) {
    const absl::Status refused = ToAbsl(s->stream_->Finish());
    s->stream_.reset();  // finished: the destructor must not finish it again (a gRPC API misuse)
    return refused;
  }
  s->session_id_ = first.session_id();
  s->secret_ = first.session_secret();
  s->shm_socket_ = first.shm_socket();
  if (s->session_id_.empty()) return absl::InternalError("the server's first session message has no session_id");
  std::lock_guard<std::mutex> lock(secrets_mu_);
  session_secrets_[s->session_id_] = s->secret_;
  return s;
}

void LceClient::AddSessionMetadata(grpc::ClientContext* ctx, const HiddenBatch& batch) const {
  if (!batch.hidden_region && !batch.d_hidden_region) return;
  const RegionRef& r = batch.hidden_region ? *batch.hidden_region : *batch.d_hidden_region;
  std::string secret = r.session_secret;
  if (secret.empty()) {
    std::lock_guard<std::mutex> lock(secrets_mu_);
    auto it = session_secrets_.find(r.session_id);
    if (it != session_secrets_.end()) secret = it->second;
  }
  ctx->AddMetadata("lce-session", r.session_id);
  ctx->AddMetadata("lce-session-secret", secret);
}

absl::StatusOr<v1::SessionResponse> SharedMemorySession::Ask(const v1::SessionRequest& req) {
  std::lock_guard<std::mutex> lock(mu_);
  v1::SessionResponse resp;
  if (broken_ || !stream_->Write(req) || !stream_->Read(&resp)) {
    broken_ = true;
    return absl::UnavailableError("the session stream has ended");
  }
  if (resp.code() != 0) return absl::Status(static_cast<absl::StatusCode>(resp.code()), resp.message());
  return resp;
}

absl::StatusOr<uint64_t> SharedMemorySession::AskRegionId(const v1::SessionRequest& req) {
  absl::StatusOr<v1::SessionResponse> resp = Ask(req);
  if (!resp.ok()) return resp.status();
  return resp->region_id();
}

absl::StatusOr<uint64_t> SharedMemorySession::Register(const std::string& shm_name, int64_t offset,
                                                       int64_t byte_size, const std::string& name) {
  v1::SessionRequest req;
  v1::RegisterRegion* r = req.mutable_register_region();
  r->set_name(name.empty() ? shm_name : name);
  r->set_shm_name(shm_name);
  r->set_offset(offset);
  r->set_byte_size(byte_size);
  return AskRegionId(req);
}

absl::StatusOr<uint64_t> SharedMemorySession::RegisterCudaIpc(absl::string_view ipc_handle, int64_t offset,
                                                              int64_t byte_size, const std::string& name) {
  v1::SessionRequest req;
  v1::RegisterRegion* r = req.mutable_register_region();
  r->set_name(name.empty() ? "cuda-ipc" : name);
  r->set_cuda_ipc_handle(std::string(ipc_handle));
  r->set_offset(offset);
  r->set_byte_size(byte_size);
  return AskRegionId(req);
}

absl::StatusOr<uint64_t> SharedMemorySession::AllocateServerMemory(int64_t byte_size, const std::string& name) {
  v1::SessionRequest req;
  v1::RegisterRegion* r = req.mutable_register_region();
  r->set_name(name.empty() ? "server-memory" : name);
  r->set_server_memory(true);
  r->set_byte_size(byte_size);
  return AskRegionId(req);
}

absl::Status SharedMemorySession::Unregister(uint64_t region_id) {
  v1::SessionRequest req;
  req.mutable_unregister_region()->set_region_id(region_id);
  return Ask(req).status();
}

absl::StatusOr<uint64_t> SharedMemorySession::RegisterFd(int fd, int64_t offset, int64_t byte_size,
                                                         const std::string& name) {
  return RegisterFdOverSocket(shm_socket_, {session_id_, secret_, offset, byte_size, name.empty() ? "memfd" : name}, fd);
}

absl::StatusOr<SharedMemorySession::Region> SharedMemorySession::CreateRegion(int64_t bytes, const std::string& name) {
  if (bytes <= 0) return absl::InvalidArgumentError(absl::StrCat("region size must be > 0, got ", bytes));
  // A memfd has no name in /dev/shm: only a process that holds its descriptor can map it.
  const int fd = memfd_create(name.empty() ? "lce-region" : name.c_str(), MFD_CLOEXEC);
  if (fd < 0) return absl::InternalError(absl::StrCat("memfd_create: ", std::strerror(errno)));
  void* addr = MAP_FAILED;
  if (ftruncate(fd, bytes) == 0) addr = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (addr == MAP_FAILED) {
    const int e = errno;
    close(fd);
    return absl::InternalError(absl::StrCat("ftruncate/mmap of a memfd of ", bytes, " bytes: ", std::strerror(e)));
  }
  absl::StatusOr<uint64_t> id = RegisterFd(fd, 0, bytes, name);
  if (!id.ok()) {
    munmap(addr, static_cast<size_t>(bytes));
    close(fd);
    return id.status();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    owned_.push_back({*id, fd, addr, static_cast<size_t>(bytes)});
  }
  return Region{*id, "", absl::Span<uint8_t>(static_cast<uint8_t*>(addr), static_cast<size_t>(bytes)), fd, session_id_, secret_};
}

absl::Status SharedMemorySession::ReleaseRegion(uint64_t region_id) {
  Owned o{};
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = std::find_if(owned_.begin(), owned_.end(), [&](const Owned& x) { return x.id == region_id; });
    if (it == owned_.end()) return absl::NotFoundError(absl::StrCat("region ", region_id, " was not created here"));
    o = *it;
    owned_.erase(it);
  }
  absl::Status s = Unregister(region_id);
  munmap(o.addr, o.len);
  close(o.fd);
  return s;
}

SharedMemorySession::~SharedMemorySession() {
  if (stream_ != nullptr) {
    if (!broken_) stream_->WritesDone();
    v1::SessionResponse resp;
    while (stream_->Read(&resp)) {
    }
    stream_->Finish();
  }
  for (const Owned& o : owned_) {
    munmap(o.addr, o.len);
    close(o.fd);
  }
}

}  // namespace lce::client
