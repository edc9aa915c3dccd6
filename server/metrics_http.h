// Serves a metrics::Registry over HTTP (civetweb, the server prometheus-cpp itself uses):
//   GET /metrics  -> 200, text/plain; version=0.0.4; charset=utf-8, Registry::Render()
//   GET /healthz  -> 200 "ok" (or 503 "not serving" while the optional health callback says false)
// Anything else is 404; methods other than GET/HEAD are 405.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "metrics.h"

struct mg_context;
struct mg_connection;

namespace lce::server::metrics {

struct MetricsHttpOptions {
  std::string host = "0.0.0.0";  // listen address; "127.0.0.1" for loopback only
  int port = 9400;               // 0 picks a free port; port() reports it
  int num_threads = 2;           // civetweb worker threads
  std::function<bool()> healthy; // optional: /healthz answers 503 while it returns false
};

class MetricsHttpServer {
 public:
  // The registry must outlive the server. Errors (port in use, bad address) as absl::Status.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const Registry* registry,
                                                                  MetricsHttpOptions options);
  ~MetricsHttpServer();  // stops civetweb, waiting for handlers in flight
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  int port() const { return port_; }

 private:
  MetricsHttpServer() = default;
  static int HandleMetrics(::mg_connection* conn, void* self);
  static int HandleHealth(::mg_connection* conn, void* self);

  const Registry* registry_ = nullptr;
  MetricsHttpOptions options_;
  mg_context* ctx_ = nullptr;
  int port_ = 0;
};

}  // namespace lce::server::metrics
