// The /metrics exposer. Not civetweb, although prometheus-cpp uses it: Debian's libcivetweb starts
// its worker threads with a fixed 100 KB stack, and glibc carves every thread's static TLS out of
// that stack; with the CUDA libraries in the process (cuBLASLt alone has ~94 KB of static TLS)
// civetweb cannot create a single thread. Here every thread is a std::thread with a normal stack.
// Not cpp-httplib either: its deadlines are per read, not per request, and a thread serves a
// connection from its first byte to its last, so a few clients sending a byte every few seconds
// would hold all of them. This server reads every connection from one thread without blocking, so
// a slow client holds nothing but its own socket until its request deadline.
#include "metrics_http.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace lce::server::metrics {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kMetricsContentType[] = "text/plain; version=0.0.4; charset=utf-8";
constexpr size_t kMaxRequestBytes = 16384;

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

std::string Reply(int code, const char* content_type, const std::string& body, bool head_only,
                  const char* extra_headers = "") {
  std::string out = absl::StrCat("HTTP/1.1 ", code, " ", Reason(code), "\r\nContent-Type: ", content_type,
                                 "\r\nContent-Length: ", body.size(), "\r\n", extra_headers,
                                 "Connection: close\r\n\r\n");
  if (!head_only) out += body;
  return out;
}

Clock::time_point After(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

}  // namespace

struct MetricsHttpServer::Connection {
  enum class State { kReading, kAnswering, kWriting };
  int fd = -1;
  State state = State::kReading;
  std::string in, out;
  size_t sent = 0;
  Clock::time_point deadline;  // of the state it is in (none while a worker builds its answer)
};

std::string AnswerHttpRequest(const Registry& registry, const std::function<bool()>& healthy,
                              const std::string& req) {
  const size_t sp1 = req.find(' ');
  const size_t sp2 = sp1 == std::string::npos ? sp1 : req.find(' ', sp1 + 1);
  if (sp2 == std::string::npos) return Reply(400, "text/plain; charset=utf-8", "bad request\n", false);
  const std::string method = req.substr(0, sp1);
  std::string path = req.substr(sp1 + 1, sp2 - sp1 - 1);
  if (const size_t q = path.find('?'); q != std::string::npos) path.resize(q);
  const bool head_only = method == "HEAD";
  if (path != "/metrics" && path != "/healthz") return Reply(404, "text/plain; charset=utf-8", "not found\n", head_only);
  if (method != "GET" && !head_only) {
    return Reply(405, "text/plain; charset=utf-8", "method not allowed\n", false, "Allow: GET, HEAD\r\n");
  }
  if (path == "/metrics") return Reply(200, kMetricsContentType, registry.Render(), head_only);
  const bool ok = !healthy || healthy();
  return Reply(ok ? 200 : 503, "text/plain; charset=utf-8", ok ? "ok\n" : "not serving\n", head_only);
}

std::string MetricsHttpServer::Answer(const std::string& req) const {
  return AnswerHttpRequest(*registry_, options_.healthy, req);
}

bool MetricsHttpServer::ReadRequest(Connection& c) {
  char buf[2048];
  for (;;) {
    const ssize_t n = ::recv(c.fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n > 0) {
      c.in.append(buf, static_cast<size_t>(n));
      if (c.in.find("\r\n\r\n") != std::string::npos || c.in.size() >= kMaxRequestBytes) return true;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
    ::close(c.fd);  // the peer closed or failed before its request was whole
    c.fd = -1;
    return false;
  }
}

bool MetricsHttpServer::WriteAnswer(Connection& c) {
  while (c.sent < c.out.size()) {
    const ssize_t n = ::send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      c.sent += static_cast<size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) ? false : true;  // else: the peer is gone
    }
  }
  return true;
}

void MetricsHttpServer::Accept(std::map<uint64_t, Connection>& conns, uint64_t& next_id) {
  for (;;) {
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR) continue;
      return;  // EAGAIN: none left (or a transient error: the next poll retries)
    }
    if (static_cast<int>(conns.size()) >= options_.max_connections) {
      // Ids grow with time: the first connection still reading is the oldest.
      auto oldest = std::find_if(conns.begin(), conns.end(),
                                 [](const auto& kv) { return kv.second.state == Connection::State::kReading; });
      if (oldest == conns.end()) {
        ::close(fd);
        continue;
      }
      ::close(oldest->second.fd);
      conns.erase(oldest);
    }
    Connection c;
    c.fd = fd;
    c.deadline = After(options_.request_timeout_seconds);
    conns.emplace(next_id++, std::move(c));
  }
}

void MetricsHttpServer::Work() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_ready_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (stop_) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    Done done{job.id, Answer(job.request)};
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_.push_back(std::move(done));
    }
    const char c = 0;
    (void)!::write(wake_[1], &c, 1);  // full pipe: a wake-up is already pending
  }
}

void MetricsHttpServer::Serve() {
  std::map<uint64_t, Connection> conns;
  uint64_t next_id = 0;
  std::vector<pollfd> fds;
  std::vector<uint64_t> ids;  // of fds[2...]
  for (;;) {
    // Overdue connections go; the nearest deadline bounds the wait.
    const Clock::time_point now = Clock::now();
    Clock::time_point soonest = Clock::time_point::max();
    fds.assign({{listen_fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}});
    ids.clear();
    for (auto it = conns.begin(); it != conns.end();) {
      Connection& c = it->second;
      if (c.state != Connection::State::kAnswering && c.deadline <= now) {
        ::close(c.fd);
        it = conns.erase(it);
        continue;
      }
      if (c.state != Connection::State::kAnswering) {
        soonest = std::min(soonest, c.deadline);
        fds.push_back({c.fd, static_cast<short>(c.state == Connection::State::kReading ? POLLIN : POLLOUT), 0});
        ids.push_back(it->first);
      }
      ++it;
    }
    int timeout_ms = -1;
    if (soonest != Clock::time_point::max()) {
      timeout_ms = static_cast<int>(std::chrono::ceil<std::chrono::milliseconds>(soonest - now).count()) + 1;
    }
    if (::poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) break;
    if (fds[1].revents != 0) {
      char drain[64];
      while (::read(wake_[0], drain, sizeof drain) > 0) {
      }
      std::deque<Done> ready;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (stop_) break;
        ready.swap(done_);
      }
      for (Done& d : ready) {
        auto it = conns.find(d.id);
        if (it == conns.end()) continue;
        it->second.out = std::move(d.response);
        it->second.state = Connection::State::kWriting;
        it->second.deadline = After(options_.request_timeout_seconds);
      }
    }
    for (size_t i = 2; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      auto it = conns.find(ids[i - 2]);
      Connection& c = it->second;
      if (c.state == Connection::State::kReading) {
        if (ReadRequest(c)) {
          c.state = Connection::State::kAnswering;
          {
            std::lock_guard<std::mutex> lock(mu_);
            jobs_.push_back({it->first, std::move(c.in)});
          }
          work_ready_.notify_one();
        } else if (c.fd < 0) {
          conns.erase(it);
        }
      } else if (c.state == Connection::State::kWriting && WriteAnswer(c)) {
        ::close(c.fd);
        conns.erase(it);
      }
    }
    if (fds[0].revents & POLLIN) Accept(conns, next_id);
  }
  for (auto& [id, c] : conns) ::close(c.fd);
}

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

  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICHOST | AI_NUMERICSERV;
  addrinfo* addr = nullptr;
  const std::string port = std::to_string(o.port);
  if (int rc = ::getaddrinfo(o.host.empty() ? nullptr : o.host.c_str(), port.c_str(), &hints, &addr); rc != 0) {
    return absl::InvalidArgumentError(absl::StrCat("metrics http: bad address ", o.host, ": ", gai_strerror(rc)));
  }
  const int fd = ::socket(addr->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  const bool bound = fd >= 0 && ::bind(fd, addr->ai_addr, addr->ai_addrlen) == 0 && ::listen(fd, 64) == 0;
  const int err = errno;
  ::freeaddrinfo(addr);
  if (!bound) {
    if (fd >= 0) ::close(fd);
    return absl::UnavailableError(absl::StrCat("metrics http: cannot listen on ", o.host, ":", o.port, ": ",
                                               std::strerror(err)));
  }
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
  server->port_ = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                                 : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  server->listen_fd_ = fd;
  if (::pipe2(server->wake_, O_CLOEXEC | O_NONBLOCK) != 0) {
    return absl::InternalError("metrics http: pipe2 failed");
  }
  for (int i = 0; i < o.num_threads; ++i) server->workers_.emplace_back([s = server.get()] { s->Work(); });
  server->io_thread_ = std::thread([s = server.get()] { s->Serve(); });
  return server;
}

MetricsHttpServer::~MetricsHttpServer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_ready_.notify_all();
  if (wake_[1] >= 0) {
    const char c = 0;
    (void)!::write(wake_[1], &c, 1);
  }
  if (io_thread_.joinable()) io_thread_.join();
  for (std::thread& w : workers_) w.join();
  for (int fd : {listen_fd_, wake_[0], wake_[1]}) {
    if (fd >= 0) ::close(fd);
  }
}

}  // namespace lce::server::metrics
