// Serves a metrics::Registry over HTTP/1.1, on cpp-httplib (Debian's libcpp-httplib-dev):
//   GET /metrics  -> 200, text/plain; version=0.0.4; charset=utf-8, Registry::Render()
//   GET /healthz  -> 200 "ok" (or 503 "not serving" while the optional health callback says false)
// Anything else is 404; methods other than GET/HEAD are 405. One request per connection.
// The routing (RouteMetricsRequest) is apart from the transport, so that it can be fuzzed.
// Slow clients cannot blind it (cpp-httplib alone can be: metrics_http.cc): each connection has a
// thread of its own (a std::thread, whose stack holds the CUDA libraries' static TLS), its request
// must arrive whole within a deadline and its answer be read within another, and past
// max_connections the oldest connection still sending its request is dropped for a new one.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <thread>

#include "absl/status/statusor.h"
#include "metrics.h"

namespace lce::server::metrics {

struct MetricsHttpOptions {
  std::string host = "0.0.0.0";  // listen address; "127.0.0.1" for loopback only
  int port = 9400;               // 0 picks a free port; port() reports it
  int num_threads = 2;           // connection threads started up front (more as connections need them)
  std::function<bool()> healthy; // optional: /healthz answers 503 while it returns false
  // A connection must send its whole request within this, and read the whole answer within as
  // long again; otherwise it is closed.
  double request_timeout_seconds = 5.0;
  // Connections served at once (each on a thread); a new one beyond it drops the oldest still
  // sending its request.
  int max_connections = 128;
};

// The answer to one request, without the transport.
struct MetricsHttpAnswer {
  int status = 200;
  std::string content_type;
  std::string body;
  std::string allow;  // the Allow header's value (405), or empty
};

// The routing: a request's method and target (its path, with or without a query) to its answer.
// HEAD answers as GET (the transport sends no body). No I/O.
MetricsHttpAnswer RouteMetricsRequest(const Registry& registry, const std::function<bool()>& healthy,
                                      std::string_view method, std::string_view target);

// The whole HTTP/1.1 answer (status line, headers, body) to a request's bytes as a connection sent
// them: its request line parsed, then RouteMetricsRequest. The server's transport is cpp-httplib;
// this is the routing's entry for tests and the fuzz target (tests/fuzz).
std::string AnswerHttpRequest(const Registry& registry, const std::function<bool()>& healthy,
                              const std::string& request);

class MetricsHttpServer {
 public:
  // The registry must outlive the server. Errors (port in use, bad address) as absl::Status.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const Registry* registry,
                                                                  MetricsHttpOptions options);
  ~MetricsHttpServer();  // stops accepting, closes every connection, joins the threads
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  int port() const { return port_; }

 private:
  class Connections;  // the connections' threads and deadlines
  class Transport;    // cpp-httplib's server, its connections under Connections' deadlines

  MetricsHttpServer() = default;

  const Registry* registry_ = nullptr;
  MetricsHttpOptions options_;
  int port_ = 0;
  std::unique_ptr<Connections> connections_;
  std::unique_ptr<Transport> transport_;
  std::thread accept_thread_;
};

}  // namespace lce::server::metrics
