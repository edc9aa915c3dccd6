#include "shm_socket_client.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "socket_io.h"

namespace lce::client {
namespace {

namespace wire = v1::shm_socket;

// The request (fixed bytes, then the name) in one sendmsg with `fd` as its ancillary data.
bool SendRequest(int sock, const std::string& bytes, int fd) {
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  m.msg_control = control;
  m.msg_controllen = sizeof(control);
  cmsghdr* c = CMSG_FIRSTHDR(&m);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  ssize_t sent = ::sendmsg(sock, &m, MSG_NOSIGNAL);
  while (sent < 0 && errno == EINTR) sent = ::sendmsg(sock, &m, MSG_NOSIGNAL);
  if (sent < 0) return false;
  // The descriptor went with the first byte; the rest (a stream socket may take part) follows.
  return SendAll(sock, bytes.data() + sent, bytes.size() - static_cast<size_t>(sent));
}

}  // namespace

absl::StatusOr<uint64_t> RegisterFdOverSocket(const std::string& path, const wire::Request& request, int fd) {
  if (path.empty()) {
    return absl::FailedPreconditionError(
        "the server has no shm socket (start lce_server with --shm-socket) to hand shared memory to");
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) return absl::InvalidArgumentError(absl::StrCat("shm socket path too long: ", path));
  std::memcpy(addr.sun_path, path.data(), path.size());
  const int sock = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (sock < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  const timeval tv{30, 0};
  setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  if (::connect(sock, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int e = errno;
    ::close(sock);
    return absl::UnavailableError(absl::StrCat("shm socket ", path, ": connect: ", std::strerror(e),
                                               " (the server must run on this host)"));
  }
  std::string bytes(wire::kRequestBytes, '\0');
  wire::EncodeRequest(request, reinterpret_cast<uint8_t*>(bytes.data()));
  bytes.append(request.name, 0, wire::kMaxNameBytes);
  uint8_t head[wire::kReplyHeaderBytes];
  int32_t code = 0;
  uint32_t len = 0;
  uint64_t id = 0;
  std::string message;
  bool ok = SendRequest(sock, bytes, fd) && RecvAll(sock, head, sizeof(head));
  if (ok) {
    wire::DecodeReplyHeader(head, &code, &len, &id);
    message.resize(len);
    ok = len == 0 || RecvAll(sock, message.data(), len);
  }
  const int e = errno;
  ::close(sock);
  if (!ok) return absl::UnavailableError(absl::StrCat("shm socket ", path, ": ", std::strerror(e)));
  if (code != 0) return absl::Status(static_cast<absl::StatusCode>(code), message);
  return id;
}

}  // namespace lce::client
