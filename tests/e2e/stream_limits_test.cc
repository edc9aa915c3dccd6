// Streams whose clients go silent: they hold no admission slot before their header, and they end
// DEADLINE_EXCEEDED (naming the wait) once the header or the next message is overdue; the server
// keeps serving others meanwhile and afterwards. Raw gRPC streams, as a hostile client sends.
#include <chrono>
#include <fstream>
#include <memory>
#include <thread>
#include <vector>

#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "test_server.h"
#include "thread_start.h"

namespace lce::e2e {
namespace {

using Stream = grpc::ClientReaderWriter<v1::StreamRequest, v1::StreamResponse>;

v1::StreamRequest Header(bool sends_ahead = false) {
  v1::StreamRequest m;
  m.mutable_header()->set_hidden_size(kHidden);
  m.mutable_header()->set_dtype(v1::DTYPE_BFLOAT16);
  m.mutable_header()->set_sends_ahead(sends_ahead);
  return m;
}

v1::StreamRequest Chunk(const Batch& b) {
  v1::StreamRequest m;
  m.mutable_chunk()->set_hidden(b.hidden.data(), b.hidden.size());
  for (int32_t y : b.targets) m.mutable_chunk()->add_targets(y);
  return m;
}

// A whole Score of a few rows.
grpc::Status ScoreFew(const std::string& target, bool sends_ahead = false, const std::string& token = "") {
  auto stub = RawStub(target);
  grpc::ClientContext ctx;
  if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
  auto stream = stub->Score(&ctx);
  stream->Write(Header(sends_ahead));
  stream->Write(Chunk(MakeBatch(5, v1::DTYPE_BFLOAT16, 1)));
  stream->WritesDone();
  v1::StreamResponse r;
  int answers = 0;
  while (stream->Read(&r)) answers += r.chunk().logprobs_size() == 5 ? 1 : 0;
  grpc::Status s = stream->Finish();
  if (s.ok() && answers != 1) return grpc::Status(grpc::StatusCode::INTERNAL, "no answer of 5 rows");
  return s;
}

// Reads to the end of a stream the server ends, and returns its status.
grpc::Status Drain(Stream& stream) {
  v1::StreamResponse r;
  while (stream.Read(&r)) {
  }
  return stream.Finish();
}

double Rejections(const TestServer& ts, const char* reason) {
  return ts.metrics->rejections.WithLabels({reason}).Value();
}

void ExpectDeadline(const grpc::Status& s, const std::string& words) {
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  EXPECT_NE(s.error_message().find(words), std::string::npos) << "'" << s.error_message() << "' lacks '" << words << "'";
}

TEST(StreamLimits, StreamsWithoutAHeaderHoldNoSlot) {
  constexpr int kSlots = 2, kSilent = 6;
  auto ts = StartTestServer(8 << 20, false, false, [](server::GrpcServerOptions& o) {
    o.service.max_concurrent_streams = kSlots;
    o.service.stream_header_timeout_seconds = 300;  // they stay silent for the whole test
  });
  auto stub = RawStub(ts->target);
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<Stream>> silent;
  for (int i = 0; i < kSilent; ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    silent.push_back(stub->Score(contexts.back().get()));
  }
  // Every silent stream's handler is running (waiting for its header) before the real request.
  for (int i = 0; i < 2000 && ts->metrics->inflight.Value() < kSilent; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(ts->metrics->inflight.Value(), kSilent);
  for (int i = 0; i < 3; ++i) {
    grpc::Status s = ScoreFew(ts->target);
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
  EXPECT_EQ(Rejections(*ts, "concurrent_streams"), 0);
  for (int i = 0; i < kSilent; ++i) {
    contexts[i]->TryCancel();
    EXPECT_EQ(Drain(*silent[i]).error_code(), grpc::StatusCode::CANCELLED);
  }
}

TEST(StreamLimits, AStreamWithoutAHeaderEndsAtTheHeaderTimeout) {
  auto ts = StartTestServer(8 << 20, false, false,
                            [](server::GrpcServerOptions& o) { o.service.stream_header_timeout_seconds = 0.5; });
  auto stub = RawStub(ts->target);
  grpc::ClientContext ctx;
  auto stream = stub->Score(&ctx);
  ExpectDeadline(Drain(*stream), "no request header within 0.5 s");
  EXPECT_EQ(Rejections(*ts, "header_timeout"), 1);
  grpc::Status s = ScoreFew(ts->target);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(Rejections(*ts, "header_timeout"), 1) << "a prompt request was cut";
}

// Serial and pipelined streams (the test server pipelines clients that send ahead).
TEST(StreamLimits, AStreamSilentBetweenChunksEndsAtTheIdleTimeout) {
  auto ts = StartTestServer(8 << 20, false, false,
                            [](server::GrpcServerOptions& o) { o.service.stream_idle_timeout_seconds = 0.2; });
  auto stub = RawStub(ts->target);
  for (bool sends_ahead : {false, true}) {
    SCOPED_TRACE(sends_ahead ? "pipelined" : "serial");
    grpc::ClientContext ctx;
    auto stream = stub->Score(&ctx);
    ASSERT_TRUE(stream->Write(Header(sends_ahead)));
    ASSERT_TRUE(stream->Write(Chunk(MakeBatch(7, v1::DTYPE_BFLOAT16, 3))));
    v1::StreamResponse r;
    ASSERT_TRUE(stream->Read(&r));  // chunk 0 answered; then the client says nothing more
    EXPECT_EQ(r.chunk().logprobs_size(), 7);
    ExpectDeadline(Drain(*stream), "for the message after chunk 0");
  }
  EXPECT_EQ(Rejections(*ts, "idle_timeout"), 2);
  // Before its first chunk too.
  {
    grpc::ClientContext ctx;
    auto stream = stub->ForwardBackward(&ctx);
    v1::StreamRequest h = Header();
    h.mutable_header()->set_reduction(v1::REDUCTION_SUM);
    ASSERT_TRUE(stream->Write(h));
    ExpectDeadline(Drain(*stream), "--stream-idle-timeout-seconds");
  }
  grpc::Status s = ScoreFew(ts->target);
  EXPECT_TRUE(s.ok()) << s.error_message();
}

// A token file of `token` under the test's temporary directory.
std::string TokenFile(const std::string& name, const std::string& token) {
  const std::string path = ::testing::TempDir() + "/stream_limits_" + name + ".token";
  std::ofstream(path) << token << "\n";
  return path;
}

// Issue 35, item 8: one client once held every admission slot by trickling chunks on 64 streams.
// A client (its host, its token and, on loopback, its uid) now holds at most its share, and another
// client is admitted meanwhile.
TEST(StreamLimits, OneClientCannotHoldEverySlot) {
  auto ts = StartTestServer(8 << 20, false, false, [](server::GrpcServerOptions& o) {
    o.service.max_concurrent_streams = 4;  // a client's share: 2
    o.service.stream_idle_timeout_seconds = 300;
    o.service.auth = *server::RequestAuthenticator::FromFiles(TokenFile("scoring", "tok-scoring-0123456789"),
                                                              TokenFile("admin", "tok-admin-0123456789"));
  });
  auto stub = RawStub(ts->target);
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<Stream>> held;
  for (int i = 0; i < 3; ++i) {  // the hog's streams: two admitted and answered, then silent
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    contexts.back()->AddMetadata("authorization", "Bearer tok-scoring-0123456789");
    held.push_back(stub->Score(contexts.back().get()));
    held.back()->Write(Header());
    held.back()->Write(Chunk(MakeBatch(1, v1::DTYPE_BFLOAT16, 7)));
    v1::StreamResponse r;
    if (i < 2) ASSERT_TRUE(held.back()->Read(&r)) << "stream " << i << " was not admitted";
  }
  held.back()->WritesDone();
  const grpc::Status third = Drain(*held.back());
  EXPECT_EQ(third.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << third.error_message();
  EXPECT_NE(third.error_message().find("--max-streams-per-client"), std::string::npos) << third.error_message();
  EXPECT_EQ(Rejections(*ts, "streams_per_client"), 1);
  // Another client (another token) is admitted while the hog holds its share.
  grpc::Status other = ScoreFew(ts->target, false, "tok-admin-0123456789");
  EXPECT_TRUE(other.ok()) << other.error_message();
  for (int i = 0; i < 2; ++i) {
    contexts[i]->TryCancel();
    Drain(*held[i]);
  }
}

// Issue 35, item 4: where a stream's threads (its answer writer, a pipelined stream's engine calls)
// cannot start, as under a task limit, the stream is served on its handler's thread; nothing aborts.
TEST(StreamLimits, StreamsAreServedWhenTheirThreadsCannotStart) {
  auto ts = StartTestServer(8 << 20, false, false);
  for (bool sends_ahead : {false, true}) {  // serial, pipelined (the test server pipelines on CPU)
    server::FailThreadStartsForTest(1000);
    grpc::Status s = ScoreFew(ts->target, sends_ahead);
    server::FailThreadStartsForTest(0);
    EXPECT_TRUE(s.ok()) << "sends_ahead " << sends_ahead << ": " << s.error_message();
  }
  grpc::Status s = ScoreFew(ts->target, true);
  EXPECT_TRUE(s.ok()) << s.error_message();
}

}  // namespace
}  // namespace lce::e2e
