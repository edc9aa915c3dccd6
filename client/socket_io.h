// Whole-buffer socket I/O for the client's own sockets (the data plane's, the shm socket's).
#pragma once

#include <sys/socket.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>

namespace lce::client {

// Runs `io(p, n)` (a recv or send of up to n bytes) until all of [p, p + n) has moved; false on EOF
// (errno ECONNRESET) or an error (errno says which). EINTR is retried.
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

inline bool RecvAll(int fd, void* p, size_t n) {
  return Exactly([fd](uint8_t* b, size_t k) { return ::recv(fd, b, k, MSG_WAITALL); }, static_cast<uint8_t*>(p), n);
}

inline bool SendAll(int fd, const void* p, size_t n) {
  return Exactly([fd](uint8_t* b, size_t k) { return ::send(fd, b, k, MSG_NOSIGNAL); },
                 static_cast<uint8_t*>(const_cast<void*>(p)), n);
}

}  // namespace lce::client
