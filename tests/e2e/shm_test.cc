// The co-located path through the C++ client: shared-memory regions registered over OpenSession give
// the same answers as bytes on the wire, d_hidden lands in place, every misuse gets its status, and
// the server drops a session's mappings when the session's stream goes away.
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>
#include "absl/cleanup/cleanup.h"
#include "gtest/gtest.h"
#include "lce/client/lce_client.h"
#include "lce/numeric.h"
#include "region_registry.h"
#include "test_server.h"

namespace lce::e2e {
namespace {

using client::HiddenBatch;
using client::LceClient;
using client::RegionRef;
using client::SharedMemorySession;

std::unique_ptr<LceClient> Connect(const TestServer& ts, int64_t chunk_bytes) {
  return ConnectClient(ts.target, chunk_bytes);
}

// Lines of this process's memory map that map the memfd named `name` (client and in-process server alike).
// Shared memory against bytes: the same bits on the CPU engine; a GPU may chunk another way.
const double kShmTolerance = TestBackend() == Backend::kCpu ? 1e-5 : 1e-4;

int Mappings(const std::string& name) {
  std::ifstream f("/proc/self/maps");
  std::string line;
  int n = 0;
  while (std::getline(f, line)) n += line.find("/memfd:" + name + " ") != std::string::npos ? 1 : 0;
  return n;
}

bool WaitFor(const std::function<bool()>& pred) {
  for (int i = 0; i < 300 && !pred(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  return pred();
}

// A region-backed request goes as one chunk, the bytes as several (a smaller first chunk, then full
// ones): the same math, summed in another order, so the answers agree to rounding.
// bf16 bytes: within one bf16 rounding step of each other on the CPU engine; within 1% of the
// largest magnitude on the GPU.
void ExpectBf16Close(const uint8_t* got, const uint8_t* want, size_t bytes) {
  double max_err = 0, max_ref = 0;
  for (size_t i = 0; i + 1 < bytes; i += 2) {
    uint16_t g, w;
    std::memcpy(&g, got + i, 2);
    std::memcpy(&w, want + i, 2);
    const double gf = Bf16ToFloat(g), wf = Bf16ToFloat(w);
    if (TestBackend() == Backend::kCpu) {
      ASSERT_LE(std::fabs(gf - wf), std::max(std::fabs(gf), std::fabs(wf)) / 128 + 1e-30) << "element " << i / 2;
    }
    max_err = std::max(max_err, std::fabs(gf - wf));
    max_ref = std::max(max_ref, std::fabs(wf));
  }
  EXPECT_GT(max_ref, 0.0);
  EXPECT_LE(max_err, 1e-2 * max_ref);
}

TEST(SharedMemory, AnswersEqualTheBytesPathAndDHiddenLandsInPlace) {
  auto ts = StartTestServer();
  const Batch b = MakeBatch(50, v1::DTYPE_BFLOAT16, 11);
  const int64_t row_bytes = kHidden * 2;
  auto c = Connect(*ts, 7 * row_bytes);  // 8 chunks: slices at many offsets
  auto session = c->OpenSession();
  ASSERT_TRUE(session.ok()) << session.status();
  SharedMemorySession& s = **session;
  EXPECT_EQ(s.id().size(), 32u);
  const int64_t off = 3 * row_bytes + 2;  // not at the start of the region
  auto in = s.CreateRegion(off + static_cast<int64_t>(b.hidden.size()), "hidden");
  auto out = s.CreateRegion(static_cast<int64_t>(b.hidden.size()), "d_hidden");
  ASSERT_TRUE(in.ok() && out.ok()) << in.status() << out.status();
  std::memcpy(in->bytes.data() + off, b.hidden.data(), b.hidden.size());

  HiddenBatch shm = View(b);
  shm.hidden = {};
  shm.hidden_region = in->Ref(off);
  v1::RequestHeader h;
  h.set_temperature(0.9f);
  auto want_s = c->Score(View(b), h);
  auto got_s = c->Score(shm, h);
  ASSERT_TRUE(want_s.ok() && got_s.ok()) << want_s.status() << got_s.status();
  ExpectElementsNear(got_s->logprobs, want_s->logprobs, kShmTolerance);
  ExpectElementsNear(got_s->entropy, want_s->entropy, kShmTolerance);

  v1::RequestHeader fb;
  auto want = c->ForwardBackward(View(b), fb);
  shm.d_hidden_region = out->Ref();
  auto got = c->ForwardBackward(shm, fb);
  ASSERT_TRUE(want.ok() && got.ok()) << want.status() << got.status();
  EXPECT_NEAR(got->reduced_loss, want->reduced_loss, 1e-5 * std::fabs(want->reduced_loss));
  ExpectElementsNear(got->loss, want->loss, kShmTolerance);
  EXPECT_TRUE(got->d_hidden.empty());  // written in place instead
  ASSERT_EQ(want->d_hidden.size(), out->bytes.size());
  ExpectBf16Close(out->bytes.data(), want->d_hidden.data(), out->bytes.size());

  std::vector<float> gl(b.rows, 0.5f), ge(b.rows, -0.25f);
  auto want_b = c->Backward(View(b), {}, gl, ge);
  std::memset(out->bytes.data(), 0, out->bytes.size());
  auto got_b = c->Backward(shm, {}, gl, ge);
  ASSERT_TRUE(want_b.ok() && got_b.ok()) << want_b.status() << got_b.status();
  ExpectBf16Close(out->bytes.data(), want_b->d_hidden.data(), out->bytes.size());
}

TEST(SharedMemory, MisuseGetsItsStatusAndTheServerKeepsServing) {
  auto ts = StartTestServer();
  const Batch b = MakeBatch(6, v1::DTYPE_FLOAT32, 12);  // head "wide" is fp32
  auto c = Connect(*ts, 4 << 20);
  auto s1 = c->OpenSession();
  auto s2 = c->OpenSession();
  ASSERT_TRUE(s1.ok() && s2.ok());
  EXPECT_NE((*s1)->id(), (*s2)->id());
  auto region = (*s1)->CreateRegion(static_cast<int64_t>(b.hidden.size()));
  ASSERT_TRUE(region.ok()) << region.status();
  std::memcpy(region->bytes.data(), b.hidden.data(), b.hidden.size());
  v1::RequestHeader h;
  h.set_head("wide");
  HiddenBatch shm = View(b);
  shm.hidden = {};

  // out of bounds: one byte past the region's end
  shm.hidden_region = region->Ref(1);
  auto r = c->Score(shm, h);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("offset 1"), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find(absl::StrCat("has ", b.hidden.size(), " bytes")), std::string::npos)
      << r.status();
  // another session (its id and secret) with this session's region
  RegionRef stolen = region->Ref();
  stolen.session_id = (*s2)->id();
  stolen.session_secret = (*s2)->secret();
  shm.hidden_region = stolen;
  r = c->Score(shm, h);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kPermissionDenied) << r.status();
  EXPECT_NE(r.status().message().find("belongs to another session"), std::string::npos) << r.status();
  // Issue 35, item 12: the session's id alone (it travels in metadata), from a client that never
  // saw the secret, or with a wrong secret, opens nothing.
  auto stranger = Connect(*ts, 4 << 20);
  shm.hidden_region = RegionRef{(*s1)->id(), region->id, 0};
  r = stranger->Score(shm, h);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kPermissionDenied) << r.status();
  EXPECT_NE(r.status().message().find("lce-session-secret"), std::string::npos) << r.status();
  shm.hidden_region = RegionRef{(*s1)->id(), region->id, 0, (*s2)->secret()};
  r = c->Score(shm, h);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kPermissionDenied) << r.status();
  EXPECT_NE(r.status().message().find("do not name an open session"), std::string::npos) << r.status();
  // A RegionRef made by hand without the secret, on the client that opened the session, works.
  shm.hidden_region = RegionRef{(*s1)->id(), region->id, 0};
  EXPECT_TRUE(c->Score(shm, h).ok());
  // unknown region
  shm.hidden_region = RegionRef{(*s1)->id(), uint64_t{1} << 40, 0};
  r = c->Score(shm, h);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
  // registrations: beyond the object, by name (off by default); the session goes on
  auto bad = (*s1)->RegisterFd(region->fd, 0, static_cast<int64_t>(b.hidden.size()) + 1);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_NE(bad.status().message().find("exceeds the object's size"), std::string::npos) << bad.status();
  bad = (*s1)->Register("/lce-no-such-object", 0, 16);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kPermissionDenied) << bad.status();
  EXPECT_NE(bad.status().message().find("--allow-shm-by-name"), std::string::npos) << bad.status();
  EXPECT_EQ((*s2)->Unregister(region->id).code(), absl::StatusCode::kPermissionDenied);
  // the owner's request works, as does the bytes path
  shm.hidden_region = region->Ref();
  auto ok = c->Score(shm, h);
  auto ref = c->Score(View(b), h);
  ASSERT_TRUE(ok.ok() && ref.ok()) << ok.status() << ref.status();
  EXPECT_EQ(ok->logprobs, ref->logprobs);
}

// Issue 16 item 2: a client that shrinks its object under the server's mapping (the server then
// faults on it with SIGBUS) gets FAILED_PRECONDITION naming the region, the region stays refused,
// and the server keeps serving everyone. The client's own mappings are not touched after the cut.
TEST(SharedMemory, AClientThatShrinksItsObjectGetsAnErrorAndTheServerKeepsServing) {
  auto ts = StartTestServer();
  const Batch b = MakeBatch(200, v1::DTYPE_FLOAT32, 14);
  auto c = Connect(*ts, 4 << 20);
  auto s = c->OpenSession();
  ASSERT_TRUE(s.ok()) << s.status();
  const auto bytes = static_cast<int64_t>(b.hidden.size());
  ASSERT_GT(bytes, 3 * 4096);
  auto hidden = (*s)->CreateRegion(bytes, "hidden");
  auto cut = (*s)->CreateRegion(bytes, "cut");
  auto d_hidden = (*s)->CreateRegion(bytes, "d_hidden");
  ASSERT_TRUE(hidden.ok() && cut.ok() && d_hidden.ok());
  std::memcpy(hidden->bytes.data(), b.hidden.data(), b.hidden.size());
  std::memcpy(cut->bytes.data(), b.hidden.data(), b.hidden.size());
  v1::RequestHeader h;
  h.set_head("wide");
  HiddenBatch shm = View(b);
  shm.hidden = {};
  shm.hidden_region = cut->Ref();
  auto before = c->Score(shm, h);
  ASSERT_TRUE(before.ok()) << before.status();
  // The client holds the memfd it handed over, and may cut it as it could a named object.
  auto shrink = [](int fd, off_t size) { ASSERT_EQ(ftruncate(fd, size), 0); };
  shrink(cut->fd, 0);
  auto r = c->Score(shm, h);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_NE(r.status().message().find("region 'cut'"), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find("shrunk"), std::string::npos) << r.status();
  r = c->Score(shm, h);  // refused from now on, before any use
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();

  // d_hidden written into an object cut in its middle.
  shrink(d_hidden->fd, 4096);
  shm.hidden_region = hidden->Ref();
  shm.d_hidden_region = d_hidden->Ref();
  auto fb = c->ForwardBackward(shm, v1::RequestHeader(h));
  EXPECT_EQ(fb.status().code(), absl::StatusCode::kFailedPrecondition) << fb.status();
  EXPECT_NE(fb.status().message().find("d_hidden_region"), std::string::npos) << fb.status();

  // Everyone else, this session's intact regions included, is served as before.
  shm.d_hidden_region.reset();
  auto after = c->Score(shm, h);
  auto bytes_path = ConnectClient(ts->target, 4 << 20)->Score(View(b), h);
  ASSERT_TRUE(after.ok() && bytes_path.ok()) << after.status() << bytes_path.status();
  EXPECT_EQ(after->logprobs, before->logprobs);
  EXPECT_EQ(bytes_path->logprobs, before->logprobs);
}

TEST(SharedMemory, DeviceRegionsNeedAGpuEngineAndOneSourceAndSessionsHaveACap) {
  // Registration by name, for the cap's many registrations of one object over a raw stream.
  auto ts = StartTestServer(8 << 20, false, true, [](server::GrpcServerOptions& o) { o.allow_shm_by_name = true; });
  auto c = Connect(*ts, 4 << 20);
  auto s = c->OpenSession();
  ASSERT_TRUE(s.ok()) << s.status();
  const std::string handle(64, '\0');
  auto ipc = (*s)->RegisterCudaIpc(handle, 0, 1024);
  if (TestBackend() == Backend::kCpu) {  // engines on the CPU: no device regions
    EXPECT_EQ(ipc.status().code(), absl::StatusCode::kUnimplemented) << ipc.status();
    EXPECT_NE(ipc.status().message().find("--backend=cuda"), std::string::npos) << ipc.status();
  } else {  // a GPU engine: the driver refuses a handle that is not one
    EXPECT_EQ(ipc.status().code(), absl::StatusCode::kInvalidArgument) << ipc.status();
  }

  // Both sources (or neither) in one registration: INVALID_ARGUMENT, and the session goes on.
  auto region = (*s)->CreateRegion(4096);
  ASSERT_TRUE(region.ok()) << region.status();
  auto stub = RawStub(ts->target);
  grpc::ClientContext ctx;
  auto raw = stub->OpenSession(&ctx);
  v1::SessionResponse resp;
  ASSERT_TRUE(raw->Read(&resp));
  v1::SessionRequest req;
  req.mutable_register_region()->set_shm_name("/lce-any");
  req.mutable_register_region()->set_cuda_ipc_handle(handle);
  req.mutable_register_region()->set_byte_size(16);
  ASSERT_TRUE(raw->Write(req) && raw->Read(&resp));
  EXPECT_EQ(resp.code(), static_cast<int>(absl::StatusCode::kInvalidArgument)) << resp.message();
  EXPECT_NE(resp.message().find("exactly one of shm_name, cuda_ipc_handle and server_memory"), std::string::npos)
      << resp.message();
  req.mutable_register_region()->clear_shm_name();
  req.mutable_register_region()->clear_cuda_ipc_handle();
  ASSERT_TRUE(raw->Write(req) && raw->Read(&resp));
  EXPECT_EQ(resp.code(), static_cast<int>(absl::StatusCode::kInvalidArgument)) << resp.message();

  // A session holds at most kMaxRegionsPerSession regions; another session is not affected. (An
  // object of its own: one another session registered is refused, shm_ownership_test.cc.)
  const std::string own = "/lce-cap-" + std::to_string(getpid());
  const int own_fd = shm_open(own.c_str(), O_CREAT | O_RDWR, 0600);
  ASSERT_GE(own_fd, 0);
  ASSERT_EQ(ftruncate(own_fd, 4096), 0);
  close(own_fd);
  absl::Cleanup unlink_own = [&own] { shm_unlink(own.c_str()); };
  req.mutable_register_region()->set_shm_name(own);
  int registered = 0;
  for (size_t i = 0; i < server::RegionRegistry::kMaxRegionsPerSession; ++i) {
    ASSERT_TRUE(raw->Write(req) && raw->Read(&resp));
    registered += resp.code() == 0 ? 1 : 0;
  }
  EXPECT_EQ(registered, static_cast<int>(server::RegionRegistry::kMaxRegionsPerSession));
  ASSERT_TRUE(raw->Write(req) && raw->Read(&resp));
  EXPECT_EQ(resp.code(), static_cast<int>(absl::StatusCode::kResourceExhausted)) << resp.message();
  auto other = (*s)->RegisterFd(region->fd, 0, 16);
  EXPECT_TRUE(other.ok()) << other.status();
  raw->WritesDone();
  EXPECT_TRUE(raw->Finish().ok());
}

TEST(SharedMemory, SessionEndReleasesTheServersMappings) {
  auto ts = StartTestServer();
  const Batch b = MakeBatch(4, v1::DTYPE_BFLOAT16, 13);
  auto c = Connect(*ts, 4 << 20);
  HiddenBatch shm = View(b);
  shm.hidden = {};
  std::string name;
  {
    auto s = c->OpenSession();
    ASSERT_TRUE(s.ok());
    name = "lce-end-" + std::to_string(getpid());
    auto region = (*s)->CreateRegion(static_cast<int64_t>(b.hidden.size()), name);
    ASSERT_TRUE(region.ok());
    EXPECT_EQ(Mappings(name), 2);  // ours and the (in-process) server's
    std::memcpy(region->bytes.data(), b.hidden.data(), b.hidden.size());
    shm.hidden_region = region->Ref();
    ASSERT_TRUE(c->Score(shm, {}).ok());
    (*s)->Cancel();  // as a client that goes away
    EXPECT_TRUE(WaitFor([&] { return Mappings(name) == 1; })) << "the server kept its mapping";
    auto r = c->Score(shm, {});  // an ended session's id and secret open nothing
    EXPECT_EQ(r.status().code(), absl::StatusCode::kPermissionDenied) << r.status();
    // unregistering a region explicitly also unmaps it
    auto s2 = c->OpenSession();
    ASSERT_TRUE(s2.ok());
    auto r2 = (*s2)->CreateRegion(64, name + "-2");
    ASSERT_TRUE(r2.ok());
    EXPECT_EQ(Mappings(name + "-2"), 2);
    ASSERT_TRUE((*s2)->ReleaseRegion(r2->id).ok());
    EXPECT_EQ(Mappings(name + "-2"), 0);
  }
  EXPECT_EQ(Mappings(name), 0);  // the session's destructor unmapped and closed ours
  EXPECT_TRUE(c->Score(View(b), {}).ok());  // still serving
}

}  // namespace
}  // namespace lce::e2e
