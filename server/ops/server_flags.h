// Command-line flags of lce_server: `--name=value` or `--name value`, dashes in names.
#pragma once

#include <cstdint>
#include <string>
#include <vector>
#include <utility>

#include "absl/status/statusor.h"
#include "head_source.h"

namespace lce::server {

struct ServerFlags {
  std::string host = "0.0.0.0";
  int port = 50051;             // 0: pick a free port
  std::string port_file;        // written with the port once serving
  std::string backend = "auto"; // cpu | cuda | auto
  std::string head_name = "default";
  HeadSource head;
  int64_t max_message_bytes = 64 << 20;
  int64_t http2_window_bytes = 0;
  int grpc_cqs = 0;
  int data_port = -1;
  int64_t data_plane_bytes_per_session = int64_t{4} << 30;
  int data_plane_max_connections = 512;
  int64_t data_plane_total_bytes = -1;  // server memory over all sessions; -1: half the host's, 0: no limit
  int64_t max_sessions_per_peer = 64;
  double data_plane_auth_timeout_seconds = 60;
  int data_plane_max_unauthenticated = 256;
  std::string grpc_poll_strategy;
  std::vector<std::pair<std::string, int>> grpc_channel_args;  // extra integer gRPC channel arguments
  int64_t max_rows_per_request = int64_t{1} << 24;
  bool log_requests = true;     // one JSON line per finished RPC on stderr
  bool pipeline_chunks = true;  // ServiceConfig.pipeline_chunks
  // Dynamic batching (ServiceConfig.batching): rows of a merged engine call at most (<= 1: off),
  // and how long a batch waits for more rows (0: it launches as soon as the engine is free).
  int64_t batch_max_rows = 0;
  int64_t batch_max_delay_us = 0;
  int metrics_port = -1;        // -1: no metrics endpoint; 0: pick a free port
  std::string metrics_host = "0.0.0.0";
  int64_t max_concurrent_streams = 64;
  int64_t max_request_bytes = int64_t{16} << 30;
  std::string tls_cert, tls_key, tls_client_ca;
  std::string auth_token_file, admin_token_file;
  int64_t workspace_bytes = int64_t{1} << 30;
  int cpu_threads = 0;
  bool batch_invariant = false;  // EngineConfig::batch_invariant (CUDA)
  bool tp_invariant = false;     // EngineConfig::tp_invariant (CUDA)
  int device = 0;
  double shutdown_grace_seconds = 30.0;
  // Tensor parallelism: this process is rank tp_rank of tp_size; ranks meet in tp_rendezvous.
  int tp_size = 1;
  int tp_rank = 0;
  std::string tp_rendezvous;
  std::string tp_host = "127.0.0.1";
  double tp_timeout_seconds = 30.0;
  // Data parallelism: this group is replica dp_rank of dp_size, which meet in dp_rendezvous (dp_rank.h).
  int dp_size = 1;
  int dp_rank = 0;
  std::string dp_rendezvous;
  std::string dp_host = "127.0.0.1";
  double dp_timeout_seconds = 30.0;
  double dp_join_timeout_seconds = 600.0;
  std::string dp_tls_ca;
  // Edge limits (docs/SECURITY.md): waits on silent stream clients (0: no limit), and the largest
  // head shard built (0: the GPU's memory on CUDA, the host's otherwise).
  double stream_header_timeout_seconds = 10.0;
  double stream_idle_timeout_seconds = 60.0;
  int64_t max_head_bytes = 0;
  bool help = false;
};

absl::StatusOr<ServerFlags> ParseServerFlags(int argc, char** argv);
const char* ServerUsage();

}  // namespace lce::server
