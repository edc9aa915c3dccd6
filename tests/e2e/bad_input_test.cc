// Every malformed request gets the right gRPC status and a message naming the problem, and the
// server keeps serving afterwards. Uses the raw generated stub so that it can send what the
// client library never would.
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <thread>

#include "absl/strings/str_cat.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "grpcpp/support/byte_buffer.h"
#include "gtest/gtest.h"
#include "test_server.h"

namespace lce::e2e {
namespace {

using Stream = grpc::ClientReaderWriter<v1::StreamRequest, v1::StreamResponse>;
using Opener = std::function<std::unique_ptr<Stream>(v1::LceService::Stub&, grpc::ClientContext*)>;

const Opener kScore = [](v1::LceService::Stub& s, grpc::ClientContext* c) { return s.Score(c); };
const Opener kForwardBackward = [](v1::LceService::Stub& s, grpc::ClientContext* c) { return s.ForwardBackward(c); };
const Opener kBackward = [](v1::LceService::Stub& s, grpc::ClientContext* c) { return s.Backward(c); };

class BadInput : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { server_ = StartTestServer(/*max_message_bytes=*/1 << 20).release(); }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override { stub_ = RawStub(server_->target); }

  static v1::StreamRequest Header(v1::DType dtype = v1::DTYPE_BFLOAT16) {
    v1::StreamRequest m;
    m.mutable_header()->set_hidden_size(kHidden);
    m.mutable_header()->set_dtype(dtype);
    return m;
  }
  static v1::StreamRequest Chunk(const Batch& b) {
    v1::StreamRequest m;
    m.mutable_chunk()->set_hidden(b.hidden.data(), b.hidden.size());
    for (int32_t y : b.targets) m.mutable_chunk()->add_targets(y);
    return m;
  }
  grpc::Status Run(const Opener& open, const std::vector<v1::StreamRequest>& msgs,
                   std::vector<v1::StreamResponse>* out = nullptr) {
    grpc::ClientContext ctx;
    auto stream = open(*stub_, &ctx);
    for (const auto& m : msgs) {
      if (!stream->Write(m)) break;
    }
    stream->WritesDone();
    v1::StreamResponse r;
    while (stream->Read(&r)) {
      if (out != nullptr) out->push_back(r);
    }
    return stream->Finish();
  }
  // After every bad request, a good one still works.
  void ExpectStillServing() {
    std::vector<v1::StreamResponse> out;
    grpc::Status s = Run(kScore, {Header(), Chunk(MakeBatch(5, v1::DTYPE_BFLOAT16, 1))}, &out);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_EQ(out.size(), 1u);
    EXPECT_EQ(out[0].chunk().logprobs_size(), 5);
  }
  void ExpectError(const grpc::Status& s, grpc::StatusCode code, const std::string& words) {
    EXPECT_EQ(s.error_code(), code) << s.error_message();
    EXPECT_NE(s.error_message().find(words), std::string::npos)
        << "message '" << s.error_message() << "' lacks '" << words << "'";
    ExpectStillServing();
  }

  static TestServer* server_;
  std::unique_ptr<v1::LceService::Stub> stub_;
};
TestServer* BadInput::server_ = nullptr;

TEST_F(BadInput, MissingHeader) {
  ExpectError(Run(kScore, {Chunk(MakeBatch(3, v1::DTYPE_BFLOAT16, 2))}), grpc::StatusCode::INVALID_ARGUMENT,
              "first message of a request must be a header");
  ExpectError(Run(kScore, {}), grpc::StatusCode::INVALID_ARGUMENT, "empty request");
}

// Messages as bytes, as a client the library does not write could send them: `method` is the
// full name ("/lce.v1.LceService/Score").
grpc::Status RunBytes(const std::string& target, const std::string& method, const std::vector<std::string>& msgs,
                      int* answers) {
  auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  grpc::ClientContext ctx;
  const grpc::internal::RpcMethod rpc(method.c_str(), grpc::internal::RpcMethod::BIDI_STREAMING, channel);
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(channel.get(), rpc, &ctx));
  for (const std::string& m : msgs) {
    grpc::Slice slice(m);
    if (!stream->Write(grpc::ByteBuffer(&slice, 1))) break;
  }
  stream->WritesDone();
  grpc::ByteBuffer bytes;
  for (*answers = 0; stream->Read(&bytes);) {
    v1::StreamResponse r;
    EXPECT_TRUE(grpc::SerializationTraits<v1::StreamResponse>::Deserialize(&bytes, &r).ok());
    *answers += r.has_chunk() ? 1 : 0;
  }
  return stream->Finish();
}

// gRPC's typed Read cannot tell a message that does not parse from the stream's end: such a
// message once ended the request, answered OK with the rows before it (the soak's probe
// garbage_after_chunk). It is an error naming the message, in every streamed computation.
TEST_F(BadInput, MessageThatIsNotAStreamRequest) {
  const std::string garbage("\x12\xff\xff\xff\xff\x0f", 6);  // field 2, a length past the message
  const std::string chunk = Chunk(MakeBatch(5, v1::DTYPE_BFLOAT16, 3)).SerializeAsString();
  v1::StreamRequest sum = Header();
  sum.mutable_header()->set_reduction(v1::REDUCTION_SUM);
  // PolicyLoss takes the same path (LceService::ServeStream) behind a longer header.
  for (const char* rpc : {"Score", "ForwardBackward", "Backward"}) {
    SCOPED_TRACE(rpc);
    const std::string method = absl::StrCat("/lce.v1.LceService/", rpc);
    const std::string header = (std::string(rpc) == "ForwardBackward" ? sum : Header()).SerializeAsString();
    int answers = -1;
    ExpectError(RunBytes(server_->target, method, {header, chunk, garbage, chunk}, &answers),
                grpc::StatusCode::INVALID_ARGUMENT, "message 3 of the stream (6 bytes) is not a StreamRequest");
    EXPECT_LE(answers, 1);
    ExpectError(RunBytes(server_->target, method, {garbage}, &answers), grpc::StatusCode::INVALID_ARGUMENT,
                "message 1 of the stream (6 bytes) is not a StreamRequest");
    EXPECT_EQ(answers, 0);
  }
  // The same bytes through the bytes path answer as the typed path does.
  int answers = -1;
  grpc::Status ok = RunBytes(server_->target, "/lce.v1.LceService/Score", {Header().SerializeAsString(), chunk, chunk},
                             &answers);
  EXPECT_TRUE(ok.ok()) << ok.error_message();
  EXPECT_EQ(answers, 2);
}

TEST_F(BadInput, RepeatedHeader) {
  ExpectError(Run(kScore, {Header(), Header()}), grpc::StatusCode::INVALID_ARGUMENT, "repeated header");
}

TEST_F(BadInput, UnknownHead) {
  v1::StreamRequest h = Header();
  h.mutable_header()->set_head("no_such_head");
  ExpectError(Run(kScore, {h, Chunk(MakeBatch(3, v1::DTYPE_BFLOAT16, 2))}), grpc::StatusCode::NOT_FOUND,
              "unknown head 'no_such_head'");
}

TEST_F(BadInput, HiddenSizeOrDtypeNotMatchingHead) {
  v1::StreamRequest h = Header();
  h.mutable_header()->set_hidden_size(kHidden + 1);
  ExpectError(Run(kScore, {h}), grpc::StatusCode::INVALID_ARGUMENT, "hidden_size is 33");
  ExpectError(Run(kScore, {Header(v1::DTYPE_FLOAT16)}), grpc::StatusCode::INVALID_ARGUMENT, "dtype is fp16");
  ExpectError(Run(kScore, {Header(v1::DTYPE_UNSPECIFIED)}), grpc::StatusCode::INVALID_ARGUMENT, "dtype must be set");
}

TEST_F(BadInput, ByteCountNotRowsTimesHidden) {
  v1::StreamRequest c = Chunk(MakeBatch(4, v1::DTYPE_BFLOAT16, 3));
  c.mutable_chunk()->mutable_hidden()->pop_back();
  ExpectError(Run(kScore, {Header(), Chunk(MakeBatch(2, v1::DTYPE_BFLOAT16, 3)), c}),
              grpc::StatusCode::INVALID_ARGUMENT, "chunk 1: hidden holds 255 bytes");
}

TEST_F(BadInput, TargetOutOfRange) {
  Batch b = MakeBatch(6, v1::DTYPE_BFLOAT16, 4);
  b.targets[4] = kVocab;
  ExpectError(Run(kScore, {Header(), Chunk(b)}), grpc::StatusCode::INVALID_ARGUMENT, "row 4: target 3001");
  b.targets[4] = -5;
  ExpectError(Run(kForwardBackward, {[] { auto h = Header(); h.mutable_header()->set_reduction(v1::REDUCTION_SUM); return h; }(),
                                     Chunk(b)}),
              grpc::StatusCode::INVALID_ARGUMENT, "row 4: target -5");
}

TEST_F(BadInput, MismatchedRowCounts) {
  v1::StreamRequest c = Chunk(MakeBatch(4, v1::DTYPE_BFLOAT16, 5));
  for (int i = 0; i < 3; ++i) c.mutable_chunk()->add_grad_logprob(1.0f);
  ExpectError(Run(kBackward, {Header(), c}), grpc::StatusCode::INVALID_ARGUMENT, "grad_logprob has 3 values for 4 rows");
  v1::StreamRequest h = Header();
  h.mutable_header()->set_reduction(v1::REDUCTION_NONE);
  c = Chunk(MakeBatch(4, v1::DTYPE_BFLOAT16, 5));
  c.mutable_chunk()->add_grad_loss(1.0f);
  ExpectError(Run(kForwardBackward, {h, c}), grpc::StatusCode::INVALID_ARGUMENT, "grad_loss has 1 values for 4 rows");
}

TEST_F(BadInput, ZeroRows) {
  ExpectError(Run(kScore, {Header()}), grpc::StatusCode::INVALID_ARGUMENT, "no rows");
  v1::StreamRequest empty;
  empty.mutable_chunk();
  ExpectError(Run(kScore, {Header(), empty}), grpc::StatusCode::INVALID_ARGUMENT, "chunk 0: no rows");
}

TEST_F(BadInput, NonPositiveTemperature) {
  for (float t : {0.0f, -1.0f}) {
    v1::StreamRequest h = Header();
    h.mutable_header()->set_temperature(t);
    ExpectError(Run(kScore, {h}), grpc::StatusCode::INVALID_ARGUMENT, "temperature must be > 0");
  }
}

TEST_F(BadInput, MessageOverTheLimit) {
  // The server accepts 1 MiB messages; this chunk is ~1.5 MiB.
  ExpectError(Run(kScore, {Header(), Chunk(MakeBatch(24000, v1::DTYPE_BFLOAT16, 6))}),
              grpc::StatusCode::RESOURCE_EXHAUSTED, "");
}

TEST_F(BadInput, NonFiniteHidden) {
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    Batch b = MakeBatch(8, v1::DTYPE_FLOAT32, 7);
    std::memcpy(b.hidden.data() + (6 * kHidden + 3) * 4, &bad, 4);
    v1::StreamRequest h = Header(v1::DTYPE_FLOAT32);
    h.mutable_header()->set_head("wide");
    ExpectError(Run(kScore, {h, Chunk(b)}), grpc::StatusCode::INVALID_ARGUMENT, "row 6: non-finite logits");
  }
}

TEST_F(BadInput, NonFiniteHiddenInAPipelinedStream) {
  // A client that sends ahead (header.sends_ahead) gets the pipelined server: chunk k computes while
  // chunk k+1 is read, and chunks queued behind a busy engine share one call (--merge-chunk-rows). A
  // failing middle chunk still ends the stream with its own error, named as a call of that chunk alone
  // would name it, after the answers of the calls before its own (how many chunks those held depends on
  // the threads' timing) and without the answers of those after it.
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    v1::StreamRequest h = Header(v1::DTYPE_FLOAT32);
    h.mutable_header()->set_head("wide");
    h.mutable_header()->set_sends_ahead(true);
    std::vector<v1::StreamRequest> msgs{h};
    for (int c = 0; c < 5; ++c) {
      Batch b = MakeBatch(8, v1::DTYPE_FLOAT32, 20 + c);
      if (c == 2) std::memcpy(b.hidden.data() + (5 * kHidden + 1) * 4, &bad, 4);
      msgs.push_back(Chunk(b));
    }
    std::vector<v1::StreamResponse> answers;
    ExpectError(Run(kScore, msgs, &answers), grpc::StatusCode::INVALID_ARGUMENT,
                "chunk 2 (rows 16..23): row 5: non-finite logits");
    ASSERT_LE(answers.size(), 2u);  // chunks 0 and 1, where they did not share chunk 2's call
    for (size_t k = 0; k < answers.size(); ++k) {
      EXPECT_EQ(answers[k].chunk().first_row(), static_cast<int64_t>(8 * k));
      EXPECT_EQ(answers[k].chunk().logprobs_size(), 8);
    }
  }
  ExpectStillServing();
}

TEST_F(BadInput, MeanNeedsTheValidTokenCount) {
  Batch b = MakeBatch(10, v1::DTYPE_BFLOAT16, 8);
  ExpectError(Run(kForwardBackward, {Header(), Chunk(b)}), grpc::StatusCode::INVALID_ARGUMENT, "num_valid_tokens");
  v1::StreamRequest h = Header();
  h.mutable_header()->set_num_valid_tokens(11);
  ExpectError(Run(kForwardBackward, {h, Chunk(b)}), grpc::StatusCode::INVALID_ARGUMENT, "declared 11");
}

// A seeded head's shape comes from the client: its byte size once wrapped to a tiny allocation that
// the fill overran. Sizes that overflow are INVALID_ARGUMENT, sizes beyond memory RESOURCE_EXHAUSTED.
TEST_F(BadInput, LoadHeadOfAHugeSeededHead) {
  auto load = [&](int64_t vocab, int64_t hidden, v1::DType dtype) {
    grpc::ClientContext ctx;
    v1::LoadHeadRequest req;
    req.set_name("huge");
    req.mutable_seeded()->set_vocab_size(vocab);
    req.mutable_seeded()->set_hidden_size(hidden);
    req.mutable_seeded()->set_dtype(dtype);
    v1::HeadDescription desc;
    return stub_->LoadHead(&ctx, req, &desc);
  };
  ExpectError(load((int64_t{1} << 61) + 1, 4, v1::DTYPE_BFLOAT16), grpc::StatusCode::INVALID_ARGUMENT,
              "not a valid size");
  ExpectError(load(int64_t{1} << 40, 1024, v1::DTYPE_FLOAT32), grpc::StatusCode::RESOURCE_EXHAUSTED,
              "over this server's limit");
  ExpectError(load(-5, 4, v1::DTYPE_BFLOAT16), grpc::StatusCode::INVALID_ARGUMENT, "positive shape");
}

TEST_F(BadInput, ClientCancelsMidStream) {
  {
    grpc::ClientContext ctx;
    auto stream = stub_->Score(&ctx);
    ASSERT_TRUE(stream->Write(Header()));
    ASSERT_TRUE(stream->Write(Chunk(MakeBatch(50, v1::DTYPE_BFLOAT16, 9))));
    v1::StreamResponse r;
    ASSERT_TRUE(stream->Read(&r));
    ctx.TryCancel();
    while (stream->Read(&r)) {
    }
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  ExpectStillServing();
}

TEST_F(BadInput, ClientProcessKilledMidStream) {
  // A real client process (lce_cli bench) is SIGKILLed while its stream is in flight.
  const char* cli_env = std::getenv("LCE_CLI_BIN");  // a tree copied elsewhere (GPU machine)
  const std::string cli = cli_env != nullptr && *cli_env != 0 ? cli_env : LCE_CLI_PATH;
  ASSERT_EQ(access(cli.c_str(), X_OK), 0) << "lce_cli not found at " << cli;
  // One stream, then one request split over four connections (300000 rows: above two 8 MiB parts),
  // then over the data plane (sockets cut mid-transfer; the session's server memory must go).
  for (const char* flags : {"--rows=4000", "--rows=300000 --streams=4",
                            "--rows=300000 --streams=2 --data-plane=1 --data-plane-streams=2 --data-plane-sockets=3 "
                            "--first-chunk-bytes=65536 --last-chunk-bytes=65536 --grow-chunks=1"}) {
    const std::string cmd = cli + " bench --target=" + server_->target + " --op=train " + flags +
                            " --iterations=100000 >/dev/null 2>&1 & pid=$!; sleep 1.5; kill -9 $pid; wait $pid";
    ASSERT_NE(std::system(cmd.c_str()), -1);
    for (int i = 0; i < 3; ++i) ExpectStillServing();
  }
  for (int i = 0; i < 500 && server_->server->regions().counts().server != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(server_->server->regions().counts().server, 0u) << "a killed client's server memory was not freed";
}

}  // namespace
}  // namespace lce::e2e
