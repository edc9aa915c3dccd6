// A running gRPC server around LceService: health service, reflection, message-size limits,
// graceful shutdown. Used by lce_server's main and by the end-to-end tests (port 0).
#pragma once

#include <memory>
#include <string>
#include <vector>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/server.h"
#include "lce_service.h"
#include "region_data_plane.h"
#include "shm_socket.h"

namespace lce::server {

// TLS: PEM file paths. With client_ca set, clients must present a certificate it signed (mTLS).
struct TlsFiles {
  std::string cert, key, client_ca;
  bool enabled() const { return !cert.empty(); }
};

// A PEM file's text (TLS certificates and keys).
absl::StatusOr<std::string> ReadPem(const std::string& path);

struct GrpcServerOptions {
  std::string address = "0.0.0.0:50051";  // port 0 picks a free port
  ServiceConfig service;
  TlsFiles tls;
  // HTTP/2 flow-control window per stream (grpc.http2.lookahead_bytes); 0: gRPC's default.
  int64_t http2_window_bytes = 0;
  // Completion queues of the sync server; connections are spread over their pollsets, so that
  // several connections' bytes are handled by several threads. 0: one per core, at most 16.
  int completion_queues = 0;
  // Handler threads kept polling per completion queue (the sync server's MAX_POLLERS): one that
  // finishes while as many poll exits, and a request that finds none polling starts a thread.
  // 0: kIdleThreads over all queues, at least 4 a queue.
  int idle_threads_per_queue = 0;
  static constexpr int kIdleThreads = 64;
  // Extra integer channel arguments (transport tuning).
  std::vector<std::pair<std::string, int>> channel_args;
  // Data plane (region_data_plane.h): TCP port for server-memory regions (-1: none; 0: any free
  // port), on the gRPC address's host, and the server memory one session may hold.
  int data_port = -1;
  int64_t server_memory_per_session = int64_t{4} << 30;
  int64_t server_memory_total = 0;  // over all sessions (0: no limit)
  int data_plane_max_connections = 512;
  int data_plane_max_connections_per_session = 64;  // RegionDataPlaneOptions::max_connections_per_session
  double data_plane_idle_timeout_seconds = 600;     // RegionDataPlaneOptions::idle_timeout
  double data_plane_auth_timeout_seconds = 60;  // RegionDataPlaneOptions::auth_timeout
  int data_plane_max_unauthenticated = 256;
  // TLS on the data plane, with `tls`'s certificate and key (region_data_plane.h).
  bool data_plane_tls = false;
  // The shm socket (shm_socket.h): its path; "auto": $TMPDIR (else /tmp)/lce-server-<port>.sock, or
  // with port 0 lce-server-pid<pid>-<n>.sock; "": none.
  std::string shm_socket = "auto";
  // Bytes of clients' shared memory mapped, per session and over all (RegionRegistry::LimitMappedBytes).
  int64_t shm_bytes_per_session = RegionRegistry::kDefaultMappedBytesPerSession;
  int64_t shm_total_bytes = RegionRegistry::kDefaultMappedBytesTotal;
  // Registration of shared memory by name (RegisterRegion.shm_name; region_registry.h).
  bool allow_shm_by_name = false;
};

class GrpcServer {
 public:
  static absl::StatusOr<std::unique_ptr<GrpcServer>> Start(std::shared_ptr<HeadStore> heads,
                                                          const GrpcServerOptions& options);
  ~GrpcServer();

  int port() const { return port_; }
  // The data plane's port (0: none).
  int data_port() const { return data_plane_ ? data_plane_->port() : 0; }
  // The shm socket's path ("": none).
  std::string shm_socket() const { return shm_socket_ ? shm_socket_->path() : ""; }
  // The sessions' regions (shared memory, CUDA IPC, server memory).
  const RegionRegistry& regions() const { return service_->regions(); }
  // Health answers SERVING / NOT_SERVING for "" and lce.v1.LceService.
  void SetServing(bool serving);
  // Stops accepting, marks health NOT_SERVING, lets in-flight streams finish for up to `grace`,
  // then cancels what remains. Idempotent.
  void Shutdown(absl::Duration grace);

 private:
  GrpcServer() = default;
  std::unique_ptr<LceService> service_;
  std::unique_ptr<RegionDataPlane> data_plane_;
  std::unique_ptr<ShmSocket> shm_socket_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  bool shut_down_ = false;
};

}  // namespace lce::server
