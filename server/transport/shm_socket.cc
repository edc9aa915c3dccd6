#include "shm_socket.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "lce/v1/shm_socket_wire.h"
#include "thread_start.h"

namespace lce::server {
namespace {

namespace wire = v1::shm_socket;

// Bounds the next recv on `fd` by what is left before `deadline`: false when nothing is. The time
// is the request's, not each recv's: a byte every 4 s once held a connection for ever (issue 35,
// item 9).
bool BoundRecv(int fd, absl::Time deadline) {
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return false;
  timeval tv = absl::ToTimeval(left);
  if (tv.tv_sec == 0 && tv.tv_usec == 0) tv.tv_usec = 1;  // zero would be no limit
  return setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) == 0;
}

// `n` bytes before `deadline`: false when the connection ended or the time ran out first.
bool RecvBefore(int fd, void* p, size_t n, absl::Time deadline) {
  auto* b = static_cast<uint8_t*>(p);
  while (n > 0) {
    if (!BoundRecv(fd, deadline)) return false;
    const ssize_t r = ::recv(fd, b, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    b += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// The request's first bytes and the descriptors that came with them (closed by the caller).
// False when the connection ended or `deadline` passed first.
bool RecvWithFds(int fd, uint8_t* buf, size_t n, std::vector<int>* fds, absl::Time deadline) {
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 8)];
  iovec iov{buf, n};
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  m.msg_control = control;
  m.msg_controllen = sizeof(control);
  ssize_t r = -1;
  do {
    if (!BoundRecv(fd, deadline)) return false;
    r = ::recvmsg(fd, &m, MSG_CMSG_CLOEXEC);
  } while (r < 0 && errno == EINTR);
  if (r <= 0) return false;
  for (cmsghdr* c = CMSG_FIRSTHDR(&m); c != nullptr; c = CMSG_NXTHDR(&m, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < k; ++i) {
      int got;
      std::memcpy(&got, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      fds->push_back(got);
    }
  }
  if ((m.msg_flags & MSG_CTRUNC) != 0) fds->push_back(-1);  // more than fit: refused below
  return RecvBefore(fd, buf + r, n - static_cast<size_t>(r), deadline);
}

void Reply(int fd, const absl::StatusOr<uint64_t>& id) {
  const std::string msg(id.status().message());
  uint8_t head[wire::kReplyHeaderBytes];
  wire::EncodeReplyHeader(static_cast<int32_t>(id.status().code()), static_cast<uint32_t>(msg.size()),
                          id.ok() ? *id : 0, head);
  std::string out(reinterpret_cast<const char*>(head), sizeof(head));
  out += msg;
  (void)!::send(fd, out.data(), out.size(), MSG_NOSIGNAL);
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShmSocket>> ShmSocket::Start(RegionRegistry& regions, const std::string& path,
                                                            std::function<void()> on_register,
                                                            ServiceMetrics* metrics, absl::Duration request_timeout) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("shm socket: the path must have 1 to ", sizeof(addr.sun_path) - 1,
                                                   " characters: '", path, "'"));
  }
  struct stat st {};
  // Another local user may have made the file first (in /tmp): say so, and how to start anyway.
  const std::string instead = " (another user's file? pass --shm-socket=<path> in a directory only this server's "
                              "user can write, or --shm-socket= for none)";
  if (lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return absl::FailedPreconditionError(absl::StrCat("shm socket: ", path, " exists and is not a socket", instead));
    }
    if (::unlink(path.c_str()) != 0) {  // a stale one (a server that did not end cleanly)
      return absl::FailedPreconditionError(
          absl::StrCat("shm socket: cannot replace ", path, ": ", std::strerror(errno), instead));
    }
  }
  std::unique_ptr<ShmSocket> s(new ShmSocket(regions, path, std::move(on_register), metrics, request_timeout));
  s->listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s->listen_fd_ < 0) return absl::InternalError(absl::StrCat("shm socket: socket: ", std::strerror(errno)));
  std::memcpy(addr.sun_path, path.data(), path.size());
  if (::bind(s->listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(s->listen_fd_, 64) != 0) {
    return absl::UnavailableError(absl::StrCat("shm socket: cannot listen at ", path, ": ", std::strerror(errno)));
  }
  ::chmod(path.c_str(), 0666);
  absl::StatusOr<std::thread> acceptor = StartThread("the shm socket's acceptor", [p = s.get()] { p->AcceptLoop(); });
  if (!acceptor.ok()) return acceptor.status();  // the destructor removes the file
  s->acceptor_ = *std::move(acceptor);
  return s;
}

ShmSocket::~ShmSocket() {
  stopping_ = true;
  if (listen_fd_ >= 0) ::shutdown(listen_fd_, SHUT_RDWR);
  if (acceptor_.joinable()) acceptor_.join();
  if (listen_fd_ >= 0) {
    ::close(listen_fd_);
    ::unlink(path_.c_str());
  }
  std::map<uint64_t, std::pair<int, std::thread>> conns;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [_, c] : conns_) {
      if (c.first >= 0) ::shutdown(c.first, SHUT_RDWR);  // wakes their threads
    }
    conns.swap(conns_);
  }
  for (auto& [_, c] : conns) c.second.join();
}

void ShmSocket::AcceptLoop() {
  while (!stopping_) {
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (backoff_.Retry(errno, stopping_)) continue;
      return;  // shut down
    }
    backoff_.Accepted();
    std::vector<std::thread> done;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (uint64_t id : finished_) {
        auto it = conns_.find(id);
        if (it == conns_.end()) continue;
        done.push_back(std::move(it->second.second));
        conns_.erase(it);
      }
      finished_.clear();
      if (stopping_ || conns_.size() >= kMaxConnections) {
        ::close(fd);
      } else {
        const uint64_t id = next_id_++;
        absl::StatusOr<std::thread> t = StartThread("a shm-socket connection", [this, id, fd] { Serve(id, fd); });
        if (t.ok()) {
          conns_[id] = {fd, *std::move(t)};
        } else {  // a task limit: drop this connection, never abort
          ::close(fd);
        }
      }
    }
    for (std::thread& t : done) t.join();
  }
}

void ShmSocket::Serve(uint64_t id, int fd) {
  const timeval tv = absl::ToTimeval(request_timeout_);  // for the reply; the request has a deadline
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  const absl::StatusOr<uint64_t> region = Register(fd, absl::Now() + request_timeout_);
  if (region.ok() && on_register_) on_register_();
  Reply(fd, region);
  std::lock_guard<std::mutex> lock(mu_);
  conns_[id].first = -1;  // its number may be reused once closed: the destructor must not shut it down
  ::close(fd);
  finished_.push_back(id);
}

absl::StatusOr<uint64_t> ShmSocket::Register(int fd, absl::Time deadline) {
  uint8_t head[wire::kRequestBytes];
  std::vector<int> fds;
  absl::Cleanup close_fds = [&fds] {
    for (int f : fds) {
      if (f >= 0) ::close(f);
    }
  };
  if (!RecvWithFds(fd, head, sizeof(head), &fds, deadline)) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm socket: the request ended early (or took over ", absl::FormatDuration(request_timeout_), ")"));
  }
  wire::Request r;
  uint32_t name_len = 0;
  if (!wire::DecodeRequest(head, &r, &name_len)) return absl::InvalidArgumentError("shm socket: bad magic (expected \"LCF1\")");
  if (name_len > wire::kMaxNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat("shm socket: a name of ", name_len, " bytes (at most ",
                                                   wire::kMaxNameBytes, ")"));
  }
  r.name.resize(name_len);
  if (name_len > 0 && !RecvBefore(fd, r.name.data(), name_len, deadline)) {
    return absl::InvalidArgumentError("shm socket: the name ended early (or came late)");
  }
  if (fds.size() != 1 || fds[0] < 0) {
    return absl::InvalidArgumentError(absl::StrCat("shm socket: region '", r.name, "': send exactly one file descriptor "
                                                   "(SCM_RIGHTS) with the request, got ", fds.size()));
  }
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return absl::InternalError(absl::StrCat("shm socket: SO_PEERCRED: ", std::strerror(errno)));
  }
  return regions_.RegisterFd(r.session_id, r.secret, cred.uid, r.name, fds[0], r.offset, r.byte_size);
}

}  // namespace lce::server
