// Issue 16, item 3: shared memory by name is for clients on the server's host that own the object,
// and an object registered by one session cannot be registered by another (a second session once
// read another client's 0600 object as hidden states and overwrote it with d_hidden).
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include "gtest/gtest.h"
#include "lce/client/lce_client.h"
#include "test_server.h"

namespace lce::e2e {
namespace {

TEST(ShmOwnership, AnotherSessionCannotRegisterAnObjectInUse) {
  auto ts = StartTestServer();
  auto c = ConnectClient(ts->target, 1 << 20);
  auto owner = c->OpenSession();
  auto thief = c->OpenSession();
  ASSERT_TRUE(owner.ok() && thief.ok());
  auto region = (*owner)->CreateRegion(4096, "victim");
  ASSERT_TRUE(region.ok()) << region.status();
  auto stolen = (*thief)->Register(region->shm_name, 0, 4096);
  EXPECT_EQ(stolen.status().code(), absl::StatusCode::kPermissionDenied) << stolen.status();
  EXPECT_NE(stolen.status().message().find("another session"), std::string::npos) << stolen.status();
  // The owner may map it again (two tensors over one allocation).
  auto again = (*owner)->Register(region->shm_name, 0, 4096);
  EXPECT_TRUE(again.ok()) << again.status();
}

TEST(ShmOwnership, AnObjectOfAnotherUserIsRefused) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to give an object to another uid: not checked here";
  auto ts = StartTestServer();
  auto c = ConnectClient(ts->target, 1 << 20);
  auto s = c->OpenSession();
  ASSERT_TRUE(s.ok());
  const std::string name = "/lce-ownership-" + std::to_string(getpid());
  const int fd = shm_open(name.c_str(), O_CREAT | O_RDWR | O_EXCL, 0666);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  ASSERT_EQ(fchown(fd, 65534, 65534), 0);  // nobody
  close(fd);
  auto r = (*s)->Register(name, 0, 4096);
  shm_unlink(name.c_str());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kPermissionDenied) << r.status();
  EXPECT_NE(r.status().message().find("belongs to uid 65534"), std::string::npos) << r.status();
}

}  // namespace
}  // namespace lce::e2e
