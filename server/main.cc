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
#include "absl/time/clock.h"
#include "chunk_staging.h"
#include "dp_job.h"
#include "dp_rank.h"
#include "grpc_server.h"
#include "head_source.h"
#include "lce/device_memory.h"
#include "memory_trimmer.h"
#include "metrics.h"
#include "metrics_http.h"
#include "server_flags.h"
#include "service_metrics.h"
#include "status_macros.h"
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

// ---- Flags into the option structs: the one place a flag's value reaches the code it configures.

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

lce::server::TpBootstrap TpBootstrapFrom(const lce::server::ServerFlags& f) {
  lce::server::TpBootstrap b;
  b.rank = f.tp_rank;
  b.world_size = f.tp_size;
  b.rendezvous_dir = f.tp_rendezvous;
  b.host = f.tp_host;
  b.timeout = absl::Seconds(f.tp_timeout_seconds);
  return b;
}

lce::EngineConfig EngineConfigFrom(const lce::server::ServerFlags& f, lce::Collectives* collectives) {
  lce::EngineConfig config;
  config.workspace_bytes = f.workspace_bytes;
  config.cpu_threads = f.cpu_threads;
  config.batch_invariant = f.batch_invariant;
  config.tp_invariant = f.tp_invariant;
  config.device = f.device;
  config.collectives = collectives;
  config.rank0_outputs = true;  // a group's front answers; the peers' outputs are never read
  return config;
}

// The service's limits and switches (what the head and the groups bring is added by ServeHead).
absl::StatusOr<lce::server::ServiceConfig> ServiceConfigFrom(const lce::server::ServerFlags& f,
                                                             int64_t max_head_bytes) {
  lce::server::ServiceConfig c;
  c.max_message_bytes = f.max_message_bytes;
  c.limits.max_rows_per_request = f.max_rows_per_request;
  c.tp_size = f.tp_size;
  c.max_sessions_per_peer = f.max_sessions_per_peer;
  c.max_concurrent_streams = f.max_concurrent_streams;
  c.max_streams_per_client = f.max_streams_per_client;
  c.pending_grads = {f.max_pending_grads, absl::Seconds(f.pending_grad_ttl_seconds)};
  c.max_request_bytes = f.max_request_bytes;
  c.stream_header_timeout_seconds = f.stream_header_timeout_seconds;
  c.stream_idle_timeout_seconds = f.stream_idle_timeout_seconds;
  c.max_head_bytes = max_head_bytes;
  absl::StatusOr<lce::server::RequestAuthenticator> auth =
      lce::server::RequestAuthenticator::FromFiles(f.auth_token_file, f.admin_token_file);
  if (!auth.ok()) return auth.status();
  c.auth = *auth;
  c.log_requests = f.log_requests;
  c.pipeline_chunks = f.pipeline_chunks;
  // Automatic: a group's calls twice one GPU's (2× H200, TP-2: 9 calls of a 16384-row training request over
  // the data plane took 54.1 ms of engine time, 5 calls 49.8 as one call's 50.1; one GPU: 93.9 against 95.2).
  c.merge_chunk_rows = f.merge_chunk_rows >= 0 ? f.merge_chunk_rows : f.tp_size > 1 ? 4096 : 2048;
  c.batching = {f.batch_max_rows, f.batch_max_delay_us};
  return c;
}

absl::StatusOr<lce::server::GrpcServerOptions> GrpcServerOptionsFrom(const lce::server::ServerFlags& f,
                                                                     int64_t max_head_bytes) {
  lce::server::GrpcServerOptions o;
  absl::StatusOr<lce::server::ServiceConfig> service = ServiceConfigFrom(f, max_head_bytes);
  if (!service.ok()) return service.status();
  o.service = *std::move(service);
  o.address = absl::StrCat(f.host, ":", f.port);
  o.http2_window_bytes = f.http2_window_bytes;
  o.completion_queues = f.grpc_cqs;
  o.idle_threads_per_queue = f.grpc_idle_threads;
  o.channel_args = f.grpc_channel_args;
  o.data_port = f.data_port;
  o.server_memory_per_session = f.data_plane_bytes_per_session;
  o.server_memory_total = f.data_plane_total_bytes < 0 ? lce::server::HostMemoryBytes() / 2 : f.data_plane_total_bytes;
  o.data_plane_auth_timeout_seconds = f.data_plane_auth_timeout_seconds;
  o.data_plane_max_unauthenticated = f.data_plane_max_unauthenticated;
  o.data_plane_max_connections = f.data_plane_max_connections;
  o.data_plane_max_connections_per_session = f.data_plane_max_connections_per_session;
  o.data_plane_idle_timeout_seconds = f.data_plane_idle_timeout_seconds;
  o.data_plane_tls = f.data_plane_tls;
  o.shm_socket = f.shm_socket;
  o.allow_shm_by_name = f.allow_shm_by_name;
  o.shm_bytes_per_session = f.shm_bytes_per_session;
  o.shm_total_bytes = f.shm_total_bytes;
  o.tls = {f.tls_cert, f.tls_key, f.tls_client_ca};
  return o;
}

// ---- The steps of main, in order.

// Everything the server holds, in the order it is built (and so destroyed in reverse).
struct ServerParts {
  lce::server::metrics::Registry registry;
  lce::server::ServiceMetrics service_metrics{registry};
  std::unique_ptr<lce::server::TpCommunicator> comm;   // tensor parallelism: the group's collectives
  std::unique_ptr<lce::server::ChunkStaging> staging;  // ... and where its operations' data is staged
  std::unique_ptr<lce::server::DpRank> dp_rank;        // this rank's link to the other replicas'
  int64_t max_head_bytes = 0;
  std::shared_ptr<lce::HeadWeights> weights;    // this rank's shard of the head
  lce::EngineMaker make_engine;                 // builds the engine of a head version
  std::shared_ptr<lce::LceEngine> engine;       // this rank's engine of the first version
  std::shared_ptr<lce::server::TpGroup> group;  // rank 0 of a group: the peers
  std::shared_ptr<lce::LceEngine> served;       // what answers requests (the group's front under TP)
  std::shared_ptr<lce::server::HeadStore> heads;
  lce::server::GrpcServerOptions options;
  std::unique_ptr<lce::server::GrpcServer> server;
  std::atomic<bool> serving{true};
  std::unique_ptr<lce::server::MemoryTrimmer> trimmer;
  std::unique_ptr<lce::server::metrics::MetricsHttpServer> metrics_http;
};

// SIGTERM/SIGINT wake main; a dead peer's socket fails with EPIPE instead of killing us.
absl::Status InstallSignalHandlers() {
  if (pipe(g_wake_pipe) != 0) return absl::InternalError("pipe() failed");
  struct sigaction action = {};
  action.sa_handler = OnSignal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
  signal(SIGPIPE, SIG_IGN);
  RaiseDescriptorLimit();
  return absl::OkStatus();
}

// --backend, with auto resolved where a group needs every rank to agree.
absl::StatusOr<lce::Backend> BackendFrom(const lce::server::ServerFlags& f) {
  // Read by gRPC when it first initialises, which is later than this.
  if (!f.grpc_poll_strategy.empty()) setenv("GRPC_POLL_STRATEGY", f.grpc_poll_strategy.c_str(), 1);
  absl::StatusOr<lce::Backend> backend = lce::ParseBackend(f.backend);
  if (!backend.ok()) return backend.status();
  if ((f.tp_size > 1 || f.dp_size > 1) && *backend == lce::Backend::kAuto) {
    return lce::CudaAvailable() ? lce::Backend::kCuda : lce::Backend::kCpu;
  }
  return backend;
}

// The tensor-parallel group's collectives and staging, and the data-parallel link.
absl::Status JoinGroups(const lce::server::ServerFlags& f, lce::Backend backend, ServerParts& p) {
  using namespace lce::server;
  p.service_metrics.tp_size.Set(f.tp_size);
  for (int r = 0; r < f.tp_size; ++r) p.service_metrics.peer_up.WithLabels({std::to_string(r)}).Set(1);
  if (f.tp_size > 1) {
    const TpBootstrap bootstrap = TpBootstrapFrom(f);
    absl::StatusOr<std::unique_ptr<TpCommunicator>> c = absl::UnimplementedError("NCCL needs a CUDA build");
    if (backend == lce::Backend::kCuda) {
#ifdef LCE_WITH_CUDA
      c = CreateNcclCommunicator(bootstrap, f.device);
      absl::StatusOr<std::unique_ptr<ChunkStaging>> st = CreateDeviceStaging(f.device);
      if (!st.ok()) return st.status();
      p.staging = std::move(*st);
#endif
    } else {
      c = CreateGlooCommunicator(bootstrap);
      p.staging = CreateHostStaging();
    }
    if (!c.ok()) return c.status();
    const std::string rank = std::to_string(f.tp_rank);
    p.comm = TimeCollectives(std::move(*c), &p.service_metrics.collective_seconds.WithLabels({rank}),
                             &p.service_metrics.collective_bytes.WithLabels({rank}));
  }
  if (f.dp_size > 1) {
    absl::StatusOr<std::unique_ptr<DpRank>> r =
        DpRank::Join(DpOptionsFrom(f), f.tp_rank, backend == lce::Backend::kCuda, f.device);
    if (!r.ok()) return r.status();
    p.dp_rank = *std::move(r);
  }
  return absl::OkStatus();
}

// This rank's shard of the head and its engine.
absl::Status LoadHeadAndEngine(const lce::server::ServerFlags& f, lce::Backend backend, ServerParts& p) {
  absl::StatusOr<int64_t> max_head_bytes = HeadSizeCap(f, backend);
  if (!max_head_bytes.ok()) return max_head_bytes.status();
  p.max_head_bytes = *max_head_bytes;
  absl::StatusOr<std::shared_ptr<lce::HeadWeights>> weights =
      lce::server::LoadHead(f.head, f.tp_rank, f.tp_size, p.max_head_bytes);
  if (!weights.ok()) return weights.status();
  p.weights = *std::move(weights);
  p.make_engine = [backend, config = EngineConfigFrom(f, p.comm.get())](
                      std::shared_ptr<const lce::HeadWeights> w) -> absl::StatusOr<std::shared_ptr<lce::LceEngine>> {
    absl::StatusOr<std::unique_ptr<lce::LceEngine>> e = lce::CreateEngine(backend, std::move(w), config);
    if (!e.ok()) return e.status();
    return std::shared_ptr<lce::LceEngine>(std::move(*e));
  };
  absl::StatusOr<std::shared_ptr<lce::LceEngine>> engine = p.make_engine(p.weights);
  if (!engine.ok()) return engine.status();
  p.engine = *std::move(engine);
  return absl::OkStatus();
}

// A rank > 0 follows the front until it stops the group; a failure exits for a group restart.
int RunPeer(const lce::server::ServerFlags& f, ServerParts& p) {
  const lce::HeadShape shape = p.engine->shape();
  std::cout << "lce_server: tensor-parallel rank " << f.tp_rank << " of " << f.tp_size << " holds vocab rows ["
            << shape.vocab_begin << ", " << shape.vocab_end() << ")" << std::endl;
  absl::Status s =
      lce::server::RunTpPeer({f.head_name, p.weights, p.engine}, p.make_engine, *p.comm, *p.staging, p.dp_rank.get());
  if (!s.ok()) {
    std::cerr << "lce_server: rank " << f.tp_rank << ": " << s << std::endl;
    std::_Exit(kExitTpFailure);
  }
  return 0;
}

// Rank 0: the head as served (the group's front under TP) and the service's options.
absl::Status ServeHead(const lce::server::ServerFlags& f, ServerParts& p) {
  using namespace lce::server;
  p.served = p.engine;
  if (f.tp_size > 1) {
    p.group = std::make_shared<TpGroup>(p.comm.get(), std::move(p.staging), [&f, &p](const absl::Status& s) {
      std::cerr << "lce_server: tensor-parallel group failed: " << s << std::endl;
      for (int r = 1; r < f.tp_size; ++r) p.service_metrics.peer_up.WithLabels({std::to_string(r)}).Set(0);
      Wake('F');
    });
    p.served = std::make_shared<TpFrontEngine>(p.group, f.head_name, 1, p.served);
  }
  p.heads = std::make_shared<HeadStore>();
  if (auto put = p.heads->Put(f.head_name, HeadVersion{p.served, p.engine, p.weights, nullptr}); !put.ok()) {
    return put.status();
  }
  absl::StatusOr<GrpcServerOptions> options = GrpcServerOptionsFrom(f, p.max_head_bytes);
  if (!options.ok()) return options.status();
  p.options = *std::move(options);
  // A GPU engine (one GPU's, or a CUDA group's front): requests stage their chunks on the device on their
  // own threads, outside the engine's (the group's) lock, and co-located clients may hand over GPU memory
  // (CUDA IPC).
  if (p.engine->backend() == "cuda") p.options.service.cuda_device = f.device;
  p.options.service.metrics = &p.service_metrics;
  if (f.batch_max_rows > 1 && p.engine->invariance().across_batches.empty()) {
    std::cerr << "lce_server: dynamic batching off: this engine's rows are not the same bits in every batch "
                 "(a CUDA engine without its epilogue GEMM: start with --batch-invariant=true to batch small calls)"
              << std::endl;
  }
  p.options.service.make_engine = p.make_engine;
  p.options.service.tp_group = p.group;
  if (f.dp_size > 1) {
    DpJobOptions job{DpOptionsFrom(f), p.options.service.weight_change_wait, f.tls_cert, f.tls_key, f.tls_client_ca,
                     f.dp_tls_ca};
    absl::StatusOr<std::shared_ptr<DpJob>> j = DpJob::Join(job, p.dp_rank.get(), p.engine->shape(), f.tp_size);
    if (!j.ok()) return j.status();
    p.options.service.dp_job = *std::move(j);
  }
  return absl::OkStatus();
}

// The gRPC server (and the data plane), the metrics endpoint and the port file.
absl::Status StartListeners(const lce::server::ServerFlags& f, ServerParts& p) {
  using namespace lce::server;
  absl::StatusOr<std::unique_ptr<GrpcServer>> server = GrpcServer::Start(p.heads, p.options);
  if (!server.ok()) return server.status();
  p.server = *std::move(server);
  const int port = p.server->port();
  if (p.options.service.dp_job != nullptr) {
    LCE_RETURN_IF_ERROR(p.options.service.dp_job->Publish(port));
  }
  p.trimmer = std::make_unique<MemoryTrimmer>(f.memory_trim_seconds, &p.registry);
  if (f.metrics_port >= 0) {
    p.registry.AddCollectHook([&p] { p.service_metrics.Sample(*p.heads); });
    absl::StatusOr<std::unique_ptr<metrics::MetricsHttpServer>> m = metrics::MetricsHttpServer::Start(
        &p.registry, {f.metrics_host, f.metrics_port, 2, [&p] { return p.serving.load(); }});
    if (!m.ok()) return m.status();
    p.metrics_http = std::move(*m);
    std::cout << "lce_server: metrics on http://" << (f.metrics_host == "0.0.0.0" ? "127.0.0.1" : f.metrics_host) << ":"
              << p.metrics_http->port() << "/metrics" << std::endl;
  }
  if (!f.port_file.empty()) {
    const std::string tmp = f.port_file + ".tmp";
    std::ofstream(tmp) << port << "\n";
    std::rename(tmp.c_str(), f.port_file.c_str());  // readers never see a half-written file
  }
  const lce::HeadShape shape = p.engine->shape();
  std::cout << "lce_server listening on " << (f.host == "0.0.0.0" ? "127.0.0.1" : f.host) << ":" << port << " (backend "
            << p.served->backend() << ", head '" << f.head_name << "' V=" << shape.vocab_size
            << " H=" << shape.hidden_size << " " << lce::DTypeName(shape.dtype) << ", tp " << f.tp_size
            << ", dp replica " << f.dp_rank << " of " << f.dp_size << ")" << std::endl;
  if (p.server->data_port() > 0) std::cout << "lce_server: data plane on port " << p.server->data_port() << std::endl;
  return absl::OkStatus();
}

// Serves until a signal (drain, stop the peers, exit 0) or a group failure (exit 3 at once).
int ServeUntilStopped(const lce::server::ServerFlags& f, ServerParts& p) {
  char why = 0;
  while (read(g_wake_pipe[0], &why, 1) != 1) {
  }
  p.serving = false;
  if (why == 'F') {
    // The group is broken: refuse new work at once, give in-flight streams a moment to receive
    // their UNAVAILABLE, and exit for the launcher to restart every rank.
    p.server->SetServing(false);
    p.server->Shutdown(absl::Seconds(2));
    // Shutdown returns once the answers are queued, not sent: exiting at once with a client's chunks
    // still unread resets the connection, and a client still writing then saw "Broken pipe" instead of
    // the answer naming the failed rank (CI, ASan, a loaded machine). A moment for the last frames.
    absl::SleepFor(absl::Milliseconds(300));
    std::cerr << "lce_server: exiting for a group restart" << std::endl;
    // No destructors: the device may hold work of the aborted communicator; the launcher restarts us.
    std::_Exit(kExitTpFailure);
  }
  std::cout << "lce_server: signal " << static_cast<int>(why) << ", draining in-flight streams" << std::endl;
  p.server->Shutdown(absl::Seconds(f.shutdown_grace_seconds));
  if (p.group != nullptr) {
    if (absl::Status s = p.group->StopPeers(); !s.ok()) std::cerr << "lce_server: stopping peers: " << s << std::endl;
  }
  std::cout << "lce_server: stopped" << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace lce::server;
  if (absl::Status s = InstallSignalHandlers(); !s.ok()) return Fail(s);
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
  absl::StatusOr<lce::Backend> backend = BackendFrom(*flags);
  if (!backend.ok()) return Fail(backend.status());
  if (absl::Status s = flags->dp_size > 1 ? CheckDpJobIsNew(DpOptionsFrom(*flags)) : absl::OkStatus(); !s.ok()) {
    std::cerr << "lce_server: " << s << std::endl;
    return kExitStaleDpJob;
  }
  ServerParts parts;
  if (absl::Status s = JoinGroups(*flags, *backend, parts); !s.ok()) return Fail(s);
  if (absl::Status s = LoadHeadAndEngine(*flags, *backend, parts); !s.ok()) return Fail(s);
  if (flags->tp_rank > 0) return RunPeer(*flags, parts);
  if (absl::Status s = ServeHead(*flags, parts); !s.ok()) return Fail(s);
  if (absl::Status s = StartListeners(*flags, parts); !s.ok()) return Fail(s);
  return ServeUntilStopped(*flags, parts);
}
