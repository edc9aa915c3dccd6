#include "region_data_plane.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "lce/device_memory.h"
#include "thread_start.h"

namespace lce::server {
namespace {

using v1::data_plane::kOpRead;
using v1::data_plane::kOpWrite;

// Pieces of a transfer to or from GPU memory: small enough that the copy of one hides behind the
// socket's work on the next, large enough that the copies run near the bus's speed.
constexpr int64_t kDevicePiece = 1 << 20;

// Send and receive timeouts of the socket (zero: none).
void SetTimeouts(int fd, absl::Duration d) {
  const timeval tv = absl::ToTimeval(d);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

bool Reply(DataPlaneLink& link, const absl::Status& s) {
  const std::string msg(s.message());
  uint8_t head[v1::data_plane::kReplyHeaderBytes];
  v1::data_plane::EncodeReplyHeader(static_cast<int32_t>(s.code()), static_cast<uint32_t>(msg.size()), head);
  return link.Send(head, sizeof(head)) && link.Send(msg.data(), msg.size());
}

}  // namespace

absl::StatusOr<std::unique_ptr<RegionDataPlane>> RegionDataPlane::Start(RegionRegistry& regions,
                                                                        const std::string& host, int port,
                                                                        const RegionDataPlaneOptions& options) {
  if (options.max_connections < 1) return absl::InvalidArgumentError("data plane: max_connections must be >= 1");
  if (options.max_connections_per_session < 1) {
    return absl::InvalidArgumentError("data plane: max_connections_per_session must be >= 1");
  }
  if (options.stall_timeout <= absl::ZeroDuration() || options.idle_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("data plane: stall_timeout and idle_timeout must be positive");
  }
  std::unique_ptr<RegionDataPlane> dp(new RegionDataPlane(regions, options));
  if (options.tls) {
    absl::StatusOr<std::unique_ptr<TlsServerContext>> tls =
        TlsServerContext::FromFiles(options.tls_cert_file, options.tls_key_file);
    if (!tls.ok()) return tls.status();
    dp->tls_ = *std::move(tls);
  }
  dp->listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (dp->listen_fd_ < 0) return absl::InternalError(absl::StrCat("data plane: socket: ", std::strerror(errno)));
  const int one = 1;
  setsockopt(dp->listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  // IPv4 only; the IPv6 wildcard and loopback map to theirs.
  std::string h = host;
  if (h.empty() || h == "[::]" || h == "::") h = "0.0.0.0";
  if (h == "localhost" || h == "[::1]" || h == "::1") h = "127.0.0.1";
  if (inet_pton(AF_INET, h.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("data plane: '", host, "' is not an IPv4 address"));
  }
  if (::bind(dp->listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(dp->listen_fd_, 64) != 0) {
    return absl::UnavailableError(absl::StrCat("data plane: cannot listen on ", h, ":", port, ": ", std::strerror(errno)));
  }
  socklen_t len = sizeof(addr);
  getsockname(dp->listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  dp->port_ = ntohs(addr.sin_port);
  absl::StatusOr<std::thread> acceptor = StartThread("the data plane's acceptor", [p = dp.get()] { p->AcceptLoop(); });
  if (!acceptor.ok()) return acceptor.status();
  dp->acceptor_ = *std::move(acceptor);
  return dp;
}

RegionDataPlane::~RegionDataPlane() {
  stopping_ = true;
  if (listen_fd_ >= 0) ::shutdown(listen_fd_, SHUT_RDWR);
  if (acceptor_.joinable()) acceptor_.join();
  if (listen_fd_ >= 0) ::close(listen_fd_);
  std::map<uint64_t, std::thread> threads;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (int fd : conns_) ::shutdown(fd, SHUT_RDWR);  // wakes their threads
    threads.swap(threads_);
  }
  for (auto& [_, t] : threads) t.join();
}

void RegionDataPlane::AcceptLoop() {
  while (!stopping_) {
    sockaddr_in peer_addr{};
    socklen_t peer_len = sizeof(peer_addr);
    const int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&peer_addr), &peer_len, SOCK_CLOEXEC);
    const uint32_t peer = peer_addr.sin_addr.s_addr;
    if (fd < 0) {
      if (backoff_.Retry(errno, stopping_)) continue;
      return;  // shut down
    }
    backoff_.Accepted();
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    std::vector<std::thread> done;  // finished connections' threads, joined below whatever happens
    bool stop = false;
    std::pair<std::string, std::string> refused;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (uint64_t id : finished_) {
        auto it = threads_.find(id);
        if (it != threads_.end()) {
          done.push_back(std::move(it->second));
          threads_.erase(it);
        }
      }
      finished_.clear();
      stop = stopping_;
      if (!stop) refused = RefusalLocked(peer);
      if (!stop && refused.first.empty()) {
        conns_.push_back(fd);
        ++unauthenticated_[peer];
        const uint64_t id = next_id_++;
        absl::StatusOr<std::thread> t = StartThread("a data-plane connection", [this, id, fd, peer] { Serve(id, fd, peer); });
        if (t.ok()) {
          threads_.emplace(id, *std::move(t));
        } else {  // a task limit: refuse this connection, never abort
          conns_.pop_back();
          if (--unauthenticated_[peer] == 0) unauthenticated_.erase(peer);
          refused = {"threads", absl::StrCat("data plane: ", t.status().message())};
        }
      }
    }
    if (!refused.first.empty()) {  // at once, with the reason where the client reads its first reply
      if (metrics_ != nullptr) metrics_->rejections.WithLabels({refused.first}).Increment();
      // (A TLS client would read a plain reply as a broken handshake: it just sees the close.)
      DataPlaneLink plain(fd);
      if (tls_ == nullptr) Reply(plain, absl::ResourceExhaustedError(refused.second));
      ::shutdown(fd, SHUT_RDWR);
    }
    if (stop || !refused.first.empty()) ::close(fd);
    for (std::thread& t : done) t.join();  // already returned, or about to
    if (stop) return;
  }
}

std::pair<std::string, std::string> RegionDataPlane::PoolFullLocked() const {
  if (authenticated_ < max_connections_) return {};
  return {"data_plane_connections",
          absl::StrCat("data plane: the server is at its limit of ", max_connections_, " connections; retry later")};
}

std::pair<std::string, std::string> RegionDataPlane::RefusalLocked(uint32_t peer) const {
  if (auto full = PoolFullLocked(); !full.first.empty()) return full;
  int total = 0;
  for (const auto& [_, n] : unauthenticated_) total += n;
  auto it = unauthenticated_.find(peer);
  if (total >= max_unauthenticated_ || (it != unauthenticated_.end() && it->second >= max_unauthenticated_per_peer_)) {
    return {"data_plane_unauthenticated",
            absl::StrCat("data plane: too many connections that have not presented a session yet (", total,
                         " here, at most ", max_unauthenticated_, ", ", max_unauthenticated_per_peer_,
                         " from one address); retry later")};
  }
  return {};
}

std::pair<std::string, std::string> RegionDataPlane::Authenticate(uint32_t peer, const std::string& session) {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto full = PoolFullLocked(); !full.first.empty()) return full;
  int& mine = by_session_[session];
  if (mine >= max_per_session_) {
    return {"data_plane_session_connections",
            absl::StrCat("data plane: this session already holds ", max_per_session_,
                         " connections, the most one session may (--data-plane-max-connections-per-session)")};
  }
  ++mine;
  if (--unauthenticated_[peer] == 0) unauthenticated_.erase(peer);
  ++authenticated_;
  return {};
}

void RegionDataPlane::Serve(uint64_t id, int fd, uint32_t peer) {
  std::string session;  // authenticated as, by a first transfer that resolved: until then, no second chance
  // The TLS handshake, like the first transfer, must come within the auth timeout.
  SetTimeouts(fd, auth_timeout_);
  std::unique_ptr<DataPlaneLink> link;
  if (tls_ != nullptr) {
    absl::StatusOr<std::unique_ptr<DataPlaneLink>> l = DataPlaneLink::AcceptTls(fd, *tls_);
    if (l.ok()) link = *std::move(l);
  } else {
    link = std::make_unique<DataPlaneLink>(fd);
  }
  std::unique_ptr<DeviceTransfer> transfer;  // made on the first transfer to or from GPU memory
  while (link != nullptr && !stopping_) {
    // Idle between transfers up to the idle timeout once authenticated (before, the first transfer
    // must come within the auth timeout); within one, every read and write must progress within the
    // stall timeout (a recv or send that times out fails, and the connection ends).
    const bool authenticated = !session.empty();
    SetTimeouts(fd, authenticated ? idle_timeout_ : auth_timeout_);
    uint8_t head[v1::data_plane::kHeaderBytes];
    if (!link->Recv(head, 1)) {
      const bool timed_out = errno == EAGAIN || errno == EWOULDBLOCK;
      if ((!authenticated || timed_out) && !stopping_ && metrics_ != nullptr) {
        metrics_->rejections.WithLabels({authenticated ? "data_plane_idle_timeout" : "data_plane_auth_timeout"})
            .Increment();
      }
      break;
    }
    SetTimeouts(fd, stall_timeout_);
    if (!link->Recv(head + 1, sizeof(head) - 1) || !Transfer(*link, head, peer, session, transfer)) break;
  }
  link.reset();
  std::lock_guard<std::mutex> lock(mu_);
  conns_.erase(std::remove(conns_.begin(), conns_.end(), fd), conns_.end());
  if (!session.empty()) {
    --authenticated_;
    if (--by_session_[session] == 0) by_session_.erase(session);
  } else if (--unauthenticated_[peer] == 0) {
    unauthenticated_.erase(peer);
  }
  ::close(fd);
  finished_.push_back(id);
}

absl::StatusOr<RegionRegistry::Slice> RegionDataPlane::Check(const v1::data_plane::TransferHeader& h) const {
  if (h.op != kOpWrite && h.op != kOpRead) return absl::InvalidArgumentError(absl::StrCat("data plane: unknown op ", h.op));
  // The id travels in request metadata and in every header; the secret went only to the session's
  // authenticated OpenSession (issue 22).
  if (absl::Status s = regions_.CheckSecret(h.session_id, h.secret); !s.ok()) {
    return absl::PermissionDeniedError(absl::StrCat("data plane: ", s.message()));
  }
  v1::RegionSlice slice;
  slice.set_region_id(h.region_id);
  slice.set_offset(h.offset);
  slice.set_byte_size(h.length);
  absl::StatusOr<RegionRegistry::Slice> s =
      regions_.Resolve(h.session_id, h.secret, slice, h.length, h.op == kOpWrite ? "data plane write" : "data plane read");
  if (s.ok() && !s->server_memory) {
    return absl::InvalidArgumentError(absl::StrCat("data plane: region ", h.region_id, " is not server memory"));
  }
  return s;
}

bool RegionDataPlane::Transfer(DataPlaneLink& link, const uint8_t* head, uint32_t peer, std::string& session,
                               std::unique_ptr<DeviceTransfer>& transfer) {
  v1::data_plane::TransferHeader h;
  if (!v1::data_plane::DecodeTransferHeader(head, &h)) {
    Reply(link, absl::InvalidArgumentError("data plane: bad magic (expected \"LCE2\")"));
    return false;
  }
  // A negative length is refused before anything uses it (Resolve refuses it too), and as the
  // payload's end is then unknown, the connection ends. Offsets are Resolve's to refuse.
  if (h.length < 0) {
    Reply(link, absl::InvalidArgumentError(absl::StrCat("data plane: negative length ", h.length)));
    return false;
  }
  absl::StatusOr<RegionRegistry::Slice> s = Check(h);
  if (s.ok() && session.empty()) {
    const auto [reason, message] = Authenticate(peer, h.session_id);
    if (!reason.empty()) {
      if (metrics_ != nullptr) metrics_->rejections.WithLabels({reason}).Increment();
      Reply(link, absl::ResourceExhaustedError(message));
      return false;
    }
    session = h.session_id;
  }
  const bool authenticated = !session.empty();
  if (!s.ok()) {
    if (!authenticated) {  // a connection that has not presented a session gets no second try
      Reply(link, s.status());
      return false;
    }
    // A refused write's payload follows: read it into nothing, so that the client sees the
    // reason and the connection goes on; one too large to be any region's is not waited for.
    if (h.op == kOpWrite && (h.length > max_write_bytes_ || !link.Discard(h.length))) {
      Reply(link, s.status());
      return false;
    }
    return Reply(link, s.status());
  }
  return Move(link, h.op == kOpWrite, *s, transfer);
}

bool RegionDataPlane::Move(DataPlaneLink& link, bool write, const RegionRegistry::Slice& s,
                           std::unique_ptr<DeviceTransfer>& transfer) {
  const int64_t length = static_cast<int64_t>(s.bytes.size());
  // Counted before the client can see the transfer end (its write's reply, a read's last byte), so that
  // a client reading the metrics after a transfer finds it there.
  auto counted = [&] {
    if (metrics_ != nullptr)
      (write ? metrics_->bytes_received : metrics_->bytes_sent).Increment(static_cast<double>(length));
    return true;
  };
  if (!s.device) {
    if (write) return link.Recv(s.bytes.data(), s.bytes.size()) && counted() && Reply(link, absl::OkStatus());
    return Reply(link, absl::OkStatus()) && counted() && link.Send(s.bytes.data(), s.bytes.size());
  }
  // GPU memory: through this connection's bounce buffers, overlapped with the socket.
  if (transfer == nullptr) {
    absl::StatusOr<std::unique_ptr<DeviceTransfer>> t = CreateDeviceTransfer(regions_.cuda_device(), kDevicePiece);
    if (!t.ok()) {
      if (!write || link.Discard(length)) Reply(link, t.status());
      return false;
    }
    transfer = *std::move(t);
  }
  if (write) {  // a CUDA failure mid-payload ends the connection
    const absl::Status w =
        transfer->ToDevice(s.bytes.data(), length, [&link](uint8_t* p, size_t n) { return link.Recv(p, n); });
    return w.ok() && counted() && Reply(link, absl::OkStatus());
  }
  if (!Reply(link, absl::OkStatus()) || !counted()) return false;
  // On a failure the client sees the connection end short of the bytes.
  return transfer->FromDevice(s.bytes.data(), length, [&link](const uint8_t* p, size_t n) { return link.Send(p, n); }).ok();
}

}  // namespace lce::server
