// The SIGBUS guard over shared mappings (issue 16 item 2): a mapping whose object is shrunk under it
// reads and writes zeros and is marked lost instead of killing the process; a fault anywhere else
// still kills it.
#include "shm_fault_guard.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstring>

#include "gtest/gtest.h"

namespace lce::server {
namespace {

constexpr size_t kBytes = 4 * 4096;

struct Mapped {
  int fd = -1;
  uint8_t* p = nullptr;
  Mapped() {
    fd = memfd_create("lce-guard-test", 0);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(ftruncate(fd, kBytes), 0);
    void* m = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    EXPECT_NE(m, MAP_FAILED);
    p = static_cast<uint8_t*>(m);
    std::memset(p, 7, kBytes);
  }
  ~Mapped() {
    munmap(p, kBytes);
    close(fd);
  }
};

TEST(ShmFaultGuard, AShrunkObjectReadsZerosAndIsMarkedLost) {
  Mapped m;
  std::atomic<bool> lost{false};
  WatchSharedMapping(m.p, kBytes, &lost);
  ASSERT_EQ(ftruncate(m.fd, 4096), 0);  // the first page stays, the rest is gone
  EXPECT_FALSE(lost.load());
  volatile uint8_t* v = m.p;
  EXPECT_EQ(v[kBytes - 1], 0);  // faults; the guard maps zeros over the whole mapping
  EXPECT_TRUE(lost.load());
  EXPECT_EQ(v[0], 0);
  v[kBytes - 1] = 3;  // writable too, and private now: the object is untouched
  EXPECT_EQ(v[kBytes - 1], 3);
  UnwatchSharedMapping(m.p);
}

TEST(ShmFaultGuard, MappingsAreWatchedSeparately) {
  Mapped a, b;
  std::atomic<bool> lost_a{false}, lost_b{false};
  WatchSharedMapping(a.p, kBytes, &lost_a);
  WatchSharedMapping(b.p, kBytes, &lost_b);
  ASSERT_EQ(ftruncate(b.fd, 0), 0);
  volatile uint8_t* vb = b.p;
  EXPECT_EQ(vb[10], 0);
  EXPECT_TRUE(lost_b.load());
  EXPECT_FALSE(lost_a.load());
  EXPECT_EQ(a.p[10], 7);
  UnwatchSharedMapping(a.p);
  UnwatchSharedMapping(b.p);
}

TEST(ShmFaultGuardDeathTest, AFaultOutsideEveryWatchedMappingStillKills) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  Mapped watched;
  std::atomic<bool> lost{false};
  WatchSharedMapping(watched.p, kBytes, &lost);  // the handler is installed
  EXPECT_EXIT(
      {
        Mapped other;  // not watched
        ASSERT_EQ(ftruncate(other.fd, 0), 0);
        volatile uint8_t* v = other.p;
        (void)v[0];
      },
      testing::KilledBySignal(SIGBUS), "");
  // A mapping no longer watched is no longer rescued.
  UnwatchSharedMapping(watched.p);
  EXPECT_EXIT(
      {
        ASSERT_EQ(ftruncate(watched.fd, 0), 0);
        volatile uint8_t* v = watched.p;
        (void)v[0];
      },
      testing::KilledBySignal(SIGBUS), "");
  EXPECT_FALSE(lost.load());
}

// The watched range is [base, base + len): the first byte past it belongs to whatever follows (here
// the unwatched rest of the same mapping), whose fault must still kill. Guards against the range check
// `addr > end` (the handler "rescues" the byte past the end, the access faults again forever: a hang,
// which the alarm turns into SIGALRM).
TEST(ShmFaultGuardDeathTest, AFaultOneBytePastAWatchedRangeStillKills) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        alarm(10);
        int fd = memfd_create("lce-guard-edge", 0);
        ASSERT_EQ(ftruncate(fd, 2 * kBytes), 0);
        void* m = mmap(nullptr, 2 * kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        ASSERT_NE(m, MAP_FAILED);
        volatile uint8_t* v = static_cast<uint8_t*>(m);
        std::atomic<bool> lost{false};
        WatchSharedMapping(m, kBytes, &lost);  // the first half only
        ASSERT_EQ(ftruncate(fd, 0), 0);
        if (v[kBytes - 1] != 0 || !lost.load()) _exit(1);  // the last watched byte is rescued
        (void)v[kBytes];
      },
      testing::KilledBySignal(SIGBUS), "");
}

}  // namespace
}  // namespace lce::server
