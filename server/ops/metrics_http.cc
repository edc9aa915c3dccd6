// The /metrics exposer on cpp-httplib, with deadlines of our own around its connections.
// Not civetweb, although prometheus-cpp uses it: Debian's libcivetweb starts its worker threads
// with a fixed 100 KB stack, and glibc carves every thread's static TLS out of that stack; with the
// CUDA libraries in the process (cuBLASLt alone has ~94 KB of static TLS) civetweb cannot create a
// single thread. cpp-httplib's threads are std::threads with a normal stack.
// cpp-httplib alone is not enough: its timeouts are per read, and a thread serves a connection from
// its first byte to its last. Measured (Debian's 0.11.4, its pool of 8 threads): 8 clients each
// sending a request a byte every 50 ms and /healthz got no answer in 20 s; 4 such clients, 0.4 ms.
// So here each connection has a thread of its own (up to max_connections) and a socket stream whose
// every wait ends at the connection's deadline (the request whole within request_timeout_seconds,
// the answer read within as long again), and a connection that finds every thread taken sheds the
// oldest still sending its request. cpp-httplib parses, routes and writes.
#include "metrics_http.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "httplib.h"

namespace lce::server::metrics {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kMetricsContentType[] = "text/plain; version=0.0.4; charset=utf-8";
constexpr char kTextContentType[] = "text/plain; charset=utf-8";

const char* Reason(int code) {
  switch (code) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 503: return "Service Unavailable";
  }
  return "Error";
}

Clock::time_point After(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

}  // namespace

MetricsHttpAnswer RouteMetricsRequest(const Registry& registry, const std::function<bool()>& healthy,
                                      std::string_view method, std::string_view target) {
  const std::string_view path = target.substr(0, target.find('?'));
  if (path != "/metrics" && path != "/healthz") return {404, kTextContentType, "not found\n", ""};
  if (method != "GET" && method != "HEAD") return {405, kTextContentType, "method not allowed\n", "GET, HEAD"};
  if (path == "/metrics") return {200, kMetricsContentType, registry.Render(), ""};
  const bool ok = !healthy || healthy();
  return {ok ? 200 : 503, kTextContentType, ok ? "ok\n" : "not serving\n", ""};
}

std::string AnswerHttpRequest(const Registry& registry, const std::function<bool()>& healthy,
                              const std::string& request) {
  const std::string line = request.substr(0, request.find("\r\n"));
  const size_t sp1 = line.find(' ');
  const size_t sp2 = sp1 == std::string::npos ? sp1 : line.find(' ', sp1 + 1);
  const std::string method = sp2 == std::string::npos ? "" : line.substr(0, sp1);
  const MetricsHttpAnswer a = sp2 == std::string::npos
                                  ? MetricsHttpAnswer{400, kTextContentType, "bad request\n", ""}
                                  : RouteMetricsRequest(registry, healthy, method, line.substr(sp1 + 1, sp2 - sp1 - 1));
  return absl::StrCat("HTTP/1.1 ", a.status, " ", Reason(a.status), "\r\nContent-Type: ", a.content_type,
                      "\r\nContent-Length: ", a.body.size(), "\r\n", a.allow.empty() ? "" : "Allow: ", a.allow,
                      a.allow.empty() ? "" : "\r\n", "Connection: close\r\n\r\n", method == "HEAD" ? "" : a.body);
}

// cpp-httplib hands each accepted connection over as a task; each runs on a thread of its own
// (started as needed, up to max_connections; idle ones kept), between Open and Close.
class MetricsHttpServer::Connections {
 public:
  explicit Connections(const MetricsHttpOptions& o) : max_threads_(o.max_connections) {
    std::lock_guard<std::mutex> lock(mu_);
    for (int i = 0; i < o.num_threads && i < o.max_connections; ++i) StartThread();
  }
  // Every open connection shut down, every thread joined (after the tasks left: each ends at once).
  ~Connections() {
    std::vector<std::thread> threads;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      for (auto& [id, c] : open_) Shut(c);
      threads.swap(threads_);
    }
    work_.notify_all();
    for (std::thread& t : threads) t.join();
  }

  void Enqueue(std::function<void()> task) {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
    if (idle_ > 0) work_.notify_one();
    // Each idle thread takes one task: a task beyond them gets a new thread, while there may be more.
    if (static_cast<int64_t>(tasks_.size()) > idle_ && static_cast<int>(threads_.size()) < max_threads_) {
      StartThread();
    }
    Shed();
  }
  // Socket `fd` is being served (until Close): it may be shut down to make room. Returns its id.
  uint64_t Open(int fd) {
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t id = next_id_++;
    Conn& c = open_[id];
    c.fd = fd;
    if (stop_) Shut(c);
    Shed();
    return id;
  }
  // Its request is whole: it no longer counts as one still sending.
  void Answering(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = open_.find(id); it != open_.end()) it->second.reading = false;
  }
  // Before its socket is closed (nothing shuts it down after this).
  void Close(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = open_.find(id);
    if (it == open_.end()) return;
    if (it->second.shut) --shut_open_;
    open_.erase(it);
  }

 private:
  struct Conn {
    int fd = -1;
    bool reading = true, shut = false;
  };

  // Hold mu_. The new thread counts as idle from here: a task waiting for it needs no room.
  void StartThread() {
    ++idle_;
    threads_.emplace_back([this] { Work(); });
  }
  // Counted in idle_ while it waits (from StartThread on).
  void Work() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      work_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
      --idle_;
      if (tasks_.empty()) return;  // stopping, nothing left
      std::function<void()> task = std::move(tasks_.front());
      tasks_.pop_front();
      lock.unlock();
      task();  // cpp-httplib's: Open, the request, Close
      lock.lock();
      ++idle_;
    }
  }
  // Hold mu_. Its reads and writes fail at once, and its thread moves on.
  void Shut(Conn& c) {
    if (c.shut) return;
    ::shutdown(c.fd, SHUT_RDWR);
    c.shut = true;
    ++shut_open_;
  }
  // Hold mu_. Connections waiting for a thread make room: for each, the oldest connection still
  // sending its request goes (ids grow with time).
  void Shed() {
    const int64_t waiting = static_cast<int64_t>(tasks_.size()) - idle_;
    for (auto it = open_.begin(); it != open_.end() && waiting > shut_open_; ++it) {
      if (it->second.reading) Shut(it->second);
    }
  }

  const int max_threads_;
  std::mutex mu_;
  std::condition_variable work_;
  std::deque<std::function<void()>> tasks_;
  std::vector<std::thread> threads_;
  std::map<uint64_t, Conn> open_;
  uint64_t next_id_ = 0;
  int idle_ = 0;
  int64_t shut_open_ = 0;  // open connections already shut down (making room)
  bool stop_ = false;
};

namespace {

// A connection's socket for cpp-httplib, under its deadline: every wait for the socket ends there
// (the request's, then, once it is being answered, the answer's).
class DeadlineStream final : public httplib::Stream {
 public:
  DeadlineStream(int fd, double timeout_seconds) : fd_(fd), timeout_(timeout_seconds), deadline_(After(timeout_)) {}
  void Answering() { deadline_ = After(timeout_); }

  bool is_readable() const override { return Wait(POLLIN); }
  bool is_writable() const override { return Wait(POLLOUT); }
  ssize_t read(char* ptr, size_t size) override {
    if (!is_readable()) return -1;
    ssize_t n;
    while ((n = ::recv(fd_, ptr, size, 0)) < 0 && errno == EINTR) {
    }
    return n;
  }
  ssize_t write(const char* ptr, size_t size) override {
    if (!is_writable()) return -1;
    ssize_t n;
    while ((n = ::send(fd_, ptr, size, MSG_NOSIGNAL)) < 0 && errno == EINTR) {
    }
    return n;
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override { Address(::getpeername, ip, port); }
  void get_local_ip_and_port(std::string& ip, int& port) const override { Address(::getsockname, ip, port); }
  socket_t socket() const override { return fd_; }

 private:
  bool Wait(short events) const {
    for (;;) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline_ - Clock::now()).count();
      if (left <= 0) return false;
      pollfd p{fd_, events, 0};
      const int r = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left, INT32_MAX)));
      if (r > 0) return (p.revents & (events | POLLHUP | POLLERR)) != 0;
      if (r < 0 && errno != EINTR) return false;
    }
  }
  template <typename F>
  void Address(F name_of, std::string& ip, int& port) const {
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    char host[NI_MAXHOST] = "", serv[NI_MAXSERV] = "0";
    if (name_of(fd_, reinterpret_cast<sockaddr*>(&ss), &len) == 0) {
      ::getnameinfo(reinterpret_cast<sockaddr*>(&ss), len, host, sizeof host, serv, sizeof serv,
                    NI_NUMERICHOST | NI_NUMERICSERV);
    }
    ip = host;
    port = std::atoi(serv);
  }

  const int fd_;
  const double timeout_;
  Clock::time_point deadline_;
};

// The stream of the connection this thread serves (the routing handler marks it answering).
thread_local DeadlineStream* current_stream = nullptr;
thread_local uint64_t current_connection = 0;

}  // namespace

// cpp-httplib's server: its connections on Connections' threads, each through a DeadlineStream.
class MetricsHttpServer::Transport : public httplib::Server {
 public:
  Transport(Connections& connections, double timeout_seconds)
      : connections_(connections), timeout_(timeout_seconds) {
    // cpp-httplib owns (and deletes) what new_task_queue makes: a forwarder.
    struct Forward : httplib::TaskQueue {
      explicit Forward(Connections& c) : c(c) {}
      void enqueue(std::function<void()> fn) override { c.Enqueue(std::move(fn)); }
      void shutdown() override {}  // Connections ends its threads
      Connections& c;
    };
    new_task_queue = [this] { return new Forward(connections_); };
  }
  // On the connection's thread, from the routing handler.
  void Answering() {
    if (current_stream != nullptr) current_stream->Answering();
    connections_.Answering(current_connection);
  }

 private:
  // cpp-httplib's own (private, virtual) serves a socket under per-read timeouts: this one under the
  // connection's deadlines, one request, then the socket closed.
  bool process_and_close_socket(socket_t sock) override {
    DeadlineStream stream(sock, timeout_);
    current_stream = &stream;
    current_connection = connections_.Open(sock);
    bool closed = false;
    const bool ok = process_request(stream, /*close_connection=*/true, closed, nullptr);
    connections_.Close(current_connection);
    current_stream = nullptr;
    ::shutdown(sock, SHUT_RDWR);
    ::close(sock);
    return ok;
  }

  Connections& connections_;
  const double timeout_;
};

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(const Registry* registry,
                                                                            MetricsHttpOptions options) {
  if (registry == nullptr) return absl::InvalidArgumentError("metrics http: no registry");
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("metrics http: bad port ", options.port));
  }
  if (options.num_threads < 1 || options.max_connections < 1 || !(options.request_timeout_seconds > 0)) {
    return absl::InvalidArgumentError("metrics http: num_threads, max_connections and request_timeout_seconds must be > 0");
  }
  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer());
  server->registry_ = registry;
  server->options_ = std::move(options);
  const MetricsHttpOptions& o = server->options_;
  server->connections_ = std::make_unique<Connections>(o);
  server->transport_ = std::make_unique<Transport>(*server->connections_, o.request_timeout_seconds);
  Transport& http = *server->transport_;
  http.set_payload_max_length(16384);
  // Not cpp-httplib's default (SO_REUSEPORT too): a second server on the port must fail, not share it.
  int listen_fd = -1;
  http.set_socket_options([&listen_fd](socket_t sock) {
    const int one = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    listen_fd = sock;  // the last one offered is the one that bound
  });
  http.set_pre_routing_handler([s = server.get()](const httplib::Request& req, httplib::Response& res) {
    s->transport_->Answering();
    MetricsHttpAnswer a = RouteMetricsRequest(*s->registry_, s->options_.healthy, req.method, req.path);
    res.status = a.status;
    if (!a.allow.empty()) res.set_header("Allow", a.allow);
    res.set_content(std::move(a.body), a.content_type.c_str());
    return httplib::Server::HandlerResponse::Handled;
  });
  const bool bound = o.port == 0 ? (server->port_ = http.bind_to_any_port(o.host)) > 0
                                 : http.bind_to_port(o.host, server->port_ = o.port);
  if (!bound) {
    return absl::UnavailableError(absl::StrCat("metrics http: cannot listen on ", o.host, ":", o.port,
                                               " (in use, or not an address of this host)"));
  }
  // cpp-httplib listens with a backlog of 5: a burst of connections (scrapers, probes, many idle
  // ones) would see SYNs dropped and retried a second later.
  ::listen(listen_fd, 128);
  auto ended = std::make_shared<std::atomic<bool>>(false);
  server->accept_thread_ = std::thread([&http, ended] {
    http.listen_after_bind();
    *ended = true;
  });
  // stop() does nothing before the accept loop runs: the destructor must find it running.
  while (!http.is_running() && !*ended) std::this_thread::sleep_for(std::chrono::microseconds(100));
  return server;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (transport_ != nullptr) transport_->stop();
  if (accept_thread_.joinable()) accept_thread_.join();
  connections_.reset();  // shuts the open connections down and joins their threads
  transport_.reset();
}

}  // namespace lce::server::metrics
