// The data plane (ClientOptions.data_plane, server/transport/region_data_plane.h): a remote client's hidden
// states and d_hidden travel over plain TCP into and out of server memory, and the answers are the
// bytes path's; every transfer is checked (owner, bounds, kind of region) and a refusal leaves the
// connection and the server working; a session's server memory goes with the session.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>
#include <tuple>

#include "data_plane_connection.h"
#include "lce/v1/data_plane_wire.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "lce/client/lce_client.h"
#include "test_server.h"

namespace lce::e2e {
namespace {

using client::ClientOptions;
using client::DataPlaneConnection;
using client::HiddenBatch;
using client::LceClient;

// The data plane makes the bytes path's engine calls (equal answers on the CPU engine).
std::unique_ptr<LceClient> Connect(const TestServer& ts, int streams, bool data_plane, int64_t chunk_bytes,
                                   int sockets = 2) {
  return ConnectClient(ts.target, chunk_bytes, [&](ClientOptions& o) {
    o.data_plane_sockets = sockets;
    o.streams = o.data_plane_streams = streams;
    o.min_stream_bytes = 2 * chunk_bytes;  // small, so that a test-sized batch splits
    o.data_plane = data_plane;
  });
}

// Same chunks, same engine calls: equal on the CPU engine, to rounding on a GPU.

void ExpectSameBytes(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  if (TestBackend() == Backend::kCpu) {
    EXPECT_TRUE(got == want) << what << " differs";
    return;
  }
  size_t differ = 0;
  for (size_t i = 0; i < got.size(); ++i) differ += got[i] != want[i] ? 1 : 0;
  EXPECT_LE(differ, got.size() / 20) << what;  // rounding of the last bf16 bit, at most
}

TEST(DataPlane, AnswersEqualTheBytesPathOverOneAndSeveralStreams) {
  auto ts = StartTestServer();
  ASSERT_GT(ts->server->data_port(), 0);
  const int64_t row_bytes = kHidden * 2;
  const Batch b = MakeBatch(600, v1::DTYPE_BFLOAT16, 31);
  for (int streams : {1, 4}) {
    SCOPED_TRACE(streams);
    auto bytes = Connect(*ts, streams, false, 16 * row_bytes);
    auto plane = Connect(*ts, streams, true, 16 * row_bytes);
    v1::RequestHeader h;
    h.set_temperature(0.7f);
    auto want_s = bytes->Score(View(b), h);
    auto got_s = plane->Score(View(b), h);
    ASSERT_TRUE(want_s.ok() && got_s.ok()) << want_s.status() << got_s.status();
    ExpectElementsNear(got_s->logprobs, want_s->logprobs, TransportTolerance(), "logprobs");
    ExpectElementsNear(got_s->entropy, want_s->entropy, TransportTolerance(), "entropy");
    EXPECT_EQ(ts->server->regions().counts().server, 1u);  // the hidden states' region; Score needs no other

    v1::RequestHeader fb;
    fb.add_outputs(v1::OUTPUT_LOSS);
    auto want = bytes->ForwardBackward(View(b), fb);
    // The data plane's bytes count in lce_bytes_{received,sent}_total as the messages' do.
    const double received = ts->metrics->bytes_received.Value(), sent = ts->metrics->bytes_sent.Value();
    auto got = plane->ForwardBackward(View(b), fb);
    EXPECT_GE(ts->metrics->bytes_received.Value() - received, static_cast<double>(b.hidden.size()));
    EXPECT_GE(ts->metrics->bytes_sent.Value() - sent, static_cast<double>(b.hidden.size()));
    ASSERT_TRUE(want.ok() && got.ok()) << want.status() << got.status();
    EXPECT_NEAR(got->reduced_loss, want->reduced_loss, 1e-6 * std::fabs(want->reduced_loss));
    ExpectElementsNear(got->loss, want->loss, TransportTolerance(), "loss");
    ExpectSameBytes(got->d_hidden, want->d_hidden, "d_hidden");
    EXPECT_EQ(ts->server->regions().counts().server, 2u);

    // Into the caller's buffer, and Backward.
    std::vector<uint8_t> dst(b.hidden.size(), 0xff);
    HiddenBatch into = View(b);
    into.d_hidden_out = absl::MakeSpan(dst);
    auto got_into = plane->ForwardBackward(into, fb);
    ASSERT_TRUE(got_into.ok()) << got_into.status();
    EXPECT_TRUE(got_into->d_hidden.empty());
    ExpectSameBytes(dst, want->d_hidden, "d_hidden_out");
    std::vector<float> gl(b.rows, 0.5f), ge(b.rows, -0.25f);
    auto want_b = bytes->Backward(View(b), {}, gl, ge);
    auto got_b = plane->Backward(View(b), {}, gl, ge);
    ASSERT_TRUE(want_b.ok() && got_b.ok()) << want_b.status() << got_b.status();
    ExpectSameBytes(got_b->d_hidden, want_b->d_hidden, "backward d_hidden");

    // A larger batch grows the regions; a smaller one reuses them.
    const Batch big = MakeBatch(3000, v1::DTYPE_BFLOAT16, 32);
    auto want_big = bytes->ForwardBackward(View(big), fb);
    auto got_big = plane->ForwardBackward(View(big), fb);
    ASSERT_TRUE(want_big.ok() && got_big.ok()) << want_big.status() << got_big.status();
    ExpectSameBytes(got_big->d_hidden, want_big->d_hidden, "grown d_hidden");
    EXPECT_EQ(ts->server->regions().counts().server, 2u);
    // Chunks large enough to be split over several sockets per direction (64 KiB and more).
    auto split = Connect(*ts, streams, true, 1500 * row_bytes, /*sockets=*/3);
    auto got_split = split->ForwardBackward(View(big), fb);
    ASSERT_TRUE(got_split.ok()) << got_split.status();
    auto want_split = Connect(*ts, streams, false, 1500 * row_bytes)->ForwardBackward(View(big), fb);
    ASSERT_TRUE(want_split.ok()) << want_split.status();
    ExpectSameBytes(got_split->d_hidden, want_split->d_hidden, "d_hidden over 3 sockets a direction");
    split.reset();
    plane.reset();  // its session ends, and its server memory with it
    for (int i = 0; i < 200 && ts->server->regions().counts().server != 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_EQ(ts->server->regions().counts().server, 0u);
  }
}

// A request over the data plane goes as one stream by default (ClientOptions.data_plane_streams) where the same
// client splits it over the wire; data_plane_streams, up to `streams`, splits it there too.
TEST(DataPlane, OneStreamByDefault) {
  auto ts = StartTestServer();
  const int64_t row_bytes = kHidden * 2;
  const Batch b = MakeBatch(600, v1::DTYPE_BFLOAT16, 34);
  for (const auto& [data_plane, data_plane_streams, want] :
       {std::tuple{false, 1, 4}, std::tuple{true, 1, 1}, std::tuple{true, 3, 3}, std::tuple{true, 8, 4}}) {
    SCOPED_TRACE(testing::Message() << "data plane " << data_plane << ", data_plane_streams " << data_plane_streams);
    std::atomic<int> streams{0};
    // Copies of the bindings: clang 14 cannot capture a structured binding.
    auto c =
        ConnectClient(ts->target, 16 * row_bytes, [&, dp = data_plane, dps = data_plane_streams](ClientOptions& o) {
          o.streams = 4;
          o.min_stream_bytes = 32 * row_bytes;
          o.data_plane = dp;
          o.data_plane_streams = dps;
          o.stream_trace = [&streams](const client::StreamTrace&) { ++streams; };
        });
    v1::RequestHeader fb;
    fb.add_outputs(v1::OUTPUT_LOSS);
    auto got = c->ForwardBackward(View(b), fb);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(streams.load(), want);
  }
}

TEST(DataPlane, NeedsAServerWithOne) {
  auto ts = StartTestServer(8 << 20, false, /*data_plane=*/false);
  const Batch b = MakeBatch(10, v1::DTYPE_BFLOAT16, 33);
  auto info = Connect(*ts, 1, false, 4 << 20)->GetInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->data_port(), 0);
  auto c = Connect(*ts, 1, true, 4 << 20);
  auto r = c->Score(View(b), {});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_NE(r.status().message().find("--data-port"), std::string::npos) << r.status();
  auto s = c->OpenSession();
  ASSERT_TRUE(s.ok());
  auto m = (*s)->AllocateServerMemory(1024);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kFailedPrecondition) << m.status();
}

TEST(DataPlane, TransfersAreCheckedAndARefusalLeavesTheConnectionWorking) {
  auto ts = StartTestServer();
  auto c = Connect(*ts, 1, false, 4 << 20);
  auto a = c->OpenSession();
  auto other = c->OpenSession();
  ASSERT_TRUE(a.ok() && other.ok());
  auto region = (*a)->AllocateServerMemory(4096, "mine");
  auto theirs = (*other)->AllocateServerMemory(4096, "theirs");
  auto shm = (*a)->CreateRegion(4096, "shm");
  ASSERT_TRUE(region.ok() && theirs.ok() && shm.ok()) << region.status() << theirs.status() << shm.status();
  // Issue 22: a connection that shows another session's secret for this session's id is refused at
  // its first transfer (PERMISSION_DENIED) and closed.
  auto wrong = DataPlaneConnection::Connect("127.0.0.1", ts->server->data_port(), {(*other)->secret()});
  ASSERT_TRUE(wrong.ok()) << wrong.status();
  std::vector<uint8_t> probe(16);
  const absl::Status refused = (*wrong)->Write((*a)->id(), *region, 0, probe);
  EXPECT_EQ(refused.code(), absl::StatusCode::kPermissionDenied) << refused;
  EXPECT_NE(refused.message().find("secret"), std::string::npos) << refused;
  EXPECT_FALSE((*wrong)->Write((*a)->id(), *region, 0, probe).ok()) << "no second try";
  auto conn = DataPlaneConnection::Connect("127.0.0.1", ts->server->data_port(), {(*a)->secret()});
  ASSERT_TRUE(conn.ok()) << conn.status();
  DataPlaneConnection& dp = **conn;
  const std::string& id = (*a)->id();

  std::vector<uint8_t> data(1000), back(1000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 7 + 3);
  ASSERT_TRUE(dp.Write(id, *region, 96, data).ok());
  ASSERT_TRUE(dp.Read(id, *region, 96, absl::MakeSpan(back)).ok());
  EXPECT_EQ(back, data);

  auto expect = [&](absl::Status s, absl::StatusCode code, const char* says) {
    EXPECT_EQ(s.code(), code) << s;
    EXPECT_NE(s.message().find(says), std::string::npos) << s;
    EXPECT_TRUE(dp.usable());
  };
  expect(dp.Write(id, *region, 3500, data), absl::StatusCode::kInvalidArgument, "does not fit");
  expect(dp.Read(id, *region, -1, absl::MakeSpan(back)), absl::StatusCode::kInvalidArgument, "does not fit");
  expect(dp.Write(id, *theirs, 0, data), absl::StatusCode::kPermissionDenied, "another session");
  expect(dp.Read(id, *theirs, 0, absl::MakeSpan(back)), absl::StatusCode::kPermissionDenied, "another session");
  expect(dp.Write(id, shm->id, 0, data), absl::StatusCode::kInvalidArgument, "not server memory");
  expect(dp.Write(id, 999999, 0, data), absl::StatusCode::kNotFound, "not registered");
  // After every refusal the connection still carries transfers.
  std::fill(back.begin(), back.end(), 0);
  ASSERT_TRUE(dp.Read(id, *region, 96, absl::MakeSpan(back)).ok());
  EXPECT_EQ(back, data);

  // Beyond the session's limit: refused, nothing allocated.
  auto huge = (*a)->AllocateServerMemory(int64_t{64} << 30);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted) << huge.status();

  // A header without the magic: answered, the connection closed, the server still serving.
  {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(ts->server->data_port()));
    inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    char junk[v1::data_plane::kHeaderBytes];
    std::memset(junk, 'x', sizeof(junk));
    ASSERT_EQ(::send(fd, junk, sizeof(junk), 0), static_cast<ssize_t>(sizeof(junk)));
    int32_t code = 0;
    ASSERT_EQ(::recv(fd, &code, 4, MSG_WAITALL), 4);
    EXPECT_EQ(code, static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
    char rest[256];
    ssize_t n = 0, total = 0;
    while ((n = ::recv(fd, rest, sizeof(rest), 0)) > 0) total += n;
    EXPECT_EQ(n, 0) << "the server should close the connection";
    EXPECT_GT(total, 4);  // length and message
    ::close(fd);
  }

  // The session's end frees its server memory and forgets its secret: transfers naming it are
  // PERMISSION_DENIED from then on.
  const std::string gone = id;
  const uint64_t gone_region = *region;
  a->reset();
  absl::Status s;
  for (int i = 0; i < 200; ++i) {
    s = dp.Write(gone, gone_region, 0, data);
    if (s.code() == absl::StatusCode::kPermissionDenied) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_EQ(ts->server->regions().counts().server, 1u);  // `other`'s
  EXPECT_TRUE(c->Score(View(MakeBatch(4, v1::DTYPE_BFLOAT16, 34)), {}).ok());
}

// A CA and a server certificate for 127.0.0.1 and localhost, made with the openssl command (Debian's
// openssl package) in a fresh directory; "" when it is missing.
std::string MakeCertificates() {
  char dir_template[] = "/tmp/lce-tls-XXXXXX";
  const char* dir = mkdtemp(dir_template);
  if (dir == nullptr) return "";
  const std::string d = dir;
  const std::string ec = " -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  const std::string cmd = "cd " + d + " && printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' > san.ext && " +
                          "openssl req -x509" + ec + " -keyout ca.key -out ca.pem -days 2 -subj /CN=lce-test-ca && " +
                          "openssl req" + ec + " -keyout server.key -out server.csr -subj /CN=localhost && " +
                          "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem " +
                          "-days 2 -extfile san.ext && " +
                          "openssl req -x509" + ec + " -keyout other.key -out other.pem -days 2 -subj /CN=other-ca";
  return std::system((cmd + " >/dev/null 2>&1").c_str()) == 0 ? d : "";
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Issue 22: the data plane over TLS (--data-plane-tls) carries the same bytes as plain TCP; a client
// that does not trust the server's certificate cannot connect.
TEST(DataPlane, TlsCarriesTheSameBytesAsPlain) {
  const std::string d = MakeCertificates();
  if (d.empty()) GTEST_SKIP() << "no openssl command to make certificates with";
  auto plain = StartTestServer();
  auto tls = StartTestServer(8 << 20, false, true, [&](server::GrpcServerOptions& o) {
    o.tls = {d + "/server.pem", d + "/server.key", ""};
    o.data_plane_tls = true;
  });
  auto tls_client = [&](const std::string& ca) {
    return ConnectClient(tls->target, 16 * kHidden * 2, [&](ClientOptions& o) {
      o.credentials = grpc::SslCredentials(grpc::SslCredentialsOptions{ReadFile(d + "/ca.pem"), "", ""});
      o.data_plane = true;
      o.data_plane_sockets = 2;
      o.data_plane_tls_ca = ca;
    });
  };
  auto over_tls = tls_client(d + "/ca.pem");
  auto info = over_tls->GetInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(info->data_plane_tls());
  const Batch b = MakeBatch(300, v1::DTYPE_BFLOAT16, 35);
  v1::RequestHeader fb;
  fb.add_outputs(v1::OUTPUT_LOSS);
  auto got = over_tls->ForwardBackward(View(b), fb);
  auto want = Connect(*plain, 1, true, 16 * kHidden * 2)->ForwardBackward(View(b), fb);
  ASSERT_TRUE(got.ok() && want.ok()) << got.status() << want.status();
  ExpectSameBytes(got->d_hidden, want->d_hidden, "d_hidden over TLS");
  ExpectElementsNear(got->loss, want->loss, TransportTolerance(), "loss over TLS");

  // One connection's round trip: the bytes read back are the bytes written.
  auto s = over_tls->OpenSession();
  ASSERT_TRUE(s.ok()) << s.status();
  auto region = (*s)->AllocateServerMemory(1 << 20);
  ASSERT_TRUE(region.ok()) << region.status();
  auto conn = DataPlaneConnection::Connect("127.0.0.1", tls->server->data_port(), {(*s)->secret(), true, d + "/ca.pem"});
  ASSERT_TRUE(conn.ok()) << conn.status();
  std::vector<uint8_t> data(1 << 20), back(1 << 20);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 131 + 7);
  ASSERT_TRUE((*conn)->Write((*s)->id(), *region, 0, data).ok());
  ASSERT_TRUE((*conn)->Read((*s)->id(), *region, 0, absl::MakeSpan(back)).ok());
  EXPECT_TRUE(back == data);

  // A certificate that does not chain to the client's CA: the handshake fails, clearly.
  auto untrusted = DataPlaneConnection::Connect("127.0.0.1", tls->server->data_port(), {(*s)->secret(), true, d + "/other.pem"});
  EXPECT_EQ(untrusted.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(untrusted.status().message().find("TLS handshake failed"), std::string::npos) << untrusted.status();
  auto r = tls_client(d + "/other.pem")->ForwardBackward(View(b), fb);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  // A plain client on the TLS data plane gets no service (the server ends the connection), and the
  // server goes on serving.
  auto raw = DataPlaneConnection::Connect("127.0.0.1", tls->server->data_port(), {(*s)->secret()});
  ASSERT_TRUE(raw.ok());
  EXPECT_FALSE((*raw)->Write((*s)->id(), *region, 0, absl::MakeSpan(data).subspan(0, 64)).ok());
  EXPECT_TRUE(over_tls->ForwardBackward(View(b), fb).ok());
  std::system(("rm -rf " + d).c_str());
}

}  // namespace
}  // namespace lce::e2e
