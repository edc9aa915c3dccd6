#include "server_flags.h"

#include <functional>
#include <map>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/str_replace.h"

namespace lce::server {

const char* ServerUsage() {
  return R"(lce_server: fused linear-cross-entropy loss head over gRPC (lce.v1.LceService)

  --host=ADDR                 listen address (default 0.0.0.0)
  --port=N                    listen port (default 50051; 0 picks a free one)
  --port-file=PATH            write the port there once serving
  --backend=cpu|cuda|auto     engine backend (default auto: cuda when a GPU is visible)
  --head-name=NAME            name of the served head (default "default")
  --head-file=PATH            safetensors file holding the head
  --head-tensor=NAME          tensor in it (default lm_head.weight), [vocab, hidden]
  --head-bias-tensor=NAME     optional bias tensor [vocab]
  --seed-head=VxH             instead of a file: a seeded random head, e.g. 32000x512
  --seed=N                    seed of the seeded head (default 0)
  --head-dtype=bf16|fp16|fp32 dtype of the seeded head (default bf16)
  --max-message-bytes=N       largest gRPC message accepted (default 67108864)
  --http2-window-bytes=N      HTTP/2 flow-control window per stream (default 0: gRPC's, adapted by
                              its bandwidth probe); larger lets a client stream further ahead
  --grpc-cqs=N                gRPC completion queues (each with its own pollers), over which
                              connections are spread (default 0: one per core, at most 16)
  --data-port=N               data plane for remote clients' bulk bytes (plain TCP, no TLS: trusted
                              networks only) on the --host address (default -1: off; 0: any port)
  --data-plane-bytes-per-session=N  server memory one session may allocate (default 4294967296)
  --data-plane-total-bytes=N  server memory all sessions together may allocate (default -1: half the
                              host's memory; 0: no limit); beyond, RESOURCE_EXHAUSTED
  --max-sessions-per-peer=N   sessions (OpenSession) one client host may hold at once (default 64;
                              0: no limit); more get RESOURCE_EXHAUSTED
  --data-plane-auth-timeout-seconds=S  a new data-plane connection's first transfer must come within S
                              and name its session's region, or the connection ends (default 60)
  --data-plane-max-unauthenticated=N   connections that have not done so yet, at most (default 256;
                              128 from one address); they never take --data-plane-max-connections' slots
  --data-plane-max-connections=N    data-plane connections served at once (default 512; a client opens
                              2 x data_plane_sockets a stream); more are answered RESOURCE_EXHAUSTED
                              and closed (a client already sending sees the connection reset)
  --grpc-poll-strategy=NAME   gRPC's I/O poller (GRPC_POLL_STRATEGY): epoll1 (gRPC's default) or
                              poll (each completion queue polls its own connections); default: gRPC's
  --grpc-channel-args=K=V,... extra integer gRPC channel arguments, for transport tuning, e.g.
                              grpc.http2.max_frame_size=16777215
  --max-rows-per-request=N    largest request, in rows (default 16777216; 0 = no limit)
  --log-requests=true|false   one JSON line per finished RPC on stderr, with its request id (default true)
  --pipeline-chunks=true|false  GPU engines, for clients that send ahead (RequestHeader.sends_ahead): compute
                              a chunk while the next is read and staged, answer from another thread (default true)
  --batch-max-rows=N          dynamic batching: concurrent small Calls (Score; ForwardBackward and Backward
                              without accumulate_weight_grad) of the same head version and options are
                              merged into one engine call of at most N rows; a request of more rows runs
                              alone (default 0: off). Only on engines whose rows are the same bits in any
                              batch (the CPU engine; CUDA with --batch-invariant=true)
  --batch-max-delay-us=US     how long a batch waits for more requests before it launches (default 0: at
                              once when the engine is free; requests queue only while it is busy)
  --metrics-port=N            serve Prometheus metrics at http://HOST:N/metrics (and /healthz); rank 0 only;
                              default off, 0 picks a free port
  --metrics-host=ADDR         listen address of the metrics endpoint (default 0.0.0.0)
  --max-concurrent-streams=N  streams served at once; more get RESOURCE_EXHAUSTED (default 64; 0 = no limit)
  --max-request-bytes=N       largest request, in bytes of hidden states (default 16 GiB; 0 = no limit)
  --tls-cert=PEM --tls-key=PEM  serve TLS
  --tls-client-ca=PEM         require client certificates signed by this CA (mutual TLS)
  --auth-token-file=PATH      bearer token for scoring RPCs (read from the file, never the command line)
  --admin-token-file=PATH     bearer token for admin RPCs (also accepted for scoring)
  --workspace-bytes=N         engine scratch budget (default 1073741824)
  --cpu-threads=N             CPU engine threads (default: all cores)
  --batch-invariant=true|false  CUDA engine: a row's results the same bits in any batch (one GEMM
                              algorithm for every row count; costs 5-13% at some train shapes,
                              more on small calls; default false; the CPU engine always is)
  --tp-invariant=true|false   CUDA engine, with --batch-invariant: logprob, entropy, loss and d_hidden
                              the same bits for any TP group size, V >= 131072; costs 31-44% of a
                              train step (default false)
  --device=N                  CUDA device ordinal (default 0)
  --shutdown-grace-seconds=S  on SIGTERM, time in-flight streams get to finish (default 30)
  --tp-size=K                  tensor-parallel group size (default 1): the head's vocabulary is
                              split over K processes, one per GPU (or CPU process)
  --tp-rank=R                 this process's rank; rank 0 serves the API, the others are peers
  --tp-rendezvous=DIR         directory the ranks share to meet (pid files, Gloo store, NCCL id);
                              wipe it before (re)starting a group (deploy/lce_tp_launch.sh does)
  --tp-host=ADDR              address peers reach this rank on (default 127.0.0.1)
  --tp-timeout-seconds=S      a collective slower than this fails the group (default 30): in-flight
                              requests get UNAVAILABLE naming the rank, health turns NOT_SERVING,
                              and every rank exits with code 3 for its launcher to restart the group
  --dp-size=R                 data-parallel replicas (default 1): R groups of the same --tp-size serve
                              one head and train it as one job (docs/TRAINING.md)
  --dp-rank=D                 this group's replica (every rank of the group passes the same D)
  --dp-rendezvous=DIR         directory every process of every replica sees, fresh for each start of
                              the job (deploy/lce_dp_launch.sh makes one)
  --dp-host=ADDR              address the other replicas reach this process on (default 127.0.0.1);
                              a front's also, with its --port, where the other fronts call it
  --dp-timeout-seconds=S      a dW sum between replicas slower than this fails (default 30): the job's
                              training is down (UNAVAILABLE naming the replica), every replica keeps scoring
  --dp-join-timeout-seconds=S how long start waits for every replica to join (default 600)
  --dp-tls-ca=PEM             with --tls-cert: the CA that signed the other fronts' certificates
  --stream-header-timeout-seconds=S  a stream must send its header within S seconds of opening, or
                              end DEADLINE_EXCEEDED; it holds no admission slot meanwhile (default 10; 0 = no limit)
  --stream-idle-timeout-seconds=S  then it must send each next message, and read each answer, within S
                              seconds (default 60; 0 = no limit)
  --max-head-bytes=N          largest head shard (weight bytes) loaded at start or by LoadHead; larger is
                              RESOURCE_EXHAUSTED (default 0: the GPU's memory on CUDA, the host's otherwise)
  --help
)";
}

namespace {

absl::Status CheckDpFlags(const ServerFlags& f) {
  if (f.dp_size < 1 || f.dp_rank < 0 || f.dp_rank >= f.dp_size) {
    return absl::InvalidArgumentError(absl::StrCat("--dp-rank must be in [0, --dp-size), got ", f.dp_rank, " of ", f.dp_size));
  }
  if (f.dp_size == 1) return absl::OkStatus();
  if (f.dp_rendezvous.empty()) return absl::InvalidArgumentError("--dp-size > 1 needs --dp-rendezvous=DIR");
  if (f.dp_timeout_seconds <= 0 || f.dp_join_timeout_seconds <= 0) {
    return absl::InvalidArgumentError("--dp-timeout-seconds and --dp-join-timeout-seconds must be > 0");
  }
  if (!f.tls_cert.empty() && f.dp_tls_ca.empty()) {
    return absl::InvalidArgumentError("--dp-size > 1 with --tls-cert needs --dp-tls-ca (the fronts call each other over TLS)");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ServerFlags> ParseServerFlags(int argc, char** argv) {
  ServerFlags f;
  auto str = [](std::string* dst) { return [dst](const std::string& v) { *dst = v; return true; }; };
  auto i64 = [](int64_t* dst) { return [dst](const std::string& v) { return absl::SimpleAtoi(v, dst); }; };
  auto i32 = [](int* dst) { return [dst](const std::string& v) { return absl::SimpleAtoi(v, dst); }; };
  // A timeout: 0 (none) up to a year.
  auto seconds = [](double* dst) {
    return [dst](const std::string& v) { return absl::SimpleAtod(v, dst) && *dst >= 0 && *dst <= 3.2e7; };
  };
  absl::Status seed_shape;  // why --seed-head was refused
  std::map<std::string, std::function<bool(const std::string&)>> setters = {
      {"host", str(&f.host)},
      {"port", i32(&f.port)},
      {"port-file", str(&f.port_file)},
      {"backend", str(&f.backend)},
      {"head-name", str(&f.head_name)},
      {"head-file", str(&f.head.file)},
      {"head-tensor", str(&f.head.tensor)},
      {"head-bias-tensor", str(&f.head.bias_tensor)},
      {"seed-head", [&f, &seed_shape](const std::string& v) { return (seed_shape = ParseSeedShape(v, f.head)).ok(); }},
      {"seed", [&f](const std::string& v) { return absl::SimpleAtoi(v, &f.head.seed); }},
      {"head-dtype", [&f](const std::string& v) {
         absl::StatusOr<DType> d = ParseDType(v);
         if (d.ok()) f.head.dtype = *d;
         return d.ok();
       }},
      {"max-message-bytes", i64(&f.max_message_bytes)},
      {"http2-window-bytes", i64(&f.http2_window_bytes)},
      {"grpc-cqs", i32(&f.grpc_cqs)},
      {"data-port", i32(&f.data_port)},
      {"data-plane-bytes-per-session", i64(&f.data_plane_bytes_per_session)},
      {"data-plane-total-bytes", i64(&f.data_plane_total_bytes)},
      {"max-sessions-per-peer", i64(&f.max_sessions_per_peer)},
      {"data-plane-auth-timeout-seconds", [&f](const std::string& v) { return absl::SimpleAtod(v, &f.data_plane_auth_timeout_seconds); }},
      {"data-plane-max-unauthenticated", i32(&f.data_plane_max_unauthenticated)},
      {"data-plane-max-connections", i32(&f.data_plane_max_connections)},
      {"grpc-poll-strategy", str(&f.grpc_poll_strategy)},
      {"grpc-channel-args", [&f](const std::string& v) {
         for (absl::string_view kv : absl::StrSplit(v, ',', absl::SkipEmpty())) {
           std::pair<absl::string_view, absl::string_view> p = absl::StrSplit(kv, absl::MaxSplits('=', 1));
           int value = 0;
           if (p.first.empty() || !absl::SimpleAtoi(p.second, &value)) return false;
           f.grpc_channel_args.emplace_back(std::string(p.first), value);
         }
         return true;
       }},
      {"max-rows-per-request", i64(&f.max_rows_per_request)},
      {"workspace-bytes", i64(&f.workspace_bytes)},
      {"max-concurrent-streams", i64(&f.max_concurrent_streams)},
      {"metrics-port", i32(&f.metrics_port)},
      {"log-requests", [&f](const std::string& v) { return absl::SimpleAtob(v, &f.log_requests); }},
      {"batch-max-rows", [&f](const std::string& v) { return absl::SimpleAtoi(v, &f.batch_max_rows) && f.batch_max_rows >= 0; }},
      {"batch-max-delay-us", [&f](const std::string& v) {
         return absl::SimpleAtoi(v, &f.batch_max_delay_us) && f.batch_max_delay_us >= 0 && f.batch_max_delay_us <= 1000000;
       }},
      {"pipeline-chunks", [&f](const std::string& v) { return absl::SimpleAtob(v, &f.pipeline_chunks); }},
      {"metrics-host", str(&f.metrics_host)},
      {"max-request-bytes", i64(&f.max_request_bytes)},
      {"tls-cert", str(&f.tls_cert)},
      {"tls-key", str(&f.tls_key)},
      {"tls-client-ca", str(&f.tls_client_ca)},
      {"auth-token-file", str(&f.auth_token_file)},
      {"admin-token-file", str(&f.admin_token_file)},
      {"cpu-threads", i32(&f.cpu_threads)},
      {"batch-invariant", [&f](const std::string& v) { return absl::SimpleAtob(v, &f.batch_invariant); }},
      {"tp-invariant", [&f](const std::string& v) { return absl::SimpleAtob(v, &f.tp_invariant); }},
      {"device", i32(&f.device)},
      {"tp-size", i32(&f.tp_size)},
      {"tp-rank", i32(&f.tp_rank)},
      {"tp-rendezvous", str(&f.tp_rendezvous)},
      {"tp-host", str(&f.tp_host)},
      {"tp-timeout-seconds", [&f](const std::string& v) { return absl::SimpleAtod(v, &f.tp_timeout_seconds); }},
      {"dp-size", i32(&f.dp_size)},
      {"dp-rank", i32(&f.dp_rank)},
      {"dp-rendezvous", str(&f.dp_rendezvous)},
      {"dp-host", str(&f.dp_host)},
      {"dp-timeout-seconds", seconds(&f.dp_timeout_seconds)},
      {"dp-join-timeout-seconds", seconds(&f.dp_join_timeout_seconds)},
      {"dp-tls-ca", str(&f.dp_tls_ca)},
      {"shutdown-grace-seconds", [&f](const std::string& v) { return absl::SimpleAtod(v, &f.shutdown_grace_seconds); }},
      {"stream-header-timeout-seconds", seconds(&f.stream_header_timeout_seconds)},
      {"stream-idle-timeout-seconds", seconds(&f.stream_idle_timeout_seconds)},
      {"max-head-bytes", [&f](const std::string& v) { return absl::SimpleAtoi(v, &f.max_head_bytes) && f.max_head_bytes >= 0; }},
  };
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      f.help = true;
      continue;
    }
    if (arg.rfind("--", 0) != 0) return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", arg, "'"));
    std::string name = arg.substr(2), value;
    const size_t eq = name.find('=');
    if (eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      return absl::InvalidArgumentError(absl::StrCat("flag --", name, " needs a value"));
    }
    name = absl::StrReplaceAll(name, {{"_", "-"}});
    auto it = setters.find(name);
    if (it == setters.end()) return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name, " (see --help)"));
    if (!it->second(value)) {
      return absl::InvalidArgumentError(absl::StrCat("bad value '", value, "' for --", name,
                                                     seed_shape.ok() ? "" : ": ", seed_shape.message()));
    }
  }
  if (f.port < 0 || f.port > 65535) return absl::InvalidArgumentError(absl::StrCat("bad --port ", f.port));
  if (f.tp_size < 1 || f.tp_rank < 0 || f.tp_rank >= f.tp_size) {
    return absl::InvalidArgumentError(absl::StrCat("--tp-rank must be in [0, --tp-size), got ", f.tp_rank, " of ", f.tp_size));
  }
  if (f.tp_size > 1 && f.tp_rendezvous.empty()) {
    return absl::InvalidArgumentError("--tp-size > 1 needs --tp-rendezvous=DIR");
  }
  if (absl::Status s = CheckDpFlags(f); !s.ok()) return s;
  if (f.max_message_bytes < (1 << 16)) return absl::InvalidArgumentError("--max-message-bytes must be >= 65536");
  if (f.http2_window_bytes < 0 || f.http2_window_bytes > INT32_MAX) {
    return absl::InvalidArgumentError("--http2-window-bytes must be in [0, 2147483647]");
  }
  if (f.grpc_cqs < 0 || f.grpc_cqs > 256) return absl::InvalidArgumentError("--grpc-cqs must be in [0, 256]");
  if (f.data_port < -1 || f.data_port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("--data-port must be -1 (off), 0 (any) or a port, got ", f.data_port));
  }
  if (f.data_plane_bytes_per_session <= 0) return absl::InvalidArgumentError("--data-plane-bytes-per-session must be > 0");
  if (f.data_plane_total_bytes < -1) return absl::InvalidArgumentError("--data-plane-total-bytes must be >= -1");
  if (f.max_sessions_per_peer < 0) return absl::InvalidArgumentError("--max-sessions-per-peer must be >= 0");
  if (!(f.data_plane_auth_timeout_seconds > 0 && f.data_plane_auth_timeout_seconds <= 3600)) {
    return absl::InvalidArgumentError("--data-plane-auth-timeout-seconds must be in (0, 3600]");
  }
  if (f.data_plane_max_unauthenticated < 1) return absl::InvalidArgumentError("--data-plane-max-unauthenticated must be >= 1");
  if (f.data_plane_max_connections < 1 || f.data_plane_max_connections > 65536) {
    return absl::InvalidArgumentError("--data-plane-max-connections must be in [1, 65536]");
  }
  return f;
}

}  // namespace lce::server
