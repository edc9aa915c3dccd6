// The /metrics exposer. Not civetweb, although prometheus-cpp uses it: Debian's libcivetweb starts
// its worker threads with a fixed 100 KB stack, and glibc carves every thread's static TLS out of
// that stack; with the CUDA libraries in the process (cuBLASLt alone has ~94 KB of static TLS)
// civetweb cannot create a single thread. This server needs one thread with a normal stack and
// serves a scrape at a time, which is what a Prometheus endpoint sees.
#include "metrics_http.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace lce::server::metrics {
namespace {

constexpr char kMetricsContentType[] = "text/plain; version=0.0.4; charset=utf-8";

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

void SendAll(int fd, const std::string& data) {
  size_t off = 0;
  while (off < data.size()) {
    const ssize_t n = ::send(fd, data.data() + off, data.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return;
    off += static_cast<size_t>(n);
  }
}

void Reply(int fd, int code, const char* content_type, const std::string& body, bool head_only,
           const char* extra_headers = "") {
  std::string out = absl::StrCat("HTTP/1.1 ", code, " ", Reason(code), "\r\nContent-Type: ", content_type,
                                 "\r\nContent-Length: ", body.size(), "\r\n", extra_headers,
                                 "Connection: close\r\n\r\n");
  if (!head_only) out += body;
  SendAll(fd, out);
}

}  // namespace

void MetricsHttpServer::HandleConnection(int fd) {
  timeval tv{5, 0};  // a client that stalls mid-request is dropped after 5 s
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  std::string req;
  char buf[2048];
  while (req.find("\r\n\r\n") == std::string::npos && req.size() < 16384) {
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) return;
    req.append(buf, static_cast<size_t>(n));
  }
  const size_t sp1 = req.find(' ');
  const size_t sp2 = sp1 == std::string::npos ? sp1 : req.find(' ', sp1 + 1);
  if (sp2 == std::string::npos) {
    Reply(fd, 400, "text/plain; charset=utf-8", "bad request\n", false);
    return;
  }
  const std::string method = req.substr(0, sp1);
  std::string path = req.substr(sp1 + 1, sp2 - sp1 - 1);
  if (const size_t q = path.find('?'); q != std::string::npos) path.resize(q);
  const bool head_only = method == "HEAD";
  if (path != "/metrics" && path != "/healthz") {
    Reply(fd, 404, "text/plain; charset=utf-8", "not found\n", head_only);
    return;
  }
  if (method != "GET" && !head_only) {
    Reply(fd, 405, "text/plain; charset=utf-8", "method not allowed\n", false, "Allow: GET, HEAD\r\n");
    return;
  }
  if (path == "/metrics") {
    Reply(fd, 200, kMetricsContentType, registry_->Render(), head_only);
    return;
  }
  const bool ok = !options_.healthy || options_.healthy();
  Reply(fd, ok ? 200 : 503, "text/plain; charset=utf-8", ok ? "ok\n" : "not serving\n", head_only);
}

void MetricsHttpServer::Serve() {
  for (;;) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    if (fds[0].revents & POLLIN) {
      const int fd = ::accept(listen_fd_, nullptr, nullptr);
      if (fd < 0) continue;
      HandleConnection(fd);
      ::close(fd);
    }
  }
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(const Registry* registry,
                                                                            MetricsHttpOptions options) {
  if (registry == nullptr) return absl::InvalidArgumentError("metrics http: no registry");
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("metrics http: bad port ", options.port));
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
  const int fd = ::socket(addr->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
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
  if (::pipe2(server->wake_, O_CLOEXEC) != 0) {
    return absl::InternalError("metrics http: pipe2 failed");
  }
  server->thread_ = std::thread([s = server.get()] { s->Serve(); });
  return server;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (wake_[1] >= 0) {
    const char c = 0;
    (void)!::write(wake_[1], &c, 1);
  }
  if (thread_.joinable()) thread_.join();
  for (int fd : {listen_fd_, wake_[0], wake_[1]}) {
    if (fd >= 0) ::close(fd);
  }
}

}  // namespace lce::server::metrics
