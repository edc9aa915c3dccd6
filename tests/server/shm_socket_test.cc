// The shm socket (server/transport/shm_socket.h) without a gRPC server: what a client may make the
// server map, and a listener that outlives a descriptor shortage (issue 35, items 2 and 3).
#include "shm_socket.h"

#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "descriptor_exhaustion.h"
#include "gtest/gtest.h"
#include "lce/v1/shm_socket_wire.h"
#include "metrics.h"
#include "service_metrics.h"
#include "thread_start.h"

namespace lce::server {
namespace {

namespace wire = v1::shm_socket;

struct Reply {
  int32_t code = -1;  // -1: no reply within 5 s
  std::string message;
  uint64_t region = 0;
};

bool RecvAll(int fd, void* p, size_t n) {
  auto* b = static_cast<uint8_t*>(p);
  for (ssize_t r; n > 0; b += r, n -= static_cast<size_t>(r)) {
    if ((r = ::recv(fd, b, n, 0)) <= 0) return false;
  }
  return true;
}

// Registers [0, byte_size) of `memfd` for `session` as a client would (one request, SCM_RIGHTS).
Reply Register(const std::string& path, const RegionRegistry::SessionKeys& session, int memfd, int64_t byte_size) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  Reply reply;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    reply.message = std::strerror(errno);
    ::close(fd);
    return reply;
  }
  const timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  uint8_t head[wire::kRequestBytes + 1];
  wire::EncodeRequest({session.id, session.secret, 0, byte_size, "r"}, head);
  head[wire::kRequestBytes] = 'r';
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  iovec iov{head, sizeof(head)};
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  m.msg_control = control;
  m.msg_controllen = sizeof(control);
  cmsghdr* c = CMSG_FIRSTHDR(&m);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &memfd, sizeof(int));
  uint8_t rh[wire::kReplyHeaderBytes];
  uint32_t len = 0;
  if (::sendmsg(fd, &m, MSG_NOSIGNAL) == static_cast<ssize_t>(sizeof(head)) && RecvAll(fd, rh, sizeof(rh))) {
    wire::DecodeReplyHeader(rh, &reply.code, &len, &reply.region);
    reply.message.resize(len);
    if (len > 0 && !RecvAll(fd, reply.message.data(), len)) reply.code = -1;
  }
  ::close(fd);
  return reply;
}

// A memfd of `bytes` (sparse: ftruncate allocates nothing).
int Memfd(int64_t bytes) {
  const int fd = memfd_create("shm_socket_test", MFD_CLOEXEC);
  EXPECT_GE(fd, 0) << std::strerror(errno);
  EXPECT_EQ(ftruncate(fd, bytes), 0) << std::strerror(errno);
  return fd;
}

std::string SocketPath() {
  static int n = 0;
  return "/tmp/lce-shm-socket-test-" + std::to_string(getpid()) + "-" + std::to_string(n++) + ".sock";
}

// Issue 35, item 2: 68 sparse memfds once mapped 128 TiB of the server's address space and the next
// thread creation aborted it. Every mapped byte now counts against a cap checked before mmap.
TEST(ShmSocket, ASparseTerabyteMemfdIsRefusedBeforeItIsMapped) {
  RegionRegistry regions;
  auto socket = ShmSocket::Start(regions, SocketPath());
  ASSERT_TRUE(socket.ok()) << socket.status();
  const RegionRegistry::SessionKeys session = regions.OpenSession();
  const int64_t tib = int64_t{1} << 40;
  for (int i = 0; i < 70; ++i) {  // the attack: every one refused, none mapped
    const int huge = Memfd(tib);
    const Reply r = Register((*socket)->path(), session, huge, tib);
    ::close(huge);
    ASSERT_EQ(r.code, static_cast<int32_t>(absl::StatusCode::kResourceExhausted)) << "memfd " << i << ": " << r.message;
    EXPECT_NE(r.message.find("--shm-bytes-per-session"), std::string::npos) << r.message;
  }
  EXPECT_EQ(regions.size(), 0u);
  // The server goes on serving: an ordinary region registers.
  const int small = Memfd(4096);
  const Reply ok = Register((*socket)->path(), session, small, 4096);
  ::close(small);
  EXPECT_EQ(ok.code, 0) << ok.message;
  EXPECT_EQ(regions.size(), 1u);
}

// The cap over all sessions: two sessions, each within its own cap, may not pass the server's.
TEST(ShmSocket, MappedBytesOverAllSessionsAreCapped) {
  RegionRegistry regions;
  regions.LimitMappedBytes(int64_t{2} << 20, int64_t{3} << 20);
  auto socket = ShmSocket::Start(regions, SocketPath());
  ASSERT_TRUE(socket.ok()) << socket.status();
  const RegionRegistry::SessionKeys a = regions.OpenSession(), b = regions.OpenSession();
  const int fa = Memfd(int64_t{2} << 20), fb = Memfd(int64_t{2} << 20);
  EXPECT_EQ(Register((*socket)->path(), a, fa, int64_t{2} << 20).code, 0);
  const Reply over = Register((*socket)->path(), b, fb, int64_t{2} << 20);
  EXPECT_EQ(over.code, static_cast<int32_t>(absl::StatusCode::kResourceExhausted)) << over.message;
  EXPECT_NE(over.message.find("--shm-total-bytes"), std::string::npos) << over.message;
  EXPECT_EQ(Register((*socket)->path(), b, fb, int64_t{1} << 20).code, 0) << "room for 1 MiB more";
  ::close(fa);
  ::close(fb);
}

// Issue 35, item 3: an accept that failed with EMFILE once ended the accept loop for good.
TEST(ShmSocket, AcceptsAgainAfterTheDescriptorsRanOut) {
  RegionRegistry regions;
  metrics::Registry registry;
  ServiceMetrics metrics(registry);
  auto socket = ShmSocket::Start(regions, SocketPath(), {}, &metrics);
  ASSERT_TRUE(socket.ok()) << socket.status();
  const RegionRegistry::SessionKeys session = regions.OpenSession();
  const int memfd = Memfd(4096);
  // One served registration first: the listener's and a connection's threads have started before the
  // descriptors run out (UBSan's checks at a thread's start need descriptors of their own).
  const int open_before = DescriptorExhaustion::OpenDescriptors();
  ASSERT_EQ(Register((*socket)->path(), session, memfd, 4096).code, 0);
  DescriptorExhaustion::AwaitOpenAtMost(open_before);
  {
    DescriptorExhaustion exhausted;
    ASSERT_TRUE(exhausted.exhausted());
    exhausted.Free(1);  // the client's socket; the server's accept finds none left
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, (*socket)->path().data(), (*socket)->path().size());
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << std::strerror(errno);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    ::close(fd);
  }
  const Reply r = Register((*socket)->path(), session, memfd, 4096);
  EXPECT_EQ(r.code, 0) << "no reply: the listener stopped accepting. " << r.message;
  EXPECT_GE(metrics.accept_errors.WithLabels({"shm_socket", "EMFILE"}).Value(), 1.0);
  ::close(memfd);
}

// Issue 35, item 9: the request's time was each recv's, so a byte every 4 s held a connection (and
// one of the 32) for ever. The whole request must now arrive within the timeout.
TEST(ShmSocket, ARequestTrickledByteByByteEndsAtItsTimeout) {
  RegionRegistry regions;
  auto socket = ShmSocket::Start(regions, SocketPath(), {}, nullptr, absl::Seconds(1));
  ASSERT_TRUE(socket.ok()) << socket.status();
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, (*socket)->path().data(), (*socket)->path().size());
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << std::strerror(errno);
  const auto start = std::chrono::steady_clock::now();
  bool ended = false;
  for (int i = 0; i < 20 && !ended; ++i) {  // 6 s of trickling at most, a byte every 300 ms
    if (::send(fd, "L", 1, MSG_NOSIGNAL) != 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    pollfd p{fd, POLLIN, 0};
    ended = ::poll(&p, 1, 0) == 1;  // the refusal, or the close
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_TRUE(ended) << "a trickling client held its connection for " << seconds << " s";
  EXPECT_LT(seconds, 3.0);
  ::close(fd);
}

// Issue 35, item 4: a thread that cannot start (a task limit) fails the start, or drops that one
// connection; the next connection is served.
TEST(ShmSocket, AThreadThatCannotStartIsAnErrorNotAnAbort) {
  RegionRegistry regions;
  const std::string path = SocketPath();
  FailThreadStartsForTest(1);
  auto refused = ShmSocket::Start(regions, path);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find("shm socket's acceptor"), std::string::npos) << refused.status();
  auto socket = ShmSocket::Start(regions, path);
  ASSERT_TRUE(socket.ok()) << socket.status();
  const RegionRegistry::SessionKeys session = regions.OpenSession();
  const int memfd = Memfd(4096);
  FailThreadStartsForTest(1);  // this connection's thread
  EXPECT_EQ(Register(path, session, memfd, 4096).code, -1) << "the connection was not dropped";
  const Reply r = Register(path, session, memfd, 4096);
  EXPECT_EQ(r.code, 0) << r.message;
  FailThreadStartsForTest(0);
  ::close(memfd);
}

}  // namespace
}  // namespace lce::server
