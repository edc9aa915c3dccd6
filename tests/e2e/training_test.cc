// Training RPCs end to end (raw stubs; the CPU engine, or the CUDA one with LCE_TEST_BACKEND=cuda):
// accumulated dW equals the engine's, AdamW steps equal the host AdamW on the same gradient,
// versions pin, weight updates are atomic for readers and wait for the requests on their head, and
// SaveHead -> LoadHead gives the same answers.
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <thread>

#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "lce/numeric.h"
#include "lce/training.h"
#include "test_server.h"
#include "training_rpcs.h"

namespace lce::e2e {
namespace {

class Training : public ::testing::Test {
 protected:
  void SetUp() override {
    ts_ = StartTestServer();
    stub_ = RawStub(ts_->target);
  }

  // Runs a streamed RPC with one chunk; returns the status and fills the responses.
  grpc::Status RunOne(const std::string& rpc, const v1::RequestHeader& h, const Batch& b,
                      std::vector<v1::StreamResponse>* out) {
    return RunOneChunk(*stub_, rpc, h, b, out);
  }
  std::vector<float> Score(const Batch& b, const std::string& head = "wide", int64_t version = 0, grpc::Status* st = nullptr) {
    v1::RequestHeader h;
    h.set_head(head);
    h.set_hidden_size(kHidden);
    h.set_dtype(b.dtype);
    h.set_head_version(version);
    std::vector<v1::StreamResponse> out;
    grpc::Status s = RunOne("score", h, b, &out);
    if (st != nullptr) *st = s;
    if (!s.ok()) return {};
    EXPECT_EQ(out.size(), 1u);
    return {out[0].chunk().logprobs().begin(), out[0].chunk().logprobs().end()};
  }
  std::vector<float> GetGrad(const std::string& head) { return GradOf(*stub_, head); }
  // The fp32 "wide" head's weight, as the test server made it.
  std::vector<float> WideWeight() const {
    const server::ServedHead& h = **ts_->heads->Get("wide");
    const float* p = reinterpret_cast<const float*>(h.weights->weight.data());
    return {p, p + kVocab * kHidden};
  }
  std::vector<float> EngineScore(const std::vector<float>& weight, const Batch& b) { return CpuEngineLogprobs(weight, b); }

  std::unique_ptr<TestServer> ts_;
  std::unique_ptr<v1::LceService::Stub> stub_;
};

// The head-gradient contract over the wire (docs/MATH.md, "When dW is committed"): a deferred
// request's dW reaches no dW until CommitGrad adds it, scaled; GetGrad reads it back while it waits;
// a Backward with the loss's upstream gradient adds the ForwardBackward's dW.
TEST_F(Training, DeferredAndBackwardWeightGradients) {
  const Batch b = MakeBatch(90, v1::DTYPE_FLOAT32, 43);
  v1::RequestHeader h;
  h.set_head("wide");
  h.set_hidden_size(kHidden);
  h.set_dtype(v1::DTYPE_FLOAT32);
  h.set_reduction(v1::REDUCTION_SUM);
  h.set_accumulate_weight_grad(true);
  auto zero_grad = [&] {
    grpc::ClientContext ctx;
    v1::ZeroGradRequest req;
    req.set_head("wide");
    v1::ZeroGradResponse resp;
    ASSERT_TRUE(stub_->ZeroGrad(&ctx, req, &resp).ok());
  };
  std::vector<v1::StreamResponse> out;
  zero_grad();
  ASSERT_TRUE(RunOne("fb", h, b, &out).ok());
  const std::vector<float> plain = GetGrad("wide");
  zero_grad();
  h.set_defer_weight_grad(true);
  out.clear();
  ASSERT_TRUE(RunOne("fb", h, b, &out).ok());
  ASSERT_EQ(out.back().summary().pending_grad_ids_size(), 1);
  const uint64_t id = out.back().summary().pending_grad_ids(0);
  for (float x : GetGrad("wide")) ASSERT_EQ(x, 0.0f) << "nothing before the commit";
  ExpectElementsNear(GradOf(*stub_, "wide", id), plain, 1e-6, "the pending contribution read back");
  grpc::ClientContext ctx;
  v1::CommitGradRequest commit;
  commit.set_head("wide");
  commit.set_pending_grad_id(id);
  commit.set_scale(0.5f);
  v1::CommitGradResponse committed;
  ASSERT_TRUE(stub_->CommitGrad(&ctx, commit, &committed).ok());
  std::vector<float> half(plain.size());
  for (size_t i = 0; i < plain.size(); ++i) half[i] = 0.5f * plain[i];
  ExpectElementsNear(GetGrad("wide"), half, 1e-6, "dW after the commit");
  zero_grad();
  h.set_defer_weight_grad(false);
  h.clear_reduction();  // a ForwardBackward option
  out.clear();
  grpc::Status bw = RunOne("bw", h, b, &out);
  ASSERT_TRUE(bw.ok()) << bw.error_message();
  ASSERT_TRUE(out.back().has_summary()) << "a Backward that adds dW ends with a summary";
  ExpectElementsNear(GetGrad("wide"), plain, 1e-5, "the Backward's dW");
}

TEST_F(Training, AccumulatedGradientEqualsEngineAndAdamWStepsMatch) {
  Batch b = MakeBatch(120, v1::DTYPE_FLOAT32, 41);
  v1::RequestHeader h;
  h.set_head("wide");
  h.set_hidden_size(kHidden);
  h.set_dtype(v1::DTYPE_FLOAT32);
  h.set_reduction(v1::REDUCTION_SUM);
  h.set_accumulate_weight_grad(true);
  std::vector<v1::StreamResponse> out;
  // Two requests accumulate: the buffer holds twice one request's dW.
  ASSERT_TRUE(RunOne("fb", h, b, &out).ok());
  ASSERT_TRUE(RunOne("fb", h, b, &out).ok());
  std::vector<float> want(kVocab * kHidden, 0.0f);
  {
    RowsView rows{b.hidden.data(), b.targets.data(), b.rows, MemorySpace::kHost};
    Upstream up{GradMode::kLoss, nullptr, nullptr, nullptr};
    ASSERT_TRUE(ts_->fp32_engine->Compute(rows, LceOptions{}, up, {}, {nullptr, want.data()}).ok());
    ASSERT_TRUE(ts_->fp32_engine->Compute(rows, LceOptions{}, up, {}, {nullptr, want.data()}).ok());
  }
  std::vector<float> got = GetGrad("wide");
  ExpectElementsNear(got, want, 1e-5);

  // Two AdamW steps with clipping, against AdamWStep on the same gradient.
  std::vector<float> master = WideWeight(), m(master.size(), 0.0f), v(master.size(), 0.0f);
  for (int step = 1; step <= 2; ++step) {
    grpc::ClientContext ctx;
    v1::OptimizerStepRequest req;
    req.set_head("wide");
    req.set_lr(1e-2f);
    req.set_weight_decay(0.01f);
    req.set_max_grad_norm(0.5f);
    v1::OptimizerStepResponse resp;
    ASSERT_TRUE(stub_->OptimizerStep(&ctx, req, &resp).ok());
    const double norm = std::sqrt(SquaredNorm(got.data(), static_cast<int64_t>(got.size())));
    EXPECT_NEAR(resp.grad_norm(), norm, 1e-6 * norm);
    EXPECT_EQ(resp.head().version(), 1 + step);
    EXPECT_EQ(resp.step(), step);
    AdamWParams p;
    p.lr = 1e-2f;
    p.weight_decay = 0.01f;
    const float scale = norm > 0.5 ? static_cast<float>(0.5 / (norm + 1e-6)) : 1.0f;
    AdamWStep(master.data(), m.data(), v.data(), got.data(), static_cast<int64_t>(master.size()), p, step, scale);
  }
  ExpectElementsNear(Score(b), EngineScore(master, b), 1e-5);

  // Version pinning: the old version is gone.
  grpc::Status st;
  Score(b, "wide", 1, &st);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
  EXPECT_TRUE(Score(b, "wide", 3, &st).size() == 120u && st.ok());

  grpc::ClientContext zctx;
  v1::ZeroGradRequest zreq;
  zreq.set_head("wide");
  v1::ZeroGradResponse zresp;
  ASSERT_TRUE(stub_->ZeroGrad(&zctx, zreq, &zresp).ok());
  for (float g : GetGrad("wide")) ASSERT_EQ(g, 0.0f);
}

grpc::Status Update(v1::LceService::Stub& stub, const std::vector<float>& w, int64_t expected, v1::HeadDescription* out) {
  return UpdateWeightsRpc(stub, "wide", w, expected, out);
}

TEST_F(Training, UpdateWeightsIsAtomicForConcurrentReaders) {
  Batch b = MakeBatch(64, v1::DTYPE_FLOAT32, 42);
  std::vector<float> w1 = WideWeight(), w2 = w1;
  for (float& x : w2) x = -x;
  const std::vector<float> a1 = EngineScore(w1, b), a2 = EngineScore(w2, b);
  v1::HeadDescription d;
  EXPECT_EQ(Update(*stub_, w2, /*expected=*/5, &d).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  std::atomic<bool> stop{false};
  std::atomic<int> mixed{0}, reads{0};
  std::thread reader([&] {
    while (!stop) {
      std::vector<float> lp = Score(b);
      if (lp.empty()) continue;
      ++reads;
      bool is1 = true, is2 = true;
      for (size_t i = 0; i < lp.size(); ++i) {
        is1 = is1 && std::abs(lp[i] - a1[i]) <= 1e-5f * std::max(1.0f, std::abs(a1[i]));
        is2 = is2 && std::abs(lp[i] - a2[i]) <= 1e-5f * std::max(1.0f, std::abs(a2[i]));
      }
      if (!is1 && !is2) ++mixed;
    }
  });
  // At least 10 updates, and on until the reader has overlapped a good number of them (bounded).
  int updates = 0;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (updates < 10 || (reads.load() < 20 && std::chrono::steady_clock::now() < give_up)) {
    ASSERT_TRUE(Update(*stub_, updates % 2 == 0 ? w2 : w1, 0, &d).ok());
    EXPECT_EQ(d.version(), 2 + updates);
    ++updates;
  }
  stop = true;
  reader.join();
  EXPECT_GT(reads.load(), 0);
  EXPECT_EQ(mixed.load(), 0) << "a request saw a head that was neither version";
  ExpectElementsNear(Score(b), updates % 2 == 0 ? a1 : a2, 1e-5);  // the last update decides
}

// A weight change waits for the requests running on its head: a request's later chunks keep the
// answers of the version it started on, a request arriving meanwhile waits and runs on the new
// version, and a change whose deadline comes first is refused with ABORTED and changes nothing.
TEST_F(Training, AWeightChangeWaitsForTheRequestsOnItsHead) {
  Batch b = MakeBatch(64, v1::DTYPE_FLOAT32, 44);
  std::vector<float> w1 = WideWeight(), w2 = w1;
  for (float& x : w2) x = -x;
  const std::vector<float> a2 = EngineScore(w2, b);
  OpenScore request(*stub_, "wide", b);

  {  // a step whose deadline comes before the request ends
    grpc::ClientContext sctx;
    sctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    v1::OptimizerStepRequest req;
    req.set_head("wide");
    req.set_lr(1e-2f);
    v1::OptimizerStepResponse resp;
    grpc::Status st = stub_->OptimizerStep(&sctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::ABORTED) << st.error_message();
    EXPECT_NE(st.error_message().find("still running"), std::string::npos) << st.error_message();
  }
  v1::HeadDescription d;
  grpc::Status update;
  std::thread updater([&] { update = Update(*stub_, w2, 0, &d); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the update arrives and waits
  std::vector<float> late;
  std::thread late_reader([&] { late = Score(b); });  // arrives while the update waits
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ(request.Again(), request.first()) << "the request's second chunk ran on the version it started on";
  ASSERT_TRUE(request.Finish().ok());
  updater.join();
  late_reader.join();
  ASSERT_TRUE(update.ok()) << update.error_message();
  EXPECT_EQ(d.version(), 2) << "the refused step made no version";
  ExpectElementsNear(late, a2, 1e-5);
}

TEST_F(Training, SaveHeadThenLoadHeadGivesTheSameAnswers) {
  Batch b = MakeBatch(50, v1::DTYPE_BFLOAT16, 43);
  const std::string dir = (std::filesystem::temp_directory_path() / ("lce_save_" + std::to_string(::getpid()))).string();
  grpc::ClientContext ctx;
  v1::SaveHeadRequest req;
  req.set_head("default");
  req.set_directory(dir);
  v1::SaveHeadResponse resp;
  ASSERT_TRUE(stub_->SaveHead(&ctx, req, &resp).ok());
  ASSERT_EQ(resp.files_size(), 1);
  grpc::ClientContext lctx;
  v1::LoadHeadRequest load;
  load.set_name("restored");
  load.set_safetensors_file(resp.index_file());
  v1::HeadDescription desc;
  grpc::Status s = stub_->LoadHead(&lctx, load, &desc);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(desc.vocab_size(), kVocab);
  EXPECT_EQ(desc.version(), 1);
  const std::vector<float> a = Score(b, "default"), c = Score(b, "restored");
  ASSERT_EQ(a.size(), 50u);
  EXPECT_EQ(a, c);
  // A single shard file is an ordinary safetensors file too.
  grpc::ClientContext l2;
  load.set_name("restored2");
  load.set_safetensors_file(resp.files(0));
  ASSERT_TRUE(stub_->LoadHead(&l2, load, &desc).ok());
  EXPECT_EQ(Score(b, "restored2"), a);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace lce::e2e
