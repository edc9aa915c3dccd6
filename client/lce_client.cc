#include "lce/client/lce_client.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cerrno>
#include <cstring>
#include <functional>
#include <random>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "data_plane_connection.h"
#include "shm_socket_client.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "replica.h"
#include "worker_pool.h"

namespace lce::client {

std::string_view Version() { return LCE_SERVE_VERSION; }

namespace {

using BidiStream = grpc::ClientReaderWriter<v1::StreamRequest, v1::StreamResponse>;

}  // namespace

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

struct LceClient::DataPlaneLane {
  std::vector<DataPlaneConnection*> up, down;  // ClientOptions.data_plane_sockets each
};

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

// Socket i's share [offset, offset + length) of a transfer of `bytes` over k sockets: equal shares
// (whole 4 KiB pages where possible); below 64 KiB all of it on socket 0.
std::pair<int64_t, int64_t> SocketShare(int64_t bytes, int64_t k, int64_t i) {
  if (k == 1 || bytes < (int64_t{1} << 16)) return {0, i == 0 ? bytes : 0};
  const int64_t lo = bytes * i / k / 4096 * 4096, hi = i + 1 == k ? bytes : bytes * (i + 1) / k / 4096 * 4096;
  return {lo, hi - lo};
}

// Moves `bytes` over the sockets at once, a SocketShare each: `move(socket, offset, length)`, the
// first share on this thread and the others on `workers` (kept threads: this runs once a chunk).
// The first failure is returned.
absl::Status SplitTransfer(const std::vector<DataPlaneConnection*>& sockets, int64_t bytes, WorkerPool& workers,
                           const std::function<absl::Status(DataPlaneConnection&, int64_t, int64_t)>& move) {
  const int64_t k = static_cast<int64_t>(sockets.size());
  if (SocketShare(bytes, k, 0).second == bytes) return move(*sockets[0], 0, bytes);  // one share: no threads
  std::vector<absl::Status> results(static_cast<size_t>(k));
  auto part = [&](int64_t i) {
    const auto [lo, len] = SocketShare(bytes, k, i);
    results[static_cast<size_t>(i)] = move(*sockets[static_cast<size_t>(i)], lo, len);
  };
  TaskLatch others_done(k - 1);
  for (int64_t i = 1; i < k; ++i) {
    workers.Run([&, i] {
      part(i);
      others_done.Done();
    });
  }
  part(0);
  others_done.Wait();
  for (const absl::Status& s : results) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
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

// Answers of every stream of one request land here, each at its rows. Outputs are sized on first
// use (under the lock); afterwards parts write disjoint row ranges without it.
struct LceClient::Assembly {
  int64_t rows = 0, row_bytes = 0;
  ForwardBackwardResult* out = nullptr;
  std::mutex mu;
  std::vector<uint8_t> seen;  // rows answered; each part touches only its own range
  std::atomic<int64_t> covered{0}, n_logprobs{0}, n_entropy{0}, n_loss{0}, n_dhidden{0};

  float* Floats(std::vector<float>& v) {
    std::lock_guard<std::mutex> lock(mu);
    if (v.empty()) v.resize(static_cast<size_t>(rows));
    return v.data();
  }
  absl::Span<uint8_t> d_hidden_out;  // the caller's destination, if any
  uint8_t* DHidden() {
    if (!d_hidden_out.empty()) return d_hidden_out.data();
    std::lock_guard<std::mutex> lock(mu);
    if (out->d_hidden.empty()) out->d_hidden.resize(static_cast<size_t>(rows * row_bytes));
    return out->d_hidden.data();
  }
};

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
                               absl::Span<const float> grad_loss, absl::Span<const float> grad_logprob,
                               absl::Span<const float> grad_entropy, ForwardBackwardResult* out) {
  // Requests that change the head's gradient, or name a session's regions, belong to the front.
  if (header.accumulate_weight_grad() || batch.hidden_region || batch.d_hidden_region) {
    return StreamOn(*front_, rpc, batch, header, grad_loss, grad_logprob, grad_entropy, out);
  }
  // The rest have no side effects: spread, and sent again whole on UNAVAILABLE.
  std::vector<bool> failed(replicas_.size(), false);
  absl::Duration backoff = options_.retry_backoff;
  const size_t start = static_cast<size_t>(next_replica_.fetch_add(1) % replicas_.size());
  for (int attempt = 1;; ++attempt) {
    const size_t i = PickReplica(start, failed);
    *out = ForwardBackwardResult{};
    absl::Status s = StreamOn(*replicas_[i], rpc, batch, header, grad_loss, grad_logprob, grad_entropy, out);
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

absl::Status LceClient::StreamOn(Replica& replica, const char* rpc, const HiddenBatch& batch,
                                 const v1::RequestHeader& header, absl::Span<const float> grad_loss,
                                 absl::Span<const float> grad_logprob, absl::Span<const float> grad_entropy,
                                 ForwardBackwardResult* out) {
  const int64_t es = WireDTypeSize(batch.dtype);
  const int64_t row_bytes = batch.hidden_size * es;
  if (es == 0) {
    return absl::InvalidArgumentError(absl::StrCat("batch dtype ", v1::DType_Name(batch.dtype), " is not a wire dtype"));
  }
  if (batch.hidden_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("batch hidden_size must be > 0, got ", batch.hidden_size));
  }
  const bool hidden_in_region = batch.hidden_region.has_value();
  if (batch.hidden_region && batch.d_hidden_region &&
      batch.hidden_region->session_id != batch.d_hidden_region->session_id) {
    return absl::InvalidArgumentError("hidden_region and d_hidden_region must belong to one session");
  }
  if (batch.rows < 0 || (!hidden_in_region && static_cast<int64_t>(batch.hidden.size()) != batch.rows * row_bytes) ||
      static_cast<int64_t>(batch.targets.size()) != batch.rows) {
    return absl::InvalidArgumentError(absl::StrCat("batch of ", batch.rows, " rows x ", batch.hidden_size,
                                                   " needs ", batch.rows * row_bytes, " hidden bytes and ",
                                                   batch.rows, " targets; got ", batch.hidden.size(), " and ",
                                                   batch.targets.size()));
  }
  for (auto [name, span] : {std::pair{"grad_loss", grad_loss}, std::pair{"grad_logprob", grad_logprob},
                            std::pair{"grad_entropy", grad_entropy}}) {
    if (!span.empty() && static_cast<int64_t>(span.size()) != batch.rows) {
      return absl::InvalidArgumentError(absl::StrCat(name, " has ", span.size(), " values for ", batch.rows, " rows"));
    }
  }
  if (!batch.d_hidden_out.empty() && static_cast<int64_t>(batch.d_hidden_out.size()) != batch.rows * row_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("d_hidden_out has ", batch.d_hidden_out.size(), " bytes; ",
                                                   batch.rows, " rows need ", batch.rows * row_bytes));
  }
  Assembly assembly;
  assembly.d_hidden_out = batch.d_hidden_out;
  assembly.rows = batch.rows;
  assembly.row_bytes = row_bytes;
  assembly.out = out;
  assembly.seen.assign(static_cast<size_t>(batch.rows), 0);

  const auto parts = hidden_in_region ? std::vector<std::pair<int64_t, int64_t>>{{0, batch.rows}}
                                      : PlanStreams(batch.rows, row_bytes, options_.chunk_bytes,
                                                    1 + static_cast<int>(replica.extra_stubs.size()),
                                                    options_.min_stream_bytes);
  const bool split = parts.size() > 1;
  // Over the data plane: the bytes go through server memory, the messages name slices of it.
  // (Not for weight-gradient accumulation, which a GPU server does not do on its own memory yet.)
  const bool via_data_plane = options_.data_plane && !hidden_in_region && !batch.d_hidden_region && batch.rows > 0 &&
                              !header.accumulate_weight_grad();
  // The request then goes out as a region-backed one whose bytes the lanes carry.
  std::unique_lock<std::mutex> data_plane_lock;
  std::vector<DataPlaneLane> lanes;
  HiddenBatch routed = batch;
  if (via_data_plane) {
    DataPlane& dp = replica.data_plane;
    data_plane_lock = std::unique_lock<std::mutex>(dp.mu);
    const bool wants_d_hidden = std::string(rpc) != "Score";
    if (absl::Status s = PrepareDataPlane(replica, parts.size(), batch.rows * row_bytes, wants_d_hidden); !s.ok()) {
      dp.Reset();
      return s;
    }
    routed.hidden_region = RegionRef{dp.session->id(), dp.hidden_region, 0, dp.session->secret()};
    if (wants_d_hidden) routed.d_hidden_region = RegionRef{dp.session->id(), dp.d_hidden_region, 0, dp.session->secret()};
    const size_t k = static_cast<size_t>(options_.data_plane_sockets);
    for (size_t i = 0; i < parts.size(); ++i) {
      DataPlaneLane lane;
      for (size_t j = 0; j < k; ++j) {
        lane.up.push_back(dp.up[i * k + j].get());
        lane.down.push_back(dp.down[i * k + j].get());
      }
      lanes.push_back(std::move(lane));
    }
  }
  // The first split request connects the extra channels all at once; a connection that fails its
  // first attempt is retried here, where a fail-fast call would give up at once.
  if (split && !replica.extra_connected.load()) {
    const auto deadline = std::chrono::system_clock::now() +
                          std::min<std::chrono::system_clock::duration>(absl::ToChronoSeconds(options_.timeout),
                                                                       std::chrono::seconds(30));
    bool all = true;
    for (auto& ch : replica.extra_channels) all = ch->WaitForConnected(deadline) && all;
    replica.extra_connected = all;
  }
  v1::RequestHeader part_header = header;
  if (split) part_header.set_partial(true);
  std::vector<grpc::ClientContext> contexts(parts.size());
  std::vector<PartSummary> summaries(parts.size());
  std::vector<absl::Status> results(parts.size());
  std::atomic<bool> cancelled{false};
  auto run_part = [&](size_t i) {
    v1::LceService::Stub& stub = i == 0 ? *replica.stub : *replica.extra_stubs[i - 1];
    const HiddenCall* hidden_call = i == 0 ? replica.hidden_call.get() : nullptr;
    results[i] = StreamPart(stub, hidden_call, contexts[i], rpc, routed, part_header, grad_loss, grad_logprob,
                            grad_entropy, parts[i].first, parts[i].second, assembly, &summaries[i],
                            via_data_plane ? &lanes[i] : nullptr);
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
  // The first real error, not the CANCELLED that it caused in the other parts.
  absl::Status first_error;
  for (const absl::Status& r : results) {
    if (!r.ok() && (first_error.ok() || (absl::IsCancelled(first_error) && !absl::IsCancelled(r)))) first_error = r;
  }
  if (!first_error.ok()) {
    if (via_data_plane) replica.data_plane.Reset();
    return first_error;
  }

  if (assembly.covered != batch.rows) {
    return absl::InternalError(absl::StrCat("the server answered ", assembly.covered.load(), " of ", batch.rows, " rows"));
  }
  for (auto [count, what] : {std::pair{assembly.n_logprobs.load(), "logprobs"}, std::pair{assembly.n_entropy.load(), "entropy"},
                             std::pair{assembly.n_loss.load(), "loss"}, std::pair{assembly.n_dhidden.load(), "d_hidden"}}) {
    if (count != 0 && count != batch.rows) {
      return absl::InternalError(absl::StrCat("the server answered ", what, " for ", count, " of ", batch.rows, " rows"));
    }
  }
  // Parts' losses add up (RequestHeader.partial); so do their valid tokens, which must then match
  // the declared count that every part's mean used.
  out->reduced_loss = 0;
  out->valid_tokens = 0;
  out->head_version = summaries[0].head_version;
  for (const PartSummary& p : summaries) {
    out->reduced_loss += p.loss;
    out->valid_tokens += p.valid_tokens;
    out->pending_grads.insert(out->pending_grads.end(), p.pending_grads.begin(), p.pending_grads.end());
    if (p.head_version != out->head_version) {
      return absl::AbortedError(absl::StrCat("the head changed version during the request (", out->head_version,
                                             " and ", p.head_version, "); retry it"));
    }
  }
  if (split && header.has_num_valid_tokens() && out->valid_tokens != header.num_valid_tokens()) {
    return absl::InvalidArgumentError(absl::StrCat("header.num_valid_tokens declared ", header.num_valid_tokens(),
                                                   " but the request has ", out->valid_tokens,
                                                   " non-ignored rows; the returned d_hidden is wrong, discard it"));
  }
  return absl::OkStatus();
}

absl::Status LceClient::StreamPart(v1::LceService::Stub& stub, const HiddenCall* hidden_call, grpc::ClientContext& ctx,
                                   const char* rpc, const HiddenBatch& batch, const v1::RequestHeader& header,
                                   absl::Span<const float> grad_loss, absl::Span<const float> grad_logprob,
                                   absl::Span<const float> grad_entropy, int64_t part_first, int64_t part_rows,
                                   Assembly& assembly, PartSummary* summary, const DataPlaneLane* lane) {
  const int64_t row_bytes = assembly.row_bytes;
  const bool hidden_in_region = batch.hidden_region.has_value();
  const bool tracing = static_cast<bool>(options_.stream_trace);
  const auto now = [] { return std::chrono::steady_clock::now(); };
  StreamTrace trace;
  if (tracing) trace.start = now();
  Prepare(&ctx);
  AddSessionMetadata(&ctx, batch);
  const std::string which = rpc;
  // A region-backed chunk carries no hidden bytes: one chunk (of at most kRegionChunkRows rows) lets
  // the server run the part as one engine call. Over the data plane the bytes still travel, and
  // are chunked as on the wire so that transfer and compute overlap.
  constexpr int64_t kRegionChunkRows = 1 << 16;
  // The smaller last chunk only where d_hidden comes back: a score's last answer is a few floats and
  // its tail the last chunk's compute, which a smaller chunk does not shorten (it adds an engine call).
  const int64_t last_chunk_bytes = which == "Score" ? 0 : options_.last_chunk_bytes;
  auto plan = hidden_in_region && lane == nullptr ? PlanChunks(part_rows, row_bytes, kRegionChunkRows * row_bytes)
                               : PlanChunks(part_rows, row_bytes, options_.chunk_bytes, options_.first_chunk_bytes,
                                            last_chunk_bytes, options_.grow_chunks);
  for (auto& [first, n] : plan) first += part_first;
  // Write on a thread of its own: the server answers chunk k while later chunks are in flight,
  // so reading and writing must proceed together or flow control stalls both sides.
  //
  // Over the data plane, uploaders (below) move the plan's chunks into server memory back to back
  // and the writer announces each chunk once its bytes are in, without waiting for answers.
  struct Progress {
    std::mutex mu;
    std::condition_variable cv;
    size_t uploaded = 0;  // data plane: plan chunks whose bytes are in server memory
    bool stop = false;    // the call is over (failed, or the answers are all in)
  } progress;
  auto stop_all = [&progress] {
    std::lock_guard<std::mutex> l(progress.mu);
    progress.stop = true;
    progress.cv.notify_all();
  };
  absl::Status upload_error;
  const int uploaders = lane == nullptr ? 0 : static_cast<int>(lane->up.size());
  TaskLatch tasks_done(uploaders + 1);  // the uploaders and the writer
  std::vector<int> shares_done(lane == nullptr ? 0 : plan.size(), 0);
  // The message of plan chunk k.
  // `with_hidden`: the hidden bytes too (a HiddenCall sends them from the batch itself).
  auto chunk_message = [&](size_t k, v1::StreamRequest& msg, bool with_hidden = true) {
    const auto [first, n] = plan[k];
    msg.Clear();
    v1::RowChunk* c = msg.mutable_chunk();
    if (hidden_in_region) {  // a slice of the region, no bytes
      v1::RegionSlice* r = c->mutable_hidden_region();
      r->set_region_id(batch.hidden_region->region_id);
      r->set_offset(batch.hidden_region->offset + first * row_bytes);
      r->set_byte_size(n * row_bytes);
    } else if (with_hidden) {
      c->set_hidden(reinterpret_cast<const char*>(batch.hidden.data()) + first * row_bytes, n * row_bytes);
    }
    if (batch.d_hidden_region) {
      v1::RegionSlice* r = c->mutable_d_hidden_region();
      r->set_region_id(batch.d_hidden_region->region_id);
      r->set_offset(batch.d_hidden_region->offset + first * row_bytes);
      r->set_byte_size(n * row_bytes);
    }
    c->mutable_targets()->Add(batch.targets.begin() + first, batch.targets.begin() + first + n);
    if (!grad_loss.empty()) c->mutable_grad_loss()->Add(grad_loss.begin() + first, grad_loss.begin() + first + n);
    if (!grad_logprob.empty()) {
      c->mutable_grad_logprob()->Add(grad_logprob.begin() + first, grad_logprob.begin() + first + n);
    }
    if (!grad_entropy.empty()) {
      c->mutable_grad_entropy()->Add(grad_entropy.begin() + first, grad_entropy.begin() + first + n);
    }
  };
  // Answers are placed by first_row/rows (relative to the part); together they must cover the
  // part's rows exactly once.
  absl::Status shape_error;
  auto place = [&](const auto& src, std::vector<float>& dst, int64_t first, int64_t n, std::atomic<int64_t>& count,
                   const char* what) {
    if (src.empty()) return;
    if (static_cast<int64_t>(src.size()) != n) {
      shape_error = absl::InternalError(absl::StrCat("answer for rows [", first, ", ", first + n, ") has ", src.size(),
                                                     " ", what, " values"));
      return;
    }
    std::copy(src.begin(), src.end(), assembly.Floats(dst) + first);
    count += n;
  };
  ForwardBackwardResult* out = assembly.out;
  // One answer placed by first_row/rows (relative to the part); false once the answers are unusable.
  auto handle = [&](const v1::StreamResponse& resp) -> bool {
    if (tracing) {
      trace.last_answer = now();
      if (trace.first_answer == StreamTrace::Time{}) trace.first_answer = trace.last_answer;
    }
    if (resp.has_summary()) {
      summary->loss = resp.summary().loss();
      summary->valid_tokens = resp.summary().valid_tokens();
      summary->head_version = resp.summary().head_version();
      summary->pending_grads.assign(resp.summary().pending_grad_ids().begin(), resp.summary().pending_grad_ids().end());
      return true;
    }
    const v1::ChunkResult& c = resp.chunk();
    const int64_t n = c.rows(), first = part_first + c.first_row();
    if (c.first_row() < 0 || n <= 0 || c.first_row() > part_rows - n) {
      shape_error = absl::InternalError(absl::StrCat("answer for rows [", first, ", ", first + n,
                                                     ") is outside the stream's rows [", part_first, ", ",
                                                     part_first + part_rows, ")"));
      return false;
    }
    for (int64_t r = first; r < first + n; ++r) {
      if (assembly.seen[r]++) {
        shape_error = absl::InternalError(absl::StrCat("row ", r, " was answered twice"));
        return false;
      }
    }
    if (!shape_error.ok()) return false;
    place(c.logprobs(), out->logprobs, first, n, assembly.n_logprobs, "logprob");
    place(c.entropy(), out->entropy, first, n, assembly.n_entropy, "entropy");
    place(c.loss(), out->loss, first, n, assembly.n_loss, "loss");
    if (lane != nullptr && batch.d_hidden_region) {  // the server wrote it into its memory before answering
      const RegionRef& from = *batch.d_hidden_region;
      uint8_t* dst = assembly.DHidden() + first * row_bytes;
      auto read = [&](DataPlaneConnection& c, int64_t off, int64_t len) {
        return c.Read(from.session_id, from.region_id, from.offset + first * row_bytes + off,
                      absl::MakeSpan(dst + off, len));
      };
      shape_error = SplitTransfer(lane->down, n * row_bytes, *workers_, read);
      if (!shape_error.ok()) return false;
      assembly.n_dhidden += n;
    } else if (!c.d_hidden().empty()) {
      if (static_cast<int64_t>(c.d_hidden().size()) != n * row_bytes) {
        shape_error = absl::InternalError(absl::StrCat("answer for rows [", first, ", ", first + n, ") has ",
                                                       c.d_hidden().size(), " d_hidden bytes, not ", n * row_bytes));
      } else {
        std::copy(c.d_hidden().begin(), c.d_hidden().end(), assembly.DHidden() + first * row_bytes);
        assembly.n_dhidden += n;
      }
    }
    assembly.covered += n;
    return shape_error.ok();
  };
  // A whole request of one chunk, without the data plane: one Call, one message each way (no stream
  // to set up, no round trip a message), unless the server has no Call (an older one).
  if (lane == nullptr && plan.size() == 1 && part_rows == assembly.rows && options_.single_message_calls &&
      !no_call_.load()) {
    v1::CallRequest req;
    req.set_method(which == "Score"             ? v1::CALL_SCORE
                   : which == "ForwardBackward" ? v1::CALL_FORWARD_BACKWARD
                                                : v1::CALL_BACKWARD);
    *req.mutable_header() = header;
    req.mutable_header()->set_hidden_size(batch.hidden_size);
    req.mutable_header()->set_dtype(batch.dtype);
    const bool hidden_apart = hidden_call != nullptr && !hidden_in_region;
    v1::StreamRequest msg;
    chunk_message(0, msg, /*with_hidden=*/!hidden_apart);
    *req.mutable_chunk() = std::move(*msg.mutable_chunk());
    grpc::ClientContext call_ctx;
    Prepare(&call_ctx);
    AddSessionMetadata(&call_ctx, batch);
    v1::CallResponse answer;
    if (tracing) trace.opened = trace.first_chunk_sent = trace.last_chunk_sent = now();
    const grpc::Status s =
        hidden_apart ? hidden_call->Run(&call_ctx, req,
                                          batch.hidden.subspan(plan[0].first * row_bytes, plan[0].second * row_bytes),
                                          &answer)
                     : stub.Call(&call_ctx, req, &answer);
    if (tracing) {
      trace.first_answer = trace.last_answer = trace.ended = now();
      options_.stream_trace(trace);
    }
    if (s.error_code() != grpc::StatusCode::UNIMPLEMENTED) {
      if (!s.ok()) return ToAbsl(s);
      v1::StreamResponse chunk;
      *chunk.mutable_chunk() = std::move(*answer.mutable_chunk());
      if (handle(chunk) && answer.has_summary()) {
        v1::StreamResponse last;
        *last.mutable_summary() = std::move(*answer.mutable_summary());
        handle(last);
      }
      return shape_error;
    }
    no_call_ = true;  // an older server: stream from now on (if it refuses that too, it says why)
  }
  // The call is created first (at once: its initial metadata waits for the header), then the
  // uploaders start on threads kept for the client's life, and the header goes. An upload that
  // fails cancels the call.
  std::unique_ptr<BidiStream> stream;
  ctx.set_initial_metadata_corked(true);
  if (which == "Score") {
    stream = stub.Score(&ctx);
  } else if (which == "ForwardBackward") {
    stream = stub.ForwardBackward(&ctx);
  } else {
    stream = stub.Backward(&ctx);
  }
  if (tracing) trace.opened = now();
  // One uploader per socket, each moving its share of every chunk in turn without waiting for the
  // others (no barrier a chunk: a slow socket delays only the chunks it has not finished).
  if (lane != nullptr) {
    const int k = uploaders;
    for (int i = 0; i < k; ++i) {
      workers_->Run([&, i, k] {
        absl::Cleanup done = [&tasks_done] { tasks_done.Done(); };
        const RegionRef& to = *batch.hidden_region;
        for (size_t c = 0; c < plan.size(); ++c) {
          const auto [first, n] = plan[c];
          const auto [off, len] = SocketShare(n * row_bytes, k, i);
          absl::Status s;
          if (len > 0) {
            s = lane->up[static_cast<size_t>(i)]->Write(to.session_id, to.region_id,
                                                         to.offset + first * row_bytes + off,
                                                         batch.hidden.subspan(first * row_bytes + off, len));
          }
          std::lock_guard<std::mutex> l(progress.mu);
          if (!s.ok()) {
            if (upload_error.ok()) upload_error = s;
            progress.stop = true;
            progress.cv.notify_all();
            ctx.TryCancel();
            return;
          }
          if (progress.stop) return;
          ++shares_done[c];
          while (progress.uploaded < plan.size() && shares_done[progress.uploaded] == k) ++progress.uploaded;
          progress.cv.notify_all();
        }
      });
    }
  }

  // The header, with the call's initial metadata, from this thread (a woken worker starts later),
  // and the first chunk too where its bytes need no upload; the rest from a worker, each as its
  // bytes are in.
  bool rest_to_write = false;  // the header went, and chunks are left for the worker
  size_t first_for_writer = 0;
  {
    v1::StreamRequest msg;
    *msg.mutable_header() = header;
    msg.mutable_header()->set_hidden_size(batch.hidden_size);
    msg.mutable_header()->set_dtype(batch.dtype);
    // Every chunk goes without waiting for answers: the server may then compute one chunk while
    // it reads and stages the next (RequestHeader.sends_ahead).
    msg.mutable_header()->set_sends_ahead(true);
    // (A write that fails: the server ended the call; Finish says why.)
    rest_to_write = stream->Write(msg);
    if (rest_to_write && lane == nullptr && !plan.empty()) {
      chunk_message(0, msg);
      rest_to_write = stream->Write(msg);
      first_for_writer = 1;
      if (tracing) trace.first_chunk_sent = now();
    }
    if (rest_to_write && first_for_writer == plan.size()) {
      if (tracing) trace.last_chunk_sent = now();
      stream->WritesDone();
      rest_to_write = false;
    }
  }
  if (!rest_to_write) {
    tasks_done.Done();
  } else {
    workers_->Run([&] {
      absl::Cleanup done = [&tasks_done] { tasks_done.Done(); };
      v1::StreamRequest msg;
      for (size_t next = first_for_writer; next < plan.size(); ++next) {
        if (lane != nullptr) {
          std::unique_lock<std::mutex> l(progress.mu);
          progress.cv.wait(l, [&] { return progress.stop || progress.uploaded > next; });
          if (progress.stop) return;
        }
        chunk_message(next, msg);
        if (!stream->Write(msg)) return;  // the server ended the call; Finish says why
        if (tracing && next == 0) trace.first_chunk_sent = now();
        if (tracing && next + 1 == plan.size()) trace.last_chunk_sent = now();
      }
      stream->WritesDone();
    });
  }

  v1::StreamResponse resp;
  while (shape_error.ok() && stream->Read(&resp) && handle(resp)) {
  }
  if (!shape_error.ok()) {
    ctx.TryCancel();  // stop the server's work and our writer; the answer is unusable
    while (stream->Read(&resp)) {
    }
  }
  stop_all();
  tasks_done.Wait();
  grpc::Status s = stream->Finish();
  if (tracing) {
    trace.ended = now();
    options_.stream_trace(trace);
  }
  if (!upload_error.ok()) return upload_error;
  if (!shape_error.ok()) return shape_error;
  return ToAbsl(s);
}

absl::StatusOr<ScoreResult> LceClient::Score(const HiddenBatch& batch, v1::RequestHeader header) {
  HiddenBatch b = batch;
  // Score returns no d_hidden: a batch set up for training scores as it is.
  b.d_hidden_region.reset();
  b.d_hidden_out = {};
  ForwardBackwardResult r;
  if (absl::Status s = Stream("Score", b, header, {}, {}, {}, &r); !s.ok()) return s;
  return ScoreResult{std::move(r.logprobs), std::move(r.entropy)};
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
  if (absl::Status s = Stream("ForwardBackward", batch, header, grad_loss, {}, {}, &r); !s.ok()) return s;
  return r;
}

absl::StatusOr<BackwardResult> LceClient::Backward(const HiddenBatch& batch, v1::RequestHeader header,
                                                   absl::Span<const float> grad_logprob,
                                                   absl::Span<const float> grad_entropy) {
  ForwardBackwardResult r;
  if (absl::Status s = Stream("Backward", batch, header, {}, grad_logprob, grad_entropy, &r); !s.ok()) return s;
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
