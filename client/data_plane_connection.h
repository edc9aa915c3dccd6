// One TCP connection to a server's data plane (GetInfoResponse.data_port): fills and drains the
// session's server-memory regions (RegisterRegion.server_memory) at socket speed, outside HTTP/2.
// The wire format: proto/lce/v1/data_plane_wire.h. One transfer at a time; a client
// keeps one connection per direction per stream so that transfers proceed together.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace lce::client {

class DataPlaneConnection {
 public:
  // Connects to host:port (an IPv4/IPv6 address or a name).
  static absl::StatusOr<std::unique_ptr<DataPlaneConnection>> Connect(const std::string& host, int port);
  ~DataPlaneConnection();
  DataPlaneConnection(const DataPlaneConnection&) = delete;
  DataPlaneConnection& operator=(const DataPlaneConnection&) = delete;

  // Copies `bytes` to [offset, offset + size) of region `region_id` of session `session_id`.
  absl::Status Write(const std::string& session_id, uint64_t region_id, int64_t offset, absl::Span<const uint8_t> bytes);
  // Copies [offset, offset + size) of the region into `bytes`.
  absl::Status Read(const std::string& session_id, uint64_t region_id, int64_t offset, absl::Span<uint8_t> bytes);
  // False once a transfer failed on the wire: the connection cannot be used again.
  bool usable() const { return fd_ >= 0; }

 private:
  explicit DataPlaneConnection(int fd) : fd_(fd) {}
  absl::Status Transfer(uint32_t op, const std::string& session_id, uint64_t region_id, int64_t offset, uint8_t* data,
                        int64_t size);
  absl::Status Broken(const char* what);
  int fd_;
};

}  // namespace lce::client
