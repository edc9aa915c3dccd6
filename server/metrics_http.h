// Serves a metrics::Registry over HTTP/1.1 (a small server of our own on POSIX sockets; see
// metrics_http.cc for why not civetweb):
//   GET /metrics  -> 200, text/plain; version=0.0.4; charset=utf-8, Registry::Render()
//   GET /healthz  -> 200 "ok" (or 503 "not serving" while the optional health callback says false)
// Anything else is 404; methods other than GET/HEAD are 405.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "metrics.h"

namespace lce::server::metrics {

struct MetricsHttpOptions {
  std::string host = "0.0.0.0";  // listen address; "127.0.0.1" for loopback only
  int port = 9400;               // 0 picks a free port; port() reports it
  int num_threads = 1;           // connections are served one at a time by one thread (kept for API stability)
  std::function<bool()> healthy; // optional: /healthz answers 503 while it returns false
};

class MetricsHttpServer {
 public:
  // The registry must outlive the server. Errors (port in use, bad address) as absl::Status.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const Registry* registry,
                                                                  MetricsHttpOptions options);
  ~MetricsHttpServer();  // stops the server thread, after the request in flight
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  int port() const { return port_; }

 private:
  MetricsHttpServer() = default;
  void Serve();
  void HandleConnection(int fd);

  const Registry* registry_ = nullptr;
  MetricsHttpOptions options_;
  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};  // the destructor writes here to stop Serve()
  std::thread thread_;
  int port_ = 0;
};

}  // namespace lce::server::metrics
