// The data plane's own limits (server/transport/region_data_plane.h), without a gRPC server: a session's
// server memory written and read back over a raw socket, and connections beyond max_connections
// refused with RESOURCE_EXHAUSTED while the others go on being served.
#include "region_data_plane.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "descriptor_exhaustion.h"
#include "gtest/gtest.h"
#include "metrics.h"
#include "service_metrics.h"
#include "thread_start.h"

namespace lce::server {
namespace {

int Connect(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0) << std::strerror(errno);
  return fd;
}

bool RecvAll(int fd, void* p, size_t n) {
  auto* b = static_cast<uint8_t*>(p);
  while (n > 0) {
    const ssize_t r = ::recv(fd, b, n, 0);
    if (r <= 0) return false;
    b += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

struct Reply {
  int32_t code = -1;
  std::string message;
};

// Reads one reply (i32 code, u32 length, message); code -1 when the connection ended first.
Reply ReadReply(int fd) {
  uint8_t head[v1::data_plane::kReplyHeaderBytes];
  Reply r;
  if (!RecvAll(fd, head, sizeof(head))) return r;
  uint32_t len = 0;
  v1::data_plane::DecodeReplyHeader(head, &r.code, &len);
  r.message.resize(len);
  if (len > 0 && !RecvAll(fd, r.message.data(), len)) r.code = -1;
  return r;
}

// Sends a transfer header (op 1 write, 2 read) and, for a write, `payload`.
void SendTransfer(int fd, uint32_t op, const RegionRegistry::SessionKeys& session, uint64_t region, int64_t offset,
                  const std::string& payload, int64_t length) {
  uint8_t head[v1::data_plane::kHeaderBytes];
  v1::data_plane::EncodeTransferHeader({op, session.id, session.secret, region, offset, length}, head);
  ASSERT_EQ(::send(fd, head, sizeof(head), MSG_NOSIGNAL), static_cast<ssize_t>(sizeof(head)));
  if (!payload.empty()) {
    ASSERT_EQ(::send(fd, payload.data(), payload.size(), MSG_NOSIGNAL), static_cast<ssize_t>(payload.size()));
  }
}

// A new connection's read of `n` bytes of the region, retried while the server still holds a closed
// connection's slot (it notices the close on its own time): the last reply.
Reply ReadOnANewConnection(int port, const RegionRegistry::SessionKeys& session, uint64_t region, int64_t n) {
  Reply r;
  for (int i = 0; i < 100 && r.code != 0; ++i) {
    const int fd = Connect(port);
    SendTransfer(fd, v1::data_plane::kOpRead, session, region, 0, "", n);
    r = ReadReply(fd);
    std::string bytes(static_cast<size_t>(n), '\0');
    if (r.code == 0 && !RecvAll(fd, bytes.data(), bytes.size())) r.code = -1;
    ::close(fd);
    if (r.code != 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return r;
}

// A data plane on a free loopback port over its own registry (1 MiB of server memory a session),
// counting in its own metrics; `o.metrics` is set here.
struct TestPlane {
  explicit TestPlane(RegionDataPlaneOptions o) {
    regions.EnableServerMemory(1 << 20);
    o.metrics = &metrics;
    auto started = RegionDataPlane::Start(regions, "127.0.0.1", 0, o);
    EXPECT_TRUE(started.ok()) << started.status();
    if (started.ok()) dp = *std::move(started);
  }
  int port() const { return dp->port(); }
  RegionRegistry regions;  // host memory: no GPU here
  metrics::Registry registry;
  ServiceMetrics metrics{registry};
  std::unique_ptr<RegionDataPlane> dp;
};

TEST(RegionDataPlane, ConnectionsBeyondTheLimitAreRefusedAndTheOthersServed) {
  RegionRegistry regions;  // host memory: no GPU here
  regions.EnableServerMemory(1 << 20);
  metrics::Registry registry;
  ServiceMetrics metrics(registry);
  RegionDataPlaneOptions o;
  o.max_write_bytes = 1 << 20;
  o.max_connections = 2;
  o.metrics = &metrics;
  auto dp = RegionDataPlane::Start(regions, "127.0.0.1", 0, o);
  ASSERT_TRUE(dp.ok()) << dp.status();
  const RegionRegistry::SessionKeys session = regions.OpenSession();
  auto region = regions.RegisterServerMemory(session.id, "r", 4096);
  ASSERT_TRUE(region.ok()) << region.status();

  const int a = Connect((*dp)->port()), b = Connect((*dp)->port());
  // Both served: a write on one, read back on the other.
  const std::string bytes(100, 'x');
  SendTransfer(a, v1::data_plane::kOpWrite, session, *region, 8, bytes, static_cast<int64_t>(bytes.size()));
  EXPECT_EQ(ReadReply(a).code, 0);
  SendTransfer(b, v1::data_plane::kOpRead, session, *region, 8, "", static_cast<int64_t>(bytes.size()));
  ASSERT_EQ(ReadReply(b).code, 0);
  std::string back(bytes.size(), '\0');
  ASSERT_TRUE(RecvAll(b, back.data(), back.size()));
  EXPECT_EQ(back, bytes);

  // A third is answered RESOURCE_EXHAUSTED at once and closed; the first two still work.
  const int c = Connect((*dp)->port());
  const Reply refused = ReadReply(c);
  EXPECT_EQ(refused.code, static_cast<int32_t>(absl::StatusCode::kResourceExhausted)) << refused.message;
  EXPECT_NE(refused.message.find("limit of 2 connections"), std::string::npos) << refused.message;
  char one;
  EXPECT_EQ(::recv(c, &one, 1, 0), 0) << "the refused connection is closed";
  ::close(c);
  EXPECT_EQ(metrics.rejections.WithLabels({"data_plane_connections"}).Value(), 1.0);
  SendTransfer(a, v1::data_plane::kOpRead, session, *region, 8, "", 4);
  EXPECT_EQ(ReadReply(a).code, 0);
  ASSERT_TRUE(RecvAll(a, back.data(), 4));

  // Once one closes, a new connection is served again (the server notices the close first).
  ::close(b);
  const Reply r = ReadOnANewConnection((*dp)->port(), session, *region, 4);
  EXPECT_EQ(r.code, 0) << r.message;
  ::close(a);
}

// Issue 16, item 1: a negative length is refused before any byte moves and the connection closed
// (its payload's end is unknown); a read of length -1 once streamed the heap beyond a 4 KiB region,
// a write of length -1 overflowed it. A negative offset or an end past 2^63 is refused too.
TEST(RegionDataPlane, NegativeOrOverflowingPlacementIsRefusedBeforeAnyByteMoves) {
  RegionRegistry regions;
  regions.EnableServerMemory(1 << 20);
  RegionDataPlaneOptions o;
  o.max_write_bytes = 1 << 20;
  auto dp = RegionDataPlane::Start(regions, "127.0.0.1", 0, o);
  ASSERT_TRUE(dp.ok()) << dp.status();
  const RegionRegistry::SessionKeys session = regions.OpenSession();
  auto region = regions.RegisterServerMemory(session.id, "r", 4096);
  ASSERT_TRUE(region.ok()) << region.status();
  const int w = Connect((*dp)->port());
  SendTransfer(w, v1::data_plane::kOpWrite, session, *region, 0, std::string(4096, 'a'), 4096);
  ASSERT_EQ(ReadReply(w).code, 0);
  ::close(w);
  struct Bad {
    uint32_t op;
    int64_t offset, length;
    std::string payload;
  };
  const int64_t max = std::numeric_limits<int64_t>::max();
  for (const Bad& b : {Bad{v1::data_plane::kOpRead, 0, -1, ""}, Bad{v1::data_plane::kOpWrite, 0, -1, std::string(65536, 'z')},
                       Bad{v1::data_plane::kOpRead, -8, 16, ""}, Bad{v1::data_plane::kOpWrite, 16, max, std::string(64, 'z')},
                       Bad{v1::data_plane::kOpRead, max, 1, ""}}) {
    const int fd = Connect((*dp)->port());
    SendTransfer(fd, b.op, session, *region, b.offset, b.payload, b.length);
    const Reply r = ReadReply(fd);
    EXPECT_EQ(r.code, static_cast<int32_t>(absl::StatusCode::kInvalidArgument))
        << "op " << b.op << " offset " << b.offset << " length " << b.length << ": " << r.message;
    if (b.length < 0) {
      char one;
      EXPECT_LE(::recv(fd, &one, 1, 0), 0) << "no bytes follow the refusal; the connection ends";
    }
    ::close(fd);
  }
  // The same slice through Resolve (the gRPC path names slices too).
  v1::RegionSlice slice;
  slice.set_region_id(*region);
  slice.set_byte_size(-1);
  EXPECT_EQ(regions.Resolve(session.id, session.secret, slice, -1, "chunk").status().code(), absl::StatusCode::kInvalidArgument);
  const Reply back = ReadOnANewConnection((*dp)->port(), session, *region, 4096);
  EXPECT_EQ(back.code, 0) << back.message;
}

// Issue 16, item 4: connections that present no session cannot lock the data plane. They count
// against their own cap (and one a peer address), never the authenticated connections', and end at
// the auth timeout; a connection whose first transfer is refused gets no second try.
TEST(RegionDataPlane, SilentConnectionsCannotLockOutASession) {
  RegionDataPlaneOptions o;
  // Room for `real`, `again` and `forged` at once: a closed connection's slot is freed when its
  // thread notices, which under load can be after the next connection arrives.
  o.max_connections = 4;
  o.max_unauthenticated = 8;
  o.max_unauthenticated_per_peer = 3;
  o.auth_timeout = absl::Milliseconds(400);
  TestPlane plane(o);
  ASSERT_NE(plane.dp, nullptr);
  RegionRegistry& regions = plane.regions;
  ServiceMetrics& metrics = plane.metrics;
  const int port = plane.port();
  const RegionRegistry::SessionKeys session = regions.OpenSession();
  auto region = regions.RegisterServerMemory(session.id, "r", 4096);
  ASSERT_TRUE(region.ok()) << region.status();
  const int real = Connect(port);  // authenticated by its first transfer
  SendTransfer(real, v1::data_plane::kOpWrite, session, *region, 0, std::string(16, 'r'), 16);
  ASSERT_EQ(ReadReply(real).code, 0);

  std::vector<int> silent;
  for (int i = 0; i < 3; ++i) silent.push_back(Connect(port));
  const int fourth = Connect(port);  // past the per-address cap: refused at once
  const Reply refused = ReadReply(fourth);
  EXPECT_EQ(refused.code, static_cast<int32_t>(absl::StatusCode::kResourceExhausted)) << refused.message;
  EXPECT_NE(refused.message.find("not presented a session"), std::string::npos) << refused.message;
  ::close(fourth);
  EXPECT_GE(metrics.rejections.WithLabels({"data_plane_unauthenticated"}).Value(), 1.0);
  // Meanwhile the session's connection works, and the silent ones take none of its slots.
  SendTransfer(real, v1::data_plane::kOpRead, session, *region, 0, "", 16);
  ASSERT_EQ(ReadReply(real).code, 0);
  std::string back(16, '\0');
  ASSERT_TRUE(RecvAll(real, back.data(), back.size()));
  EXPECT_EQ(back, std::string(16, 'r'));
  // At the auth timeout the silent ones are dropped; a new connection is served again.
  for (int fd : silent) {
    char one;
    EXPECT_LE(::recv(fd, &one, 1, 0), 0) << "a silent connection ends at the auth timeout";
    ::close(fd);
  }
  EXPECT_GE(metrics.rejections.WithLabels({"data_plane_auth_timeout"}).Value(), 3.0);
  const Reply again = ReadOnANewConnection(port, session, *region, 16);
  EXPECT_EQ(again.code, 0) << again.message;
  // A first transfer naming a made-up session, or the real session with a wrong secret (issue 22:
  // the id alone is no capability), is answered PERMISSION_DENIED and the connection closed.
  for (const RegionRegistry::SessionKeys& bad :
       {RegionRegistry::SessionKeys{RegionRegistry::NewSessionId(), session.secret},
        RegionRegistry::SessionKeys{session.id, RegionRegistry::NewSessionId()},
        RegionRegistry::SessionKeys{session.id, ""}}) {
    const int forged = Connect(port);
    SendTransfer(forged, v1::data_plane::kOpRead, bad, *region, 0, "", 16);
    const Reply r = ReadReply(forged);
    EXPECT_EQ(r.code, static_cast<int32_t>(absl::StatusCode::kPermissionDenied)) << r.message;
    EXPECT_NE(r.message.find("secret do not name an open session"), std::string::npos) << r.message;
    char one;
    EXPECT_LE(::recv(forged, &one, 1, 0), 0);
    ::close(forged);
  }
  // On an authenticated connection a wrong secret is refused too, and the connection goes on.
  SendTransfer(real, v1::data_plane::kOpWrite, {session.id, RegionRegistry::NewSessionId()}, *region, 0,
               std::string(16, 'x'), 16);
  EXPECT_EQ(ReadReply(real).code, static_cast<int32_t>(absl::StatusCode::kPermissionDenied));
  const Reply unchanged = ReadOnANewConnection(port, session, *region, 16);
  EXPECT_EQ(unchanged.code, 0) << unchanged.message;
  ::close(real);
}

// A transfer that stops half-way loses its connection after the stall timeout, and its slot is
// freed; a connection idle between transfers keeps going however long it waits.
TEST(RegionDataPlane, AStalledTransferEndsItsConnection) {
  RegionRegistry regions;
  regions.EnableServerMemory(1 << 20);
  RegionDataPlaneOptions o;
  o.max_connections = 1;
  o.stall_timeout = absl::Milliseconds(200);
  auto dp = RegionDataPlane::Start(regions, "127.0.0.1", 0, o);
  ASSERT_TRUE(dp.ok()) << dp.status();
  const RegionRegistry::SessionKeys session = regions.OpenSession();
  auto region = regions.RegisterServerMemory(session.id, "r", 4096);
  ASSERT_TRUE(region.ok()) << region.status();

  // Idle longer than the timeout before a transfer: still served.
  const int idle = Connect((*dp)->port());
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  SendTransfer(idle, v1::data_plane::kOpWrite, session, *region, 0, std::string(16, 'y'), 16);
  EXPECT_EQ(ReadReply(idle).code, 0);
  ::close(idle);

  // Half a header, then nothing: closed after the timeout, and the one slot serves the next client.
  int stalled = -1;
  for (int i = 0; i < 100; ++i) {  // the slot frees once the server has noticed the close above
    stalled = Connect((*dp)->port());
    ASSERT_EQ(::send(stalled, v1::data_plane::kMagic, 4, MSG_NOSIGNAL), 4);
    timeval tv{0, 100 * 1000};
    setsockopt(stalled, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    char b;
    const ssize_t r = ::recv(stalled, &b, 1, 0);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;  // held, not refused: the stall begins
    ::close(stalled);
    stalled = -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_GE(stalled, 0) << "the stalled connection was never served";
  timeval wait{2, 0};
  setsockopt(stalled, SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof(wait));
  char b;
  EXPECT_EQ(::recv(stalled, &b, 1, 0), 0) << "the server did not end the stalled transfer";
  ::close(stalled);
  const Reply r = ReadOnANewConnection((*dp)->port(), session, *region, 16);
  EXPECT_EQ(r.code, 0) << r.message;
}

// Issue 35, item 1: a fresh server-memory region once held whatever the heap last held there
// (another session's hidden states, gRPC buffers). Each round dirties a block of the region's size
// with a marker and frees it, so that an allocator reusing it hands the marker on; the region read
// back over the data plane, and through Resolve, must be all zeros.
TEST(RegionDataPlane, AFreshServerMemoryRegionHoldsOnlyZeros) {
  RegionRegistry regions;
  regions.EnableServerMemory(int64_t{64} << 20);
  auto dp = RegionDataPlane::Start(regions, "127.0.0.1", 0, RegionDataPlaneOptions{});
  ASSERT_TRUE(dp.ok()) << dp.status();
  const RegionRegistry::SessionKeys session = regions.OpenSession();
  const int fd = Connect((*dp)->port());
  for (const int64_t size : {int64_t{4096}, int64_t{4096}, int64_t{65536}, int64_t{1} << 20}) {
    void* dirty = std::aligned_alloc(4096, static_cast<size_t>(size));
    ASSERT_NE(dirty, nullptr);
    std::memset(dirty, 0xA5, static_cast<size_t>(size));
    asm volatile("" : : "r"(dirty) : "memory");  // the marker is really written before the free
    std::free(dirty);
    auto region = regions.RegisterServerMemory(session.id, "fresh", size);
    ASSERT_TRUE(region.ok()) << region.status();
    v1::RegionSlice slice;
    slice.set_region_id(*region);
    slice.set_byte_size(size);
    auto resolved = regions.Resolve(session.id, session.secret, slice, size, "fresh");
    ASSERT_TRUE(resolved.ok()) << resolved.status();
    EXPECT_EQ(std::count(resolved->bytes.begin(), resolved->bytes.end(), 0), size) << size << "-byte region";
    SendTransfer(fd, v1::data_plane::kOpRead, session, *region, 0, "", size);
    ASSERT_EQ(ReadReply(fd).code, 0);
    std::string back(static_cast<size_t>(size), '\1');
    ASSERT_TRUE(RecvAll(fd, back.data(), back.size()));
    EXPECT_EQ(std::count(back.begin(), back.end(), '\0'), size) << size << "-byte region over the data plane";
    ASSERT_TRUE(regions.Unregister(session.id, *region).ok());
  }
  ::close(fd);
}

// Issue 35, item 3: an accept that failed with EMFILE once ended the accept loop for good; every
// later connection waited in the backlog unanswered although the descriptors were free again.
TEST(RegionDataPlane, AcceptsAgainAfterTheDescriptorsRanOut) {
  RegionRegistry regions;
  regions.EnableServerMemory(1 << 20);
  metrics::Registry registry;
  ServiceMetrics metrics(registry);
  RegionDataPlaneOptions o;
  o.metrics = &metrics;
  auto dp = RegionDataPlane::Start(regions, "127.0.0.1", 0, o);
  ASSERT_TRUE(dp.ok()) << dp.status();
  const RegionRegistry::SessionKeys session = regions.OpenSession();
  auto region = regions.RegisterServerMemory(session.id, "r", 4096);
  ASSERT_TRUE(region.ok()) << region.status();
  auto round_trip = [&] {
    const int fd = Connect((*dp)->port());
    const timeval tv{5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    SendTransfer(fd, v1::data_plane::kOpRead, session, *region, 0, "", 16);
    const Reply r = ReadReply(fd);
    ::close(fd);
    return r;
  };
  // One served connection first: the listener's and a connection's threads have started before the
  // descriptors run out (UBSan's checks at a thread's start need descriptors of their own).
  const int open_before = DescriptorExhaustion::OpenDescriptors();
  ASSERT_EQ(round_trip().code, 0);
  DescriptorExhaustion::AwaitOpenAtMost(open_before);
  {
    DescriptorExhaustion exhausted;
    ASSERT_TRUE(exhausted.exhausted());
    exhausted.Free(1);  // the client's socket; the server's accept finds none left
    const int fd = Connect((*dp)->port());
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    ::close(fd);
  }
  const Reply r = round_trip();
  EXPECT_EQ(r.code, 0) << "no reply: the listener stopped accepting. " << r.message;
  EXPECT_GE(metrics.accept_errors.WithLabels({"data_plane", "EMFILE"}).Value(), 1.0);
}

TEST(RegionDataPlane, NeedsRoomForOneConnectionAndAPositiveStallTimeout) {
  RegionRegistry regions;
  RegionDataPlaneOptions o;
  o.max_connections = 0;
  EXPECT_EQ(RegionDataPlane::Start(regions, "127.0.0.1", 0, o).status().code(), absl::StatusCode::kInvalidArgument);
  o.max_connections = 1;
  o.stall_timeout = absl::ZeroDuration();
  EXPECT_EQ(RegionDataPlane::Start(regions, "127.0.0.1", 0, o).status().code(), absl::StatusCode::kInvalidArgument);
}

// Issue 35, item 5: one session holding idle connections once locked every other client out of the
// pool. A session holds at most max_connections_per_session of it, and an authenticated connection
// idle for idle_timeout ends.
TEST(RegionDataPlane, OneSessionCannotTakeThePoolAndIdleConnectionsEnd) {
  RegionDataPlaneOptions o;
  o.max_connections = 4;
  o.max_connections_per_session = 2;
  o.idle_timeout = absl::Milliseconds(600);
  TestPlane plane(o);
  ASSERT_NE(plane.dp, nullptr);
  RegionRegistry& regions = plane.regions;
  const int port = plane.port();
  const RegionRegistry::SessionKeys hog = regions.OpenSession(), other = regions.OpenSession();
  auto hog_region = regions.RegisterServerMemory(hog.id, "r", 4096);
  auto other_region = regions.RegisterServerMemory(other.id, "r", 4096);
  ASSERT_TRUE(hog_region.ok() && other_region.ok());
  std::vector<int> held;
  for (int i = 0; i < 3; ++i) {
    held.push_back(Connect(port));
    SendTransfer(held.back(), v1::data_plane::kOpWrite, hog, *hog_region, 0, std::string(16, 'h'), 16);
    const Reply r = ReadReply(held.back());
    if (i < 2) {
      EXPECT_EQ(r.code, 0) << r.message;
    } else {
      EXPECT_EQ(r.code, static_cast<int32_t>(absl::StatusCode::kResourceExhausted)) << r.message;
      EXPECT_NE(r.message.find("--data-plane-max-connections-per-session"), std::string::npos) << r.message;
    }
  }
  EXPECT_EQ(plane.metrics.rejections.WithLabels({"data_plane_session_connections"}).Value(), 1.0);
  const Reply served = ReadOnANewConnection(port, other, *other_region, 16);
  EXPECT_EQ(served.code, 0) << "another session is locked out: " << served.message;
  // The hog's connections, idle past the timeout, are closed by the server.
  for (int i = 0; i < 2; ++i) {
    timeval wait{3, 0};
    setsockopt(held[i], SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof(wait));
    char b;
    EXPECT_EQ(::recv(held[i], &b, 1, 0), 0) << "an idle authenticated connection was kept";
  }
  for (int fd : held) ::close(fd);
  EXPECT_GE(plane.metrics.rejections.WithLabels({"data_plane_idle_timeout"}).Value(), 2.0);
}

// Issue 35, item 4: a thread that cannot start (a task limit) fails the start, or refuses that one
// connection with RESOURCE_EXHAUSTED; the next connection is served.
TEST(RegionDataPlane, AThreadThatCannotStartIsAnErrorNotAnAbort) {
  RegionRegistry regions;
  regions.EnableServerMemory(1 << 20);
  metrics::Registry registry;
  ServiceMetrics metrics(registry);
  RegionDataPlaneOptions o;
  o.metrics = &metrics;
  FailThreadStartsForTest(1);
  auto refused = RegionDataPlane::Start(regions, "127.0.0.1", 0, o);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  auto dp = RegionDataPlane::Start(regions, "127.0.0.1", 0, o);
  ASSERT_TRUE(dp.ok()) << dp.status();
  const RegionRegistry::SessionKeys session = regions.OpenSession();
  auto region = regions.RegisterServerMemory(session.id, "r", 4096);
  ASSERT_TRUE(region.ok()) << region.status();
  FailThreadStartsForTest(1);  // this connection's thread
  const int a = Connect((*dp)->port());
  const Reply r = ReadReply(a);
  EXPECT_EQ(r.code, static_cast<int32_t>(absl::StatusCode::kResourceExhausted)) << r.message;
  EXPECT_NE(r.message.find("cannot start a thread"), std::string::npos) << r.message;
  ::close(a);
  EXPECT_EQ(metrics.rejections.WithLabels({"threads"}).Value(), 1.0);
  FailThreadStartsForTest(0);
  EXPECT_EQ(ReadOnANewConnection((*dp)->port(), session, *region, 16).code, 0);
}

}  // namespace
}  // namespace lce::server
