// A GrpcServer whose start fails (issue 35, item 13): the error comes back with a message that says
// what to do, and the half-built server is torn down without touching the gRPC server it never had
// (~GrpcServer once called Shutdown on a null one: SIGSEGV, no message).
#include "grpc_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace lce::server {
namespace {

TEST(GrpcServerStart, APreCreatedShmSocketFileIsAClearErrorNotACrash) {
  const std::string path = "/tmp/lce-grpc-server-start-test-" + std::to_string(getpid()) + ".sock";
  std::ofstream(path) << "planted";
  GrpcServerOptions o;
  o.address = "127.0.0.1:0";
  o.data_port = 0;
  o.shm_socket = path;
  auto server = GrpcServer::Start(std::make_shared<HeadStore>(), o);
  ::unlink(path.c_str());
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kFailedPrecondition) << server.status();
  EXPECT_NE(server.status().message().find("--shm-socket="), std::string::npos) << server.status();
}

TEST(GrpcServerStart, ADataPortInUseIsAnErrorNotACrash) {
  const int taken = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  ASSERT_EQ(::bind(taken, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(::listen(taken, 1), 0);
  socklen_t len = sizeof(a);
  getsockname(taken, reinterpret_cast<sockaddr*>(&a), &len);
  GrpcServerOptions o;
  o.address = "127.0.0.1:0";
  o.data_port = ntohs(a.sin_port);
  o.shm_socket = "";
  auto server = GrpcServer::Start(std::make_shared<HeadStore>(), o);
  EXPECT_FALSE(server.ok());
  ::close(taken);
}

}  // namespace
}  // namespace lce::server
