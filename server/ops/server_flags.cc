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
#include "status_macros.h"

namespace lce::server {
namespace {

// One flag of lce_server: its absl name, and what puts its value into ServerFlags.
struct ServerFlag {
  const char* name;
  void (*copy)(ServerFlags&);
};

// Every flag, in declaration order (--help's): the one list that parsing, --help and
// docs/OPERATING.md's table (ServerFlagsMarkdown) go through.
std::vector<ServerFlag>& Flags() {
  static std::vector<ServerFlag> flags;
  return flags;
}

bool AddFlag(const char* name, void (*copy)(ServerFlags&)) {
  Flags().push_back({name, copy});
  return true;
}

void Composite(ServerFlags&) {}  // read by ReadCompositeFlags

}  // namespace
}  // namespace lce::server

// A flag and the ServerFlags field it sets (`member`: a field path such as head.file), declared
// once: the absl flag holds its type, default and help.
#define LCE_SERVER_FLAG(Type, name, member, default_value, help) \
  ABSL_FLAG(Type, name, default_value, help);                    \
  [[maybe_unused]] static const bool lce_server_flag_##name =    \
      ::lce::server::AddFlag(#name, [](::lce::server::ServerFlags& f) { f.member = absl::GetFlag(FLAGS_##name); })
// A flag whose value ReadCompositeFlags parses into ServerFlags.
#define LCE_SERVER_FLAG_COMPOSITE(Type, name, default_value, help) \
  ABSL_FLAG(Type, name, default_value, help);                      \
  [[maybe_unused]] static const bool lce_server_flag_##name = ::lce::server::AddFlag(#name, ::lce::server::Composite)

LCE_SERVER_FLAG(std::string, host, host, "0.0.0.0", "listen address");
LCE_SERVER_FLAG(int32_t, port, port, 50051, "listen port (0 picks a free one)");
LCE_SERVER_FLAG(std::string, port_file, port_file, "", "write the port there once serving");
LCE_SERVER_FLAG(std::string, backend, backend, "auto",
                "engine backend: cpu, cuda, or auto (cuda when a GPU is visible)");
LCE_SERVER_FLAG(std::string, head_name, head_name, "default", "name of the served head");
LCE_SERVER_FLAG(std::string, head_file, head.file, "", "safetensors file holding the head");
LCE_SERVER_FLAG(std::string, head_tensor, head.tensor, "lm_head.weight", "tensor in it, [vocab, hidden]");
LCE_SERVER_FLAG(std::string, head_bias_tensor, head.bias_tensor, "", "optional bias tensor [vocab]");
LCE_SERVER_FLAG_COMPOSITE(std::string, seed_head, "", "instead of a file: a seeded random head, e.g. 32000x512");
LCE_SERVER_FLAG(uint64_t, seed, head.seed, 0, "seed of the seeded head");
LCE_SERVER_FLAG_COMPOSITE(std::string, head_dtype, "bf16", "dtype of the seeded head: bf16, fp16 or fp32");
LCE_SERVER_FLAG(int64_t, max_message_bytes, max_message_bytes, 64 << 20, "largest gRPC message accepted");
LCE_SERVER_FLAG(int64_t, http2_window_bytes, http2_window_bytes, 0,
                "HTTP/2 flow-control window per stream (0: gRPC's, adapted by its bandwidth probe); larger lets a "
                "client stream further ahead");
LCE_SERVER_FLAG(int32_t, grpc_cqs, grpc_cqs, 0,
                "gRPC completion queues (each with its own pollers), over which connections are spread (0: one per "
                "core, at most 16)");
LCE_SERVER_FLAG(int32_t, grpc_idle_threads, grpc_idle_threads, 0,
                "handler threads kept polling per completion queue (0: 64 over all queues, at least 4 each); one that "
                "finishes while as many poll exits, and a request that finds none polling starts one: too few and a "
                "busy server makes a thread a request");
LCE_SERVER_FLAG(int32_t, data_port, data_port, -1,
                "data plane for remote clients' bulk bytes (TCP beside gRPC; each transfer shows its session's secret; "
                "plain unless --data-plane-tls) on the --host address (-1: off; 0: any port)");
LCE_SERVER_FLAG(bool, data_plane_tls, data_plane_tls, false,
                "serve the data plane over TLS with --tls-cert/--tls-key (clients verify it against their CA); costs "
                "throughput (bench/RESULTS.md; bench/device.sh tls-wire measures it)");
LCE_SERVER_FLAG(
    std::string, shm_socket, shm_socket, "auto",
    "Unix socket on which co-located clients hand over shared memory as a file descriptor (memfd, SCM_RIGHTS) with "
    "their session's secret, from the session's uid; auto: $TMPDIR (else /tmp)/lce-server-<port>.sock; empty: none");
LCE_SERVER_FLAG(
    bool, allow_shm_by_name, allow_shm_by_name, false,
    "also map POSIX shm objects that clients name (RegisterRegion.shm_name): any co-located client with the scoring "
    "token may then register any object its uid owns by a guessable name; only where every such client is trusted");
LCE_SERVER_FLAG(int64_t, data_plane_bytes_per_session, data_plane_bytes_per_session, int64_t{4} << 30,
                "server memory one session may allocate");
LCE_SERVER_FLAG(int64_t, data_plane_total_bytes, data_plane_total_bytes, -1,
                "server memory all sessions together may allocate (-1: half the host's memory; 0: no limit); beyond, "
                "RESOURCE_EXHAUSTED");
LCE_SERVER_FLAG(int64_t, shm_bytes_per_session, shm_bytes_per_session, int64_t{64} << 30,
                "bytes of clients' shared memory (shm socket, shm names) the server maps for one session; beyond, "
                "RESOURCE_EXHAUSTED before anything is mapped");
LCE_SERVER_FLAG(int64_t, shm_total_bytes, shm_total_bytes, int64_t{4} << 40,
                "bytes of clients' shared memory the server maps for all sessions together (address space: a sparse "
                "memfd costs its client nothing); beyond, RESOURCE_EXHAUSTED");
LCE_SERVER_FLAG(int64_t, max_sessions_per_peer, max_sessions_per_peer, 64,
                "sessions (OpenSession) one client (its host and bearer token, and on loopback its uid) may hold at "
                "once (0: no limit); more get RESOURCE_EXHAUSTED");
LCE_SERVER_FLAG(double, data_plane_auth_timeout_seconds, data_plane_auth_timeout_seconds, 60,
                "a new data-plane connection's first transfer must come within S and name its session's region, or the "
                "connection ends");
LCE_SERVER_FLAG(int32_t, data_plane_max_unauthenticated, data_plane_max_unauthenticated, 256,
                "connections that have not done so yet, at most (128 from one address); they never take "
                "--data-plane-max-connections' slots");
LCE_SERVER_FLAG(int32_t, data_plane_max_connections, data_plane_max_connections, 512,
                "data-plane connections served at once (a client opens 2 x data_plane_sockets a stream); more are "
                "answered RESOURCE_EXHAUSTED and closed (a client already sending sees the connection reset)");
LCE_SERVER_FLAG(int32_t, data_plane_max_connections_per_session, data_plane_max_connections_per_session, 64,
                "of those, the most one session may hold (a client opens 2 x data_plane_sockets a stream); more are "
                "answered RESOURCE_EXHAUSTED and closed");
LCE_SERVER_FLAG(double, data_plane_idle_timeout_seconds, data_plane_idle_timeout_seconds, 600,
                "an authenticated data-plane connection silent between transfers for S ends (the clients reconnect on "
                "their next request)");
LCE_SERVER_FLAG(std::string, grpc_poll_strategy, grpc_poll_strategy, "",
                "gRPC's I/O poller (GRPC_POLL_STRATEGY): epoll1 (gRPC's default) or poll (each completion queue polls "
                "its own connections); empty: gRPC's choice");
LCE_SERVER_FLAG_COMPOSITE(
    std::string, grpc_channel_args, "",
    "extra integer gRPC channel arguments, for transport tuning, e.g. grpc.http2.max_frame_size=16777215");
LCE_SERVER_FLAG(int64_t, max_rows_per_request, max_rows_per_request, int64_t{1} << 24,
                "largest request, in rows (0 = no limit)");
LCE_SERVER_FLAG(bool, log_requests, log_requests, true,
                "one JSON line per finished RPC on stderr, with its request id");
LCE_SERVER_FLAG(bool, pipeline_chunks, pipeline_chunks, true,
                "GPU engines (one GPU or a tensor-parallel group's front), for clients that send ahead "
                "(RequestHeader.sends_ahead): compute a chunk while the next is read and staged, answer from another "
                "thread");
LCE_SERVER_FLAG(
    int64_t, merge_chunk_rows, merge_chunk_rows, -1,
    "pipelined streams: chunks that queue up behind a busy engine go to it together, in calls of up to N "
    "rows (or 64 chunks), so that the clients' small chunks (4 MiB: 512 rows at H 4096) do not each "
    "re-read and re-write dW; a stream's staging holds 2 x N rows (64 MiB at H 4096, bf16 and N 2048) (0 or "
    "1: one call a chunk; -1: 2048 on one GPU, 4096 for a tensor-parallel group, whose every call also "
    "pays the group's collectives)");
LCE_SERVER_FLAG(
    int64_t, batch_max_rows, batch_max_rows, 256,
    "dynamic batching: concurrent small Calls (Score; ForwardBackward and Backward without "
    "accumulate_weight_grad) of the same head version and options are merged into one engine call of at "
    "most N rows; a request of more rows runs alone (0 or 1: off). Only on engines whose rows are the same "
    "bits in any batch (the CPU engine; CUDA with its epilogue GEMM, or --batch-invariant=true); others run "
    "every call alone");
LCE_SERVER_FLAG(int64_t, batch_max_delay_us, batch_max_delay_us, 0,
                "how long a batch waits for more requests before it launches, in microseconds, at most 1000000 (0: at "
                "once when the engine is free; requests queue only while it is busy)");
LCE_SERVER_FLAG(
    int32_t, metrics_port, metrics_port, -1,
    "serve Prometheus metrics at http://HOST:N/metrics (and /healthz); rank 0 only (-1: off, 0 picks a free port)");
LCE_SERVER_FLAG(std::string, metrics_host, metrics_host, "0.0.0.0", "listen address of the metrics endpoint");
LCE_SERVER_FLAG(int64_t, max_concurrent_streams, max_concurrent_streams, 64,
                "streams served at once; more get RESOURCE_EXHAUSTED (0 = no limit)");
LCE_SERVER_FLAG(int64_t, max_streams_per_client, max_streams_per_client, 0,
                "streams one client (its host and bearer token, and on loopback its uid) may hold at once (0: half of "
                "--max-concurrent-streams; -1: no cap); more get RESOURCE_EXHAUSTED. Calls are not counted");
LCE_SERVER_FLAG(
    int64_t, max_pending_grads, max_pending_grads, 4,
    "weight-gradient contributions a head holds pending at once (being computed, or deferred and waiting for "
    "CommitGrad); each takes a dW-sized fp32 buffer; a new one past this drops the oldest deferred one");
LCE_SERVER_FLAG(double, pending_grad_ttl_seconds, pending_grad_ttl_seconds, 600,
                "how long a deferred weight-gradient contribution waits for CommitGrad before it is dropped");
LCE_SERVER_FLAG(int64_t, max_request_bytes, max_request_bytes, int64_t{16} << 30,
                "largest request, in bytes of hidden states (0 = no limit)");
LCE_SERVER_FLAG(std::string, tls_cert, tls_cert, "", "serve TLS: the certificate chain (with --tls-key)");
LCE_SERVER_FLAG(std::string, tls_key, tls_key, "", "serve TLS: the private key (with --tls-cert)");
LCE_SERVER_FLAG(std::string, tls_client_ca, tls_client_ca, "",
                "require client certificates signed by this CA (mutual TLS)");
LCE_SERVER_FLAG(std::string, auth_token_file, auth_token_file, "",
                "bearer token for scoring RPCs (read from the file, never the command line)");
LCE_SERVER_FLAG(std::string, admin_token_file, admin_token_file, "",
                "bearer token for admin RPCs (also accepted for scoring)");
LCE_SERVER_FLAG(int64_t, workspace_bytes, workspace_bytes, int64_t{1} << 30,
                "engine scratch budget: a call's rows run in blocks that fit it (a training row takes ~2 bytes a "
                "vocabulary row for its dL/dlogits copy); a larger one means fewer blocks, e.g. 1.5 GiB trains ~4% "
                "faster at 16384-row calls on an H200 (bench/RESULTS.md); the first call of a shape also takes up to "
                "256 MiB for a moment, beside it, to time the weight gradient's GEMM candidates (none free: a "
                "narrower timing in the budget)");
LCE_SERVER_FLAG(int32_t, cpu_threads, cpu_threads, 0, "CPU engine threads (0: all cores)");
LCE_SERVER_FLAG(bool, batch_invariant, batch_invariant, false,
                "CUDA engine's logit-tile path (no epilogue GEMM: fp32 heads, builds without CUTLASS, training calls "
                "with rankings): a row's results the same bits in any batch (one GEMM algorithm for every row count; "
                "cost 5-13% at some train shapes, more on small calls). The epilogue GEMM's path and the CPU engine "
                "always are");
LCE_SERVER_FLAG(bool, tp_invariant, tp_invariant, true,
                "CUDA engine (the epilogue GEMM's path, or with --batch-invariant): logprob, entropy, loss and "
                "d_hidden one GPU's bits in TP groups of 2 and 4, V >= 98304; nothing on one GPU, within the "
                "spread of a TP-2 train step");
LCE_SERVER_FLAG(int32_t, device, device, 0, "CUDA device ordinal");
LCE_SERVER_FLAG(double, shutdown_grace_seconds, shutdown_grace_seconds, 30.0,
                "on SIGTERM, time in-flight streams get to finish");
LCE_SERVER_FLAG(
    int32_t, tp_size, tp_size, 1,
    "tensor-parallel group size: the head's vocabulary is split over K processes, one per GPU (or CPU process)");
LCE_SERVER_FLAG(int32_t, tp_rank, tp_rank, 0, "this process's rank; rank 0 serves the API, the others are peers");
LCE_SERVER_FLAG(std::string, tp_rendezvous, tp_rendezvous, "",
                "directory the ranks share to meet (pid files, Gloo store, NCCL id); wipe it before (re)starting a "
                "group (deploy/lce_tp_launch.sh does)");
LCE_SERVER_FLAG(std::string, tp_host, tp_host, "127.0.0.1", "address peers reach this rank on");
LCE_SERVER_FLAG(double, tp_timeout_seconds, tp_timeout_seconds, 30.0,
                "a collective slower than this fails the group: in-flight requests get UNAVAILABLE naming the rank, "
                "health turns NOT_SERVING, and every rank exits with code 3 for its launcher to restart the group");
LCE_SERVER_FLAG(
    int32_t, dp_size, dp_size, 1,
    "data-parallel replicas: R groups of the same --tp-size serve one head and train it as one job (docs/TRAINING.md)");
LCE_SERVER_FLAG(int32_t, dp_rank, dp_rank, 0, "this group's replica (every rank of the group passes the same D)");
LCE_SERVER_FLAG(std::string, dp_rendezvous, dp_rendezvous, "",
                "directory every process of every replica sees, fresh for each start of the job "
                "(deploy/lce_dp_launch.sh makes one)");
LCE_SERVER_FLAG(std::string, dp_host, dp_host, "127.0.0.1",
                "address the other replicas reach this process on; a front's also, with its --port, where the other "
                "fronts call it");
LCE_SERVER_FLAG(double, dp_timeout_seconds, dp_timeout_seconds, 30.0,
                "a dW sum between replicas slower than this fails: the job's training is down (UNAVAILABLE naming the "
                "replica), every replica keeps scoring");
LCE_SERVER_FLAG(double, dp_join_timeout_seconds, dp_join_timeout_seconds, 600.0,
                "how long start waits for every replica to join");
LCE_SERVER_FLAG(std::string, dp_tls_ca, dp_tls_ca, "",
                "with --tls-cert: the CA that signed the other fronts' certificates");
LCE_SERVER_FLAG(double, stream_header_timeout_seconds, stream_header_timeout_seconds, 10.0,
                "a stream must send its header within S seconds of opening, or end DEADLINE_EXCEEDED; it holds no "
                "admission slot meanwhile (0 = no limit)");
LCE_SERVER_FLAG(double, stream_idle_timeout_seconds, stream_idle_timeout_seconds, 60.0,
                "then it must send each next message, and read each answer, within S seconds (0 = no limit)");
LCE_SERVER_FLAG(double, memory_trim_seconds, memory_trim_seconds, 10.0,
                "every S seconds give the allocator's free memory back to the system (malloc_trim; 0 = never)");
LCE_SERVER_FLAG(int64_t, max_head_bytes, max_head_bytes, 0,
                "largest head shard (weight bytes) loaded at start or by LoadHead; larger is RESOURCE_EXHAUSTED (0: "
                "the GPU's memory on CUDA, the host's otherwise)");

namespace lce::server {
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


// Back to the defaults, so that each parse starts from them.
void ResetFlags() {
  for (const ServerFlag& known : Flags()) {
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(known.name);
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
    for (const ServerFlag& known : Flags()) {
      if (known.name == key) flag = absl::FindCommandLineFlag(known.name);
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
    LCE_RETURN_IF_ERROR(CheckSeconds(name, v));
  }
  if (f.max_head_bytes < 0) return absl::InvalidArgumentError("--max-head-bytes must be >= 0");
  return absl::OkStatus();
}

// The port, and the tensor- and data-parallel group this process belongs to.
absl::Status CheckGroupFlags(const ServerFlags& f) {
  if (f.port < 0 || f.port > 65535) return absl::InvalidArgumentError(absl::StrCat("bad --port ", f.port));
  if (f.tp_size < 1 || f.tp_rank < 0 || f.tp_rank >= f.tp_size) {
    return absl::InvalidArgumentError(absl::StrCat("--tp-rank must be in [0, --tp-size), got ", f.tp_rank, " of ", f.tp_size));
  }
  if (f.tp_size > 1 && f.tp_rendezvous.empty()) {
    return absl::InvalidArgumentError("--tp-size > 1 needs --tp-rendezvous=DIR");
  }
  return CheckDpFlags(f);
}

// Pending gradients, batching, messages and gRPC's threads.
absl::Status CheckServingFlags(const ServerFlags& f) {
  if (f.max_pending_grads < 1) return absl::InvalidArgumentError("--max-pending-grads must be >= 1");
  if (!(f.pending_grad_ttl_seconds > 0)) return absl::InvalidArgumentError("--pending-grad-ttl-seconds must be > 0");
  if (f.batch_max_rows < 0) return absl::InvalidArgumentError("--batch-max-rows must be >= 0");
  if (f.merge_chunk_rows < -1 || f.merge_chunk_rows > (int64_t{1} << 20)) {
    return absl::InvalidArgumentError("--merge-chunk-rows must be -1 (automatic) or in [0, 1048576]");
  }
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
  return absl::OkStatus();
}

// The data plane's and shared memory's limits, and the per-client caps.
absl::Status CheckDataPlaneFlags(const ServerFlags& f) {
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
  return absl::OkStatus();
}

}  // namespace

std::string ServerUsage() {
  std::string usage =
      "lce_server: fused linear-cross-entropy loss head over gRPC (lce.v1.LceService)\n\n"
      "  --name=VALUE or --name VALUE (dashes or underscores); --flagfile=FILE: one flag a line\n\n";
  for (const ServerFlag& known : Flags()) {
    const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(known.name);
    absl::StrAppend(&usage, "  --", absl::StrReplaceAll(known.name, {{"_", "-"}}),
                    " (default: ", flag->DefaultValue().empty() ? "\"\"" : flag->DefaultValue(), ")\n");
    std::string line = "     ";
    for (absl::string_view word : absl::StrSplit(flag->Help(), ' ')) {  // wrapped at 100 columns
      if (line.size() + 1 + word.size() > 100) absl::StrAppend(&usage, line, "\n"), line = "     ";
      absl::StrAppend(&line, " ", word);
    }
    absl::StrAppend(&usage, line, "\n");
  }
  return usage + "  --help\n";
}

std::string ServerFlagsMarkdown() {
  std::string table = "| flag | default | what it does |\n| --- | --- | --- |\n";
  for (const ServerFlag& known : Flags()) {
    const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(known.name);
    const std::string value = flag->DefaultValue().empty() ? "\"\"" : flag->DefaultValue();
    absl::StrAppend(&table, "| `--", absl::StrReplaceAll(known.name, {{"_", "-"}}), "` | `", value, "` | ",
                    absl::StrReplaceAll(flag->Help(), {{"|", "\\|"}}), " |\n");
  }
  return table;
}

absl::StatusOr<ServerFlags> ParseServerFlags(int argc, char** argv) {
  ResetFlags();
  absl::StatusOr<std::vector<std::string>> words = ExpandFlagfiles(argc, argv);
  if (!words.ok()) return words.status();
  ServerFlags f;
  LCE_RETURN_IF_ERROR(SetFlags(*words, f.help, f.version));
  for (const ServerFlag& flag : Flags()) flag.copy(f);
  LCE_RETURN_IF_ERROR(ReadCompositeFlags(f));
  LCE_RETURN_IF_ERROR(CheckTimeouts(f));
  LCE_RETURN_IF_ERROR(CheckGroupFlags(f));
  LCE_RETURN_IF_ERROR(CheckServingFlags(f));
  LCE_RETURN_IF_ERROR(CheckDataPlaneFlags(f));
  return f;
}

}  // namespace lce::server
