#include "reference.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "lce/numeric.h"

namespace lce::testing {

RefResult ReferenceLce(const RefProblem& p) {
  const int64_t N = p.rows, H = p.hidden, V = p.vocab;
  const LceOptions& o = p.options;
  const double T = o.temperature, s = o.softcap, eps = o.label_smoothing, lam = o.z_loss;
  RefResult r;
  r.lse.assign(N, 0);
  r.logprob.assign(N, 0);
  r.entropy.assign(N, 0);
  r.loss.assign(N, 0);
  r.z_loss.assign(N, 0);
  if (o.top_k > 0) r.all_logprob.assign(N * V, 0);
  const bool weighted = !p.class_weight.empty();
  double W = static_cast<double>(V);
  if (weighted) W = 0;
  for (double c : p.class_weight) W += c;
  auto weight = [&](int64_t j) { return weighted ? p.class_weight[j] : 1.0; };
  const bool grad = p.mode != GradMode::kNone;
  if (grad) {
    r.d_hidden.assign(N * H, 0);
    r.d_weight.assign(V * H, 0);
    r.d_bias.assign(V, 0);
  }
  std::vector<double> a(V), z(V), pr(V), dz(V);
  for (int64_t i = 0; i < N; ++i) {
    for (int64_t j = 0; j < V; ++j) {
      double acc = p.bias.empty() ? 0.0 : p.bias[j];
      for (int64_t k = 0; k < H; ++k) acc += p.h[i * H + k] * p.w[j * H + k];
      a[j] = acc;
      z[j] = (s > 0 ? s * std::tanh(acc / s) : acc) / T;
    }
    const double m = *std::max_element(z.begin(), z.end());
    double se = 0, swz = 0;
    for (int64_t j = 0; j < V; ++j) {
      se += std::exp(z[j] - m);
      swz += weight(j) * z[j];
    }
    const double lse = m + std::log(se);
    double pz = 0;
    for (int64_t j = 0; j < V; ++j) {
      pr[j] = std::exp(z[j] - lse);
      pz += pr[j] * (z[j] - m);
    }
    const int32_t y = p.targets[i];
    const bool ignored = y == o.ignore_index;
    r.lse[i] = lse;
    r.entropy[i] = (lse - m) - pz;
    r.logprob[i] = ignored ? 0.0 : z[y] - lse;
    const double wy = ignored ? 0.0 : weight(y);
    r.z_loss[i] = ignored ? 0.0 : lam * lse * lse;
    r.loss[i] = ignored ? 0.0 : -(1 - eps) * wy * r.logprob[i] + eps * (W * lse - swz) / V + r.z_loss[i];
    for (int64_t j = 0; o.top_k > 0 && j < V; ++j) r.all_logprob[i * V + j] = z[j] - lse;
    if (!grad) continue;
    for (int64_t j = 0; j < V; ++j) {
      double d = 0;
      if (p.mode == GradMode::kLoss) {
        if (!ignored) {
          const double g = p.grad_loss.empty() ? 1.0 : p.grad_loss[i];
          d = g *
              ((1 - eps) * wy * (pr[j] - (j == y ? 1 : 0)) + eps / V * (W * pr[j] - weight(j)) + 2 * lam * lse * pr[j]);
        }
      } else {
        const double u = (ignored || p.grad_logprob.empty()) ? 0.0 : p.grad_logprob[i];
        const double e = p.grad_entropy.empty() ? 0.0 : p.grad_entropy[i];
        d = u * ((j == y ? 1 : 0) - pr[j]) + e * (-pr[j] * ((z[j] - m) - pz));
      }
      d /= T;
      if (s > 0) {
        const double t = std::tanh(a[j] / s);
        d *= 1 - t * t;
      }
      dz[j] = d;
    }
    for (int64_t j = 0; j < V; ++j) {
      r.d_bias[j] += dz[j];
      for (int64_t k = 0; k < H; ++k) {
        r.d_hidden[i * H + k] += dz[j] * p.w[j * H + k];
        r.d_weight[j * H + k] += dz[j] * p.h[i * H + k];
      }
    }
  }
  return r;
}

double RelErr(const std::vector<float>& got, const std::vector<double>& want, size_t cols) {
  if (got.size() != want.size()) return std::numeric_limits<double>::infinity();
  cols = std::max<size_t>(cols, 1);
  const size_t rows = want.size() / cols;
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!std::isfinite(got[i])) return std::numeric_limits<double>::infinity();
    const double d = static_cast<double>(got[i]) - want[i];
    num += d * d;
    den += want[i] * want[i];
  }
  const double global = den == 0 ? std::sqrt(num) : std::sqrt(num / den);
  // Per row: its error against its own norm, or a typical row's (the RMS row norm) where its own is
  // smaller, so that rows near zero are not held to a relative bound they cannot meet. One bad row
  // (or one tile edge) of N moves the global ratio by only ~1/sqrt(N) of its own error.
  const double typical = rows > 0 ? std::sqrt(den / static_cast<double>(rows)) : 0.0;
  double worst = 0;
  for (size_t r = 0; r < rows; ++r) {
    double rn = 0, rd = 0;
    for (size_t c = r * cols; c < (r + 1) * cols; ++c) {
      const double d = static_cast<double>(got[c]) - want[c];
      rn += d * d;
      rd += want[c] * want[c];
    }
    const double scale = std::max(std::sqrt(rd), typical);
    worst = std::max(worst, scale == 0 ? std::sqrt(rn) : std::sqrt(rn) / scale);
  }
  return std::max(global, worst);
}

double Encode(double v, DType dtype, std::vector<uint8_t>& out) {
  const float f = static_cast<float>(v);
  std::vector<uint8_t> bytes(static_cast<size_t>(DTypeSize(dtype)));
  ConvertFromFloat(&f, 1, dtype, bytes.data());
  out.insert(out.end(), bytes.begin(), bytes.end());
  float back = 0;
  ConvertToFloat(bytes.data(), dtype, 1, &back);
  return back;
}

std::vector<float> Decode(const std::vector<uint8_t>& bytes, DType dtype) {
  std::vector<float> out(bytes.size() / static_cast<size_t>(DTypeSize(dtype)));
  ConvertToFloat(bytes.data(), dtype, static_cast<int64_t>(out.size()), out.data());
  return out;
}

double ReferenceObjective(const RefProblem& p) {
  RefProblem fwd = p;
  fwd.mode = GradMode::kNone;
  const RefResult r = ReferenceLce(fwd);
  double f = 0;
  for (int64_t i = 0; i < p.rows; ++i) {
    if (p.mode == GradMode::kLoss) {
      f += (p.grad_loss.empty() ? 1.0 : p.grad_loss[i]) * r.loss[i];
    } else {
      f += (p.grad_logprob.empty() ? 0.0 : p.grad_logprob[i]) * r.logprob[i] +
           (p.grad_entropy.empty() ? 0.0 : p.grad_entropy[i]) * r.entropy[i];
    }
  }
  return f;
}

}  // namespace lce::testing
