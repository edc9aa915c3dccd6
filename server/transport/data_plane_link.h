// One data-plane connection's byte stream: the plain socket, or TLS over it (lce_server
// --data-plane-tls; OpenSSL). The data plane moves every byte through Recv and Send, so that one
// code path serves both; the socket's timeouts (SO_RCVTIMEO/SO_SNDTIMEO) bound TLS reads and
// writes as they bound plain ones.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

typedef struct ssl_ctx_st SSL_CTX;
typedef struct ssl_st SSL;

namespace lce::server {

// The server's TLS certificate and key, loaded once; Accept runs a connection's handshake.
class TlsServerContext {
 public:
  // PEM files (the certificate file may hold the chain). INVALID_ARGUMENT naming what is wrong.
  static absl::StatusOr<std::unique_ptr<TlsServerContext>> FromFiles(const std::string& cert_file,
                                                                    const std::string& key_file);
  ~TlsServerContext();
  SSL_CTX* ctx() const { return ctx_; }

 private:
  explicit TlsServerContext(SSL_CTX* ctx) : ctx_(ctx) {}
  SSL_CTX* ctx_;
};

class DataPlaneLink {
 public:
  // A plain link over `fd` (not owned).
  explicit DataPlaneLink(int fd) : fd_(fd) {}
  // The server's end of a TLS link over `fd`: runs the handshake (bounded by the socket's timeouts).
  static absl::StatusOr<std::unique_ptr<DataPlaneLink>> AcceptTls(int fd, const TlsServerContext& tls);
  ~DataPlaneLink();
  DataPlaneLink(const DataPlaneLink&) = delete;
  DataPlaneLink& operator=(const DataPlaneLink&) = delete;

  // All n bytes, or false (EOF, error, or a timeout).
  bool Recv(void* p, size_t n);
  bool Send(const void* p, size_t n);
  // Reads and drops n bytes (a refused write's payload).
  bool Discard(int64_t n);

 private:
  int fd_;
  SSL* ssl_ = nullptr;
};

}  // namespace lce::server
