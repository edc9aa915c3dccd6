// Shares of a pool by client (server/transport/client_shares.h; issue 35, items 8 and 10): local
// clients of two uids on one host, and two tokens, hold caps of their own.
#include "client_shares.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace lce::server {
namespace {

// A loopback TCP connection whose client end was made by `uid` (the euid at the socket's creation is
// what the kernel's table names); gRPC's peer string for that end, as a server sees it.
struct Loopback {
  int listener = -1, client = -1, served = -1;
  std::string peer;
  ~Loopback() {
    for (int fd : {listener, client, served}) {
      if (fd >= 0) ::close(fd);
    }
  }
};

void Connect(Loopback& l, uid_t uid) {
  l.listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  ASSERT_EQ(::bind(l.listener, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(::listen(l.listener, 1), 0);
  ASSERT_EQ(::getsockname(l.listener, reinterpret_cast<sockaddr*>(&a), &len), 0);
  const uid_t was = ::geteuid();
  ASSERT_EQ(::seteuid(uid), 0);
  l.client = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_EQ(::seteuid(was), 0);
  ASSERT_EQ(::connect(l.client, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  l.served = ::accept(l.listener, nullptr, nullptr);
  sockaddr_in mine{};
  len = sizeof(mine);
  ASSERT_EQ(::getsockname(l.client, reinterpret_cast<sockaddr*>(&mine), &len), 0);
  l.peer = absl::StrCat("ipv4:127.0.0.1:", ntohs(mine.sin_port));
}

TEST(ClientShares, LocalClientsOfAnotherUidHoldACapOfTheirOwn) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root, to make a socket as another uid";
  const uid_t nobody = 65534;
  Loopback mine[2], theirs;
  for (Loopback& l : mine) Connect(l, 0);
  Connect(theirs, nobody);
  SocketOwners owners = SocketOwners::Read();
  ASSERT_EQ(owners.Uid(mine[0].peer), 0) << mine[0].peer;
  ASSERT_EQ(owners.Uid(theirs.peer), nobody) << theirs.peer;

  ClientShares shares;
  const ClientShares::Grant first = shares.Acquire(mine[0].peer, "", 1);
  ASSERT_NE(first.ticket, 0u);
  const ClientShares::Grant second = shares.Acquire(mine[1].peer, "", 1);  // the same uid, another port
  EXPECT_EQ(second.ticket, 0u);
  EXPECT_EQ(second.client, "127.0.0.1, uid 0");
  const ClientShares::Grant other = shares.Acquire(theirs.peer, "", 1);
  EXPECT_NE(other.ticket, 0u) << "another local user is locked out";
  shares.Release(first.ticket);
  EXPECT_NE(shares.Acquire(mine[1].peer, "", 1).ticket, 0u);
}

TEST(ClientShares, TokensAndHostsHoldCapsOfTheirOwn) {
  ClientShares shares;
  ASSERT_NE(shares.Acquire("ipv4:10.0.0.1:1000", "Bearer a", 1).ticket, 0u);
  EXPECT_EQ(shares.Acquire("ipv4:10.0.0.1:1001", "Bearer a", 1).ticket, 0u);  // the port is not the client
  EXPECT_NE(shares.Acquire("ipv4:10.0.0.1:1002", "Bearer b", 1).ticket, 0u);
  EXPECT_NE(shares.Acquire("ipv4:10.0.0.2:1000", "Bearer a", 1).ticket, 0u);
  EXPECT_NE(shares.Acquire("ipv4:10.0.0.1:1003", "Bearer a", 0).ticket, 0u);  // no cap
}

}  // namespace
}  // namespace lce::server
