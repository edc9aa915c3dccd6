// Host-side math of training the head: AdamW on fp32 master weights, and the per-token RL policy
// loss (clipped surrogate, entropy bonus, KL penalty) with its gradients with respect to the
// logprob and entropy the engine produced. Formulas: docs/MATH.md.
#pragma once

#include <cstdint>

namespace lce {

struct AdamWParams {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
};

// One AdamW step (torch.optim.AdamW semantics, step counted from 1) over n parameters:
// p ← p·(1 − lr·wd);  m ← β1·m + (1−β1)·g;  v ← β2·v + (1−β2)·g²;
// p ← p − lr·(m / (1−β1^t)) / (sqrt(v / (1−β2^t)) + eps),   with g = grad·grad_scale.
void AdamWStep(float* param, float* exp_avg, float* exp_avg_sq, const float* grad, int64_t n,
               const AdamWParams& p, int64_t step, float grad_scale);

// Σ grad² in double.
double SquaredNorm(const float* grad, int64_t n);

enum class KlKind : uint8_t { kK1, kK3 };
enum class AggregationKind : uint8_t { kTokenMean, kSeqMeanTokenSum, kSeqMeanTokenMean };

struct PolicyLossConfig {
  float clip_low = 0.2f;
  float clip_high = 0.2f;
  float dual_clip = 0.0f;  // > 1 enables dual clip; 0 = off
  float entropy_coef = 0.0f;
  float kl_coef = 0.0f;
  KlKind kl = KlKind::kK1;
};

// Weight w_t of a token in the aggregated loss: token-mean 1/total_tokens; seq-mean-token-sum
// 1/num_sequences; seq-mean-token-mean 1/(num_sequences · sequence_tokens). 0 if a count is 0.
float AggregationWeight(AggregationKind kind, int64_t sequence_tokens, int64_t total_tokens, int64_t num_sequences);

// Running sums over valid tokens, for the summary statistics.
struct PolicyLossSums {
  double loss = 0;         // Σ w_t L_t (the aggregated loss)
  double clipped = 0;      // tokens where the clipped branch was taken
  double ratio = 0;        // Σ r_t
  double approx_kl = 0;    // Σ (old_t − lp_t)
  double entropy = 0;      // Σ H_t
  double kl = 0;           // Σ KL_t
  int64_t tokens = 0;
};

// For n rows: per-token loss L_t (0 when weight is 0 / row ignored), and the upstream gradients
// u_t = ∂(Σ w L)/∂logprob_t, e_t = ∂(Σ w L)/∂entropy_t. `ref_logprob` may be null when kl_coef = 0.
// `valid[t]` false marks ignored rows (weight must be 0 there).
void PolicyLossRows(int64_t n, const PolicyLossConfig& c, const float* logprob, const float* entropy,
                    const float* old_logprob, const float* advantage, const float* ref_logprob,
                    const float* weight, const bool* valid, float* loss, float* grad_logprob,
                    float* grad_entropy, PolicyLossSums* sums);

}  // namespace lce
