#include "data_plane_connection.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "lce/v1/data_plane_wire.h"
#include "socket_io.h"

namespace lce::client {
namespace {

using v1::data_plane::kHeaderBytes;
using v1::data_plane::kOpRead;
using v1::data_plane::kOpWrite;

// OpenSSL's socket BIO writes with write(2), which raises SIGPIPE (ending the process) when the
// server has closed the connection; this one sends with MSG_NOSIGNAL, as the plain path does.
BIO_METHOD* NoSigpipeSocket() {
  static BIO_METHOD* method = [] {
    BIO_METHOD* m = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK, "lce data plane socket");
    BIO_meth_set_write(m, [](BIO* b, const char* p, int n) -> int {
      const int fd = static_cast<int>(reinterpret_cast<intptr_t>(BIO_get_data(b)));
      ssize_t r;
      do r = ::send(fd, p, static_cast<size_t>(n), MSG_NOSIGNAL); while (r < 0 && errno == EINTR);
      return static_cast<int>(r);
    });
    BIO_meth_set_read(m, [](BIO* b, char* p, int n) -> int {
      const int fd = static_cast<int>(reinterpret_cast<intptr_t>(BIO_get_data(b)));
      ssize_t r;
      do r = ::recv(fd, p, static_cast<size_t>(n), 0); while (r < 0 && errno == EINTR);
      return static_cast<int>(r);
    });
    BIO_meth_set_ctrl(m, [](BIO*, int cmd, long, void*) -> long { return cmd == BIO_CTRL_FLUSH ? 1 : 0; });
    BIO_meth_set_create(m, [](BIO* b) -> int {
      BIO_set_init(b, 1);
      return 1;
    });
    return m;
  }();
  return method;
}

std::string TlsErrors() {
  std::string out;
  for (unsigned long e = ERR_get_error(); e != 0; e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof(buf));
    absl::StrAppend(&out, out.empty() ? "" : "; ", buf);
  }
  return out.empty() ? "the connection closed" : out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<DataPlaneConnection>> DataPlaneConnection::Connect(const std::string& host, int port,
                                                                                  const DataPlaneAuth& auth) {
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
  std::unique_ptr<DataPlaneConnection> c(new DataPlaneConnection(fd, auth.secret));
  if (auth.tls) {
    if (absl::Status s = c->StartTls(host, auth.tls_ca); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("data plane ", host, ":", port, ": ", s.message()));
    }
  }
  return c;
}

absl::Status DataPlaneConnection::StartTls(const std::string& host, const std::string& ca_file) {
  SSL_CTX* ctx = SSL_CTX_new(TLS_client_method());
  if (ctx == nullptr) return absl::InternalError(TlsErrors());
  SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
  SSL_CTX_set_read_ahead(ctx, 1);  // whole records in one recv, not a 5-byte header and then the body
  SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, nullptr);
  const bool cas = ca_file.empty() ? SSL_CTX_set_default_verify_paths(ctx) == 1
                                   : SSL_CTX_load_verify_locations(ctx, ca_file.c_str(), nullptr) == 1;
  if (!cas) {
    SSL_CTX_free(ctx);
    return absl::InvalidArgumentError(absl::StrCat("TLS CA file '", ca_file, "': ", TlsErrors()));
  }
  ssl_ = SSL_new(ctx);
  SSL_CTX_free(ctx);  // the SSL holds its own reference
  if (ssl_ == nullptr) return absl::InternalError(TlsErrors());
  BIO* bio = BIO_new(NoSigpipeSocket());
  BIO_set_data(bio, reinterpret_cast<void*>(static_cast<intptr_t>(fd_)));
  SSL_set_bio(ssl_, bio, bio);
  // The certificate must name the host the client was given (an address or a DNS name).
  in6_addr ip{};
  const bool is_ip = inet_pton(AF_INET, host.c_str(), &ip) == 1 || inet_pton(AF_INET6, host.c_str(), &ip) == 1;
  if (is_ip) {
    X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl_), host.c_str());
  } else {
    SSL_set_tlsext_host_name(ssl_, host.c_str());
    SSL_set1_host(ssl_, host.c_str());
  }
  if (SSL_connect(ssl_) != 1) {
    const long verify = SSL_get_verify_result(ssl_);
    return absl::UnavailableError(absl::StrCat("TLS handshake failed: ", TlsErrors(),
                                               verify != X509_V_OK ? absl::StrCat(" (", X509_verify_cert_error_string(verify), ")") : ""));
  }
  return absl::OkStatus();
}

bool DataPlaneConnection::SendAll(const uint8_t* p, size_t n) {
  if (ssl_ == nullptr) return client::SendAll(fd_, p, n);
  return Exactly([this](uint8_t* b, size_t k) -> ssize_t {
    size_t put = 0;
    return SSL_write_ex(ssl_, b, k, &put) == 1 ? static_cast<ssize_t>(put) : -1;
  }, const_cast<uint8_t*>(p), n);
}

bool DataPlaneConnection::RecvAll(uint8_t* p, size_t n) {
  if (ssl_ == nullptr) return client::RecvAll(fd_, p, n);
  return Exactly([this](uint8_t* b, size_t k) -> ssize_t {
    size_t got = 0;
    return SSL_read_ex(ssl_, b, k, &got) == 1 ? static_cast<ssize_t>(got) : -1;
  }, p, n);
}

void DataPlaneConnection::Close() {
  if (ssl_ != nullptr) SSL_free(ssl_);  // frees the BIO; the socket is ours to close
  ssl_ = nullptr;
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

DataPlaneConnection::~DataPlaneConnection() { Close(); }

absl::Status DataPlaneConnection::Broken(const char* what) {
  const int e = errno;
  ERR_clear_error();
  Close();
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
  v1::data_plane::EncodeTransferHeader({op, session_id, secret_, region_id, offset, size}, head);
  if (op == kOpWrite && ssl_ == nullptr) {
    // Header and payload in one go where the socket takes them.
    iovec iov[2] = {{head, kHeaderBytes}, {data, static_cast<size_t>(size)}};
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = 2;
    ssize_t sent = ::sendmsg(fd_, &m, MSG_NOSIGNAL);
    while (sent < 0 && errno == EINTR) sent = ::sendmsg(fd_, &m, MSG_NOSIGNAL);
    if (sent < 0) return Broken("sending");
    const size_t done = static_cast<size_t>(sent);
    if (done < kHeaderBytes) {
      if (!SendAll(head + done, kHeaderBytes - done) || !SendAll(data, static_cast<size_t>(size))) return Broken("sending");
    } else if (!SendAll(data + (done - kHeaderBytes), static_cast<size_t>(size) - (done - kHeaderBytes))) {
      return Broken("sending");
    }
  } else if (!SendAll(head, kHeaderBytes) || (op == kOpWrite && !SendAll(data, static_cast<size_t>(size)))) {
    return Broken("sending");
  }
  uint8_t reply[v1::data_plane::kReplyHeaderBytes];
  if (!RecvAll(reply, sizeof(reply))) return Broken("waiting for the reply");
  int32_t code = 0;
  uint32_t len = 0;
  v1::data_plane::DecodeReplyHeader(reply, &code, &len);
  std::string message(len, '\0');
  if (len > 0 && !RecvAll(reinterpret_cast<uint8_t*>(message.data()), len)) return Broken("reading the reply");
  // A refusal leaves the connection usable: the server read a refused write's payload.
  if (code != 0) return absl::Status(static_cast<absl::StatusCode>(code), message);
  if (op == kOpRead && !RecvAll(data, static_cast<size_t>(size))) return Broken("receiving");
  return absl::OkStatus();
}

}  // namespace lce::client
