// The client over several replicas, against in-process fake lce.v1 servers that count their calls:
// scoring calls spread over the targets (listed, comma-separated, or one round_robin name), training
// calls on the front, retries on UNAVAILABLE to the next replica, a dead replica passed over; the
// training RPCs' messages (GetGrad reassembly, UpdateWeights blocks) and the admin token.
#include <map>
#include <mutex>

#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "lce/client/lce_client.h"

namespace lce::client {
namespace {

using grpc::ServerContext;
using RW = grpc::ServerReaderWriter<v1::StreamResponse, v1::StreamRequest>;

// Answers every call, counting it by method with the bearer token it carried. Streaming calls get
// logprob = target per row (and a summary); `unavailable` makes them fail UNAVAILABLE instead.
class CountingService final : public v1::LceService::Service {
 public:
  std::atomic<bool> unavailable{false};

  int Calls(const std::string& method) {
    std::lock_guard<std::mutex> l(mu_);
    return calls_[method];
  }
  std::string Token(const std::string& method) {
    std::lock_guard<std::mutex> l(mu_);
    return tokens_[method];
  }
  std::vector<v1::TensorChunk> weight_blocks() {
    std::lock_guard<std::mutex> l(mu_);
    return weight_blocks_;
  }

  grpc::Status GetInfo(ServerContext* ctx, const v1::GetInfoRequest*, v1::GetInfoResponse* r) override {
    Count("GetInfo", ctx);
    r->set_backend("fake");
    return grpc::Status::OK;
  }
  grpc::Status Score(ServerContext* ctx, RW* s) override { return Serve("Score", ctx, s); }
  grpc::Status ForwardBackward(ServerContext* ctx, RW* s) override { return Serve("ForwardBackward", ctx, s); }
  grpc::Status LoadHead(ServerContext* ctx, const v1::LoadHeadRequest* req, v1::HeadDescription* r) override {
    Count("LoadHead", ctx);
    r->set_name(req->name());
    r->set_version(1);
    return grpc::Status::OK;
  }
  grpc::Status ZeroGrad(ServerContext* ctx, const v1::ZeroGradRequest*, v1::ZeroGradResponse*) override {
    Count("ZeroGrad", ctx);
    return grpc::Status::OK;
  }
  // A 5 x 2 gradient, value 10·row + col, in blocks of rows [3, 5), [0, 3).
  grpc::Status GetGrad(ServerContext* ctx, const v1::GetGradRequest*, grpc::ServerWriter<v1::TensorChunk>* w) override {
    Count("GetGrad", ctx);
    for (auto [first, rows] : {std::pair{3, 2}, std::pair{0, 3}}) {
      v1::TensorChunk c;
      c.set_first_row(first);
      c.set_rows(rows);
      c.set_cols(2);
      c.set_rows_total(5);
      c.set_dtype(v1::DTYPE_FLOAT32);
      std::vector<float> v;
      for (int r = first; r < first + rows; ++r) v.insert(v.end(), {10.0f * r, 10.0f * r + 1});
      c.set_data(v.data(), v.size() * 4);
      w->Write(c);
    }
    return grpc::Status::OK;
  }
  grpc::Status OptimizerStep(ServerContext* ctx, const v1::OptimizerStepRequest* req,
                             v1::OptimizerStepResponse* r) override {
    Count("OptimizerStep", ctx);
    r->set_step(1);
    r->set_grad_norm(req->lr());
    return grpc::Status::OK;
  }
  grpc::Status UpdateWeights(ServerContext* ctx, grpc::ServerReader<v1::UpdateWeightsRequest>* reader,
                             v1::HeadDescription* r) override {
    Count("UpdateWeights", ctx);
    v1::UpdateWeightsRequest m;
    while (reader->Read(&m)) {
      if (m.has_header()) r->set_name(m.header().head()), r->set_version(m.header().expected_version() + 1);
      std::lock_guard<std::mutex> l(mu_);
      if (m.has_chunk()) weight_blocks_.push_back(m.chunk());
    }
    return grpc::Status::OK;
  }
  grpc::Status SaveHead(ServerContext* ctx, const v1::SaveHeadRequest* req, v1::SaveHeadResponse* r) override {
    Count("SaveHead", ctx);
    r->set_index_file(req->directory() + "/index.json");
    return grpc::Status::OK;
  }

 private:
  void Count(const std::string& method, ServerContext* ctx) {
    auto it = ctx->client_metadata().find("authorization");
    std::lock_guard<std::mutex> l(mu_);
    ++calls_[method];
    tokens_[method] = it == ctx->client_metadata().end() ? "" : std::string(it->second.data(), it->second.size());
  }
  grpc::Status Serve(const std::string& method, ServerContext* ctx, RW* s) {
    Count(method, ctx);
    if (unavailable) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "rank 1 of the group is gone (fake)");
    v1::StreamRequest req;
    int64_t row = 0;
    while (s->Read(&req)) {
      if (!req.has_chunk()) continue;
      v1::StreamResponse resp;
      v1::ChunkResult* c = resp.mutable_chunk();
      c->set_first_row(row);
      c->set_rows(req.chunk().targets_size());
      for (int32_t y : req.chunk().targets()) c->add_logprobs(static_cast<float>(y));
      if (method != "Score") c->set_d_hidden(req.chunk().hidden());
      row += c->rows();
      s->Write(resp);
    }
    if (method != "Score") {
      v1::StreamResponse resp;
      resp.mutable_summary()->set_rows(row);
      s->Write(resp);
    }
    return grpc::Status::OK;
  }
  std::mutex mu_;
  std::map<std::string, int> calls_;
  std::map<std::string, std::string> tokens_;
  std::vector<v1::TensorChunk> weight_blocks_;
};

struct FakeServer {
  CountingService service;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  std::string target() const { return "127.0.0.1:" + std::to_string(port); }
  void Start() {
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(&service);
    server = b.BuildAndStart();
  }
  void Kill() { server->Shutdown(std::chrono::system_clock::now()); }
  ~FakeServer() {
    if (server) server->Shutdown(std::chrono::system_clock::now());
  }
};

class Replicas : public ::testing::Test {
 protected:
  void SetUp() override {
    for (FakeServer& s : servers_) {
      s.Start();
      ASSERT_NE(s.server, nullptr);
    }
  }
  std::unique_ptr<LceClient> Connect(ClientOptions o) {
    o.timeout = absl::Seconds(20);
    absl::StatusOr<std::unique_ptr<LceClient>> c = LceClient::Create(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }
  ClientOptions Listed() {
    ClientOptions o;
    o.target = servers_[0].target() + "," + servers_[1].target();
    return o;
  }
  absl::Status ScoreOnce(LceClient& c) {
    v1::RequestHeader h;
    return c.Score(batch_, h).status();
  }
  absl::Status TrainOnce(LceClient& c, bool accumulate) {
    v1::RequestHeader h;
    h.set_reduction(v1::REDUCTION_SUM);
    h.set_accumulate_weight_grad(accumulate);
    return c.ForwardBackward(batch_, h).status();
  }

  FakeServer servers_[2];
  std::vector<uint8_t> hidden_ = std::vector<uint8_t>(3 * 4 * 2, 1);
  std::vector<int32_t> targets_ = {1, 2, 3};
  HiddenBatch batch_{v1::DTYPE_BFLOAT16, 3, 4, absl::MakeConstSpan(hidden_), absl::MakeConstSpan(targets_)};
};

TEST_F(Replicas, ScoringCallsSpreadInTurnAndTrainingCallsGoToTheFront) {
  auto c = Connect(Listed());
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->replica_targets(), (std::vector<std::string>{servers_[0].target(), servers_[1].target()}));
  for (int i = 0; i < 6; ++i) ASSERT_TRUE(ScoreOnce(*c).ok());
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(TrainOnce(*c, /*accumulate=*/false).ok());
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(TrainOnce(*c, /*accumulate=*/true).ok());
  EXPECT_EQ(servers_[0].service.Calls("Score"), 3);
  EXPECT_EQ(servers_[1].service.Calls("Score"), 3);
  // 2 + 2 spread, then the 3 that accumulate dW on the front.
  EXPECT_EQ(servers_[0].service.Calls("ForwardBackward"), 2 + 3);
  EXPECT_EQ(servers_[1].service.Calls("ForwardBackward"), 2);

  v1::LoadHeadRequest load;
  load.set_name("h");
  ASSERT_TRUE(c->LoadHead(load).ok());
  ASSERT_TRUE(c->ZeroGrad("h").ok());
  ASSERT_TRUE(c->GetGrad("h").ok());
  ASSERT_TRUE(c->OptimizerStep(v1::OptimizerStepRequest()).ok());
  std::vector<uint8_t> w(4 * 2 * 2, 0);
  ASSERT_TRUE(c->UpdateWeights("h", WeightTensor{v1::DTYPE_BFLOAT16, 4, 2, absl::MakeConstSpan(w)}).ok());
  ASSERT_TRUE(c->SaveHead("h", "/tmp/x").ok());
  ASSERT_TRUE(c->GetInfo().ok());
  for (const char* m : {"LoadHead", "ZeroGrad", "GetGrad", "OptimizerStep", "UpdateWeights", "SaveHead", "GetInfo"}) {
    EXPECT_EQ(servers_[0].service.Calls(m), 1) << m;
    EXPECT_EQ(servers_[1].service.Calls(m), 0) << m;
  }
}

TEST_F(Replicas, ATargetListIsTheSameAsACommaSeparatedOne) {
  ClientOptions o;
  o.targets = {servers_[0].target(), servers_[1].target()};
  auto c = Connect(o);
  ASSERT_NE(c, nullptr);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(ScoreOnce(*c).ok());
  EXPECT_EQ(servers_[0].service.Calls("Score"), 2);
  EXPECT_EQ(servers_[1].service.Calls("Score"), 2);
}

TEST_F(Replicas, AKilledReplicaIsPassedOverAndScoringCallsSucceedOnTheOther) {
  auto c = Connect(Listed());
  ASSERT_NE(c, nullptr);
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(ScoreOnce(*c).ok());  // both connected
  servers_[1].Kill();
  for (int i = 0; i < 6; ++i) ASSERT_TRUE(ScoreOnce(*c).ok()) << i;
  EXPECT_EQ(servers_[0].service.Calls("Score"), 1 + 6);
  // Training calls keep going to the front, which is alive.
  EXPECT_TRUE(c->ZeroGrad().ok());
  EXPECT_TRUE(TrainOnce(*c, /*accumulate=*/true).ok());
}

TEST_F(Replicas, AFrontThatIsGoneFailsTrainingCallsButNotScoringCalls) {
  auto c = Connect(Listed());
  ASSERT_NE(c, nullptr);
  servers_[0].Kill();
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(ScoreOnce(*c).ok()) << i;
  EXPECT_EQ(servers_[1].service.Calls("Score"), 4);
  EXPECT_TRUE(absl::IsUnavailable(c->ZeroGrad())) << "training calls are not moved to another replica";
  EXPECT_TRUE(absl::IsUnavailable(TrainOnce(*c, /*accumulate=*/true)));
  absl::StatusOr<v1::GetInfoResponse> info = c->GetInfo();  // any replica describes the heads
  EXPECT_TRUE(info.ok()) << info.status();
}

TEST_F(Replicas, UnavailableIsRetriedOnTheNextReplicaWithinMaxAttempts) {
  servers_[0].service.unavailable = true;
  auto c = Connect(Listed());
  ASSERT_NE(c, nullptr);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(ScoreOnce(*c).ok()) << i;
  EXPECT_EQ(servers_[1].service.Calls("Score"), 4);
  EXPECT_EQ(servers_[0].service.Calls("Score"), 2) << "every other call started there and was sent again";

  servers_[1].service.unavailable = true;  // both down: the last attempt's error, saying how many were made
  absl::Status s = ScoreOnce(*c);
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_NE(s.message().find("tried 3 times over 2 replica(s)"), std::string::npos) << s;

  ClientOptions once = Listed();
  once.max_attempts = 1;
  auto c1 = Connect(once);
  EXPECT_TRUE(absl::IsUnavailable(ScoreOnce(*c1)));
  // A training request is never sent again.
  const int before = servers_[0].service.Calls("ForwardBackward") + servers_[1].service.Calls("ForwardBackward");
  EXPECT_TRUE(absl::IsUnavailable(TrainOnce(*c, /*accumulate=*/true)));
  EXPECT_EQ(servers_[0].service.Calls("ForwardBackward") + servers_[1].service.Calls("ForwardBackward"), before + 1);
}

TEST_F(Replicas, OneServerIsNotRetriedByDefault) {
  servers_[0].service.unavailable = true;
  ClientOptions o;
  o.target = servers_[0].target();
  auto c = Connect(o);
  EXPECT_TRUE(absl::IsUnavailable(ScoreOnce(*c)));
  EXPECT_EQ(servers_[0].service.Calls("Score"), 1);
  o.max_attempts = 3;
  auto c3 = Connect(o);
  EXPECT_TRUE(absl::IsUnavailable(ScoreOnce(*c3)));
  EXPECT_EQ(servers_[0].service.Calls("Score"), 1 + 3);
}

TEST_F(Replicas, RoundRobinNameSpreadsScoringAndKeepsTrainingOnOneAddress) {
  ClientOptions o;
  o.target = "ipv4:" + servers_[0].target() + "," + servers_[1].target();
  o.load_balancing = "round_robin";
  auto c = Connect(o);
  ASSERT_NE(c, nullptr);
  // gRPC's round_robin picks among the addresses that are connected; both are after a few calls.
  for (int i = 0; i < 200 && (servers_[0].service.Calls("Score") == 0 || servers_[1].service.Calls("Score") == 0); ++i) {
    ASSERT_TRUE(ScoreOnce(*c).ok());
  }
  EXPECT_GT(servers_[0].service.Calls("Score"), 0);
  EXPECT_GT(servers_[1].service.Calls("Score"), 0);
  for (int i = 0; i < 6; ++i) ASSERT_TRUE(c->ZeroGrad().ok());
  const int a = servers_[0].service.Calls("ZeroGrad"), b = servers_[1].service.Calls("ZeroGrad");
  EXPECT_TRUE((a == 6 && b == 0) || (a == 0 && b == 6)) << a << " " << b;
}

TEST_F(Replicas, BadTargetsAreInvalidArgument) {
  auto bad = [](ClientOptions o) { return LceClient::Create(o).status(); };
  ClientOptions o;
  o.target = "a:1,,b:2";
  EXPECT_TRUE(absl::IsInvalidArgument(bad(o))) << bad(o);
  o.target = "";
  EXPECT_TRUE(absl::IsInvalidArgument(bad(o)));
  o.target = "a:1";
  o.targets = {"b:2"};
  EXPECT_TRUE(absl::IsInvalidArgument(bad(o)));
  o.targets.clear();
  o.load_balancing = "random";
  EXPECT_NE(bad(o).message().find("load_balancing"), std::string::npos) << bad(o);
  o.load_balancing = "round_robin";
  o.targets = {"a:1", "b:2"};
  o.target = "";
  EXPECT_TRUE(absl::IsInvalidArgument(bad(o)));
  o.targets = {"dns:///fronts:50051"};
  o.data_plane = true;
  EXPECT_NE(bad(o).message().find("data_plane"), std::string::npos) << bad(o);
}

TEST_F(Replicas, TrainingRpcsCarryTheAdminTokenAndTheirBlocks) {
  ClientOptions o = Listed();
  o.bearer_token = "scoring";
  o.admin_token = "admin";
  o.chunk_bytes = 2 * 2 * 3;  // 3 rows of 2 bf16 a block
  auto c = Connect(o);
  ASSERT_TRUE(ScoreOnce(*c).ok());
  absl::StatusOr<Gradient> g = c->GetGrad("h");
  ASSERT_TRUE(g.ok()) << g.status();
  ASSERT_EQ(g->rows, 5);
  ASSERT_EQ(g->cols, 2);
  for (int r = 0; r < 5; ++r) {
    EXPECT_EQ(g->values[r * 2], 10.0f * r);
    EXPECT_EQ(g->values[r * 2 + 1], 10.0f * r + 1);
  }
  std::vector<uint8_t> w(7 * 2 * 2);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<uint8_t>(i);
  absl::StatusOr<v1::HeadDescription> h =
      c->UpdateWeights("h", WeightTensor{v1::DTYPE_BFLOAT16, 7, 2, absl::MakeConstSpan(w)}, /*expected_version=*/4);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->version(), 5);
  std::string sent;
  std::vector<int64_t> rows;
  for (const v1::TensorChunk& b : servers_[0].service.weight_blocks()) {
    rows.push_back(b.rows());
    EXPECT_EQ(b.first_row(), static_cast<int64_t>(sent.size()) / 4);
    EXPECT_EQ(b.rows_total(), 7);
    sent += b.data();
  }
  EXPECT_EQ(rows, (std::vector<int64_t>{3, 3, 1}));
  EXPECT_EQ(sent, std::string(w.begin(), w.end()));
  EXPECT_EQ(servers_[0].service.Token("GetGrad"), "Bearer admin");
  EXPECT_EQ(servers_[0].service.Token("UpdateWeights"), "Bearer admin");
  EXPECT_EQ(servers_[0].service.Token("Score"), "Bearer scoring");
  // A weight whose bytes do not match its shape is refused here.
  EXPECT_TRUE(absl::IsInvalidArgument(
      c->UpdateWeights("h", WeightTensor{v1::DTYPE_BFLOAT16, 8, 2, absl::MakeConstSpan(w)}).status()));
}

}  // namespace
}  // namespace lce::client
