#include "data_plane_connection.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "lce/v1/data_plane_wire.h"

namespace lce::client {
namespace {

using v1::data_plane::kHeaderBytes;
using v1::data_plane::kOpRead;
using v1::data_plane::kOpWrite;

// Moves all of [p, p + n) through the socket; false on EOF or error (errno says which).
template <typename Io>
bool Exactly(Io io, uint8_t* p, size_t n) {
  while (n > 0) {
    const ssize_t r = io(p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      if (r == 0) errno = ECONNRESET;
      return false;
    }
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

}  // namespace

absl::StatusOr<std::unique_ptr<DataPlaneConnection>> DataPlaneConnection::Connect(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string name = host == "localhost" ? "127.0.0.1" : host;
  if (const int e = getaddrinfo(name.c_str(), std::to_string(port).c_str(), &hints, &found); e != 0) {
    return absl::UnavailableError(absl::StrCat("data plane ", host, ":", port, ": ", gai_strerror(e)));
  }
  int fd = -1, err = 0;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd >= 0 && ::connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      err = errno;
      ::close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("data plane ", host, ":", port, ": connect: ", std::strerror(err)));
  }
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));  // headers and replies are small
  return std::unique_ptr<DataPlaneConnection>(new DataPlaneConnection(fd));
}

DataPlaneConnection::~DataPlaneConnection() {
  if (fd_ >= 0) ::close(fd_);
}

absl::Status DataPlaneConnection::Broken(const char* what) {
  const int e = errno;
  ::close(fd_);
  fd_ = -1;
  return absl::UnavailableError(absl::StrCat("data plane connection lost while ", what, ": ", std::strerror(e)));
}

absl::Status DataPlaneConnection::Write(const std::string& session_id, uint64_t region_id, int64_t offset,
                                        absl::Span<const uint8_t> bytes) {
  return Transfer(kOpWrite, session_id, region_id, offset, const_cast<uint8_t*>(bytes.data()),
                  static_cast<int64_t>(bytes.size()));
}

absl::Status DataPlaneConnection::Read(const std::string& session_id, uint64_t region_id, int64_t offset,
                                       absl::Span<uint8_t> bytes) {
  return Transfer(kOpRead, session_id, region_id, offset, bytes.data(), static_cast<int64_t>(bytes.size()));
}

absl::Status DataPlaneConnection::Transfer(uint32_t op, const std::string& session_id, uint64_t region_id,
                                           int64_t offset, uint8_t* data, int64_t size) {
  if (fd_ < 0) return absl::UnavailableError("data plane connection was lost earlier");
  if (session_id.size() != v1::data_plane::kSessionIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat("session id must have 32 characters, got ", session_id.size()));
  }
  uint8_t head[kHeaderBytes];
  v1::data_plane::EncodeTransferHeader({op, session_id, region_id, offset, size}, head);
  const int fd = fd_;
  auto send = [fd](uint8_t* p, size_t n) { return ::send(fd, p, n, MSG_NOSIGNAL); };
  auto recv = [fd](uint8_t* p, size_t n) { return ::recv(fd, p, n, MSG_WAITALL); };
  if (op == kOpWrite) {
    // Header and payload in one go where the socket takes them.
    iovec iov[2] = {{head, kHeaderBytes}, {data, static_cast<size_t>(size)}};
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = 2;
    ssize_t sent = ::sendmsg(fd, &m, MSG_NOSIGNAL);
    while (sent < 0 && errno == EINTR) sent = ::sendmsg(fd, &m, MSG_NOSIGNAL);
    if (sent < 0) return Broken("sending");
    const size_t done = static_cast<size_t>(sent);
    if (done < kHeaderBytes) {
      if (!Exactly(send, head + done, kHeaderBytes - done) || !Exactly(send, data, static_cast<size_t>(size))) {
        return Broken("sending");
      }
    } else if (!Exactly(send, data + (done - kHeaderBytes), static_cast<size_t>(size) - (done - kHeaderBytes))) {
      return Broken("sending");
    }
  } else if (!Exactly(send, head, kHeaderBytes)) {
    return Broken("sending");
  }
  uint8_t reply[v1::data_plane::kReplyHeaderBytes];
  if (!Exactly(recv, reply, sizeof(reply))) return Broken("waiting for the reply");
  int32_t code = 0;
  uint32_t len = 0;
  v1::data_plane::DecodeReplyHeader(reply, &code, &len);
  std::string message(len, '\0');
  if (len > 0 && !Exactly(recv, reinterpret_cast<uint8_t*>(message.data()), len)) return Broken("reading the reply");
  // A refusal leaves the connection usable: the server read a refused write's payload.
  if (code != 0) return absl::Status(static_cast<absl::StatusCode>(code), message);
  if (op == kOpRead && !Exactly(recv, data, static_cast<size_t>(size))) return Broken("receiving");
  return absl::OkStatus();
}

}  // namespace lce::client
