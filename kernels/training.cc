#include <algorithm>
#include <cmath>

#include "lce/training.h"

namespace lce {

void AdamWStep(float* param, float* m, float* v, const float* grad, int64_t n, const AdamWParams& p,
               int64_t step, float grad_scale) {
  const double bc1 = 1.0 - std::pow(static_cast<double>(p.beta1), static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(p.beta2), static_cast<double>(step));
  const float step_size = static_cast<float>(p.lr / bc1);
  const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  const float decay = 1.0f - p.lr * p.weight_decay;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i] * grad_scale;
    param[i] *= decay;
    m[i] = p.beta1 * m[i] + (1.0f - p.beta1) * g;
    v[i] = p.beta2 * v[i] + (1.0f - p.beta2) * g * g;
    const float denom = std::sqrt(v[i]) / bc2_sqrt + p.eps;
    param[i] -= step_size * m[i] / denom;
  }
}

double SquaredNorm(const float* g, int64_t n) {
  double s = 0;
#pragma omp parallel for reduction(+ : s) schedule(static)
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(g[i]) * g[i];
  return s;
}

float AggregationWeight(AggregationKind kind, int64_t seq_tokens, int64_t total_tokens, int64_t num_sequences) {
  switch (kind) {
    case AggregationKind::kTokenMean: return total_tokens > 0 ? 1.0f / static_cast<float>(total_tokens) : 0.0f;
    case AggregationKind::kSeqMeanTokenSum: return num_sequences > 0 ? 1.0f / static_cast<float>(num_sequences) : 0.0f;
    case AggregationKind::kSeqMeanTokenMean:
      return num_sequences > 0 && seq_tokens > 0 ? 1.0f / static_cast<float>(num_sequences * seq_tokens) : 0.0f;
  }
  return 0.0f;
}

void PolicyLossRows(int64_t n, const PolicyLossConfig& c, const float* logprob, const float* entropy,
                    const float* old_logprob, const float* advantage, const float* ref_logprob,
                    const float* weight, const bool* valid, float* loss, float* u, float* e,
                    PolicyLossSums* sums) {
  for (int64_t t = 0; t < n; ++t) {
    if (!valid[t]) {
      loss[t] = u[t] = e[t] = 0.0f;
      continue;
    }
    const double lp = logprob[t], old = old_logprob[t], adv = advantage[t], w = weight[t];
    const double ratio = std::exp(lp - old);
    const double clipped_ratio = std::clamp(ratio, 1.0 - c.clip_low, 1.0 + c.clip_high);
    const double unclipped_loss = -adv * ratio;
    const double clipped_loss = -adv * clipped_ratio;
    double pg = std::max(unclipped_loss, clipped_loss);
    // d pg / d lp: the unclipped branch moves with the ratio; the clipped one only inside the range.
    const bool took_clipped = clipped_loss > unclipped_loss;
    double dpg = took_clipped ? 0.0 : -adv * ratio;
    if (c.dual_clip > 1.0f && adv < 0.0 && pg > -adv * c.dual_clip) {
      pg = -adv * c.dual_clip;  // bounded: constant in lp
      dpg = 0.0;
    }
    double kl = 0.0, dkl = 0.0;
    if (c.kl_coef != 0.0f) {
      const double d = static_cast<double>(ref_logprob[t]) - lp;
      if (c.kl == KlKind::kK1) {
        kl = -d;
        dkl = 1.0;
      } else {
        kl = std::exp(d) - d - 1.0;
        dkl = -std::exp(d) + 1.0;
      }
    }
    const double l = pg + c.kl_coef * kl - c.entropy_coef * entropy[t];
    loss[t] = static_cast<float>(l);
    u[t] = static_cast<float>(w * (dpg + c.kl_coef * dkl));
    e[t] = static_cast<float>(-w * c.entropy_coef);
    sums->loss += w * l;
    sums->clipped += took_clipped ? 1.0 : 0.0;
    sums->ratio += ratio;
    sums->approx_kl += old - lp;
    sums->entropy += entropy[t];
    sums->kl += kl;
    sums->tokens += 1;
  }
}

}  // namespace lce
