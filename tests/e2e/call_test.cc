// LceService.Call: a request in one message gets the same answers, bit for bit, and the same errors
// as the streamed RPC it names, and the server serves on.
#include <cstring>

#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/impl/client_unary_call.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "hidden_call.h"
#include "gtest/gtest.h"
#include "test_server.h"

namespace lce::e2e {
namespace {

struct Request {
  v1::RequestHeader header;
  v1::RowChunk chunk;
};

Request Make(const Batch& b, v1::CallMethod method) {
  Request r;
  r.header.set_hidden_size(kHidden);
  r.header.set_dtype(b.dtype);
  r.chunk.set_hidden(b.hidden.data(), b.hidden.size());
  for (int32_t y : b.targets) r.chunk.add_targets(y);
  if (method == v1::CALL_FORWARD_BACKWARD) r.header.set_reduction(v1::REDUCTION_SUM);
  if (method == v1::CALL_BACKWARD) {
    for (int64_t i = 0; i < b.rows; ++i) {
      r.chunk.add_grad_logprob(0.25f * static_cast<float>(i % 5) - 0.5f);
      r.chunk.add_grad_entropy(0.125f * static_cast<float>(i % 3));
    }
  }
  return r;
}

// The same request as a stream: its answers, as a Call's response would hold them.
grpc::Status Streamed(v1::LceService::Stub& stub, v1::CallMethod method, const Request& r, v1::CallResponse* out) {
  grpc::ClientContext ctx;
  auto stream = method == v1::CALL_SCORE              ? stub.Score(&ctx)
                : method == v1::CALL_FORWARD_BACKWARD ? stub.ForwardBackward(&ctx)
                                                      : stub.Backward(&ctx);
  v1::StreamRequest m;
  *m.mutable_header() = r.header;
  stream->Write(m);
  *m.mutable_chunk() = r.chunk;
  stream->Write(m);
  stream->WritesDone();
  v1::StreamResponse resp;
  while (stream->Read(&resp)) {
    if (resp.has_chunk()) *out->mutable_chunk() = resp.chunk();
    if (resp.has_summary()) *out->mutable_summary() = resp.summary();
  }
  return stream->Finish();
}

grpc::Status Called(v1::LceService::Stub& stub, v1::CallMethod method, const Request& r, v1::CallResponse* out) {
  grpc::ClientContext ctx;
  v1::CallRequest req;
  req.set_method(method);
  *req.mutable_header() = r.header;
  *req.mutable_chunk() = r.chunk;
  return stub.Call(&ctx, req, out);
}

TEST(Call, AnswersEqualTheStreamBitForBit) {
  auto ts = StartTestServer();
  auto stub = RawStub(ts->target);
  for (v1::CallMethod method : {v1::CALL_SCORE, v1::CALL_FORWARD_BACKWARD, v1::CALL_BACKWARD}) {
    for (int64_t rows : {1, 37}) {
      const Request r = Make(MakeBatch(rows, v1::DTYPE_BFLOAT16, 60 + rows), method);
      v1::CallResponse streamed, called;
      const grpc::Status s = Streamed(*stub, method, r, &streamed);
      const grpc::Status c = Called(*stub, method, r, &called);
      ASSERT_TRUE(s.ok() && c.ok()) << s.error_message() << " / " << c.error_message();
      const std::string what = absl::StrCat("method ", method, ", ", rows, " rows");
      EXPECT_EQ(called.chunk().rows(), rows) << what;
      EXPECT_EQ(called.chunk().first_row(), 0) << what;
      EXPECT_EQ(called.chunk().SerializeAsString(), streamed.chunk().SerializeAsString()) << what;
      EXPECT_EQ(called.has_summary(), method == v1::CALL_FORWARD_BACKWARD) << what;
      EXPECT_EQ(called.summary().SerializeAsString(), streamed.summary().SerializeAsString()) << what;
      if (method != v1::CALL_SCORE) {
        EXPECT_EQ(called.chunk().d_hidden().size(), static_cast<size_t>(rows * kHidden * 2)) << what;
      }
    }
  }
}

TEST(Call, ErrorsAreTheStreamsAndTheServerServesOn) {
  auto ts = StartTestServer(/*max_message_bytes=*/1 << 20);
  auto stub = RawStub(ts->target);
  Request bad = Make(MakeBatch(4, v1::DTYPE_BFLOAT16, 70), v1::CALL_SCORE);
  bad.chunk.set_targets(2, static_cast<int32_t>(kVocab));  // out of the vocabulary
  v1::CallResponse out, streamed;
  grpc::Status c = Called(*stub, v1::CALL_SCORE, bad, &out);
  grpc::Status s = Streamed(*stub, v1::CALL_SCORE, bad, &streamed);
  EXPECT_EQ(c.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.error_message();
  EXPECT_EQ(c.error_code(), s.error_code());
  EXPECT_EQ(c.error_message(), s.error_message());

  Request good = Make(MakeBatch(4, v1::DTYPE_BFLOAT16, 71), v1::CALL_SCORE);
  c = Called(*stub, v1::CALL_METHOD_UNSPECIFIED, good, &out);
  EXPECT_EQ(c.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.error_message();
  EXPECT_NE(c.error_message().find("CallRequest.method"), std::string::npos) << c.error_message();

  Request no_rows = good;
  no_rows.chunk.Clear();
  c = Called(*stub, v1::CALL_SCORE, no_rows, &out);
  EXPECT_EQ(c.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.error_message();

  // Beyond the server's message limit: gRPC refuses it before the handler.
  const Request big = Make(MakeBatch(20000, v1::DTYPE_BFLOAT16, 72), v1::CALL_SCORE);
  c = Called(*stub, v1::CALL_SCORE, big, &out);
  EXPECT_EQ(c.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << c.error_message();

  v1::CallResponse ok;
  c = Called(*stub, v1::CALL_SCORE, good, &ok);
  ASSERT_TRUE(c.ok()) << c.error_message();
  EXPECT_EQ(ok.chunk().logprobs_size(), 4);
}


// The client's Call sends the hidden states as a slice of the caller's memory after the message
// (hidden_call.h): the server reads the same request, so the answers are the stub's bits.
TEST(Call, HiddenStatesApartGiveTheSameAnswers) {
  auto ts = StartTestServer();
  auto stub = RawStub(ts->target);
  const client::HiddenCall call(grpc::CreateChannel(ts->target, grpc::InsecureChannelCredentials()));
  for (v1::CallMethod method : {v1::CALL_SCORE, v1::CALL_FORWARD_BACKWARD, v1::CALL_BACKWARD}) {
    SCOPED_TRACE(v1::CallMethod_Name(method));
    const Batch b = MakeBatch(37, v1::DTYPE_BFLOAT16, 17);
    Request r = Make(b, method);
    v1::CallResponse want, got;
    ASSERT_TRUE(Called(*stub, method, r, &want).ok());
    v1::CallRequest req;
    req.set_method(method);
    *req.mutable_header() = r.header;
    *req.mutable_chunk() = r.chunk;
    req.mutable_chunk()->clear_hidden();
    grpc::ClientContext ctx;
    const grpc::Status s = call.Run(&ctx, req, absl::MakeConstSpan(b.hidden), &got);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(got.SerializeAsString(), want.SerializeAsString());
  }
}

// A call the server refuses before it has read all of it (a message over its limit): Run returns
// the status only once gRPC let go of the caller's bytes, which may then go (ASan watches).
TEST(Call, HiddenStatesApartOverTheLimitIsRefusedAndReleased) {
  auto ts = StartTestServer(/*max_message_bytes=*/1 << 20);
  const client::HiddenCall call(grpc::CreateChannel(ts->target, grpc::InsecureChannelCredentials()));
  const int64_t rows = (8 << 20) / (kHidden * 2);
  auto hidden = std::make_unique<std::vector<uint8_t>>(MakeBatch(rows, v1::DTYPE_BFLOAT16, 5).hidden);
  v1::CallRequest req;
  req.set_method(v1::CALL_SCORE);
  req.mutable_header()->set_hidden_size(kHidden);
  req.mutable_header()->set_dtype(v1::DTYPE_BFLOAT16);
  for (int64_t i = 0; i < rows; ++i) req.mutable_chunk()->add_targets(1);
  v1::CallResponse got;
  grpc::ClientContext ctx;
  const grpc::Status s = call.Run(&ctx, req, absl::MakeConstSpan(*hidden), &got);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  std::memset(hidden->data(), 0xff, hidden->size());  // ours again
  hidden.reset();
  const Batch b = MakeBatch(3, v1::DTYPE_BFLOAT16, 6);
  Request ok = Make(b, v1::CALL_SCORE);
  v1::CallResponse answer;
  EXPECT_TRUE(Called(*RawStub(ts->target), v1::CALL_SCORE, ok, &answer).ok());
}

// A message that does not parse as a CallRequest is the client's error, named (gRPC's own answer
// for an unparsable unary request would be INTERNAL), and the server serves on.
TEST(Call, MessageThatIsNotACallRequest) {
  auto ts = StartTestServer();
  auto channel = grpc::CreateChannel(ts->target, grpc::InsecureChannelCredentials());
  const grpc::internal::RpcMethod method("/lce.v1.LceService/Call", grpc::internal::RpcMethod::NORMAL_RPC, channel);
  const std::string garbage("\x0a\xff\xff\xff\xff\x0f", 6);  // field 1, a length past the message
  grpc::Slice slice(garbage);
  const grpc::ByteBuffer wire(&slice, 1);
  v1::CallResponse answer;
  grpc::ClientContext ctx;
  const grpc::Status s =
      grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, v1::CallResponse>(channel.get(), method, &ctx, wire, &answer);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("not a CallRequest"), std::string::npos) << s.error_message();
  const Batch b = MakeBatch(3, v1::DTYPE_BFLOAT16, 6);
  EXPECT_TRUE(Called(*RawStub(ts->target), v1::CALL_SCORE, Make(b, v1::CALL_SCORE), &answer).ok());
}

}  // namespace
}  // namespace lce::e2e
