#include "client_shares.h"

#include <arpa/inet.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace lce::server {
namespace {

// "ipv4:10.0.0.1:5000" -> {"10.0.0.1", 5000}; "ipv6:[::1]:5000" -> {"[::1]", 5000}; anything else
// (a Unix socket) as it is, port -1.
std::pair<std::string, int> SplitPeer(const std::string& peer) {
  for (const char* scheme : {"ipv4:", "ipv6:"}) {
    if (peer.rfind(scheme, 0) != 0) continue;
    const std::string addr = peer.substr(5);
    const size_t colon = addr.rfind(':');
    if (colon == std::string::npos) return {addr, -1};
    return {addr.substr(0, colon), std::atoi(addr.c_str() + colon + 1)};
  }
  return {peer, -1};
}

bool IsLoopbackV4(const std::string& peer) { return peer.rfind("ipv4:127.", 0) == 0; }

}  // namespace

SocketOwners SocketOwners::Read() {
  SocketOwners t;
  for (const char* path : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream table(path);
    std::string line;
    std::getline(table, line);  // the header
    while (std::getline(table, line)) {
      std::istringstream fields(line);
      std::string sl, local, remote, st, queues, timer, retransmits;
      int64_t uid = -1;
      if (fields >> sl >> local >> remote >> st >> queues >> timer >> retransmits >> uid) t.by_local_[local] = uid;
    }
  }
  return t;
}

int64_t SocketOwners::Uid(const std::string& grpc_peer) const {
  if (!IsLoopbackV4(grpc_peer)) return -1;
  const auto [ip, port] = SplitPeer(grpc_peer);
  in_addr a{};
  if (port < 0 || inet_pton(AF_INET, ip.c_str(), &a) != 1) return -1;
  // The client's socket is IPv4, or IPv6 with the address v4-mapped (::ffff:a.b.c.d; gRPC's sockets
  // are dual-stack): the kernel prints each 32-bit word of the address in hex, in host order.
  char v4[32], v6[64];
  std::snprintf(v4, sizeof(v4), "%08X:%04X", a.s_addr, port);
  std::snprintf(v6, sizeof(v6), "0000000000000000%08X%08X:%04X", htonl(0xffffu) == 0xffffu ? 0xffffu : 0xffff0000u,
                a.s_addr, port);
  for (const char* name : {v4, v6}) {
    auto it = by_local_.find(name);
    if (it != by_local_.end()) return it->second;
  }
  return -1;
}

ClientShares::Grant ClientShares::Acquire(const std::string& peer, const std::string& token, int64_t cap) {
  const std::string host = SplitPeer(peer).first;
  Grant g{0, host};
  // The token is part of the key only (a separator no header value holds keeps host and token apart).
  const std::string group = absl::StrCat(host, "\n", token);
  int64_t uid = kUnresolved;
  std::unique_lock<std::mutex> lock(mu_);
  if (cap > 0 && by_group_[group] >= cap) {
    if (!IsLoopbackV4(peer)) return g;
    lock.unlock();  // the table's read is slow: other admissions go on meanwhile
    const SocketOwners owners = SocketOwners::Read();
    uid = owners.Uid(peer);
    lock.lock();
    g.client = absl::StrCat(host, uid >= 0 ? absl::StrCat(", uid ", uid) : std::string(", uid unknown"));
    if (HeldByUidLocked(group, uid, owners) >= cap) return g;
  }
  g.ticket = next_++;
  units_[g.ticket] = Unit{group, peer, uid};
  ++by_group_[group];
  return g;
}

int64_t ClientShares::HeldByUidLocked(const std::string& group, int64_t uid, const SocketOwners& owners) {
  int64_t n = 0;
  for (auto& [_, u] : units_) {
    if (u.group != group) continue;
    if (u.uid == kUnresolved) u.uid = owners.Uid(u.peer);
    n += u.uid == uid ? 1 : 0;
  }
  return n;
}

void ClientShares::Release(uint64_t ticket) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = units_.find(ticket);
  if (it == units_.end()) return;
  if (--by_group_[it->second.group] == 0) by_group_.erase(it->second.group);
  units_.erase(it);
}

}  // namespace lce::server
