// Command-line flags of lce_server (absl flags, server_flags.cc): `--name=value` or `--name value`,
// dashes or underscores in names, `--flagfile=FILE`.
#pragma once

#include <cstdint>
#include <string>
#include <vector>
#include <utility>

#include "absl/status/statusor.h"
#include "head_source.h"

namespace lce::server {

// The parsed flags. Each field is set by the flag that names it in server_flags.cc
// (LCE_SERVER_FLAG: its type, default, help and this field, in one place).
struct ServerFlags {
  std::string host;
  int port{};  // 0: pick a free port
  std::string port_file;  // written with the port once serving
  std::string backend;  // cpu | cuda | auto
  std::string head_name;
  HeadSource head;
  int64_t max_message_bytes{};
  int64_t http2_window_bytes{};
  int grpc_cqs{};
  int grpc_idle_threads{};
  int data_port{};
  bool data_plane_tls{};        // the data plane over TLS (--tls-cert/--tls-key)
  std::string shm_socket;       // the shm socket's path; "auto": by the port; "": none
  bool allow_shm_by_name{};     // RegisterRegion.shm_name accepted
  int64_t data_plane_bytes_per_session{};
  int data_plane_max_connections{};
  int data_plane_max_connections_per_session{};
  double data_plane_idle_timeout_seconds{};
  int64_t data_plane_total_bytes{};  // server memory over all sessions; -1: half the host's, 0: no limit
  int64_t shm_bytes_per_session{};   // clients' shared memory mapped for one session
  int64_t shm_total_bytes{};         // ... and for all sessions
  int64_t max_sessions_per_peer{};
  double data_plane_auth_timeout_seconds{};
  int data_plane_max_unauthenticated{};
  std::string grpc_poll_strategy;
  std::vector<std::pair<std::string, int>> grpc_channel_args;  // extra integer gRPC channel arguments
  int64_t max_rows_per_request{};
  bool log_requests{};  // one JSON line per finished RPC on stderr
  bool pipeline_chunks{};  // ServiceConfig.pipeline_chunks
  // Dynamic batching (ServiceConfig.batching): rows of a merged engine call at most (<= 1: off),
  // and how long a batch waits for more rows (0: it launches as soon as the engine is free).
  int64_t batch_max_rows{};
  int64_t merge_chunk_rows{};  // ServiceConfig.merge_chunk_rows
  int64_t batch_max_delay_us{};
  int metrics_port{};  // -1: no metrics endpoint; 0: pick a free port
  std::string metrics_host;
  int64_t max_concurrent_streams{};
  int64_t max_streams_per_client{};
  int64_t max_pending_grads{};
  double pending_grad_ttl_seconds{};
  int64_t max_request_bytes{};
  std::string tls_cert, tls_key, tls_client_ca;
  std::string auth_token_file, admin_token_file;
  int64_t workspace_bytes{};
  int cpu_threads{};
  bool batch_invariant{};  // EngineConfig::batch_invariant (CUDA)
  bool tp_invariant{};  // EngineConfig::tp_invariant (CUDA)
  int device{};
  double shutdown_grace_seconds{};
  // Tensor parallelism: this process is rank tp_rank of tp_size; ranks meet in tp_rendezvous.
  int tp_size{};
  int tp_rank{};
  std::string tp_rendezvous;
  std::string tp_host;
  double tp_timeout_seconds{};
  // Data parallelism: this group is replica dp_rank of dp_size, which meet in dp_rendezvous (dp_rank.h).
  int dp_size{};
  int dp_rank{};
  std::string dp_rendezvous;
  std::string dp_host;
  double dp_timeout_seconds{};
  double dp_join_timeout_seconds{};
  std::string dp_tls_ca;
  // Edge limits (docs/SECURITY.md): waits on silent stream clients (0: no limit), and the largest
  // head shard built (0: the GPU's memory on CUDA, the host's otherwise).
  double stream_header_timeout_seconds{};
  double stream_idle_timeout_seconds{};
  double memory_trim_seconds{};  // MemoryTrimmer's interval (0: never)
  int64_t max_head_bytes{};
  bool help = false;  // --help or -h
  bool version = false;  // --version
};

absl::StatusOr<ServerFlags> ParseServerFlags(int argc, char** argv);
// --help's text: every flag with its default and help, generated from the flags.
std::string ServerUsage();
// The same as a Markdown table, docs/OPERATING.md's (a test keeps the two equal).
std::string ServerFlagsMarkdown();

}  // namespace lce::server
