// CPU backend of the LCE engine. Rows are processed in blocks of kRowBlock; the vocabulary in tiles
// of kVocabTile. Pass 1 (forward) computes each logit tile with one SGEMM and folds it into per-row
// online statistics; pass 2 (backward, when asked) recomputes each tile, turns it into dL/da in
// place and feeds the d_hidden and dW products. Memory: O(kRowBlock * kVocabTile + V * H).
#include "cpu/cpu_engine.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "lce/numeric.h"

namespace lce {
namespace {

constexpr int64_t kRowBlock = 128;
constexpr int64_t kVocabTile = 2048;

// Per-row statistics of the softmax over (this shard of) the vocabulary; see docs/MATH.md.
struct RowStats {
  float max = -std::numeric_limits<float>::infinity();
  float sum_exp = 0.0f;      // S = Σ exp(z − max)
  float sum_exp_z = 0.0f;    // Q = Σ exp(z − max)·(z − max)
  float sum_z = 0.0f;        // Σ z (label smoothing)
  float target_z = 0.0f;     // z_{y}, when y is in this shard
};

// Final per-row values derived from the merged statistics.
struct RowFinal {
  float lse;
  float mean_pz_shifted;  // Q / S = Σ p (z − max)
  float max;
};

class CpuEngine final : public LceEngine {
 public:
  CpuEngine(std::shared_ptr<const HeadWeights> weights, const EngineConfig& config)
      : weights_(std::move(weights)), shape_(weights_->shape), collectives_(config.collectives) {
    const int64_t n = shape_.shard_rows * shape_.hidden_size;
    w_.resize(n);
    ConvertToFloat(weights_->weight.data(), shape_.dtype, n, w_.data());
    if (config.cpu_threads > 0) threads_ = config.cpu_threads;
  }

  std::string_view backend() const override { return "cpu"; }
  const HeadShape& shape() const override { return shape_; }
  EngineMemory memory() const override {
    return {static_cast<int64_t>(w_.size() * sizeof(float) + weights_->weight.size()),
            (kRowBlock * (kVocabTile + 2 * shape_.hidden_size)) * static_cast<int64_t>(sizeof(float))};
  }

  absl::Status Compute(const RowsView& rows, const LceOptions& options, const Upstream& upstream,
                       const RowOutputs& outputs, const GradOutputs& grads) override;

 private:
  absl::Status CheckCall(const RowsView& rows, const LceOptions& options) const;
  // Logit tile z[r, v] for rows [row0, row0+nr) (hidden already fp32 in h) and vocab tile
  // [v0, v0+nv) of the shard; applies bias, softcap and temperature.
  void LogitTile(const float* h, int64_t nr, int64_t v0, int64_t nv, const LceOptions& o,
                 float* z) const;
  absl::Status MergeAcrossRanks(std::vector<RowStats>& stats) const;

  std::shared_ptr<const HeadWeights> weights_;
  HeadShape shape_;
  Collectives* collectives_;
  std::vector<float> w_;  // fp32 copy of the shard, [shard_rows, H]
  int threads_ = 0;
  std::mutex mu_;
};

absl::Status CpuEngine::CheckCall(const RowsView& rows, const LceOptions& options) const {
  if (rows.space != MemorySpace::kHost) {
    return absl::InvalidArgumentError("the CPU engine takes host memory only");
  }
  if (rows.rows < 0) return absl::InvalidArgumentError("negative row count");
  if (rows.rows > 0 && (rows.hidden == nullptr || rows.targets == nullptr)) {
    return absl::InvalidArgumentError("hidden and targets must be given");
  }
  if (absl::Status s = ValidateOptions(options); !s.ok()) return s;
  for (int64_t i = 0; i < rows.rows; ++i) {
    const int32_t y = rows.targets[i];
    if (y != options.ignore_index && (y < 0 || y >= shape_.vocab_size)) {
      return absl::InvalidArgumentError(absl::StrCat("row ", i, ": target ", y, " is outside [0, ",
                                                     shape_.vocab_size, ") and is not ignore_index ",
                                                     options.ignore_index));
    }
  }
  return absl::OkStatus();
}

void CpuEngine::LogitTile(const float* h, int64_t nr, int64_t v0, int64_t nv, const LceOptions& o,
                          float* z) const {
  const int64_t H = shape_.hidden_size;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(nr), static_cast<int>(nv),
              static_cast<int>(H), 1.0f, h, static_cast<int>(H), w_.data() + v0 * H,
              static_cast<int>(H), 0.0f, z, static_cast<int>(nv));
  const float* bias = weights_->bias.empty() ? nullptr : weights_->bias.data() + v0;
  const float inv_t = 1.0f / o.temperature;
  const float cap = o.softcap;
#pragma omp parallel for schedule(static) num_threads(threads_ > 0 ? threads_ : omp_get_max_threads())
  for (int64_t r = 0; r < nr; ++r) {
    float* zr = z + r * nv;
    for (int64_t v = 0; v < nv; ++v) {
      float a = zr[v] + (bias != nullptr ? bias[v] : 0.0f);
      if (cap > 0.0f) a = cap * std::tanh(a / cap);
      zr[v] = a * inv_t;
    }
  }
}

absl::Status CpuEngine::MergeAcrossRanks(std::vector<RowStats>& stats) const {
  const int64_t n = static_cast<int64_t>(stats.size());
  std::vector<float> buf(n * 4);
  for (int64_t i = 0; i < n; ++i) buf[i] = stats[i].max;
  if (absl::Status s = collectives_->AllReduce(buf.data(), n, ReduceOp::kMax, false, nullptr); !s.ok()) {
    return s;
  }
  for (int64_t i = 0; i < n; ++i) {
    RowStats& st = stats[i];
    const float m = buf[i];
    const float scale = st.sum_exp > 0.0f ? std::exp(st.max - m) : 0.0f;
    const float q = st.sum_exp > 0.0f ? (st.sum_exp_z + (st.max - m) * st.sum_exp) * scale : 0.0f;
    st.max = m;
    st.sum_exp *= scale;
    st.sum_exp_z = q;
  }
  for (int64_t i = 0; i < n; ++i) {
    buf[4 * i + 0] = stats[i].sum_exp;
    buf[4 * i + 1] = stats[i].sum_exp_z;
    buf[4 * i + 2] = stats[i].sum_z;
    buf[4 * i + 3] = stats[i].target_z;
  }
  if (absl::Status s = collectives_->AllReduce(buf.data(), n * 4, ReduceOp::kSum, false, nullptr);
      !s.ok()) {
    return s;
  }
  for (int64_t i = 0; i < n; ++i) {
    stats[i].sum_exp = buf[4 * i + 0];
    stats[i].sum_exp_z = buf[4 * i + 1];
    stats[i].sum_z = buf[4 * i + 2];
    stats[i].target_z = buf[4 * i + 3];
  }
  return absl::OkStatus();
}

absl::Status CpuEngine::Compute(const RowsView& rows, const LceOptions& o, const Upstream& up,
                                const RowOutputs& out, const GradOutputs& grads) {
  if (absl::Status s = CheckCall(rows, o); !s.ok()) return s;
  std::lock_guard<std::mutex> lock(mu_);
  const int nthreads = threads_ > 0 ? threads_ : omp_get_max_threads();
  const int64_t H = shape_.hidden_size;
  const int64_t V = shape_.vocab_size;
  const int64_t shard_v = shape_.shard_rows;
  const int64_t vb = shape_.vocab_begin;
  const float eps = o.label_smoothing;
  const float inv_t = 1.0f / o.temperature;
  const bool backward = up.mode != GradMode::kNone;
  const int64_t tile = std::min(kVocabTile, shard_v);

  std::vector<float> h(kRowBlock * H);
  std::vector<float> z(kRowBlock * tile);
  std::vector<float> dh(backward ? kRowBlock * H : 0);
  std::vector<RowStats> stats;
  std::vector<RowFinal> fin;
  std::vector<float> coef_a, coef_b;  // per-row backward coefficients (see below)

  for (int64_t r0 = 0; r0 < rows.rows; r0 += kRowBlock) {
    const int64_t nr = std::min(kRowBlock, rows.rows - r0);
    ConvertToFloat(static_cast<const uint8_t*>(rows.hidden) + r0 * H * DTypeSize(shape_.dtype),
                   shape_.dtype, nr * H, h.data());
    const int32_t* y = rows.targets + r0;

    // Pass 1: online softmax statistics over the shard's vocabulary.
    stats.assign(nr, RowStats{});
    for (int64_t v0 = 0; v0 < shard_v; v0 += tile) {
      const int64_t nv = std::min(tile, shard_v - v0);
      LogitTile(h.data(), nr, v0, nv, o, z.data());
#pragma omp parallel for schedule(static) num_threads(nthreads)
      for (int64_t r = 0; r < nr; ++r) {
        const float* zr = z.data() + r * nv;
        RowStats& st = stats[r];
        float tmax = -std::numeric_limits<float>::infinity();
        float tsum_z = 0.0f;
        for (int64_t v = 0; v < nv; ++v) {
          tmax = std::max(tmax, zr[v]);
          tsum_z += zr[v];
        }
        if (std::isnan(tsum_z)) tmax = tsum_z;  // make NaN sticky: std::max may drop it
        const float m = std::max(st.max, tmax);
        float s = 0.0f, q = 0.0f;
        for (int64_t v = 0; v < nv; ++v) {
          const float d = zr[v] - m;
          const float e = std::exp(d);
          s += e;
          q += e * d;
        }
        if (st.sum_exp > 0.0f) {
          const float scale = std::exp(st.max - m);
          q += (st.sum_exp_z + (st.max - m) * st.sum_exp) * scale;
          s += st.sum_exp * scale;
        }
        st.max = std::isnan(tmax) ? tmax : m;
        st.sum_exp = s;
        st.sum_exp_z = q;
        st.sum_z += tsum_z;
        const int64_t local = static_cast<int64_t>(y[r]) - vb - v0;
        if (y[r] != o.ignore_index && local >= 0 && local < nv) st.target_z = zr[local];
      }
    }
    if (collectives_ != nullptr) {
      if (absl::Status s = MergeAcrossRanks(stats); !s.ok()) return s;
    }

    fin.resize(nr);
    for (int64_t r = 0; r < nr; ++r) {
      const RowStats& st = stats[r];
      const float lse = st.max + std::log(st.sum_exp);
      if (!std::isfinite(lse) || !std::isfinite(st.sum_z)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "row ", r0 + r, ": non-finite logits (NaN or Inf in the hidden states, or overflow)"));
      }
      fin[r] = {lse, st.sum_exp_z / st.sum_exp, st.max};
      const bool ignored = y[r] == o.ignore_index;
      const float logprob = ignored ? 0.0f : st.target_z - lse;
      if (out.lse != nullptr) out.lse[r0 + r] = lse;
      if (out.logprob != nullptr) out.logprob[r0 + r] = logprob;
      if (out.entropy != nullptr) out.entropy[r0 + r] = std::log(st.sum_exp) - fin[r].mean_pz_shifted;
      if (out.loss != nullptr) {
        out.loss[r0 + r] = ignored ? 0.0f
                                   : -(1.0f - eps) * logprob +
                                         eps * (lse - st.sum_z / static_cast<float>(V)) +
                                         o.z_loss * lse * lse;
      }
    }
    if (!backward) continue;

    // Pass 2. dL/dz_ij = A_i·p_ij + B_i·p_ij·(z_ij − max_i) − C_i·1[j=y_i] − D_i, with per-row
    // coefficients (docs/MATH.md):
    //   loss:    A = g(1 + 2λ·lse), B = 0, C = g(1−ε), D = g·ε/V      (all 0 for ignored rows)
    //   generic: A = −u + e·Σp(z−max), B = −e, C = −u, D = 0           (u = 0 for ignored rows)
    coef_a.assign(nr * 4, 0.0f);
    for (int64_t r = 0; r < nr; ++r) {
      const bool ignored = y[r] == o.ignore_index;
      float* c = coef_a.data() + 4 * r;
      if (up.mode == GradMode::kLoss) {
        if (ignored) continue;
        const float g = up.grad_loss != nullptr ? up.grad_loss[r0 + r] : 1.0f;
        c[0] = g * (1.0f + 2.0f * o.z_loss * fin[r].lse);
        c[2] = g * (1.0f - eps);
        c[3] = g * eps / static_cast<float>(V);
      } else {
        const float u = (ignored || up.grad_logprob == nullptr) ? 0.0f : up.grad_logprob[r0 + r];
        const float e = up.grad_entropy != nullptr ? up.grad_entropy[r0 + r] : 0.0f;
        c[0] = -u + e * fin[r].mean_pz_shifted;
        c[1] = -e;
        c[2] = -u;
      }
    }
    std::fill(dh.begin(), dh.begin() + nr * H, 0.0f);
    for (int64_t v0 = 0; v0 < shard_v; v0 += tile) {
      const int64_t nv = std::min(tile, shard_v - v0);
      LogitTile(h.data(), nr, v0, nv, o, z.data());
#pragma omp parallel for schedule(static) num_threads(nthreads)
      for (int64_t r = 0; r < nr; ++r) {
        float* zr = z.data() + r * nv;
        const float* c = coef_a.data() + 4 * r;
        const float lse = fin[r].lse, m = fin[r].max;
        for (int64_t v = 0; v < nv; ++v) {
          const float zz = zr[v];
          const float p = std::exp(zz - lse);
          float dz = c[0] * p + c[1] * p * (zz - m) - c[3];
          float da = dz * inv_t;
          if (o.softcap > 0.0f) {
            const float t = zz * o.temperature / o.softcap;  // tanh(a / s)
            da *= 1.0f - t * t;
          }
          zr[v] = da;
        }
        const int64_t local = static_cast<int64_t>(y[r]) - vb - v0;
        if (y[r] != o.ignore_index && local >= 0 && local < nv && c[2] != 0.0f) {
          float dcorr = -c[2] * inv_t;
          if (o.softcap > 0.0f) {
            // z was overwritten; recompute tanh from the target logit kept in stats.
            const float t = stats[r].target_z * o.temperature / o.softcap;
            dcorr *= 1.0f - t * t;
          }
          zr[local] += dcorr;
        }
      }
      // d_hidden[nr, H] += dA[nr, nv] · W_tile[nv, H]
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(nr),
                  static_cast<int>(H), static_cast<int>(nv), 1.0f, z.data(), static_cast<int>(nv),
                  w_.data() + v0 * H, static_cast<int>(H), 1.0f, dh.data(), static_cast<int>(H));
      // dW_tile[nv, H] += dA[nr, nv]ᵀ · h[nr, H]
      if (grads.d_weight != nullptr) {
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(nv),
                    static_cast<int>(H), static_cast<int>(nr), 1.0f, z.data(), static_cast<int>(nv),
                    h.data(), static_cast<int>(H), 1.0f, grads.d_weight + v0 * H,
                    static_cast<int>(H));
      }
    }
    if (collectives_ != nullptr) {
      if (absl::Status s = collectives_->AllReduce(dh.data(), nr * H, ReduceOp::kSum, false, nullptr);
          !s.ok()) {
        return s;
      }
    }
    if (grads.d_hidden != nullptr) {
      ConvertFromFloat(dh.data(), nr * H, shape_.dtype,
                       static_cast<uint8_t*>(grads.d_hidden) + r0 * H * DTypeSize(shape_.dtype));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<LceEngine>> CreateCpuEngine(std::shared_ptr<const HeadWeights> weights,
                                                           const EngineConfig& config) {
  if (config.collectives != nullptr) {
    const VocabRange want =
        VocabShard(weights->shape.vocab_size, config.collectives->rank(), config.collectives->world_size());
    if (want.begin != weights->shape.vocab_begin || want.end != weights->shape.vocab_end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "head shard [", weights->shape.vocab_begin, ", ", weights->shape.vocab_end(),
          ") does not match rank ", config.collectives->rank(), "'s range [", want.begin, ", ",
          want.end, ")"));
    }
  }
  return std::unique_ptr<LceEngine>(new CpuEngine(std::move(weights), config));
}

}  // namespace lce
