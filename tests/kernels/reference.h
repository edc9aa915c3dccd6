// A naive float64 reference of docs/MATH.md over materialised logits, for tests only.
#pragma once

#include <cstdint>
#include <vector>

#include "lce/engine.h"

namespace lce::testing {

struct RefProblem {
  int64_t rows = 0, hidden = 0, vocab = 0;
  std::vector<double> h;       // [rows, hidden] (already rounded to the input dtype)
  std::vector<double> w;       // [vocab, hidden] (already rounded to the head dtype)
  std::vector<double> bias;    // empty or [vocab]
  std::vector<int32_t> targets;
  LceOptions options;
  GradMode mode = GradMode::kNone;
  std::vector<double> grad_loss, grad_logprob, grad_entropy;  // empty = default (1 / 0 / 0)
  std::vector<double> class_weight;  // empty or [vocab]: PyTorch's CrossEntropyLoss(weight=...)
};

struct RefResult {
  std::vector<double> lse, logprob, entropy, loss, z_loss;
  std::vector<double> all_logprob;  // [rows, vocab] when options.top_k > 0: for the rankings
  std::vector<double> d_hidden;  // [rows, hidden] when mode != kNone
  std::vector<double> d_weight;  // [vocab, hidden] when mode != kNone
  std::vector<double> d_bias;    // [vocab] when mode != kNone
};

RefResult ReferenceLce(const RefProblem& p);

// The larger of ‖got − want‖ / ‖want‖ (absolute when want is all zeros) and, over rows of `cols`
// values (1: each value), the worst row's ‖got_r − want_r‖ / max(‖want_r‖, RMS row norm of want):
// a bug in one row or at one tile edge shows at its own size, not diluted over all rows. Infinity
// when got holds a non-finite value or the sizes differ.
double RelErr(const std::vector<float>& got, const std::vector<double>& want, size_t cols = 1);

// Rounds v to `dtype` (round to nearest even), appends its little-endian bytes to `out` and returns
// the rounded value, so a reference can run on exactly the engine's inputs.
double Encode(double v, DType dtype, std::vector<uint8_t>& out);

// Little-endian `dtype` bytes -> fp32 values.
std::vector<float> Decode(const std::vector<uint8_t>& bytes, DType dtype);

// The scalar objective whose gradient the engine returns: Σ g·loss (kLoss) or
// Σ u·logprob + e·entropy (kGeneric). Used by finite-difference checks.
double ReferenceObjective(const RefProblem& p);

}  // namespace lce::testing
