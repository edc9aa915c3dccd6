// Shares of a pool by client (issue 35, items 8 and 10): admission slots, sessions. One client may
// hold at most `cap` units of a pool, so that one client cannot lock the others out.
//
// A client is its host (gRPC's peer string without the port) and its bearer token, and, for an
// IPv4 loopback peer, where every local client shares the host, its uid as the kernel's socket
// table names it. The table costs milliseconds to read (more with many sockets), so it is read only
// when a host-and-token group is at its cap: then this client's uid and those of the units it holds
// are resolved (their connections are alive: each unit is an open stream), and the cap applies per
// uid. Local clients of one uid and one token (and Unix-socket peers, whose credentials gRPC does
// not give) are one client.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>

namespace lce::server {

// The uid that owns the client's end of a loopback TCP connection, as gRPC names the peer
// ("ipv4:127.0.0.1:40000"), from one read of /proc/net/tcp and tcp6; -1 where not found.
class SocketOwners {
 public:
  static SocketOwners Read();
  int64_t Uid(const std::string& grpc_peer) const;

 private:
  std::map<std::string, int64_t> by_local_;  // the kernel's "0100007F:9C40" -> uid
};

class ClientShares {
 public:
  struct Grant {
    uint64_t ticket = 0;  // 0: refused, the client holds `cap` already
    std::string client;   // who, for messages ("127.0.0.1, uid 1000"); never the token
  };
  // One unit for the client of `peer` (gRPC's peer string) with `token` (its authorization
  // metadata, "" without): refused when it holds `cap` (cap <= 0: no cap).
  Grant Acquire(const std::string& peer, const std::string& token, int64_t cap);
  void Release(uint64_t ticket);

 private:
  static constexpr int64_t kUnresolved = -2;
  struct Unit {
    std::string group, peer;  // host and token; gRPC's peer string
    int64_t uid = kUnresolved;
  };
  // Units of `group` held by `uid`, after resolving those not yet resolved from `owners`. Hold mu_.
  int64_t HeldByUidLocked(const std::string& group, int64_t uid, const SocketOwners& owners);

  std::mutex mu_;
  uint64_t next_ = 1;
  std::map<uint64_t, Unit> units_;
  std::map<std::string, int64_t> by_group_;
};

}  // namespace lce::server
