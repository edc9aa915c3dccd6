// lce_server: loads the head (this rank's shard of it), builds the engine, and either serves
// lce.v1.LceService (rank 0) or runs the tensor-parallel peer loop (ranks > 0).
// Rank 0 runs until SIGTERM/SIGINT, then stops accepting, lets in-flight streams finish, tells the
// peers to stop and exits 0. A tensor-parallel failure exits every rank with code 3, so that the
// launcher restarts the group as a unit. A data-parallel replica (--dp-size) that finds its job
// formed already (it restarted alone) exits with code 4: the job restarts as a whole.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "grpc_server.h"
#include "head_source.h"
#include "lce/device_memory.h"
#include "metrics.h"
#include "memory_trimmer.h"
#include "metrics_http.h"
#include "service_metrics.h"
#include "server_flags.h"
#include "chunk_staging.h"
#include "dp_job.h"
#include "dp_rank.h"
#include "tp_communicator.h"
#include "tp_group.h"

namespace {

constexpr int kExitTpFailure = 3;
constexpr int kExitStaleDpJob = 4;

// SIGTERM/SIGINT (and a tensor-parallel failure, as 'F') write a byte here; main blocks reading
// it. A handler rather than sigwait, because libraries start threads before main and a blocked
// signal mask would not cover them.
int g_wake_pipe[2] = {-1, -1};

void Wake(char c) { (void)!write(g_wake_pipe[1], &c, 1); }
void OnSignal(int sig) { Wake(static_cast<char>(sig)); }

int Fail(const absl::Status& s) {
  std::cerr << "lce_server: " << s << std::endl;
  return 2;
}

// --max-head-bytes, or by default the memory the head lives in: the GPU's (its host copy too must
// fit the host) on CUDA, the host's otherwise.
absl::StatusOr<int64_t> HeadSizeCap(const lce::server::ServerFlags& flags, lce::Backend backend) {
  if (flags.max_head_bytes > 0) return flags.max_head_bytes;
  const int64_t host = lce::server::HostMemoryBytes();
  if (backend == lce::Backend::kCpu || (backend == lce::Backend::kAuto && !lce::CudaAvailable())) return host;
  absl::StatusOr<int64_t> device = lce::DeviceMemoryBytes(flags.device);
  if (!device.ok()) return device.status();
  return std::min(host, *device);
}

lce::server::DpOptions DpOptionsFrom(const lce::server::ServerFlags& f) {
  lce::server::DpOptions o;
  o.size = f.dp_size;
  o.replica = f.dp_rank;
  o.rendezvous = f.dp_rendezvous;
  o.host = f.dp_host;
  o.timeout = absl::Seconds(f.dp_timeout_seconds);
  o.join_timeout = absl::Seconds(f.dp_join_timeout_seconds);
  return o;
}

// gRPC 1.51's listener stops for good when accept4 fails with EMFILE (issue 35, item 3), and it has
// no cap on incoming connections: the most descriptors the host lets us have is the reserve that
// keeps a flood of idle connections from reaching that point. (Our own listeners back off and go on.)
void RaiseDescriptorLimit() {
  rlimit l{};
  if (getrlimit(RLIMIT_NOFILE, &l) != 0 || l.rlim_cur >= l.rlim_max) return;
  const rlim_t was = l.rlim_cur;
  l.rlim_cur = l.rlim_max;
  if (setrlimit(RLIMIT_NOFILE, &l) != 0) {
    std::cerr << "lce_server: cannot raise the descriptor limit above " << was << ": " << std::strerror(errno) << std::endl;
  }
}

}  // namespace

int main(int argc, char** argv) {
  using namespace lce;
  using namespace lce::server;
  if (pipe(g_wake_pipe) != 0) return Fail(absl::InternalError("pipe() failed"));
  struct sigaction action = {};
  action.sa_handler = OnSignal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
  // A peer that dies closes its sockets; writing to them must fail with EPIPE, not kill us.
  signal(SIGPIPE, SIG_IGN);
  RaiseDescriptorLimit();

  absl::StatusOr<ServerFlags> flags = ParseServerFlags(argc, argv);
  if (!flags.ok()) return Fail(flags.status());
  if (flags->version) {
    std::cout << "lce_server " << LCE_SERVE_VERSION << std::endl;
    return 0;
  }
  if (flags->help) {
    std::cout << ServerUsage();
    return 0;
  }
  // Read by gRPC when it first initialises, which is later than this.
  if (!flags->grpc_poll_strategy.empty()) setenv("GRPC_POLL_STRATEGY", flags->grpc_poll_strategy.c_str(), 1);
  absl::StatusOr<Backend> backend = ParseBackend(flags->backend);
  if (!backend.ok()) return Fail(backend.status());
  const bool tp = flags->tp_size > 1;
  const bool dp = flags->dp_size > 1;
  if ((tp || dp) && *backend == Backend::kAuto) backend = CudaAvailable() ? Backend::kCuda : Backend::kCpu;
  if (absl::Status s = dp ? CheckDpJobIsNew(DpOptionsFrom(*flags)) : absl::OkStatus(); !s.ok()) {
    std::cerr << "lce_server: " << s << std::endl;
    return kExitStaleDpJob;
  }

  metrics::Registry registry;
  ServiceMetrics service_metrics(registry);
  service_metrics.tp_size.Set(flags->tp_size);
  for (int r = 0; r < flags->tp_size; ++r) service_metrics.peer_up.WithLabels({std::to_string(r)}).Set(1);
  std::unique_ptr<TpCommunicator> comm;
  std::unique_ptr<ChunkStaging> staging;
  TpBootstrap bootstrap;
  if (tp) {
    bootstrap.rank = flags->tp_rank;
    bootstrap.world_size = flags->tp_size;
    bootstrap.rendezvous_dir = flags->tp_rendezvous;
    bootstrap.host = flags->tp_host;
    bootstrap.timeout = absl::Seconds(flags->tp_timeout_seconds);
    absl::StatusOr<std::unique_ptr<TpCommunicator>> c = absl::UnimplementedError("NCCL needs a CUDA build");
    if (*backend == Backend::kCuda) {
#ifdef LCE_WITH_CUDA
      c = CreateNcclCommunicator(bootstrap, flags->device);
      absl::StatusOr<std::unique_ptr<ChunkStaging>> st = CreateDeviceStaging(flags->device);
      if (!st.ok()) return Fail(st.status());
      staging = std::move(*st);
#endif
    } else {
      c = CreateGlooCommunicator(bootstrap);
      staging = CreateHostStaging();
    }
    if (!c.ok()) return Fail(c.status());
    const std::string rank = std::to_string(flags->tp_rank);
    comm = TimeCollectives(std::move(*c), &service_metrics.collective_seconds.WithLabels({rank}),
                           &service_metrics.collective_bytes.WithLabels({rank}));
  }
  std::unique_ptr<DpRank> dp_rank;  // this rank's link to the other replicas' (after the group's own)
  if (dp) {
    absl::StatusOr<std::unique_ptr<DpRank>> r =
        DpRank::Join(DpOptionsFrom(*flags), flags->tp_rank, *backend == Backend::kCuda, flags->device);
    if (!r.ok()) return Fail(r.status());
    dp_rank = *std::move(r);
  }
  absl::StatusOr<int64_t> max_head_bytes = HeadSizeCap(*flags, *backend);
  if (!max_head_bytes.ok()) return Fail(max_head_bytes.status());
  absl::StatusOr<std::shared_ptr<HeadWeights>> weights =
      LoadHead(flags->head, flags->tp_rank, flags->tp_size, *max_head_bytes);
  if (!weights.ok()) return Fail(weights.status());
  EngineConfig config;
  config.workspace_bytes = flags->workspace_bytes;
  config.cpu_threads = flags->cpu_threads;
  config.batch_invariant = flags->batch_invariant;
  config.tp_invariant = flags->tp_invariant;
  config.device = flags->device;
  config.collectives = comm.get();
  // Builds the engine of a head version (this rank's shard; collectives included under TP).
  EngineMaker make_engine = [b = *backend, config](std::shared_ptr<const HeadWeights> w)
      -> absl::StatusOr<std::shared_ptr<LceEngine>> {
    absl::StatusOr<std::unique_ptr<LceEngine>> e = CreateEngine(b, std::move(w), config);
    if (!e.ok()) return e.status();
    return std::shared_ptr<LceEngine>(std::move(*e));
  };
  absl::StatusOr<std::shared_ptr<LceEngine>> engine = make_engine(*weights);
  if (!engine.ok()) return Fail(engine.status());
  const HeadShape shape = (*engine)->shape();

  if (flags->tp_rank > 0) {
    std::cout << "lce_server: tensor-parallel rank " << flags->tp_rank << " of " << flags->tp_size << " holds vocab rows ["
              << shape.vocab_begin << ", " << shape.vocab_end() << ")" << std::endl;
    absl::Status s = RunTpPeer({flags->head_name, *weights, *engine}, make_engine, *comm, *staging, dp_rank.get());
    if (!s.ok()) {
      std::cerr << "lce_server: rank " << flags->tp_rank << ": " << s << std::endl;
      std::_Exit(kExitTpFailure);
    }
    return 0;
  }

  std::shared_ptr<TpGroup> group;
  std::shared_ptr<LceEngine> served = *engine;
  if (tp) {
    group = std::make_shared<TpGroup>(comm.get(), std::move(staging), [&](const absl::Status& s) {
      std::cerr << "lce_server: tensor-parallel group failed: " << s << std::endl;
      for (int r = 1; r < flags->tp_size; ++r) service_metrics.peer_up.WithLabels({std::to_string(r)}).Set(0);
      Wake('F');
    });
    served = std::make_shared<TpFrontEngine>(group, flags->head_name, 1, served);
  }
  auto heads = std::make_shared<HeadStore>();
  if (auto put = heads->Put(flags->head_name, HeadVersion{served, *engine, *weights, nullptr}); !put.ok()) {
    return Fail(put.status());
  }

  GrpcServerOptions options;
  options.address = absl::StrCat(flags->host, ":", flags->port);
  options.service.max_message_bytes = flags->max_message_bytes;
  options.service.limits.max_rows_per_request = flags->max_rows_per_request;
  options.service.tp_size = flags->tp_size;
  options.http2_window_bytes = flags->http2_window_bytes;
  options.completion_queues = flags->grpc_cqs;
  options.idle_threads_per_queue = flags->grpc_idle_threads;
  options.channel_args = flags->grpc_channel_args;
  options.data_port = flags->data_port;
  options.server_memory_per_session = flags->data_plane_bytes_per_session;
  options.server_memory_total =
      flags->data_plane_total_bytes < 0 ? HostMemoryBytes() / 2 : flags->data_plane_total_bytes;
  options.service.max_sessions_per_peer = flags->max_sessions_per_peer;
  options.data_plane_auth_timeout_seconds = flags->data_plane_auth_timeout_seconds;
  options.data_plane_max_unauthenticated = flags->data_plane_max_unauthenticated;
  options.data_plane_max_connections = flags->data_plane_max_connections;
  options.data_plane_max_connections_per_session = flags->data_plane_max_connections_per_session;
  options.data_plane_idle_timeout_seconds = flags->data_plane_idle_timeout_seconds;
  options.data_plane_tls = flags->data_plane_tls;
  options.shm_socket = flags->shm_socket;
  options.allow_shm_by_name = flags->allow_shm_by_name;
  options.shm_bytes_per_session = flags->shm_bytes_per_session;
  options.shm_total_bytes = flags->shm_total_bytes;
  // Co-located clients may hand over GPU memory (CUDA IPC) when the engine is one GPU's.
  if (!tp && (*engine)->backend() == "cuda") options.service.cuda_device = flags->device;
  options.service.max_concurrent_streams = flags->max_concurrent_streams;
  options.service.max_streams_per_client = flags->max_streams_per_client;
  options.service.pending_grads = {flags->max_pending_grads, absl::Seconds(flags->pending_grad_ttl_seconds)};
  options.service.max_request_bytes = flags->max_request_bytes;
  options.service.stream_header_timeout_seconds = flags->stream_header_timeout_seconds;
  options.service.stream_idle_timeout_seconds = flags->stream_idle_timeout_seconds;
  options.service.max_head_bytes = *max_head_bytes;
  options.tls = {flags->tls_cert, flags->tls_key, flags->tls_client_ca};
  absl::StatusOr<RequestAuthenticator> auth = RequestAuthenticator::FromFiles(flags->auth_token_file, flags->admin_token_file);
  if (!auth.ok()) return Fail(auth.status());
  options.service.auth = *auth;
  options.service.metrics = &service_metrics;
  options.service.log_requests = flags->log_requests;
  options.service.pipeline_chunks = flags->pipeline_chunks;
  options.service.batching = {flags->batch_max_rows, flags->batch_max_delay_us};
  if (flags->batch_max_rows > 1 && (*engine)->invariance().across_batches.empty()) {
    std::cerr << "lce_server: dynamic batching off: this engine's rows are not the same bits in every batch "
                 "(CUDA: start with --batch-invariant=true to batch small calls)" << std::endl;
  }
  options.service.make_engine = make_engine;
  options.service.tp_group = group;
  if (dp) {
    DpJobOptions job{DpOptionsFrom(*flags), options.service.weight_change_wait, flags->tls_cert, flags->tls_key,
                     flags->tls_client_ca, flags->dp_tls_ca};
    absl::StatusOr<std::shared_ptr<DpJob>> j = DpJob::Join(job, dp_rank.get(), shape, flags->tp_size);
    if (!j.ok()) return Fail(j.status());
    options.service.dp_job = *std::move(j);
  }
  absl::StatusOr<std::unique_ptr<GrpcServer>> server = GrpcServer::Start(heads, options);
  if (!server.ok()) return Fail(server.status());
  const int port = (*server)->port();
  if (options.service.dp_job != nullptr) {
    if (absl::Status s = options.service.dp_job->Publish(port); !s.ok()) return Fail(s);
  }
  std::atomic<bool> serving{true};
  MemoryTrimmer trimmer(flags->memory_trim_seconds, &registry);
  std::unique_ptr<metrics::MetricsHttpServer> metrics_http;
  if (flags->metrics_port >= 0) {
    registry.AddCollectHook([&] { service_metrics.Sample(*heads); });
    absl::StatusOr<std::unique_ptr<metrics::MetricsHttpServer>> m = metrics::MetricsHttpServer::Start(
        &registry, {flags->metrics_host, flags->metrics_port, 2, [&] { return serving.load(); }});
    if (!m.ok()) return Fail(m.status());
    metrics_http = std::move(*m);
    std::cout << "lce_server: metrics on http://" << (flags->metrics_host == "0.0.0.0" ? "127.0.0.1" : flags->metrics_host)
              << ":" << metrics_http->port() << "/metrics" << std::endl;
  }
  if (!flags->port_file.empty()) {
    const std::string tmp = flags->port_file + ".tmp";
    std::ofstream(tmp) << port << "\n";
    std::rename(tmp.c_str(), flags->port_file.c_str());  // readers never see a half-written file
  }
  std::cout << "lce_server listening on " << (flags->host == "0.0.0.0" ? "127.0.0.1" : flags->host) << ":" << port
            << " (backend " << served->backend() << ", head '" << flags->head_name << "' V=" << shape.vocab_size
            << " H=" << shape.hidden_size << " " << DTypeName(shape.dtype) << ", tp " << flags->tp_size << ", dp replica "
            << flags->dp_rank << " of " << flags->dp_size << ")"
            << std::endl;
  if ((*server)->data_port() > 0) std::cout << "lce_server: data plane on port " << (*server)->data_port() << std::endl;

  char why = 0;
  while (read(g_wake_pipe[0], &why, 1) != 1) {
  }
  serving = false;
  if (why == 'F') {
    // The group is broken: refuse new work at once, give in-flight streams a moment to receive
    // their UNAVAILABLE, and exit for the launcher to restart every rank.
    (*server)->SetServing(false);
    (*server)->Shutdown(absl::Seconds(2));
    std::cerr << "lce_server: exiting for a group restart" << std::endl;
    // No destructors: the device may hold work of the aborted communicator; the launcher restarts us.
    std::_Exit(kExitTpFailure);
  }
  std::cout << "lce_server: signal " << static_cast<int>(why) << ", draining in-flight streams" << std::endl;
  (*server)->Shutdown(absl::Seconds(flags->shutdown_grace_seconds));
  if (group != nullptr) {
    if (absl::Status s = group->StopPeers(); !s.ok()) std::cerr << "lce_server: stopping peers: " << s << std::endl;
  }
  std::cout << "lce_server: stopped" << std::endl;
  return 0;
}
