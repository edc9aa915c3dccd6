// The client's streaming logic against an in-process fake lce.v1.LceService (no engine, no server
// library): chunking and per-row arrays, reassembly checks, concurrent read/write on large
// requests, status mapping, deadlines, metadata, num_valid_tokens, health.
#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>

#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "gtest/gtest.h"
#include "lce/client/lce_client.h"

namespace lce::client {
namespace {

using grpc::ServerContext;
using RW = grpc::ServerReaderWriter<v1::StreamResponse, v1::StreamRequest>;

enum class Fault { kNone, kSkipRow, kRepeatChunk, kShortLogprobs, kShortDHidden, kOverrun, kFailAtChunk2, kSlow,
                   kReversed };

// Answers chunk by chunk as a server would, with values derived from the request so that the test
// can check where every value landed: logprob_i = target_i + 0.5, entropy_i = row index,
// loss_i = 2·target_i (+ grad_loss_i), d_hidden = the hidden bytes with every byte incremented.
class FakeService final : public v1::LceService::Service {
 public:
  Fault fault = Fault::kNone;

  grpc::Status GetInfo(ServerContext*, const v1::GetInfoRequest* req, v1::GetInfoResponse* resp) override {
    if (req->head() == "nope") return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown head 'nope'");
    resp->mutable_head()->set_name(req->head().empty() ? "default" : req->head());
    resp->mutable_head()->set_hidden_size(8);
    resp->set_backend("fake");
    return grpc::Status::OK;
  }
  grpc::Status Score(ServerContext* ctx, RW* s) override { return Serve(ctx, s, 0); }
  grpc::Status ForwardBackward(ServerContext* ctx, RW* s) override { return Serve(ctx, s, 1); }
  grpc::Status Backward(ServerContext* ctx, RW* s) override { return Serve(ctx, s, 2); }

  // What the last request carried.
  std::mutex mu;
  v1::RequestHeader header;
  std::string authorization;
  std::vector<int64_t> chunk_rows;
  std::vector<int32_t> targets;
  std::vector<float> grad_loss, grad_logprob, grad_entropy;
  std::string hidden;

 private:
  grpc::Status Serve(ServerContext* ctx, RW* s, int rpc) {
    v1::StreamRequest req;
    if (!s->Read(&req) || !req.has_header()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no header");
    {
      std::lock_guard<std::mutex> l(mu);
      header = req.header();
      auto it = ctx->client_metadata().find("authorization");
      authorization = it == ctx->client_metadata().end() ? "" : std::string(it->second.data(), it->second.size());
      chunk_rows.clear();
      targets.clear();
      grad_loss.clear();
      grad_logprob.clear();
      grad_entropy.clear();
      hidden.clear();
    }
    const int32_t ignore = header.has_ignore_index() ? header.ignore_index() : -100;
    int64_t row = 0, valid = 0;
    std::vector<v1::StreamResponse> held;  // kReversed: answered at the end, last chunk first
    while (s->Read(&req)) {
      if (!req.has_chunk()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "second header");
      const v1::RowChunk& c = req.chunk();
      const int64_t n = c.targets_size();
      {
        std::lock_guard<std::mutex> l(mu);
        chunk_rows.push_back(n);
        targets.insert(targets.end(), c.targets().begin(), c.targets().end());
        grad_loss.insert(grad_loss.end(), c.grad_loss().begin(), c.grad_loss().end());
        grad_logprob.insert(grad_logprob.end(), c.grad_logprob().begin(), c.grad_logprob().end());
        grad_entropy.insert(grad_entropy.end(), c.grad_entropy().begin(), c.grad_entropy().end());
        hidden += c.hidden();
      }
      if (fault == Fault::kFailAtChunk2 && chunk_rows.size() == 2) {
        return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "chunk 1: request over the limit (fake)");
      }
      if (fault == Fault::kSlow) std::this_thread::sleep_for(std::chrono::milliseconds(300));
      v1::StreamResponse resp;
      v1::ChunkResult* r = resp.mutable_chunk();
      r->set_first_row(row);
      r->set_rows(n);
      for (int64_t i = 0; i < n; ++i) {
        const int32_t y = c.targets(static_cast<int>(i));
        valid += y != ignore;
        if (rpc == 0) {
          r->add_logprobs(static_cast<float>(y) + 0.5f);
          r->add_entropy(static_cast<float>(row + i));
        }
        if (rpc == 1) r->add_loss(2.0f * y + (c.grad_loss_size() ? c.grad_loss(static_cast<int>(i)) : 0.0f));
      }
      if (rpc != 0) {
        std::string d = c.hidden();
        for (char& ch : d) ch = static_cast<char>(ch + 1);
        r->set_d_hidden(d);
      }
      if (fault == Fault::kShortLogprobs && rpc == 0 && row > 0) r->mutable_logprobs()->RemoveLast();
      if (fault == Fault::kShortDHidden && rpc != 0 && row > 0) r->mutable_d_hidden()->pop_back();
      if (fault == Fault::kSkipRow && row == 0 && n > 1) {
        r->set_rows(n - 1);
        r->mutable_logprobs()->RemoveLast();
        r->mutable_entropy()->RemoveLast();
      }
      if (fault == Fault::kOverrun) r->set_rows(n + 1);
      row += n;
      if (fault == Fault::kReversed) {
        held.push_back(resp);
        continue;
      }
      if (!s->Write(resp)) return grpc::Status(grpc::StatusCode::CANCELLED, "client gone");
      if (fault == Fault::kRepeatChunk && row == n && !s->Write(resp)) {
        return grpc::Status(grpc::StatusCode::CANCELLED, "client gone");
      }
    }
    for (auto it = held.rbegin(); it != held.rend(); ++it) s->Write(*it);
    if (rpc == 1) {
      v1::StreamResponse resp;
      resp.mutable_summary()->set_rows(row);
      resp.mutable_summary()->set_valid_tokens(valid);
      resp.mutable_summary()->set_loss(42.25);
      resp.mutable_summary()->set_head_version(7);
      s->Write(resp);
    }
    return grpc::Status::OK;
  }
};

class Streaming : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(&service_);
    b.SetMaxReceiveMessageSize(64 << 20);
    server_ = b.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    target_ = "127.0.0.1:" + std::to_string(port);
  }
  void TearDown() override { server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2)); }

  std::unique_ptr<LceClient> Connect(int64_t chunk_bytes = 4 << 20, absl::Duration timeout = absl::Seconds(30),
                                     std::string token = "") {
    ClientOptions o;
    o.target = target_;
    o.chunk_bytes = chunk_bytes;
    o.first_chunk_bytes = chunk_bytes;  // equal chunks: the fake's faults are placed by chunk
    o.timeout = timeout;
    o.bearer_token = std::move(token);
    absl::StatusOr<std::unique_ptr<LceClient>> c = LceClient::Create(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return std::move(*c);
  }

  // rows × H bf16 rows with distinct byte patterns, targets 0..rows-1 with every 5th ignored.
  struct Batch {
    std::vector<uint8_t> hidden;
    std::vector<int32_t> targets;
    HiddenBatch view;
  };
  static Batch MakeBatch(int64_t rows, int64_t H, int32_t ignore = -100) {
    Batch b;
    b.hidden.resize(static_cast<size_t>(rows * H * 2));
    for (size_t i = 0; i < b.hidden.size(); ++i) b.hidden[i] = static_cast<uint8_t>(i * 131 + i / 7);
    for (int64_t i = 0; i < rows; ++i) b.targets.push_back(i % 5 == 4 ? ignore : static_cast<int32_t>(i));
    b.view = {v1::DTYPE_BFLOAT16, rows, H, absl::MakeConstSpan(b.hidden), absl::MakeConstSpan(b.targets)};
    return b;
  }

  FakeService service_;
  std::unique_ptr<grpc::Server> server_;
  std::string target_;
};

TEST_F(Streaming, ScoreReassemblesHoweverTheBatchIsCut) {
  const int64_t rows = 37, H = 8;
  Batch b = MakeBatch(rows, H);
  // Row = 16 bytes: 1 row per chunk, 3 rows per chunk, everything in one chunk.
  for (int64_t chunk_bytes : {int64_t{1}, int64_t{48}, int64_t{50}, int64_t{4} << 20}) {
    auto c = Connect(chunk_bytes);
    v1::RequestHeader h;
    h.set_head("h1");
    h.set_temperature(0.5f);
    absl::StatusOr<ScoreResult> r = c->Score(b.view, h);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->logprobs.size(), rows);
    ASSERT_EQ(r->entropy.size(), rows);
    for (int64_t i = 0; i < rows; ++i) {
      EXPECT_EQ(r->logprobs[i], static_cast<float>(b.targets[i]) + 0.5f);
      EXPECT_EQ(r->entropy[i], static_cast<float>(i));
    }
    const int64_t per = std::max<int64_t>(1, chunk_bytes / (H * 2));
    std::lock_guard<std::mutex> l(service_.mu);
    EXPECT_EQ(service_.chunk_rows.size(), static_cast<size_t>((rows + per - 1) / per)) << chunk_bytes;
    for (int64_t n : service_.chunk_rows) EXPECT_LE(n, per);
    EXPECT_EQ(service_.targets, b.targets);
    EXPECT_EQ(service_.hidden, std::string(b.hidden.begin(), b.hidden.end()));
    // The client fills hidden_size and dtype and keeps the caller's options.
    EXPECT_EQ(service_.header.hidden_size(), H);
    EXPECT_EQ(service_.header.dtype(), v1::DTYPE_BFLOAT16);
    EXPECT_EQ(service_.header.head(), "h1");
    EXPECT_EQ(service_.header.temperature(), 0.5f);
    EXPECT_FALSE(service_.header.has_num_valid_tokens());
    EXPECT_EQ(service_.authorization, "");
  }
}

TEST_F(Streaming, AnswersInAnyOrderAreAccepted) {
  service_.fault = Fault::kReversed;
  Batch b = MakeBatch(10, 8);
  absl::StatusOr<ScoreResult> r = Connect(32)->Score(b.view, {});
  ASSERT_TRUE(r.ok()) << r.status();
  for (int64_t i = 0; i < 10; ++i) EXPECT_EQ(r->entropy[i], static_cast<float>(i));
}

TEST_F(Streaming, ForwardBackwardPerRowArraysAndSummary) {
  const int64_t rows = 23, H = 4;
  Batch b = MakeBatch(rows, H);
  std::vector<float> g(rows);
  for (int64_t i = 0; i < rows; ++i) g[i] = 0.25f * i;
  auto c = Connect(3 * H * 2);  // 3 rows per chunk
  v1::RequestHeader h;
  h.set_reduction(v1::REDUCTION_NONE);
  absl::StatusOr<ForwardBackwardResult> r = c->ForwardBackward(b.view, h, g);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->reduced_loss, 42.25);
  EXPECT_EQ(r->head_version, 7);
  EXPECT_EQ(r->valid_tokens, rows - rows / 5);
  ASSERT_EQ(r->loss.size(), rows);
  for (int64_t i = 0; i < rows; ++i) EXPECT_EQ(r->loss[i], 2.0f * b.targets[i] + g[i]) << i;
  ASSERT_EQ(r->d_hidden.size(), b.hidden.size());
  for (size_t i = 0; i < b.hidden.size(); ++i) ASSERT_EQ(r->d_hidden[i], static_cast<uint8_t>(b.hidden[i] + 1)) << i;
  EXPECT_TRUE(r->logprobs.empty());
  std::lock_guard<std::mutex> l(service_.mu);
  EXPECT_EQ(service_.grad_loss, g);
  EXPECT_FALSE(service_.header.has_num_valid_tokens());  // not a mean
}

TEST_F(Streaming, ForwardBackwardFillsNumValidTokensForMean) {
  Batch b = MakeBatch(20, 4);  // rows 4, 9, 14, 19 ignored (-100)
  auto c = Connect(40);
  for (v1::Reduction red : {v1::REDUCTION_MEAN, v1::REDUCTION_UNSPECIFIED}) {
    v1::RequestHeader h;
    h.set_reduction(red);
    ASSERT_TRUE(c->ForwardBackward(b.view, h).ok());
    std::lock_guard<std::mutex> l(service_.mu);
    ASSERT_TRUE(service_.header.has_num_valid_tokens());
    EXPECT_EQ(service_.header.num_valid_tokens(), 16);
  }
  {  // A custom ignore_index counts that id instead: -100 is now a real (if invalid) target.
    Batch b7 = MakeBatch(20, 4, 7);
    v1::RequestHeader h;
    h.set_ignore_index(7);
    ASSERT_TRUE(c->ForwardBackward(b7.view, h).ok());
    std::lock_guard<std::mutex> l(service_.mu);
    EXPECT_EQ(service_.header.num_valid_tokens(), 15);  // rows 4, 9, 14, 19 hold 7, and so does row 7
  }
  {  // The caller's own value is kept.
    v1::RequestHeader h;
    h.set_num_valid_tokens(3);
    ASSERT_TRUE(c->ForwardBackward(b.view, h).ok());
    std::lock_guard<std::mutex> l(service_.mu);
    EXPECT_EQ(service_.header.num_valid_tokens(), 3);
  }
  {  // Not for sum.
    v1::RequestHeader h;
    h.set_reduction(v1::REDUCTION_SUM);
    ASSERT_TRUE(c->ForwardBackward(b.view, h).ok());
    std::lock_guard<std::mutex> l(service_.mu);
    EXPECT_FALSE(service_.header.has_num_valid_tokens());
  }
}

TEST_F(Streaming, BackwardSendsBothGradArrays) {
  const int64_t rows = 11, H = 4;
  Batch b = MakeBatch(rows, H);
  std::vector<float> u(rows), e(rows);
  for (int64_t i = 0; i < rows; ++i) {
    u[i] = 1.0f + i;
    e[i] = -0.5f * i;
  }
  absl::StatusOr<BackwardResult> r = Connect(2 * H * 2)->Backward(b.view, {}, u, e);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->d_hidden.size(), b.hidden.size());
  EXPECT_EQ(r->d_hidden[5], static_cast<uint8_t>(b.hidden[5] + 1));
  {
    std::lock_guard<std::mutex> l(service_.mu);
    EXPECT_EQ(service_.grad_logprob, u);
    EXPECT_EQ(service_.grad_entropy, e);
  }
  // An empty grad array sends nothing for it.
  ASSERT_TRUE(Connect()->Backward(b.view, {}, u, {}).ok());
  std::lock_guard<std::mutex> l(service_.mu);
  EXPECT_EQ(service_.grad_logprob, u);
  EXPECT_TRUE(service_.grad_entropy.empty());
}

// 48 MiB each way through 256 KiB chunks: the server answers every chunk as it arrives, so the client
// must read while it writes or both sides stall on flow control.
TEST_F(Streaming, LargeRequestDoesNotDeadlock) {
  const int64_t H = 4096, rows = 6144;  // 8 KiB rows
  Batch b = MakeBatch(rows, H);
  auto c = Connect(256 << 10, absl::Seconds(60));
  absl::StatusOr<BackwardResult> r = c->Backward(b.view, {}, {}, {});
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->d_hidden.size(), b.hidden.size());
  for (size_t i = 0; i < b.hidden.size(); i += 4093) {
    ASSERT_EQ(r->d_hidden[i], static_cast<uint8_t>(b.hidden[i] + 1)) << i;
  }
}

TEST_F(Streaming, MalformedAnswersAreInternalErrors) {
  Batch b = MakeBatch(12, 4);
  for (Fault f : {Fault::kSkipRow, Fault::kRepeatChunk, Fault::kShortLogprobs, Fault::kOverrun}) {
    service_.fault = f;
    absl::StatusOr<ScoreResult> r = Connect(3 * 8)->Score(b.view, {});
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal) << static_cast<int>(f) << " " << r.status();
  }
  service_.fault = Fault::kShortDHidden;
  EXPECT_EQ(Connect(3 * 8)->ForwardBackward(b.view, {}).status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(Connect(3 * 8)->Backward(b.view, {}, {}, {}).status().code(), absl::StatusCode::kInternal);
}

TEST_F(Streaming, ServerStatusIsMappedWithItsMessage) {
  service_.fault = Fault::kFailAtChunk2;
  Batch b = MakeBatch(64, 4);
  absl::StatusOr<ScoreResult> r = Connect(8)->Score(b.view, {});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_EQ(r.status().message(), "chunk 1: request over the limit (fake)");

  absl::StatusOr<v1::GetInfoResponse> info = Connect()->GetInfo("nope");
  EXPECT_EQ(info.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(info.status().message(), "unknown head 'nope'");
  info = Connect()->GetInfo("h2");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->head().name(), "h2");
  EXPECT_EQ(info->backend(), "fake");
}

// The client maps gRPC codes to absl codes by number; the two enumerations must agree name by name.
TEST(StatusCodes, NumericCodesAgree) {
  const std::pair<grpc::StatusCode, absl::StatusCode> pairs[] = {
      {grpc::StatusCode::OK, absl::StatusCode::kOk},
      {grpc::StatusCode::CANCELLED, absl::StatusCode::kCancelled},
      {grpc::StatusCode::UNKNOWN, absl::StatusCode::kUnknown},
      {grpc::StatusCode::INVALID_ARGUMENT, absl::StatusCode::kInvalidArgument},
      {grpc::StatusCode::DEADLINE_EXCEEDED, absl::StatusCode::kDeadlineExceeded},
      {grpc::StatusCode::NOT_FOUND, absl::StatusCode::kNotFound},
      {grpc::StatusCode::ALREADY_EXISTS, absl::StatusCode::kAlreadyExists},
      {grpc::StatusCode::PERMISSION_DENIED, absl::StatusCode::kPermissionDenied},
      {grpc::StatusCode::RESOURCE_EXHAUSTED, absl::StatusCode::kResourceExhausted},
      {grpc::StatusCode::FAILED_PRECONDITION, absl::StatusCode::kFailedPrecondition},
      {grpc::StatusCode::ABORTED, absl::StatusCode::kAborted},
      {grpc::StatusCode::OUT_OF_RANGE, absl::StatusCode::kOutOfRange},
      {grpc::StatusCode::UNIMPLEMENTED, absl::StatusCode::kUnimplemented},
      {grpc::StatusCode::INTERNAL, absl::StatusCode::kInternal},
      {grpc::StatusCode::UNAVAILABLE, absl::StatusCode::kUnavailable},
      {grpc::StatusCode::DATA_LOSS, absl::StatusCode::kDataLoss},
      {grpc::StatusCode::UNAUTHENTICATED, absl::StatusCode::kUnauthenticated},
  };
  for (auto [g, a] : pairs) EXPECT_EQ(static_cast<int>(g), static_cast<int>(a)) << absl::StatusCodeToString(a);
}

TEST_F(Streaming, DeadlineIsTheTimeout) {
  service_.fault = Fault::kSlow;
  Batch b = MakeBatch(10, 4);
  const absl::Time t0 = absl::Now();
  absl::StatusOr<ScoreResult> r = Connect(8, absl::Milliseconds(500))->Score(b.view, {});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(3));
}

TEST_F(Streaming, BearerTokenMetadata) {
  Batch b = MakeBatch(3, 4);
  ASSERT_TRUE(Connect(4 << 20, absl::Seconds(30), "s3cret")->Score(b.view, {}).ok());
  std::lock_guard<std::mutex> l(service_.mu);
  EXPECT_EQ(service_.authorization, "Bearer s3cret");
}

TEST_F(Streaming, Health) {
  auto c = Connect();
  absl::StatusOr<bool> h = c->Health();
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_TRUE(*h);
  server_->GetHealthCheckService()->SetServingStatus(false);
  h = c->Health();
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_FALSE(*h);
  EXPECT_EQ(c->Health("no.such.Service").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(Streaming, BadBatchesFailBeforeAnyCall) {
  Batch b = MakeBatch(4, 4);
  auto c = Connect();
  HiddenBatch v = b.view;
  v.rows = 5;  // targets and hidden hold 4 rows
  EXPECT_EQ(c->Score(v, {}).status().code(), absl::StatusCode::kInvalidArgument);
  v = b.view;
  v.dtype = v1::DTYPE_UNSPECIFIED;
  EXPECT_EQ(c->Score(v, {}).status().code(), absl::StatusCode::kInvalidArgument);
  v = b.view;
  v.hidden = v.hidden.subspan(1);
  EXPECT_EQ(c->Score(v, {}).status().code(), absl::StatusCode::kInvalidArgument);
  std::vector<float> g(3);
  EXPECT_EQ(c->Backward(b.view, {}, g, {}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c->ForwardBackward(b.view, {}, g).status().code(), absl::StatusCode::kInvalidArgument);
  std::lock_guard<std::mutex> l(service_.mu);
  EXPECT_TRUE(service_.chunk_rows.empty());  // nothing reached the server
}

TEST(ClientOptionsTest, CreateValidates) {
  ClientOptions o;
  EXPECT_EQ(LceClient::Create(o).status().code(), absl::StatusCode::kInvalidArgument);  // no target
  o.target = "127.0.0.1:1";
  o.chunk_bytes = 0;
  EXPECT_EQ(LceClient::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Unreachable, IsUnavailable) {
  ClientOptions o;
  o.target = "127.0.0.1:1";
  o.timeout = absl::Seconds(5);
  absl::StatusOr<std::unique_ptr<LceClient>> c = LceClient::Create(o);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ((*c)->GetInfo().status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace lce::client
