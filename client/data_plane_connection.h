// One TCP connection to a server's data plane (GetInfoResponse.data_port): fills and drains the
// session's server-memory regions (RegisterRegion.server_memory) at socket speed, outside HTTP/2.
// The wire format: proto/lce/v1/data_plane_wire.h. One transfer at a time; a client
// keeps one connection per direction per stream so that transfers proceed together. Each transfer
// carries the session's secret; with TLS (GetInfoResponse.data_plane_tls) the bytes go through
// OpenSSL, the server's certificate verified against a CA.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

typedef struct ssl_st SSL;

namespace lce::client {

struct DataPlaneAuth {
  std::string secret;   // SessionResponse.session_secret of the session the transfers name
  bool tls = false;     // GetInfoResponse.data_plane_tls
  std::string tls_ca;   // PEM file the server's certificate must chain to ("": the system's CAs)
};

class DataPlaneConnection {
 public:
  // Connects to host:port (an IPv4/IPv6 address or a name); with auth.tls, runs the TLS handshake
  // and checks the certificate names `host`.
  static absl::StatusOr<std::unique_ptr<DataPlaneConnection>> Connect(const std::string& host, int port,
                                                                      const DataPlaneAuth& auth);
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
  DataPlaneConnection(int fd, std::string secret) : fd_(fd), secret_(std::move(secret)) {}
  absl::Status StartTls(const std::string& host, const std::string& ca_file);
  absl::Status Transfer(uint32_t op, const std::string& session_id, uint64_t region_id, int64_t offset, uint8_t* data,
                        int64_t size);
  // All n bytes through the socket (or TLS); false on EOF or error.
  bool SendAll(const uint8_t* p, size_t n);
  bool RecvAll(uint8_t* p, size_t n);
  absl::Status Broken(const char* what);
  void Close();
  int fd_;
  std::string secret_;
  SSL* ssl_ = nullptr;
};

}  // namespace lce::client
