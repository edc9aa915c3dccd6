// Serves a metrics::Registry over HTTP/1.1 (a small server of our own on POSIX sockets; see
// metrics_http.cc for why not civetweb):
//   GET /metrics  -> 200, text/plain; version=0.0.4; charset=utf-8, Registry::Render()
//   GET /healthz  -> 200 "ok" (or 503 "not serving" while the optional health callback says false)
// Anything else is 404; methods other than GET/HEAD are 405. One request per connection.
// Slow clients cannot blind it: one thread reads every connection without blocking, each request
// must arrive whole within a deadline (and its answer be read within another), the oldest
// connection still sending is dropped when too many are open, and answers are built by a few
// worker threads of their own.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "metrics.h"

namespace lce::server::metrics {

struct MetricsHttpOptions {
  std::string host = "0.0.0.0";  // listen address; "127.0.0.1" for loopback only
  int port = 9400;               // 0 picks a free port; port() reports it
  int num_threads = 2;           // workers building answers (a slow scrape does not hold /healthz)
  std::function<bool()> healthy; // optional: /healthz answers 503 while it returns false
  // A connection must send its whole request within this, and read the whole answer within as
  // long again; otherwise it is closed.
  double request_timeout_seconds = 5.0;
  // Connections open at once; a new one beyond it drops the oldest still sending its request.
  int max_connections = 128;
};

// The whole answer (status line, headers, body) to one request's bytes as the server read them (up
// to the blank line, or kMaxRequestBytes): the parse of the request line and the routing above.
// No I/O; the server's workers call it, and tests/fuzz/fuzz_metrics_http.cc fuzzes it.
std::string AnswerHttpRequest(const Registry& registry, const std::function<bool()>& healthy,
                              const std::string& request);

class MetricsHttpServer {
 public:
  // The registry must outlive the server. Errors (port in use, bad address) as absl::Status.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const Registry* registry,
                                                                  MetricsHttpOptions options);
  ~MetricsHttpServer();  // stops the threads, after the answers being built; closes every connection
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  int port() const { return port_; }

 private:
  struct Connection;
  struct Job {
    uint64_t id;
    std::string request;
  };
  struct Done {
    uint64_t id;
    std::string response;
  };

  MetricsHttpServer() = default;
  // The I/O thread: accepts, reads requests, writes answers, enforces deadlines.
  void Serve();
  void Accept(std::map<uint64_t, Connection>& conns, uint64_t& next_id);
  // Reads what `c` has sent; true when its request is complete (or over the size limit).
  bool ReadRequest(Connection& c);
  // Writes what the socket takes of `c`'s answer; true when all of it is out (or the peer is gone).
  bool WriteAnswer(Connection& c);
  // A worker: builds answers for the requests the I/O thread hands over.
  void Work();
  std::string Answer(const std::string& request) const;

  const Registry* registry_ = nullptr;
  MetricsHttpOptions options_;
  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};  // a byte here: an answer is ready, or the destructor wants Serve() to stop
  int port_ = 0;
  std::mutex mu_;
  std::condition_variable work_ready_;
  std::deque<Job> jobs_;
  std::deque<Done> done_;
  bool stop_ = false;
  std::thread io_thread_;
  std::vector<std::thread> workers_;
};

}  // namespace lce::server::metrics
