// Host training math: AdamW against a float64 transcription of torch.optim.AdamW, and the policy
// loss's upstream gradients against central differences of its own per-token loss.
#include <cmath>
#include <random>

#include "gtest/gtest.h"
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

}  // namespace
}  // namespace lce
