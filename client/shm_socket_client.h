// The client's end of the server's shm socket (SessionResponse.shm_socket; wire format:
// proto/lce/v1/shm_socket_wire.h): hands one file descriptor to the server as a region of a session.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "lce/v1/shm_socket_wire.h"

namespace lce::client {

// Connects to `path`, sends `request` with `fd` (SCM_RIGHTS) and returns the region id the server
// gave, or its refusal (its code and message). UNAVAILABLE when the socket cannot be reached.
absl::StatusOr<uint64_t> RegisterFdOverSocket(const std::string& path, const v1::shm_socket::Request& request, int fd);

}  // namespace lce::client
