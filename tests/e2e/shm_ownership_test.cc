// Who may register what as a co-located client's memory. Issue 22: memory goes to the server as a file
// descriptor over its shm socket (SCM_RIGHTS), with the session's id and secret, from the session's
// uid; registration by name is off unless the server allows it (--allow-shm-by-name). Issue 16,
// item 3: an object registered by one session cannot be registered by another, and by name only its
// owner's sessions may register it.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>

#include "gtest/gtest.h"
#include "lce/client/lce_client.h"
#include "lce/v1/shm_socket_wire.h"
#include "shm_socket_client.h"
#include "test_server.h"

namespace lce::e2e {
namespace {

namespace wire = v1::shm_socket;

std::unique_ptr<TestServer> ServerAllowingNames() {
  return StartTestServer(8 << 20, false, true, [](server::GrpcServerOptions& o) { o.allow_shm_by_name = true; });
}

// A memfd of `bytes`, opened read-write.
int Memfd(int64_t bytes) {
  const int fd = memfd_create("lce-ownership", MFD_CLOEXEC);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(ftruncate(fd, bytes), 0);
  return fd;
}

TEST(ShmOwnership, ByNameIsOffByDefault) {
  auto ts = StartTestServer();
  auto s = ConnectClient(ts->target, 1 << 20)->OpenSession();
  ASSERT_TRUE(s.ok());
  const std::string name = "/lce-by-name-" + std::to_string(getpid());
  const int fd = shm_open(name.c_str(), O_CREAT | O_RDWR | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  auto r = (*s)->Register(name, 0, 4096);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kPermissionDenied) << r.status();
  EXPECT_NE(r.status().message().find("--allow-shm-by-name"), std::string::npos) << r.status();
  // The same object handed over as a descriptor is accepted.
  auto by_fd = (*s)->RegisterFd(fd, 0, 4096, "by-fd");
  EXPECT_TRUE(by_fd.ok()) << by_fd.status();
  close(fd);
  shm_unlink(name.c_str());
}

TEST(ShmOwnership, AnotherSessionCannotRegisterAnObjectInUse) {
  auto ts = ServerAllowingNames();
  auto c = ConnectClient(ts->target, 1 << 20);
  auto owner = c->OpenSession();
  auto thief = c->OpenSession();
  ASSERT_TRUE(owner.ok() && thief.ok());
  auto region = (*owner)->CreateRegion(4096, "victim");
  ASSERT_TRUE(region.ok()) << region.status();
  auto stolen = (*thief)->RegisterFd(region->fd, 0, 4096);
  EXPECT_EQ(stolen.status().code(), absl::StatusCode::kPermissionDenied) << stolen.status();
  EXPECT_NE(stolen.status().message().find("another session"), std::string::npos) << stolen.status();
  // The owner may map it again (two tensors over one allocation).
  auto again = (*owner)->RegisterFd(region->fd, 0, 4096);
  EXPECT_TRUE(again.ok()) << again.status();
  // By name too, where names are allowed.
  const std::string name = "/lce-in-use-" + std::to_string(getpid());
  const int fd = shm_open(name.c_str(), O_CREAT | O_RDWR | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  close(fd);
  EXPECT_TRUE((*owner)->Register(name, 0, 4096).ok());
  EXPECT_EQ((*thief)->Register(name, 0, 4096).status().code(), absl::StatusCode::kPermissionDenied);
  shm_unlink(name.c_str());
}

TEST(ShmOwnership, AnObjectOfAnotherUserIsRefusedByName) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to give an object to another uid: not checked here";
  auto ts = ServerAllowingNames();
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

// The request's bytes (and no descriptor) straight to the socket: the reply's code and message.
std::pair<int32_t, std::string> SendWithoutFd(const std::string& path, const wire::Request& req) {
  const int sock = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  EXPECT_EQ(::connect(sock, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  uint8_t head[wire::kRequestBytes];
  wire::EncodeRequest(req, head);
  EXPECT_EQ(::send(sock, head, sizeof(head), 0), static_cast<ssize_t>(sizeof(head)));
  uint8_t reply[wire::kReplyHeaderBytes];
  int32_t code = -1;
  uint32_t len = 0;
  uint64_t id = 0;
  std::string message;
  if (::recv(sock, reply, sizeof(reply), MSG_WAITALL) == static_cast<ssize_t>(sizeof(reply))) {
    wire::DecodeReplyHeader(reply, &code, &len, &id);
    message.resize(len);
    if (len > 0) ::recv(sock, message.data(), len, MSG_WAITALL);
  }
  ::close(sock);
  return {code, message};
}

TEST(ShmOwnership, TheShmSocketChecksTheSecretTheDescriptorAndTheSender) {
  auto ts = StartTestServer();
  auto c = ConnectClient(ts->target, 1 << 20);
  auto s = c->OpenSession();
  auto other = c->OpenSession();
  ASSERT_TRUE(s.ok() && other.ok());
  const std::string path = (*s)->shm_socket();
  ASSERT_FALSE(path.empty());
  EXPECT_EQ(path, ts->server->shm_socket());
  const int fd = Memfd(4096);
  auto expect = [&](const absl::StatusOr<uint64_t>& r, absl::StatusCode code, const char* says) {
    EXPECT_EQ(r.status().code(), code) << r.status();
    EXPECT_NE(r.status().message().find(says), std::string::npos) << r.status();
  };
  // The id with another session's secret, a made-up secret, a made-up session.
  expect(client::RegisterFdOverSocket(path, {(*s)->id(), (*other)->secret(), 0, 4096, "r"}, fd),
         absl::StatusCode::kPermissionDenied, "secret do not name an open session");
  expect(client::RegisterFdOverSocket(path, {(*s)->id(), std::string(32, 'a'), 0, 4096, "r"}, fd),
         absl::StatusCode::kPermissionDenied, "secret");
  expect(client::RegisterFdOverSocket(path, {std::string(32, 'b'), (*s)->secret(), 0, 4096, "r"}, fd),
         absl::StatusCode::kPermissionDenied, "secret");
  // No descriptor; one that is not read-write; one that is not a regular file; bad bounds.
  const auto [code, message] = SendWithoutFd(path, {(*s)->id(), (*s)->secret(), 0, 4096, ""});
  EXPECT_EQ(code, static_cast<int32_t>(absl::StatusCode::kInvalidArgument)) << message;
  EXPECT_NE(message.find("exactly one file descriptor"), std::string::npos) << message;
  const int read_only = open(("/proc/self/fd/" + std::to_string(fd)).c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(read_only, 0);
  expect((*s)->RegisterFd(read_only, 0, 4096), absl::StatusCode::kInvalidArgument, "read-write");
  close(read_only);
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  expect((*s)->RegisterFd(pipe_fds[1], 0, 16), absl::StatusCode::kInvalidArgument, "regular file");
  close(pipe_fds[0]);
  close(pipe_fds[1]);
  expect((*s)->RegisterFd(fd, 4000, 200), absl::StatusCode::kInvalidArgument, "exceeds the object's size");
  // After every refusal, the right request is accepted and the region serves the session.
  auto ok = (*s)->RegisterFd(fd, 0, 4096, "good");
  EXPECT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ts->server->regions().counts().shm, 1u);

  // A process of another uid, with the right secret, is refused (SO_PEERCRED).
  if (geteuid() == 0) {
    const pid_t child = fork();
    if (child == 0) {
      if (setgid(65534) != 0 || setuid(65534) != 0) _exit(2);
      auto r = client::RegisterFdOverSocket(path, {(*s)->id(), (*s)->secret(), 0, 4096, "r"}, fd);
      _exit(r.status().code() == absl::StatusCode::kPermissionDenied &&
                    r.status().message().find("uid 65534") != std::string_view::npos
                ? 0
                : 1);
    }
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  }
  close(fd);
}

}  // namespace
}  // namespace lce::e2e
