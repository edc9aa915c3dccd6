// lce_server's flags, as absl flags (typed, each with its help and default). Names take dashes or
// underscores; values come as `--name=value` or `--name value`; `--flagfile=FILE` reads one flag a
// line (blank lines and '#' comments skipped). ParseServerFlags returns a Status instead of exiting, so
// that main() reports a bad flag its own way and tests can parse many command lines in one process.
#include "server_flags.h"

#include <fstream>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"

ABSL_FLAG(std::string, host, "0.0.0.0",
          "listen address");
ABSL_FLAG(int32_t, port, 50051,
          "listen port (0 picks a free one)");
ABSL_FLAG(std::string, port_file, "",
          "write the port there once serving");
ABSL_FLAG(std::string, backend, "auto",
          "engine backend: cpu, cuda, or auto (cuda when a GPU is visible)");
ABSL_FLAG(std::string, head_name, "default",
          "name of the served head");
ABSL_FLAG(std::string, head_file, "",
          "safetensors file holding the head");
ABSL_FLAG(std::string, head_tensor, "lm_head.weight",
          "tensor in it, [vocab, hidden]");
ABSL_FLAG(std::string, head_bias_tensor, "",
          "optional bias tensor [vocab]");
ABSL_FLAG(std::string, seed_head, "",
          "instead of a file: a seeded random head, e.g. 32000x512");
ABSL_FLAG(uint64_t, seed, 0,
          "seed of the seeded head");
ABSL_FLAG(std::string, head_dtype, "bf16",
          "dtype of the seeded head: bf16, fp16 or fp32");
ABSL_FLAG(int64_t, max_message_bytes, 64 << 20,
          "largest gRPC message accepted");
ABSL_FLAG(int64_t, http2_window_bytes, 0,
          "HTTP/2 flow-control window per stream (0: gRPC's, adapted by its bandwidth probe); larger lets a client stream further ahead");
ABSL_FLAG(int32_t, grpc_cqs, 0,
          "gRPC completion queues (each with its own pollers), over which connections are spread (0: one per core, at most 16)");
ABSL_FLAG(int32_t, grpc_idle_threads, 0,
          "handler threads kept polling per completion queue (0: 64 over all queues, at least 4 each); one that finishes while as many poll exits, and a request that finds none polling starts one: too few and a busy server makes a thread a request");
ABSL_FLAG(int32_t, data_port, -1,
          "data plane for remote clients' bulk bytes (TCP beside gRPC; each transfer shows its session's secret; plain unless --data-plane-tls) on the --host address (-1: off; 0: any port)");
ABSL_FLAG(bool, data_plane_tls, false,
          "serve the data plane over TLS with --tls-cert/--tls-key (clients verify it against their CA); costs throughput (bench/RESULTS.md; bench/device.sh tls-wire measures it)");
ABSL_FLAG(std::string, shm_socket, "auto",
          "Unix socket on which co-located clients hand over shared memory as a file descriptor (memfd, SCM_RIGHTS) with their session's secret, from the session's uid; auto: $TMPDIR (else /tmp)/lce-server-<port>.sock; empty: none");
ABSL_FLAG(bool, allow_shm_by_name, false,
          "also map POSIX shm objects that clients name (RegisterRegion.shm_name): any co-located client with the scoring token may then register any object its uid owns by a guessable name; only where every such client is trusted");
ABSL_FLAG(int64_t, data_plane_bytes_per_session, int64_t{4} << 30,
          "server memory one session may allocate");
ABSL_FLAG(int64_t, data_plane_total_bytes, -1,
          "server memory all sessions together may allocate (-1: half the host's memory; 0: no limit); beyond, RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, shm_bytes_per_session, int64_t{64} << 30,
          "bytes of clients' shared memory (shm socket, shm names) the server maps for one session; beyond, RESOURCE_EXHAUSTED before anything is mapped");
ABSL_FLAG(int64_t, shm_total_bytes, int64_t{4} << 40,
          "bytes of clients' shared memory the server maps for all sessions together (address space: a sparse memfd costs its client nothing); beyond, RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_sessions_per_peer, 64,
          "sessions (OpenSession) one client (its host and bearer token, and on loopback its uid) may hold at once (0: no limit); more get RESOURCE_EXHAUSTED");
ABSL_FLAG(double, data_plane_auth_timeout_seconds, 60,
          "a new data-plane connection's first transfer must come within S and name its session's region, or the connection ends");
ABSL_FLAG(int32_t, data_plane_max_unauthenticated, 256,
          "connections that have not done so yet, at most (128 from one address); they never take --data-plane-max-connections' slots");
ABSL_FLAG(int32_t, data_plane_max_connections, 512,
          "data-plane connections served at once (a client opens 2 x data_plane_sockets a stream); more are answered RESOURCE_EXHAUSTED and closed (a client already sending sees the connection reset)");
ABSL_FLAG(int32_t, data_plane_max_connections_per_session, 64,
          "of those, the most one session may hold (a client opens 2 x data_plane_sockets a stream); more are answered RESOURCE_EXHAUSTED and closed");
ABSL_FLAG(double, data_plane_idle_timeout_seconds, 600,
          "an authenticated data-plane connection silent between transfers for S ends (the clients reconnect on their next request)");
ABSL_FLAG(std::string, grpc_poll_strategy, "",
          "gRPC's I/O poller (GRPC_POLL_STRATEGY): epoll1 (gRPC's default) or poll (each completion queue polls its own connections); empty: gRPC's choice");
ABSL_FLAG(std::string, grpc_channel_args, "",
          "extra integer gRPC channel arguments, for transport tuning, e.g. grpc.http2.max_frame_size=16777215");
ABSL_FLAG(int64_t, max_rows_per_request, int64_t{1} << 24,
          "largest request, in rows (0 = no limit)");
ABSL_FLAG(bool, log_requests, true,
          "one JSON line per finished RPC on stderr, with its request id");
ABSL_FLAG(bool, pipeline_chunks, true,
          "GPU engines, for clients that send ahead (RequestHeader.sends_ahead): compute a chunk while the next is read and staged, answer from another thread");
ABSL_FLAG(int64_t, batch_max_rows, 256,
          "dynamic batching: concurrent small Calls (Score; ForwardBackward and Backward without accumulate_weight_grad) of the same head version and options are merged into one engine call of at most N rows; a request of more rows runs alone (0 or 1: off). Only on engines whose rows are the same bits in any batch (the CPU engine; CUDA with --batch-invariant=true); others run every call alone");
ABSL_FLAG(int64_t, batch_max_delay_us, 0,
          "how long a batch waits for more requests before it launches, in microseconds, at most 1000000 (0: at once when the engine is free; requests queue only while it is busy)");
ABSL_FLAG(int32_t, metrics_port, -1,
          "serve Prometheus metrics at http://HOST:N/metrics (and /healthz); rank 0 only (-1: off, 0 picks a free port)");
ABSL_FLAG(std::string, metrics_host, "0.0.0.0",
          "listen address of the metrics endpoint");
ABSL_FLAG(int64_t, max_concurrent_streams, 64,
          "streams served at once; more get RESOURCE_EXHAUSTED (0 = no limit)");
ABSL_FLAG(int64_t, max_streams_per_client, 0,
          "streams one client (its host and bearer token, and on loopback its uid) may hold at once (0: half of --max-concurrent-streams; -1: no cap); more get RESOURCE_EXHAUSTED. Calls are not counted");
ABSL_FLAG(int64_t, max_pending_grads, 4,
          "weight-gradient contributions a head holds pending at once (being computed, or deferred and waiting for CommitGrad); each takes a dW-sized fp32 buffer; a new one past this drops the oldest deferred one");
ABSL_FLAG(double, pending_grad_ttl_seconds, 600,
          "how long a deferred weight-gradient contribution waits for CommitGrad before it is dropped");
ABSL_FLAG(int64_t, max_request_bytes, int64_t{16} << 30,
          "largest request, in bytes of hidden states (0 = no limit)");
ABSL_FLAG(std::string, tls_cert, "",
          "serve TLS: the certificate chain (with --tls-key)");
ABSL_FLAG(std::string, tls_key, "",
          "serve TLS: the private key (with --tls-cert)");
ABSL_FLAG(std::string, tls_client_ca, "",
          "require client certificates signed by this CA (mutual TLS)");
ABSL_FLAG(std::string, auth_token_file, "",
          "bearer token for scoring RPCs (read from the file, never the command line)");
ABSL_FLAG(std::string, admin_token_file, "",
          "bearer token for admin RPCs (also accepted for scoring)");
ABSL_FLAG(int64_t, workspace_bytes, int64_t{1} << 30,
          "engine scratch budget");
ABSL_FLAG(int32_t, cpu_threads, 0,
          "CPU engine threads (0: all cores)");
ABSL_FLAG(bool, batch_invariant, false,
          "CUDA engine: a row's results the same bits in any batch (one GEMM algorithm for every row count; costs 5-13% at some train shapes, more on small calls; the CPU engine always is)");
ABSL_FLAG(bool, tp_invariant, false,
          "CUDA engine, with --batch-invariant: logprob, entropy, loss and d_hidden the same bits for any TP group size, V >= 131072; costs 31-44% of a train step");
ABSL_FLAG(int32_t, device, 0,
          "CUDA device ordinal");
ABSL_FLAG(double, shutdown_grace_seconds, 30.0,
          "on SIGTERM, time in-flight streams get to finish");
ABSL_FLAG(int32_t, tp_size, 1,
          "tensor-parallel group size: the head's vocabulary is split over K processes, one per GPU (or CPU process)");
ABSL_FLAG(int32_t, tp_rank, 0,
          "this process's rank; rank 0 serves the API, the others are peers");
ABSL_FLAG(std::string, tp_rendezvous, "",
          "directory the ranks share to meet (pid files, Gloo store, NCCL id); wipe it before (re)starting a group (deploy/lce_tp_launch.sh does)");
ABSL_FLAG(std::string, tp_host, "127.0.0.1",
          "address peers reach this rank on");
ABSL_FLAG(double, tp_timeout_seconds, 30.0,
          "a collective slower than this fails the group: in-flight requests get UNAVAILABLE naming the rank, health turns NOT_SERVING, and every rank exits with code 3 for its launcher to restart the group");
ABSL_FLAG(int32_t, dp_size, 1,
          "data-parallel replicas: R groups of the same --tp-size serve one head and train it as one job (docs/TRAINING.md)");
ABSL_FLAG(int32_t, dp_rank, 0,
          "this group's replica (every rank of the group passes the same D)");
ABSL_FLAG(std::string, dp_rendezvous, "",
          "directory every process of every replica sees, fresh for each start of the job (deploy/lce_dp_launch.sh makes one)");
ABSL_FLAG(std::string, dp_host, "127.0.0.1",
          "address the other replicas reach this process on; a front's also, with its --port, where the other fronts call it");
ABSL_FLAG(double, dp_timeout_seconds, 30.0,
          "a dW sum between replicas slower than this fails: the job's training is down (UNAVAILABLE naming the replica), every replica keeps scoring");
ABSL_FLAG(double, dp_join_timeout_seconds, 600.0,
          "how long start waits for every replica to join");
ABSL_FLAG(std::string, dp_tls_ca, "",
          "with --tls-cert: the CA that signed the other fronts' certificates");
ABSL_FLAG(double, stream_header_timeout_seconds, 10.0,
          "a stream must send its header within S seconds of opening, or end DEADLINE_EXCEEDED; it holds no admission slot meanwhile (0 = no limit)");
ABSL_FLAG(double, stream_idle_timeout_seconds, 60.0,
          "then it must send each next message, and read each answer, within S seconds (0 = no limit)");
ABSL_FLAG(double, memory_trim_seconds, 10.0,
          "every S seconds give the allocator's free memory back to the system (malloc_trim; 0 = never)");
ABSL_FLAG(int64_t, max_head_bytes, 0,
          "largest head shard (weight bytes) loaded at start or by LoadHead; larger is RESOURCE_EXHAUSTED (0: the GPU's memory on CUDA, the host's otherwise)");


namespace lce::server {
namespace {

// Every flag of lce_server, in --help's order (names as declared above).
const std::vector<std::string>& FlagNames() {
  static const std::vector<std::string> names = {
      "host",
      "port",
      "port_file",
      "backend",
      "head_name",
      "head_file",
      "head_tensor",
      "head_bias_tensor",
      "seed_head",
      "seed",
      "head_dtype",
      "max_message_bytes",
      "http2_window_bytes",
      "grpc_cqs",
      "grpc_idle_threads",
      "data_port",
      "data_plane_tls",
      "shm_socket",
      "allow_shm_by_name",
      "data_plane_bytes_per_session",
      "data_plane_total_bytes",
      "shm_bytes_per_session",
      "shm_total_bytes",
      "max_sessions_per_peer",
      "data_plane_auth_timeout_seconds",
      "data_plane_max_unauthenticated",
      "data_plane_max_connections",
      "data_plane_max_connections_per_session",
      "data_plane_idle_timeout_seconds",
      "grpc_poll_strategy",
      "grpc_channel_args",
      "max_rows_per_request",
      "log_requests",
      "pipeline_chunks",
      "batch_max_rows",
      "batch_max_delay_us",
      "metrics_port",
      "metrics_host",
      "max_concurrent_streams",
      "max_streams_per_client",
      "max_pending_grads",
      "pending_grad_ttl_seconds",
      "max_request_bytes",
      "tls_cert",
      "tls_key",
      "tls_client_ca",
      "auth_token_file",
      "admin_token_file",
      "workspace_bytes",
      "cpu_threads",
      "batch_invariant",
      "tp_invariant",
      "device",
      "shutdown_grace_seconds",
      "tp_size",
      "tp_rank",
      "tp_rendezvous",
      "tp_host",
      "tp_timeout_seconds",
      "dp_size",
      "dp_rank",
      "dp_rendezvous",
      "dp_host",
      "dp_timeout_seconds",
      "dp_join_timeout_seconds",
      "dp_tls_ca",
      "stream_header_timeout_seconds",
      "stream_idle_timeout_seconds",
      "memory_trim_seconds",
      "max_head_bytes"};
  return names;
}

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


// Back to the defaults, so that each parse starts from them.
void ResetFlags() {
  for (const std::string& name : FlagNames()) {
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    std::string error;
    flag->ParseFrom(flag->DefaultValue(), &error);
  }
}

// The command line's words with every --flagfile expanded in place.
absl::StatusOr<std::vector<std::string>> ExpandFlagfiles(int argc, char** argv) {
  std::vector<std::string> words;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    absl::string_view path = arg;
    if (!absl::ConsumePrefix(&path, "--flagfile=")) {
      words.push_back(arg);
      continue;
    }
    std::ifstream in{std::string(path)};
    if (!in) return absl::InvalidArgumentError(absl::StrCat("cannot read --flagfile ", path));
    for (std::string line; std::getline(in, line);) {
      absl::string_view t = absl::StripAsciiWhitespace(line);
      if (!t.empty() && t[0] != '#') words.emplace_back(t);
    }
  }
  return words;
}

// Sets the flags the words name; INVALID_ARGUMENT naming the first unknown flag or bad value. A
// boolean flag alone (--batch-invariant, not followed by a value) means true.
absl::Status SetFlags(const std::vector<std::string>& words, bool& help, bool& version) {
  for (size_t i = 0; i < words.size(); ++i) {
    const std::string& arg = words[i];
    if (arg == "--help" || arg == "-h") {
      help = true;
      continue;
    }
    if (arg == "--version") {
      version = true;
      continue;
    }
    if (arg.rfind("--", 0) != 0) return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", arg, "'"));
    std::string name = arg.substr(2), value;
    const size_t eq = name.find('=');
    if (eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    const std::string key = absl::StrReplaceAll(name, {{"-", "_"}});
    absl::CommandLineFlag* flag = nullptr;
    for (const std::string& known : FlagNames()) {
      if (known == key) flag = absl::FindCommandLineFlag(known);
    }
    if (flag == nullptr) return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name, " (see --help)"));
    if (eq == std::string::npos) {
      const bool next_is_flag = i + 1 >= words.size() || words[i + 1].rfind("--", 0) == 0;
      if (flag->IsOfType<bool>() && next_is_flag) {
        value = "true";
      } else if (i + 1 < words.size()) {
        value = words[++i];
      } else {
        return absl::InvalidArgumentError(absl::StrCat("flag --", name, " needs a value"));
      }
    }
    std::string error;
    if (!flag->ParseFrom(value, &error)) {
      return absl::InvalidArgumentError(absl::StrCat("bad value '", value, "' for --", name, ": ", error));
    }
  }
  return absl::OkStatus();
}

// The flags that are not plain values: the seeded head's shape and dtype, the gRPC channel arguments.
absl::Status ReadCompositeFlags(ServerFlags& f) {
  if (const std::string shape = absl::GetFlag(FLAGS_seed_head); !shape.empty()) {
    if (absl::Status s = ParseSeedShape(shape, f.head); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("bad value '", shape, "' for --seed-head: ", s.message()));
    }
  }
  absl::StatusOr<DType> dtype = ParseDType(absl::GetFlag(FLAGS_head_dtype));
  if (!dtype.ok()) return absl::InvalidArgumentError(absl::StrCat("--head-dtype: ", dtype.status().message()));
  f.head.dtype = *dtype;
  for (absl::string_view kv : absl::StrSplit(absl::GetFlag(FLAGS_grpc_channel_args), ',', absl::SkipEmpty())) {
    std::pair<absl::string_view, absl::string_view> p = absl::StrSplit(kv, absl::MaxSplits('=', 1));
    int value = 0;
    if (p.first.empty() || !absl::SimpleAtoi(p.second, &value)) {
      return absl::InvalidArgumentError(absl::StrCat("bad --grpc-channel-args entry '", kv, "': want NAME=INTEGER"));
    }
    f.grpc_channel_args.emplace_back(std::string(p.first), value);
  }
  return absl::OkStatus();
}

// A timeout: 0 (none) up to a year; NaN refused.
absl::Status CheckSeconds(const char* name, double v) {
  if (v >= 0 && v <= 3.2e7) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("--", name, " must be in [0, 3.2e7] seconds, got ", v));
}

absl::Status CheckTimeouts(const ServerFlags& f) {
  for (auto [name, v] : {std::pair{"dp-timeout-seconds", f.dp_timeout_seconds},
                         std::pair{"dp-join-timeout-seconds", f.dp_join_timeout_seconds},
                         std::pair{"stream-header-timeout-seconds", f.stream_header_timeout_seconds},
                         std::pair{"stream-idle-timeout-seconds", f.stream_idle_timeout_seconds},
                         std::pair{"memory-trim-seconds", f.memory_trim_seconds}}) {
    if (absl::Status s = CheckSeconds(name, v); !s.ok()) return s;
  }
  if (f.max_head_bytes < 0) return absl::InvalidArgumentError("--max-head-bytes must be >= 0");
  return absl::OkStatus();
}

}  // namespace

std::string ServerUsage() {
  std::string usage = "lce_server: fused linear-cross-entropy loss head over gRPC (lce.v1.LceService)\n\n"
                      "  --name=VALUE or --name VALUE (dashes or underscores); --flagfile=FILE: one flag a line\n\n";
  for (const std::string& name : FlagNames()) {
    const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    absl::StrAppend(&usage, "  --", absl::StrReplaceAll(name, {{"_", "-"}}), " (default: ",
                    flag->DefaultValue().empty() ? "\"\"" : flag->DefaultValue(), ")\n");
    std::string line = "     ";
    for (absl::string_view word : absl::StrSplit(flag->Help(), ' ')) {  // wrapped at 100 columns
      if (line.size() + 1 + word.size() > 100) absl::StrAppend(&usage, line, "\n"), line = "     ";
      absl::StrAppend(&line, " ", word);
    }
    absl::StrAppend(&usage, line, "\n");
  }
  return usage + "  --help\n";
}

absl::StatusOr<ServerFlags> ParseServerFlags(int argc, char** argv) {
  ResetFlags();
  absl::StatusOr<std::vector<std::string>> words = ExpandFlagfiles(argc, argv);
  if (!words.ok()) return words.status();
  ServerFlags f;
  if (absl::Status s = SetFlags(*words, f.help, f.version); !s.ok()) return s;
  f.host = absl::GetFlag(FLAGS_host);
  f.port = absl::GetFlag(FLAGS_port);
  f.port_file = absl::GetFlag(FLAGS_port_file);
  f.backend = absl::GetFlag(FLAGS_backend);
  f.head_name = absl::GetFlag(FLAGS_head_name);
  f.head.file = absl::GetFlag(FLAGS_head_file);
  f.head.tensor = absl::GetFlag(FLAGS_head_tensor);
  f.head.bias_tensor = absl::GetFlag(FLAGS_head_bias_tensor);
  f.head.seed = absl::GetFlag(FLAGS_seed);
  f.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  f.http2_window_bytes = absl::GetFlag(FLAGS_http2_window_bytes);
  f.grpc_cqs = absl::GetFlag(FLAGS_grpc_cqs);
  f.grpc_idle_threads = absl::GetFlag(FLAGS_grpc_idle_threads);
  f.data_port = absl::GetFlag(FLAGS_data_port);
  f.data_plane_tls = absl::GetFlag(FLAGS_data_plane_tls);
  f.shm_socket = absl::GetFlag(FLAGS_shm_socket);
  f.allow_shm_by_name = absl::GetFlag(FLAGS_allow_shm_by_name);
  f.data_plane_bytes_per_session = absl::GetFlag(FLAGS_data_plane_bytes_per_session);
  f.data_plane_total_bytes = absl::GetFlag(FLAGS_data_plane_total_bytes);
  f.shm_bytes_per_session = absl::GetFlag(FLAGS_shm_bytes_per_session);
  f.shm_total_bytes = absl::GetFlag(FLAGS_shm_total_bytes);
  f.max_sessions_per_peer = absl::GetFlag(FLAGS_max_sessions_per_peer);
  f.data_plane_auth_timeout_seconds = absl::GetFlag(FLAGS_data_plane_auth_timeout_seconds);
  f.data_plane_max_unauthenticated = absl::GetFlag(FLAGS_data_plane_max_unauthenticated);
  f.data_plane_max_connections = absl::GetFlag(FLAGS_data_plane_max_connections);
  f.data_plane_max_connections_per_session = absl::GetFlag(FLAGS_data_plane_max_connections_per_session);
  f.data_plane_idle_timeout_seconds = absl::GetFlag(FLAGS_data_plane_idle_timeout_seconds);
  f.grpc_poll_strategy = absl::GetFlag(FLAGS_grpc_poll_strategy);
  f.max_rows_per_request = absl::GetFlag(FLAGS_max_rows_per_request);
  f.log_requests = absl::GetFlag(FLAGS_log_requests);
  f.pipeline_chunks = absl::GetFlag(FLAGS_pipeline_chunks);
  f.batch_max_rows = absl::GetFlag(FLAGS_batch_max_rows);
  f.batch_max_delay_us = absl::GetFlag(FLAGS_batch_max_delay_us);
  f.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  f.metrics_host = absl::GetFlag(FLAGS_metrics_host);
  f.max_concurrent_streams = absl::GetFlag(FLAGS_max_concurrent_streams);
  f.max_streams_per_client = absl::GetFlag(FLAGS_max_streams_per_client);
  f.max_pending_grads = absl::GetFlag(FLAGS_max_pending_grads);
  f.pending_grad_ttl_seconds = absl::GetFlag(FLAGS_pending_grad_ttl_seconds);
  f.max_request_bytes = absl::GetFlag(FLAGS_max_request_bytes);
  f.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  f.tls_key = absl::GetFlag(FLAGS_tls_key);
  f.tls_client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  f.auth_token_file = absl::GetFlag(FLAGS_auth_token_file);
  f.admin_token_file = absl::GetFlag(FLAGS_admin_token_file);
  f.workspace_bytes = absl::GetFlag(FLAGS_workspace_bytes);
  f.cpu_threads = absl::GetFlag(FLAGS_cpu_threads);
  f.batch_invariant = absl::GetFlag(FLAGS_batch_invariant);
  f.tp_invariant = absl::GetFlag(FLAGS_tp_invariant);
  f.device = absl::GetFlag(FLAGS_device);
  f.shutdown_grace_seconds = absl::GetFlag(FLAGS_shutdown_grace_seconds);
  f.tp_size = absl::GetFlag(FLAGS_tp_size);
  f.tp_rank = absl::GetFlag(FLAGS_tp_rank);
  f.tp_rendezvous = absl::GetFlag(FLAGS_tp_rendezvous);
  f.tp_host = absl::GetFlag(FLAGS_tp_host);
  f.tp_timeout_seconds = absl::GetFlag(FLAGS_tp_timeout_seconds);
  f.dp_size = absl::GetFlag(FLAGS_dp_size);
  f.dp_rank = absl::GetFlag(FLAGS_dp_rank);
  f.dp_rendezvous = absl::GetFlag(FLAGS_dp_rendezvous);
  f.dp_host = absl::GetFlag(FLAGS_dp_host);
  f.dp_timeout_seconds = absl::GetFlag(FLAGS_dp_timeout_seconds);
  f.dp_join_timeout_seconds = absl::GetFlag(FLAGS_dp_join_timeout_seconds);
  f.dp_tls_ca = absl::GetFlag(FLAGS_dp_tls_ca);
  f.stream_header_timeout_seconds = absl::GetFlag(FLAGS_stream_header_timeout_seconds);
  f.stream_idle_timeout_seconds = absl::GetFlag(FLAGS_stream_idle_timeout_seconds);
  f.memory_trim_seconds = absl::GetFlag(FLAGS_memory_trim_seconds);
  f.max_head_bytes = absl::GetFlag(FLAGS_max_head_bytes);
  if (absl::Status s = ReadCompositeFlags(f); !s.ok()) return s;
  if (absl::Status s = CheckTimeouts(f); !s.ok()) return s;
  if (f.port < 0 || f.port > 65535) return absl::InvalidArgumentError(absl::StrCat("bad --port ", f.port));
  if (f.tp_size < 1 || f.tp_rank < 0 || f.tp_rank >= f.tp_size) {
    return absl::InvalidArgumentError(absl::StrCat("--tp-rank must be in [0, --tp-size), got ", f.tp_rank, " of ", f.tp_size));
  }
  if (f.tp_size > 1 && f.tp_rendezvous.empty()) {
    return absl::InvalidArgumentError("--tp-size > 1 needs --tp-rendezvous=DIR");
  }
  if (absl::Status s = CheckDpFlags(f); !s.ok()) return s;
  if (f.max_pending_grads < 1) return absl::InvalidArgumentError("--max-pending-grads must be >= 1");
  if (!(f.pending_grad_ttl_seconds > 0)) return absl::InvalidArgumentError("--pending-grad-ttl-seconds must be > 0");
  if (f.batch_max_rows < 0) return absl::InvalidArgumentError("--batch-max-rows must be >= 0");
  if (f.batch_max_delay_us < 0 || f.batch_max_delay_us > 1000000) {
    return absl::InvalidArgumentError("--batch-max-delay-us must be in [0, 1000000]");
  }
  if (f.max_message_bytes < (1 << 16)) return absl::InvalidArgumentError("--max-message-bytes must be >= 65536");
  if (f.http2_window_bytes < 0 || f.http2_window_bytes > INT32_MAX) {
    return absl::InvalidArgumentError("--http2-window-bytes must be in [0, 2147483647]");
  }
  if (f.grpc_cqs < 0 || f.grpc_cqs > 256) return absl::InvalidArgumentError("--grpc-cqs must be in [0, 256]");
  if (f.grpc_idle_threads < 0 || f.grpc_idle_threads > 4096) {
    return absl::InvalidArgumentError("--grpc-idle-threads must be in [0, 4096]");
  }
  if (f.data_port < -1 || f.data_port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("--data-port must be -1 (off), 0 (any) or a port, got ", f.data_port));
  }
  if (f.data_plane_tls && (f.tls_cert.empty() || f.tls_key.empty())) {
    return absl::InvalidArgumentError("--data-plane-tls needs --tls-cert and --tls-key (the data plane serves the same certificate)");
  }
  if (f.data_plane_bytes_per_session <= 0) return absl::InvalidArgumentError("--data-plane-bytes-per-session must be > 0");
  if (f.data_plane_total_bytes < -1) return absl::InvalidArgumentError("--data-plane-total-bytes must be >= -1");
  if (f.shm_bytes_per_session <= 0 || f.shm_total_bytes <= 0) {
    return absl::InvalidArgumentError("--shm-bytes-per-session and --shm-total-bytes must be > 0");
  }
  if (f.max_sessions_per_peer < 0) return absl::InvalidArgumentError("--max-sessions-per-peer must be >= 0");
  if (f.max_streams_per_client < -1) return absl::InvalidArgumentError("--max-streams-per-client must be >= -1");
  if (!(f.data_plane_auth_timeout_seconds > 0 && f.data_plane_auth_timeout_seconds <= 3600)) {
    return absl::InvalidArgumentError("--data-plane-auth-timeout-seconds must be in (0, 3600]");
  }
  if (f.data_plane_max_unauthenticated < 1) return absl::InvalidArgumentError("--data-plane-max-unauthenticated must be >= 1");
  if (f.data_plane_max_connections < 1 || f.data_plane_max_connections > 65536) {
    return absl::InvalidArgumentError("--data-plane-max-connections must be in [1, 65536]");
  }
  if (f.data_plane_max_connections_per_session < 1) {
    return absl::InvalidArgumentError("--data-plane-max-connections-per-session must be >= 1");
  }
  if (!(f.data_plane_idle_timeout_seconds > 0)) {
    return absl::InvalidArgumentError("--data-plane-idle-timeout-seconds must be > 0");
  }
  return f;
}

}  // namespace lce::server
