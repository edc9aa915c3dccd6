// Host training math: AdamW against a float64 transcription of torch.optim.AdamW, the CPU
// HeadTrainer against that loop, and the policy loss's upstream gradients against central
// differences of its own per-token loss.
#include <cmath>
#include <cstring>
#include <random>

#include "gtest/gtest.h"
#include "lce/numeric.h"
#include "lce/training.h"

namespace lce {
namespace {

TEST(AdamW, MatchesTorchFormulaInFloat64) {
  const int64_t n = 257;
  std::mt19937 rng(1);
  std::normal_distribution<double> normal;
  std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f);
  std::vector<double> pd(n), md(n, 0.0), vd(n, 0.0);
  for (int64_t i = 0; i < n; ++i) pd[i] = p[i] = static_cast<float>(normal(rng));
  AdamWParams hp;
  hp.lr = 1e-2f;
  hp.beta1 = 0.8f;
  hp.beta2 = 0.95f;
  hp.eps = 1e-6f;
  hp.weight_decay = 0.1f;
  for (int step = 1; step <= 6; ++step) {
    std::vector<float> g(n);
    for (auto& x : g) x = static_cast<float>(normal(rng) * (step % 2 ? 1.0 : 1e-3));
    const float scale = step == 3 ? 0.25f : 1.0f;
    AdamWStep(p.data(), m.data(), v.data(), g.data(), n, hp, step, scale);
    const double b1 = hp.beta1, b2 = hp.beta2;
    for (int64_t i = 0; i < n; ++i) {
      const double gi = static_cast<double>(g[i]) * scale;
      pd[i] *= 1.0 - double(hp.lr) * hp.weight_decay;
      md[i] = b1 * md[i] + (1 - b1) * gi;
      vd[i] = b2 * vd[i] + (1 - b2) * gi * gi;
      const double denom = std::sqrt(vd[i]) / std::sqrt(1 - std::pow(b2, step)) + hp.eps;
      pd[i] -= (hp.lr / (1 - std::pow(b1, step))) * md[i] / denom;
    }
    for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(p[i], pd[i], 1e-5 * std::max(1.0, std::abs(pd[i]))) << "step " << step;
  }
  std::vector<float> g = {3.0f, 4.0f};
  EXPECT_DOUBLE_EQ(SquaredNorm(g.data(), 2), 25.0);
}

TEST(SquaredNorm, FixedOrderSumEqualsFloat64AndClipScaleIsTorchs) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  std::vector<float> g((int64_t{1} << 17) + 37);  // more than one block, and a partial one
  double want = 0;
  for (float& x : g) {
    x = normal(rng);
    want += static_cast<double>(x) * x;
  }
  const double got = SquaredNorm(g.data(), static_cast<int64_t>(g.size()));
  EXPECT_NEAR(got, want, 1e-12 * want);
  EXPECT_EQ(got, SquaredNorm(g.data(), static_cast<int64_t>(g.size()))) << "the same bits every call";
  EXPECT_FLOAT_EQ(ClipScale(4.0, 0.0f), 1.0f);
  EXPECT_FLOAT_EQ(ClipScale(4.0, 8.0f), 1.0f);
  EXPECT_FLOAT_EQ(ClipScale(4.0, 2.0f), static_cast<float>(2.0 / (4.0 + 1e-6)));
}

// A small bf16 head of random weights.
std::shared_ptr<HeadWeights> RandomHead(int64_t vocab, int64_t hidden, uint64_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  auto w = std::make_shared<HeadWeights>();
  w->shape = {vocab, hidden, DType::kBFloat16, 0, vocab, false};
  std::vector<float> f(static_cast<size_t>(vocab * hidden));
  for (float& x : f) x = normal(rng) / std::sqrt(static_cast<float>(hidden));
  w->weight.resize(f.size() * 2);
  ConvertFromFloat(f.data(), static_cast<int64_t>(f.size()), DType::kBFloat16, w->weight.data());
  return w;
}

absl::StatusOr<std::shared_ptr<LceEngine>> MakeCpuEngine(std::shared_ptr<const HeadWeights> w) {
  absl::StatusOr<std::unique_ptr<LceEngine>> e = CreateEngine(Backend::kCpu, std::move(w), EngineConfig{});
  if (!e.ok()) return e.status();
  return std::shared_ptr<LceEngine>(std::move(*e));
}

// The CPU trainer: dW accumulates in its host buffer, steps equal AdamWStep on that buffer, the new
// engine serves the masters rounded to bf16, SetWeight moves the masters and keeps the moments.
TEST(HeadTrainer, CpuTrainerStepsLikeTheHostLoop) {
  const int64_t V = 301, H = 16, N = 40;
  std::shared_ptr<HeadWeights> w = RandomHead(V, H, 5);
  absl::StatusOr<std::shared_ptr<LceEngine>> engine = MakeCpuEngine(w);
  ASSERT_TRUE(engine.ok()) << engine.status();
  absl::StatusOr<std::unique_ptr<HeadTrainer>> t = CreateHeadTrainer(*engine, w, MakeCpuEngine);
  ASSERT_TRUE(t.ok()) << t.status();
  HeadTrainer& trainer = **t;
  EXPECT_EQ(trainer.backend(), "cpu");
  EXPECT_EQ(trainer.grad_space(), MemorySpace::kHost);
  ASSERT_EQ(trainer.grad_elements(), V * H);

  std::mt19937 rng(6);
  std::normal_distribution<float> normal;
  std::vector<uint8_t> hidden(static_cast<size_t>(N * H * 2));
  for (int64_t i = 0; i < N * H; ++i) reinterpret_cast<uint16_t*>(hidden.data())[i] = FloatToBf16(normal(rng));
  std::vector<int32_t> targets(N);
  for (int64_t i = 0; i < N; ++i) targets[i] = static_cast<int32_t>((i * 37) % V);
  const RowsView rows{hidden.data(), targets.data(), N, MemorySpace::kHost};
  const Upstream up{GradMode::kLoss, nullptr, nullptr, nullptr};
  std::vector<float> want(static_cast<size_t>(V * H), 0.0f);
  for (int k = 0; k < 2; ++k) {
    ASSERT_TRUE((*engine)->Compute(rows, LceOptions{}, up, {}, {nullptr, trainer.grad()}).ok());
    ASSERT_TRUE((*engine)->Compute(rows, LceOptions{}, up, {}, {nullptr, want.data()}).ok());
  }
  ASSERT_EQ(std::memcmp(trainer.grad(), want.data(), want.size() * 4), 0);
  absl::StatusOr<double> sq = trainer.GradSquaredNorm();
  ASSERT_TRUE(sq.ok());
  EXPECT_NEAR(*sq, SquaredNorm(want.data(), V * H), 1e-12 * *sq);
  std::vector<float> slice(7 * H);
  ASSERT_TRUE(trainer.CopyGrad(5, 7, slice.data()).ok());
  EXPECT_EQ(std::memcmp(slice.data(), want.data() + 5 * H, slice.size() * 4), 0);
  EXPECT_EQ(trainer.CopyGrad(V - 3, 7, slice.data()).code(), absl::StatusCode::kOutOfRange);

  std::vector<float> master(static_cast<size_t>(V * H)), m(master.size(), 0.0f), v(master.size(), 0.0f);
  ConvertToFloat(w->weight.data(), DType::kBFloat16, V * H, master.data());
  AdamWParams p;
  p.lr = 1e-2f;
  p.weight_decay = 0.1f;
  std::shared_ptr<LceEngine> served = *engine;
  for (int step = 1; step <= 4; ++step) {
    if (step == 3) {  // a trainer's update in between: the masters follow it, the moments stay
      std::shared_ptr<HeadWeights> other = RandomHead(V, H, 9);
      absl::StatusOr<std::shared_ptr<LceEngine>> e = trainer.SetWeight(other);
      ASSERT_TRUE(e.ok()) << e.status();
      ConvertToFloat(other->weight.data(), DType::kBFloat16, V * H, master.data());
    }
    const float scale = ClipScale(std::sqrt(*sq), 0.5f);
    absl::StatusOr<std::shared_ptr<LceEngine>> e = trainer.Step(p, scale);
    ASSERT_TRUE(e.ok()) << e.status();
    EXPECT_NE(e->get(), served.get()) << "a CPU step serves a new engine";
    served = *e;
    AdamWStep(master.data(), m.data(), v.data(), want.data(), V * H, p, step, scale);
    EXPECT_EQ(trainer.steps(), step);
    std::vector<uint8_t> rounded(static_cast<size_t>(V * H * 2));
    ConvertFromFloat(master.data(), V * H, DType::kBFloat16, rounded.data());
    absl::StatusOr<std::shared_ptr<const HeadWeights>> now = trainer.Weights();
    ASSERT_TRUE(now.ok());
    ASSERT_EQ((*now)->weight, rounded) << "step " << step;
  }
  std::vector<float> lp_served(N), lp_direct(N);
  absl::StatusOr<std::shared_ptr<LceEngine>> direct = MakeCpuEngine(*trainer.Weights());
  ASSERT_TRUE(direct.ok());
  ASSERT_TRUE(served->Compute(rows, LceOptions{}, {}, {lp_served.data(), nullptr, nullptr, nullptr}, {}).ok());
  ASSERT_TRUE((*direct)->Compute(rows, LceOptions{}, {}, {lp_direct.data(), nullptr, nullptr, nullptr}, {}).ok());
  EXPECT_EQ(lp_served, lp_direct);

  ASSERT_TRUE(trainer.ZeroGrad().ok());
  EXPECT_EQ(*trainer.GradSquaredNorm(), 0.0);
}

// A head with a bias: the gradient buffer is [dW | dB]; the engine fills dB beside dW, a pending
// contribution commits both scaled, the norm counts both, and a step moves both (AdamW on fp32 masters,
// the bias kept in fp32) as the host loop over the whole parameter vector does.
TEST(HeadTrainer, BiasIsTrainedBesideTheWeight) {
  const int64_t V = 130, H = 8, N = 20;
  std::shared_ptr<HeadWeights> w = RandomHead(V, H, 15);
  w->shape.has_bias = true;
  for (int64_t j = 0; j < V; ++j) w->bias.push_back(0.01f * static_cast<float>(j % 11) - 0.05f);
  absl::StatusOr<std::shared_ptr<LceEngine>> engine = MakeCpuEngine(w);
  ASSERT_TRUE(engine.ok()) << engine.status();
  absl::StatusOr<std::unique_ptr<HeadTrainer>> t = CreateHeadTrainer(*engine, w, MakeCpuEngine);
  ASSERT_TRUE(t.ok()) << t.status();
  HeadTrainer& trainer = **t;
  ASSERT_EQ(trainer.grad_elements(), V * H + V);
  std::mt19937 rng(16);
  std::normal_distribution<float> normal;
  std::vector<uint8_t> hidden(static_cast<size_t>(N * H * 2));
  for (int64_t i = 0; i < N * H; ++i) reinterpret_cast<uint16_t*>(hidden.data())[i] = FloatToBf16(normal(rng));
  std::vector<int32_t> targets(N);
  for (int64_t i = 0; i < N; ++i) targets[i] = static_cast<int32_t>((i * 7) % V);
  const RowsView rows{hidden.data(), targets.data(), N, MemorySpace::kHost};
  const Upstream up{GradMode::kLoss, nullptr, nullptr, nullptr};
  std::vector<float> want(static_cast<size_t>(V * H + V), 0.0f);  // [dW | dB] made directly, scaled by 0.5
  ASSERT_TRUE(
      (*engine)->Compute(rows, LceOptions{}, up, {}, {nullptr, want.data(), 0, false, want.data() + V * H}).ok());
  for (float& x : want) x *= 0.5f;
  absl::StatusOr<float*> pending = trainer.AcquirePending(7, /*zeroed=*/false);
  ASSERT_TRUE(pending.ok());
  GradOutputs g{nullptr, *pending, 7, /*d_weight_fresh=*/true, trainer.BiasPart(*pending)};
  ASSERT_TRUE((*engine)->Compute(rows, LceOptions{}, up, {}, g).ok());
  ASSERT_TRUE(trainer.CommitPending(7, 0.5f).ok());
  ASSERT_EQ(std::memcmp(trainer.grad(), want.data(), want.size() * 4), 0);
  double dB2 = 0;
  for (int64_t j = 0; j < V; ++j) dB2 += double(want[V * H + j]) * want[V * H + j];
  ASSERT_GT(dB2, 0.0);
  EXPECT_NEAR(*trainer.GradSquaredNorm(), SquaredNorm(want.data(), V * H) + dB2, 1e-9 * (dB2 + 1));
  std::vector<float> db(V);
  ASSERT_TRUE(trainer.CopyBiasGrad(db.data()).ok());
  EXPECT_EQ(std::memcmp(db.data(), want.data() + V * H, V * 4), 0);

  std::vector<float> master(static_cast<size_t>(V * H + V)), m(master.size(), 0.0f), v(master.size(), 0.0f);
  ConvertToFloat(w->weight.data(), DType::kBFloat16, V * H, master.data());
  std::copy(w->bias.begin(), w->bias.end(), master.begin() + V * H);
  AdamWParams p;
  p.lr = 1e-2f;
  ASSERT_TRUE(trainer.Step(p, 1.0f).ok());
  AdamWStep(master.data(), m.data(), v.data(), want.data(), V * H + V, p, 1, 1.0f);
  absl::StatusOr<std::shared_ptr<const HeadWeights>> now = trainer.Weights();
  ASSERT_TRUE(now.ok());
  EXPECT_EQ((*now)->bias, std::vector<float>(master.begin() + V * H, master.end()));
  EXPECT_NE((*now)->bias, w->bias);
  std::vector<uint8_t> rounded(static_cast<size_t>(V * H * 2));
  ConvertFromFloat(master.data(), V * H, DType::kBFloat16, rounded.data());
  EXPECT_EQ((*now)->weight, rounded);
  // Without a bias there is none to copy.
  absl::StatusOr<std::unique_ptr<HeadTrainer>> plain =
      CreateHeadTrainer(*MakeCpuEngine(RandomHead(V, H, 1)), RandomHead(V, H, 1), MakeCpuEngine);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ((*plain)->CopyBiasGrad(db.data()).code(), absl::StatusCode::kFailedPrecondition);
}

// The squared norm a group combines from its shards' tiles has the bits of one rank's, for any split.
TEST(HeadTrainer, ShardsTileNormsCombineToOneRanksBits) {
  const int64_t V = 3001, H = 24;
  std::shared_ptr<HeadWeights> full = RandomHead(V, H, 7);
  std::mt19937 rng(8);
  std::normal_distribution<float> normal;
  std::vector<float> grad(static_cast<size_t>(V * H));
  for (size_t i = 0; i < grad.size(); ++i) grad[i] = normal(rng) * static_cast<float>(1 + i % 7);
  auto trainer_of = [&](std::shared_ptr<const HeadWeights> w) {
    absl::StatusOr<std::shared_ptr<LceEngine>> e = MakeCpuEngine(w);
    EXPECT_TRUE(e.ok());
    absl::StatusOr<std::unique_ptr<HeadTrainer>> t = CreateHeadTrainer(*e, w, MakeCpuEngine);
    EXPECT_TRUE(t.ok());
    const HeadShape& s = w->shape;
    std::memcpy((*t)->grad(), grad.data() + s.vocab_begin * H, static_cast<size_t>(s.shard_rows * H) * 4);
    return std::move(*t);
  };
  const double one = *trainer_of(full)->GradSquaredNorm();
  const int64_t tiles = VocabTileCount(V);
  for (int world : {2, 3, 5}) {
    std::vector<float> exchange(static_cast<size_t>(2 * tiles), 0.0f);
    for (int r = 0; r < world; ++r) {
      const VocabRange range = VocabShard(V, r, world);
      auto shard = std::make_shared<HeadWeights>();
      shard->shape = {V, H, DType::kBFloat16, range.begin, range.end - range.begin, false};
      shard->weight.assign(full->weight.begin() + range.begin * H * 2, full->weight.begin() + range.end * H * 2);
      absl::StatusOr<TileSquaredNorms> t = trainer_of(shard)->GradTileSquaredNorms();
      ASSERT_TRUE(t.ok());
      PackTileSquaredNorms(*t, exchange.data());
    }
    EXPECT_EQ(CombineTileSquaredNorms(exchange.data(), tiles), one) << world << " shards";
  }
}

double TotalLoss(const PolicyLossConfig& c, std::vector<float> lp, const std::vector<float>& ent,
                 const std::vector<float>& old, const std::vector<float>& adv, const std::vector<float>& ref,
                 const std::vector<float>& w, const bool* valid) {
  const int64_t n = static_cast<int64_t>(lp.size());
  std::vector<float> loss(n), u(n), e(n);
  PolicyLossSums sums;
  PolicyLossRows(n, c, lp.data(), ent.data(), old.data(), adv.data(), ref.data(), w.data(), valid, loss.data(), u.data(),
                 e.data(), &sums);
  return sums.loss;
}

TEST(PolicyLoss, GradientsMatchFiniteDifferences) {
  const int64_t n = 64;
  std::mt19937 rng(2);
  std::normal_distribution<float> normal;
  std::vector<float> lp(n), ent(n), old(n), adv(n), ref(n), w(n);
  std::unique_ptr<bool[]> valid(new bool[n]);
  for (int64_t t = 0; t < n; ++t) {
    lp[t] = -2.0f + 0.5f * normal(rng);
    old[t] = lp[t] + 0.4f * normal(rng);  // ratios spread across and beyond the clip range
    adv[t] = normal(rng);
    ref[t] = lp[t] + 0.3f * normal(rng);
    ent[t] = 2.0f + normal(rng);
    w[t] = 1.0f / (1 + t % 5);
    valid[t] = t % 11 != 0;
    if (!valid[t]) w[t] = 0.0f;
  }
  for (int variant = 0; variant < 4; ++variant) {
    PolicyLossConfig c;
    c.clip_low = 0.2f;
    c.clip_high = variant == 1 ? 0.28f : 0.2f;
    c.dual_clip = variant == 2 ? 3.0f : 0.0f;
    c.entropy_coef = 0.01f;
    c.kl_coef = variant >= 1 ? 0.05f : 0.0f;
    c.kl = variant == 3 ? KlKind::kK3 : KlKind::kK1;
    std::vector<float> loss(n), u(n), e(n);
    PolicyLossSums sums;
    PolicyLossRows(n, c, lp.data(), ent.data(), old.data(), adv.data(), ref.data(), w.data(), valid.get(), loss.data(),
                   u.data(), e.data(), &sums);
    EXPECT_GT(sums.clipped, 0) << "inputs must exercise the clipped branch";
    EXPECT_EQ(sums.tokens, n - (n + 10) / 11);
    for (int64_t t = 0; t < n; ++t) {
      const float h = 1e-3f;
      std::vector<float> a = lp, b = lp;
      a[t] += h;
      b[t] -= h;
      const double fd = (TotalLoss(c, a, ent, old, adv, ref, w, valid.get()) - TotalLoss(c, b, ent, old, adv, ref, w, valid.get())) / (2 * h);
      // Skip points within h of a kink (clip boundary), where the one-sided slopes differ.
      const double r = std::exp(double(lp[t]) - old[t]);
      const bool near_kink = std::abs(r - (1 - c.clip_low)) < 3e-3 || std::abs(r - (1 + c.clip_high)) < 3e-3;
      if (!near_kink) EXPECT_NEAR(u[t], fd, 2e-3 * std::max(1.0, std::abs(fd))) << "variant " << variant << " token " << t;
      EXPECT_FLOAT_EQ(e[t], valid[t] ? -w[t] * c.entropy_coef : 0.0f);
    }
  }
}

TEST(PolicyLoss, AggregationWeights) {
  EXPECT_FLOAT_EQ(AggregationWeight(AggregationKind::kTokenMean, 3, 10, 4), 0.1f);
  EXPECT_FLOAT_EQ(AggregationWeight(AggregationKind::kSeqMeanTokenSum, 3, 10, 4), 0.25f);
  EXPECT_FLOAT_EQ(AggregationWeight(AggregationKind::kSeqMeanTokenMean, 5, 10, 4), 0.05f);
  EXPECT_FLOAT_EQ(AggregationWeight(AggregationKind::kTokenMean, 0, 0, 0), 0.0f);
}

// Pending contributions (HeadTrainer::AcquirePending): handed out zero, committed as dW += s·P
// (or the buffer itself where dW is zero), released without touching dW, and reused.
TEST(HeadTrainerPending, CommitsScaledAndReleasesWithoutTouchingDW) {
  auto weights = std::make_shared<HeadWeights>();
  weights->shape = HeadShape{5, 3, DType::kFloat32, 0, 5, false};
  weights->weight.assign(5 * 3 * 4, 0);
  absl::StatusOr<std::shared_ptr<LceEngine>> engine = CreateEngine(Backend::kCpu, weights, EngineConfig{});
  ASSERT_TRUE(engine.ok()) << engine.status();
  absl::StatusOr<std::unique_ptr<HeadTrainer>> made = CreateHeadTrainer(*engine, weights, nullptr);
  ASSERT_TRUE(made.ok()) << made.status();
  HeadTrainer& t = **made;
  const int64_t n = t.grad_elements();
  auto fill = [&](uint64_t id, float base) {
    absl::StatusOr<float*> p = t.AcquirePending(id);
    EXPECT_TRUE(p.ok());
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ((*p)[i], 0.0f) << "a pending buffer starts zero";
    for (int64_t i = 0; i < n; ++i) (*p)[i] = base + static_cast<float>(i);
  };
  auto dw = [&] {
    std::vector<float> out(static_cast<size_t>(n));
    EXPECT_TRUE(t.CopyGrad(0, 5, out.data()).ok());
    return out;
  };
  ASSERT_TRUE(t.ZeroGrad().ok());
  fill(7, 1.0f);
  fill(8, 100.0f);
  EXPECT_EQ(t.pending_count(), 2);
  ASSERT_TRUE(t.CommitPending(7, 0.5f).ok());  // into a zero dW: the buffer, scaled in place
  std::vector<float> g = dw();
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(g[i], 0.5f * (1.0f + i));
  ASSERT_TRUE(t.CommitPending(8, -2.0f).ok());  // dW += s·P
  g = dw();
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(g[i], 0.5f * (1.0f + i) + -2.0f * (100.0f + i));
  EXPECT_EQ(t.CommitPending(8, 1.0f).code(), absl::StatusCode::kNotFound) << "an id commits once";
  fill(9, 5.0f);  // the spare comes back zero
  t.ReleasePending(9);
  EXPECT_EQ(dw(), g) << "a released contribution leaves dW alone";
  fill(10, 3.0f);
  ASSERT_TRUE(t.CommitPending(10, 0.0f).ok());
  EXPECT_EQ(dw(), g) << "scale 0 adds nothing";
  EXPECT_EQ(t.pending_count(), 0);
  EXPECT_EQ(t.pending_bytes(), n * 4) << "one spare kept";
  EXPECT_FALSE(t.AcquirePending(0).ok()) << "id 0 is reserved";
}


}  // namespace
}  // namespace lce
