#include "data_plane_link.h"

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <pthread.h>
#include <sys/socket.h>

#include <csignal>

#include <algorithm>
#include <cerrno>
#include <vector>

#include "absl/strings/str_cat.h"

namespace lce::server {
namespace {

// OpenSSL's error queue as text (and emptied: it is per thread, and the next call must not see it).
std::string TlsErrors() {
  std::string out;
  for (unsigned long e = ERR_get_error(); e != 0; e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof(buf));
    absl::StrAppend(&out, out.empty() ? "" : "; ", buf);
  }
  return out.empty() ? "no detail" : out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<TlsServerContext>> TlsServerContext::FromFiles(const std::string& cert_file,
                                                                             const std::string& key_file) {
  if (cert_file.empty() || key_file.empty()) {
    return absl::InvalidArgumentError("data plane TLS needs a certificate and a key (--tls-cert, --tls-key)");
  }
  SSL_CTX* ctx = SSL_CTX_new(TLS_server_method());
  if (ctx == nullptr) return absl::InternalError(absl::StrCat("data plane TLS: ", TlsErrors()));
  std::unique_ptr<TlsServerContext> self(new TlsServerContext(ctx));
  SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
  // Whole records (and what follows) in one recv, not a 5-byte header and then the body.
  SSL_CTX_set_read_ahead(ctx, 1);
  if (SSL_CTX_use_certificate_chain_file(ctx, cert_file.c_str()) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("data plane TLS: certificate ", cert_file, ": ", TlsErrors()));
  }
  if (SSL_CTX_use_PrivateKey_file(ctx, key_file.c_str(), SSL_FILETYPE_PEM) != 1 || SSL_CTX_check_private_key(ctx) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("data plane TLS: key ", key_file, ": ", TlsErrors()));
  }
  return self;
}

TlsServerContext::~TlsServerContext() { SSL_CTX_free(ctx_); }

absl::StatusOr<std::unique_ptr<DataPlaneLink>> DataPlaneLink::AcceptTls(int fd, const TlsServerContext& tls) {
  // OpenSSL writes with write(2), which raises SIGPIPE on a socket the peer closed: blocked on this
  // (the connection's own) thread, the write fails with EPIPE instead of ending the process.
  sigset_t pipe;
  sigemptyset(&pipe);
  sigaddset(&pipe, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe, nullptr);
  auto link = std::make_unique<DataPlaneLink>(fd);
  link->ssl_ = SSL_new(tls.ctx());
  if (link->ssl_ == nullptr || SSL_set_fd(link->ssl_, fd) != 1) {
    return absl::InternalError(absl::StrCat("data plane TLS: ", TlsErrors()));
  }
  if (SSL_accept(link->ssl_) != 1) {
    return absl::UnauthenticatedError(absl::StrCat("data plane TLS handshake failed: ", TlsErrors()));
  }
  return link;
}

DataPlaneLink::~DataPlaneLink() {
  if (ssl_ != nullptr) SSL_free(ssl_);  // no close_notify: the socket is shut down by its owner
}

bool DataPlaneLink::Recv(void* p, size_t n) {
  auto* b = static_cast<uint8_t*>(p);
  while (n > 0) {
    ssize_t r;
    if (ssl_ != nullptr) {
      size_t got = 0;
      r = SSL_read_ex(ssl_, b, n, &got) == 1 ? static_cast<ssize_t>(got) : -1;
      if (r < 0) ERR_clear_error();
    } else {
      r = ::recv(fd_, b, n, MSG_WAITALL);
      if (r < 0 && errno == EINTR) continue;
    }
    if (r <= 0) return false;
    b += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

bool DataPlaneLink::Send(const void* p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  while (n > 0) {
    ssize_t r;
    if (ssl_ != nullptr) {
      size_t put = 0;
      r = SSL_write_ex(ssl_, b, n, &put) == 1 ? static_cast<ssize_t>(put) : -1;
      if (r < 0) ERR_clear_error();
    } else {
      r = ::send(fd_, b, n, MSG_NOSIGNAL);
      if (r < 0 && errno == EINTR) continue;
    }
    if (r <= 0) return false;
    b += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

bool DataPlaneLink::Discard(int64_t n) {
  static thread_local std::vector<uint8_t> sink(1 << 20);
  while (n > 0) {
    const size_t k = static_cast<size_t>(std::min<int64_t>(n, static_cast<int64_t>(sink.size())));
    if (!Recv(sink.data(), k)) return false;
    n -= static_cast<int64_t>(k);
  }
  return true;
}

}  // namespace lce::server
