// Every RPC through the C++ client library against an in-process server on loopback; answers
// must equal the engine's own answers on the same rows, however the client cut the stream.
#include <cmath>
#include <thread>

#include "gtest/gtest.h"
#include "lce/client/lce_client.h"
#include "lce/numeric.h"
#include "test_server.h"

namespace lce::e2e {
namespace {

using client::HiddenBatch;
using client::LceClient;

std::unique_ptr<LceClient> Connect(const TestServer& ts, int64_t chunk_bytes = 4 << 20) {
  return ConnectClient(ts.target, chunk_bytes);
}

struct Expected {
  std::vector<float> logprob, entropy, loss;
  std::vector<uint8_t> d_hidden;
};

Expected EngineAnswer(LceEngine& e, const Batch& b, const LceOptions& o, const Upstream& up) {
  Expected x;
  x.logprob.resize(b.rows);
  x.entropy.resize(b.rows);
  x.loss.resize(b.rows);
  GradOutputs g;
  if (up.mode != GradMode::kNone) {
    x.d_hidden.resize(b.hidden.size());
    g.d_hidden = x.d_hidden.data();
  }
  RowsView rows{b.hidden.data(), b.targets.data(), b.rows, MemorySpace::kHost};
  absl::Status s = e.Compute(rows, o, up, {x.logprob.data(), x.entropy.data(), nullptr, x.loss.data()}, g);
  EXPECT_TRUE(s.ok()) << s;
  return x;
}

std::vector<float> Bf16(const std::vector<uint8_t>& bytes) {
  std::vector<float> out(bytes.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) out[i] = Bf16ToFloat(static_cast<uint16_t>(bytes[2 * i] | (bytes[2 * i + 1] << 8)));
  return out;
}

class Service : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { ts_ = StartTestServer().release(); }
  static void TearDownTestSuite() {
    delete ts_;
    ts_ = nullptr;
  }
  static TestServer* ts_;
};
TestServer* Service::ts_ = nullptr;

TEST_F(Service, InfoAndHealth) {
  auto c = Connect(*ts_);
  auto info = c->GetInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->head().name(), "default");
  EXPECT_EQ(info->head().vocab_size(), kVocab);
  EXPECT_EQ(info->head().hidden_size(), kHidden);
  EXPECT_EQ(info->head().dtype(), v1::DTYPE_BFLOAT16);
  EXPECT_EQ(info->head().version(), 1);
  EXPECT_EQ(info->backend(), TestBackend() == Backend::kCuda ? "cuda" : "cpu");
  EXPECT_EQ(info->tp_size(), 1);
  EXPECT_EQ(info->heads_size(), 2);
  // The guarantees the engine states (docs/MATH.md, "Order of reductions").
  const std::vector<std::string> batch(info->invariance().across_batches().begin(),
                                       info->invariance().across_batches().end());
  const std::vector<std::string> tp(info->invariance().across_tp_sizes().begin(),
                                    info->invariance().across_tp_sizes().end());
  const std::vector<std::string> all = {"logprob",  "entropy", "lse",        "loss",        "d_hidden",
                                        "d_weight", "argmax",  "top_tokens", "top_logprobs"};
  if (TestBackend() == Backend::kCuda) {
    // --batch-invariant is off by default: the forward's outputs and d_hidden (its product in fixed
    // chunks) where the epilogue-statistics GEMM serves the head (bf16, sm_90, built with CUTLASS),
    // nothing otherwise.
    const std::vector<std::string> rows = {"logprob", "entropy", "lse", "loss", "d_hidden"};
    EXPECT_TRUE(batch.empty() || batch == rows) << batch.size();
    EXPECT_TRUE(tp.empty());
  } else {
    EXPECT_EQ(batch, all);
    EXPECT_EQ(tp, all);
  }
  auto wide = c->GetInfo("wide");
  ASSERT_TRUE(wide.ok());
  EXPECT_EQ(wide->head().dtype(), v1::DTYPE_FLOAT32);
  EXPECT_EQ(c->GetInfo("nope").status().code(), absl::StatusCode::kNotFound);
  auto health = c->Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_TRUE(*health);
}

TEST_F(Service, ScoreMatchesEngineWhateverTheChunking) {
  Batch b = MakeBatch(777, v1::DTYPE_BFLOAT16, 21);
  v1::RequestHeader h;
  h.set_temperature(0.8f);
  h.set_softcap(4.0f);
  LceOptions o;
  o.temperature = 0.8f;
  o.softcap = 4.0f;
  Expected want = EngineAnswer(*ts_->bf16_engine, b, o, {});
  for (int64_t chunk_bytes : {int64_t{64}, int64_t{64 * 13}, int64_t{4} << 20}) {
    auto c = Connect(*ts_, chunk_bytes);
    auto got = c->Score(View(b), h);
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectElementsNear(got->logprobs, want.logprob, 1e-6, "logprob");
    ExpectElementsNear(got->entropy, want.entropy, 1e-6, "entropy");
  }
}

TEST_F(Service, ForwardBackwardEveryReduction) {
  Batch b = MakeBatch(300, v1::DTYPE_BFLOAT16, 22);
  int64_t valid = 0;
  for (int32_t y : b.targets) valid += y != -100;
  auto c = Connect(*ts_, 64 * 50);
  for (v1::Reduction red : {v1::REDUCTION_MEAN, v1::REDUCTION_SUM, v1::REDUCTION_NONE}) {
    v1::RequestHeader h;
    h.set_reduction(red);
    h.set_label_smoothing(0.1f);
    h.set_z_loss(1e-3f);
    LceOptions o;
    o.label_smoothing = 0.1f;
    o.z_loss = 1e-3f;
    std::vector<float> g(b.rows, 1.0f);
    if (red == v1::REDUCTION_MEAN) g.assign(b.rows, 1.0f / valid);
    if (red == v1::REDUCTION_NONE) for (int64_t i = 0; i < b.rows; ++i) g[i] = 0.01f * static_cast<float>(i % 7) - 0.02f;
    Upstream up;
    up.mode = GradMode::kLoss;
    up.grad_loss = g.data();
    Expected want = EngineAnswer(*ts_->bf16_engine, b, o, up);
    auto got = c->ForwardBackward(View(b), h, red == v1::REDUCTION_NONE ? absl::MakeConstSpan(g) : absl::Span<const float>{});
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectElementsNear(got->loss, want.loss, 1e-6, "loss");
    ExpectElementsNear(Bf16(got->d_hidden), Bf16(want.d_hidden), 1e-2, "d_hidden");
    double sum = 0;
    for (float l : want.loss) sum += l;
    EXPECT_NEAR(got->reduced_loss, red == v1::REDUCTION_MEAN ? sum / valid : sum, 1e-5 * std::abs(sum));
    EXPECT_EQ(got->valid_tokens, valid);
    EXPECT_EQ(got->head_version, 1);
  }
}

TEST_F(Service, BackwardMatchesEngine) {
  Batch b = MakeBatch(200, v1::DTYPE_FLOAT32, 23);
  std::vector<float> u(b.rows), e(b.rows);
  for (int64_t i = 0; i < b.rows; ++i) {
    u[i] = std::sin(0.1f * i);
    e[i] = std::cos(0.3f * i);
  }
  Upstream up;
  up.mode = GradMode::kGeneric;
  up.grad_logprob = u.data();
  up.grad_entropy = e.data();
  Expected want = EngineAnswer(*ts_->fp32_engine, b, LceOptions{}, up);
  auto c = Connect(*ts_, 128 * 33);
  v1::RequestHeader h;
  h.set_head("wide");
  auto got = c->Backward(View(b), h, u, e);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->d_hidden.size(), want.d_hidden.size());
  const float* g = reinterpret_cast<const float*>(got->d_hidden.data());
  const float* w = reinterpret_cast<const float*>(want.d_hidden.data());
  for (int64_t i = 0; i < b.rows * kHidden; ++i) ASSERT_NEAR(g[i], w[i], 1e-5 * std::max(1.0f, std::abs(w[i]))) << i;
}

// Eight clients at once, each its own sizes and chunking: every Score and ForwardBackward answer is
// the engine's own for those rows (loss, reduced loss, d_hidden too), not just an OK.
TEST_F(Service, EightConcurrentClients) {
  std::vector<std::thread> threads;
  std::vector<std::string> why(8, "did not finish");
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([this, t, &why] {
      Batch b = MakeBatch(150 + 10 * t, v1::DTYPE_BFLOAT16, 100 + t);
      const Expected scored = EngineAnswer(*ts_->bf16_engine, b, LceOptions{}, {});
      const std::vector<float> ones(b.rows, 1.0f);
      Upstream up;
      up.mode = GradMode::kLoss;
      up.grad_loss = ones.data();
      const Expected trained = EngineAnswer(*ts_->bf16_engine, b, LceOptions{}, up);
      double sum = 0;
      for (float l : trained.loss) sum += l;
      const std::vector<float> want_dh = Bf16(trained.d_hidden);
      auto close = [](float a, float b, double tol) { return std::abs(a - b) <= tol * std::max(1.0f, std::abs(b)); };
      auto c = Connect(*ts_, 64 * (7 + t));
      for (int rep = 0; rep < 3; ++rep) {
        auto got = c->Score(View(b), v1::RequestHeader{});
        if (!got.ok()) return void(why[t] = std::string(got.status().message()));
        if (got->logprobs.size() != scored.logprob.size()) return void(why[t] = "logprob count");
        for (size_t i = 0; i < scored.logprob.size(); ++i) {
          if (!close(got->logprobs[i], scored.logprob[i], 1e-5)) return void(why[t] = "logprob " + std::to_string(i));
        }
        v1::RequestHeader h;
        h.set_reduction(v1::REDUCTION_SUM);
        auto fb = c->ForwardBackward(View(b), h);
        if (!fb.ok()) return void(why[t] = std::string(fb.status().message()));
        if (std::abs(fb->reduced_loss - sum) > 1e-5 * std::abs(sum)) return void(why[t] = "reduced loss");
        const std::vector<float> got_dh = Bf16(fb->d_hidden);
        if (got_dh.size() != want_dh.size()) return void(why[t] = "d_hidden size");
        for (size_t i = 0; i < want_dh.size(); ++i) {
          if (!close(got_dh[i], want_dh[i], 1e-2)) return void(why[t] = "d_hidden " + std::to_string(i));
        }
      }
      why[t].clear();
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < 8; ++t) EXPECT_EQ(why[t], "") << "client " << t;
}

}  // namespace
}  // namespace lce::e2e
