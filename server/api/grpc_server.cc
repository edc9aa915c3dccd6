#include "grpc_server.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <filesystem>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <thread>

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"

namespace lce::server {

absl::StatusOr<std::string> ReadPem(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

namespace {

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> Credentials(const TlsFiles& tls) {
  if (!tls.enabled()) return grpc::InsecureServerCredentials();
  if (tls.key.empty()) return absl::InvalidArgumentError("--tls-cert needs --tls-key");
  absl::StatusOr<std::string> cert = ReadPem(tls.cert), key = ReadPem(tls.key);
  if (!cert.ok()) return cert.status();
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions opts(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  opts.pem_key_cert_pairs.push_back({*key, *cert});
  if (!tls.client_ca.empty()) {
    absl::StatusOr<std::string> ca = ReadPem(tls.client_ca);
    if (!ca.ok()) return ca.status();
    opts.pem_root_certs = *ca;
    opts.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(opts);
}

// A server killed outright leaves its socket file; named by its pid, nothing else would replace it.
void RemoveDeadServersSockets(const std::string& dir) {
  std::error_code e;
  for (const auto& entry : std::filesystem::directory_iterator(dir, e)) {
    const std::string name = entry.path().filename().string();
    int pid = 0;
    if (std::sscanf(name.c_str(), "lce-server-pid%d-", &pid) != 1 || pid <= 0) continue;
    if (::kill(pid, 0) != 0 && errno == ESRCH && entry.is_socket(e)) std::filesystem::remove(entry.path(), e);
  }
}

// The shm socket's path for --shm-socket: "auto" names it by the gRPC port (one server a port), or by
// the process and a count where the port is picked later (port 0: tests, several servers a process).
std::string ShmSocketPath(const std::string& option, const std::string& address) {
  if (option != "auto") return option;
  const char* tmp = std::getenv("TMPDIR");
  const std::string dir = tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
  const std::string port = address.substr(address.rfind(':') + 1);
  if (port != "0") return absl::StrCat(dir, "/lce-server-", port, ".sock");
  static std::atomic<int> n{0};
  if (n == 0) RemoveDeadServersSockets(dir);
  return absl::StrCat(dir, "/lce-server-pid", getpid(), "-", n++, ".sock");
}

}  // namespace

absl::StatusOr<std::unique_ptr<GrpcServer>> GrpcServer::Start(std::shared_ptr<HeadStore> heads,
                                                              const GrpcServerOptions& options) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> creds = Credentials(options.tls);
  if (!creds.ok()) return creds.status();
  std::unique_ptr<GrpcServer> self(new GrpcServer());
  self->service_ = std::make_unique<LceService>(std::move(heads), options.service);
  if (options.data_port >= 0) {
    const std::string host = options.address.substr(0, options.address.rfind(':'));
    RegionDataPlaneOptions dpo;
    dpo.max_write_bytes = options.server_memory_per_session;
    dpo.max_connections = options.data_plane_max_connections;
    dpo.max_connections_per_session = options.data_plane_max_connections_per_session;
    dpo.idle_timeout = absl::Seconds(options.data_plane_idle_timeout_seconds);
    dpo.auth_timeout = absl::Seconds(options.data_plane_auth_timeout_seconds);
    dpo.max_unauthenticated = options.data_plane_max_unauthenticated;
    dpo.metrics = options.service.metrics;
    dpo.tls = options.data_plane_tls;
    dpo.tls_cert_file = options.tls.cert;
    dpo.tls_key_file = options.tls.key;
    absl::StatusOr<std::unique_ptr<RegionDataPlane>> dp =
        RegionDataPlane::Start(self->service_->mutable_regions(), host, options.data_port, dpo);
    if (!dp.ok()) return dp.status();
    self->data_plane_ = *std::move(dp);
    self->service_->mutable_regions().EnableServerMemory(options.server_memory_per_session,
                                                         options.server_memory_total);
    self->service_->set_data_port(self->data_plane_->port());
    self->service_->set_data_plane_tls(options.data_plane_tls);
  }
  self->service_->mutable_regions().AllowShmByName(options.allow_shm_by_name);
  self->service_->mutable_regions().LimitMappedBytes(options.shm_bytes_per_session, options.shm_total_bytes);
  if (!options.shm_socket.empty()) {
    const std::string path = ShmSocketPath(options.shm_socket, options.address);
    absl::StatusOr<std::unique_ptr<ShmSocket>> shm =
        ShmSocket::Start(self->service_->mutable_regions(), path, [svc = self->service_.get()] { svc->RecountRegions(); },
                         options.service.metrics);
    if (!shm.ok()) return shm.status();
    self->shm_socket_ = *std::move(shm);
    self->service_->set_shm_socket(path);
  }
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.address, *creds, &self->port_);
  builder.RegisterService(self->service_.get());
  const int max_bytes = static_cast<int>(std::min<int64_t>(options.service.max_message_bytes, INT32_MAX));
  builder.SetMaxReceiveMessageSize(max_bytes);
  builder.SetMaxSendMessageSize(max_bytes);
  const int cqs = options.completion_queues > 0
                      ? options.completion_queues
                      : static_cast<int>(std::clamp<unsigned>(std::thread::hardware_concurrency(), 1, 16));
  builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::NUM_CQS, cqs);
  builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MIN_POLLERS, 1);
  // Enough idle threads in all for as many concurrent small calls (64 callers made ~one thread a
  // request with 4 a queue on a 2-core host: bench/NOTES.md, "Small calls").
  const int idle = options.idle_threads_per_queue > 0
                       ? options.idle_threads_per_queue
                       : std::max(4, (GrpcServerOptions::kIdleThreads + cqs - 1) / cqs);
  builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MAX_POLLERS, idle);
  for (const auto& [name, value] : options.channel_args) builder.AddChannelArgument(name, value);
  if (options.http2_window_bytes > 0) {
    builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES,
                               static_cast<int>(std::min<int64_t>(options.http2_window_bytes, INT32_MAX)));
  }
  self->server_ = builder.BuildAndStart();
  if (self->server_ == nullptr || self->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.address));
  }
  self->SetServing(true);
  return self;
}

void GrpcServer::SetServing(bool serving) {
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  health->SetServingStatus("", serving);
  health->SetServingStatus(v1::LceService::service_full_name(), serving);
}

void GrpcServer::Shutdown(absl::Duration grace) {
  if (shut_down_) return;
  shut_down_ = true;
  // A start that failed before gRPC listened (data plane, shm socket) leaves no server (issue 35, item 13).
  if (server_ != nullptr) {
    server_->GetHealthCheckService()->Shutdown();  // health answers NOT_SERVING from now on
    server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
    server_->Wait();
  }
  data_plane_.reset();  // after the streams: none still reads the regions it fills
  shm_socket_.reset();
}

GrpcServer::~GrpcServer() { Shutdown(absl::ZeroDuration()); }

}  // namespace lce::server
