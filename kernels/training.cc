#include <algorithm>
#include <cmath>
#include <cstring>
#include <new>
#include <vector>

#include "absl/strings/str_cat.h"
#include "lce/numeric.h"
#include "lce/training.h"
#ifdef LCE_WITH_CUDA
#include "cuda/head_trainer.h"
#endif

namespace lce {

AdamWCoefficients AdamWCoefficientsAt(const AdamWParams& p, int64_t step) {
  const double bc1 = 1.0 - std::pow(static_cast<double>(p.beta1), static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(p.beta2), static_cast<double>(step));
  return {static_cast<float>(p.lr / bc1), static_cast<float>(std::sqrt(bc2)), 1.0f - p.lr * p.weight_decay};
}

void AdamWStep(float* param, float* m, float* v, const float* grad, int64_t n, const AdamWParams& p,
               int64_t step, float grad_scale) {
  const AdamWCoefficients c = AdamWCoefficientsAt(p, step);
  // The CUDA kernel (cuda/adamw.cu) does these fp32 operations in this order, unfused.
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i] * grad_scale;
    param[i] *= c.decay;
    m[i] = p.beta1 * m[i] + (1.0f - p.beta1) * g;
    v[i] = p.beta2 * v[i] + (1.0f - p.beta2) * g * g;
    const float denom = std::sqrt(v[i]) / c.bc2_sqrt + p.eps;
    param[i] -= c.step_size * m[i] / denom;
  }
}

double SquaredNorm(const float* g, int64_t n) {
  constexpr int64_t kBlock = int64_t{1} << 16;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<double> partial(static_cast<size_t>(blocks), 0.0);
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    double s = 0;
    for (int64_t i = b * kBlock; i < std::min(n, (b + 1) * kBlock); ++i) s += static_cast<double>(g[i]) * g[i];
    partial[static_cast<size_t>(b)] = s;
  }
  double s = 0;
  for (double x : partial) s += x;
  return s;
}

float ClipScale(double norm, float max_grad_norm) {
  return max_grad_norm > 0.0f && norm > max_grad_norm ? static_cast<float>(max_grad_norm / (norm + 1e-6)) : 1.0f;
}

ShardTiles TilesOf(const HeadShape& shape) {
  ShardTiles t;
  t.tile_rows = VocabTile(shape.vocab_size);
  t.vocab_begin = shape.vocab_begin;
  t.shard_rows = shape.shard_rows;
  t.first_tile = shape.vocab_begin / t.tile_rows;
  t.count = shape.shard_rows > 0 ? (shape.vocab_end() - 1) / t.tile_rows + 1 - t.first_tile : 0;
  return t;
}

void PackTileSquaredNorms(const TileSquaredNorms& tiles, float* exchange) {
  for (size_t i = 0; i < tiles.sums.size(); ++i) {
    const double s = tiles.sums[i];
    const float hi = static_cast<float>(s);
    exchange[2 * (tiles.first_tile + static_cast<int64_t>(i))] = hi;
    exchange[2 * (tiles.first_tile + static_cast<int64_t>(i)) + 1] = static_cast<float>(s - hi);
  }
}

double CombineTileSquaredNorms(const float* exchange, int64_t tiles) {
  double s = 0;
  for (int64_t t = 0; t < tiles; ++t) s += static_cast<double>(exchange[2 * t]) + static_cast<double>(exchange[2 * t + 1]);
  return s;
}

absl::StatusOr<double> HeadTrainer::GradSquaredNorm() {
  absl::StatusOr<TileSquaredNorms> tiles = GradTileSquaredNorms();
  if (!tiles.ok()) return tiles.status();
  const int64_t all = VocabTileCount(shape_.vocab_size);
  std::vector<float> exchange(static_cast<size_t>(2 * all), 0.0f);
  PackTileSquaredNorms(*tiles, exchange.data());
  return CombineTileSquaredNorms(exchange.data(), all);
}

absl::Status HeadTrainer::ZeroGrad() {
  if (absl::Status s = Zero(grad_data()); !s.ok()) return s;
  grad_zero_ = true;
  return absl::OkStatus();
}

absl::StatusOr<float*> HeadTrainer::AcquirePending(uint64_t id, bool zeroed) {
  if (id == 0) return absl::InvalidArgumentError("pending gradient id 0 is reserved");
  if (auto it = pending_.find(id); it != pending_.end()) return it->second->data();
  std::unique_ptr<GradBuffer> buf = std::move(spare_);
  bool zero = spare_zero_;
  if (buf == nullptr) {
    absl::StatusOr<std::unique_ptr<GradBuffer>> made = NewGradBuffer();
    if (!made.ok()) return made.status();
    buf = std::move(*made);
    zero = false;
  }
  if (!zero && zeroed) {
    if (absl::Status s = Zero(buf->data()); !s.ok()) {
      spare_ = std::move(buf);
      spare_zero_ = false;
      return s;
    }
  }
  float* data = buf->data();
  pending_.emplace(id, std::move(buf));
  return data;
}

absl::Status HeadTrainer::CommitPending(uint64_t id, float scale) {
  auto it = pending_.find(id);
  if (it == pending_.end()) return absl::NotFoundError(absl::StrCat("no pending gradient ", id));
  std::unique_ptr<GradBuffer> buf = std::move(it->second);
  pending_.erase(it);
  absl::Status s;
  bool spare_zero = false;
  if (scale == 0.0f) {
    // Nothing to add; the buffer keeps its contents.
  } else if (grad_zero_) {
    // 0 + s·P: P becomes dW (scaled in place unless s = 1), the zero dW the spare.
    std::swap(grad_, buf);
    spare_zero = true;
    if (scale != 1.0f) s = Scale(grad_data(), scale);
    grad_zero_ = false;
  } else {
    s = AddScaled(grad_data(), buf->data(), scale);
  }
  spare_ = std::move(buf);
  spare_zero_ = spare_zero;
  return s;
}

absl::StatusOr<float*> HeadTrainer::FindPending(uint64_t id) {
  auto it = pending_.find(id);
  if (it == pending_.end()) return absl::NotFoundError(absl::StrCat("no pending gradient ", id));
  return it->second->data();
}

namespace {

absl::Status CheckShardRows(const HeadShape& shape, int64_t first_row, int64_t rows) {
  if (first_row < 0 || rows < 0 || first_row + rows > shape.shard_rows) {
    return absl::OutOfRangeError(absl::StrCat("gradient rows [", first_row, ", ", first_row + rows,
                                              ") are outside the shard's ", shape.shard_rows));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status HeadTrainer::CopyGrad(int64_t first_row, int64_t rows, float* host) {
  if (absl::Status s = CheckShardRows(shape_, first_row, rows); !s.ok()) return s;
  return CopyRows(grad_data(), first_row, rows, host);
}

absl::Status HeadTrainer::CopyBiasGrad(float* host) {
  if (!shape_.has_bias) return absl::FailedPreconditionError("the head has no bias");
  return CopyElements(grad_data(), weight_elements(), shape_.shard_rows, host);
}

absl::Status HeadTrainer::CopyPending(uint64_t id, int64_t first_row, int64_t rows, float* host) {
  absl::StatusOr<float*> p = FindPending(id);
  if (!p.ok()) return p.status();
  if (absl::Status s = CheckShardRows(shape_, first_row, rows); !s.ok()) return s;
  return CopyRows(*p, first_row, rows, host);
}

void HeadTrainer::ReleasePending(uint64_t id) {
  auto it = pending_.find(id);
  if (it == pending_.end()) return;
  spare_ = std::move(it->second);
  spare_zero_ = false;
  pending_.erase(it);
}

namespace {

// The CPU engine's trainer: host vectors, AdamWStep, and a new engine for each new weight.
class CpuHeadTrainer final : public HeadTrainer {
 public:
  CpuHeadTrainer(std::shared_ptr<LceEngine> engine, std::shared_ptr<const HeadWeights> weights, EngineMaker make)
      : HeadTrainer(weights->shape), engine_(std::move(engine)), weights_(std::move(weights)), make_(std::move(make)) {
    grad_ = std::make_unique<HostGradBuffer>(grad_elements());
    ZeroGrad().IgnoreError();  // host memory: cannot fail
  }

  std::string_view backend() const override { return "cpu"; }
  MemorySpace grad_space() const override { return MemorySpace::kHost; }
  void* stream() override { return nullptr; }
  absl::StatusOr<TileSquaredNorms> GradTileSquaredNorms() override {
    const ShardTiles tiles = TilesOf(shape_);
    TileSquaredNorms out{tiles.first_tile, {}};
    const float* d_bias = BiasPart(grad_data());
    for (int64_t i = 0; i < tiles.count; ++i) {
      const int64_t r0 = tiles.RowBegin(i), n = tiles.RowEnd(i) - r0;
      // A tile's rows of dW, then of dB: the tile's share of the parameters' norm.
      out.sums.push_back(SquaredNorm(grad_data() + r0 * shape_.hidden_size, n * shape_.hidden_size) +
                         (d_bias != nullptr ? SquaredNorm(d_bias + r0, n) : 0.0));
    }
    return out;
  }

  absl::Status PrepareStep() override {
    if (!make_) return absl::FailedPreconditionError("this server cannot build new head versions");
    if (!master_.empty()) return absl::OkStatus();
    const int64_t n = grad_elements();
    master_.resize(static_cast<size_t>(n));
    SetMasters(*weights_);
    m_.assign(static_cast<size_t>(n), 0.0f);
    v_.assign(static_cast<size_t>(n), 0.0f);
    return absl::OkStatus();
  }

  absl::StatusOr<std::shared_ptr<LceEngine>> Step(const AdamWParams& p, float grad_scale) override {
    if (absl::Status s = PrepareStep(); !s.ok()) return s;
    const int64_t n = grad_elements();
    ++steps_;
    AdamWStep(master_.data(), m_.data(), v_.data(), grad_data(), n, p, steps_, grad_scale);
    auto next = std::make_shared<HeadWeights>();
    next->shape = shape_;
    next->bias.assign(master_.begin() + weight_elements(), master_.end());  // fp32, as the masters
    next->weight.resize(weights_->weight.size());
    ConvertFromFloat(master_.data(), weight_elements(), shape_.dtype, next->weight.data());
    return Serve(std::move(next));
  }

  absl::StatusOr<std::shared_ptr<LceEngine>> SetWeight(std::shared_ptr<const HeadWeights> w) override {
    if (!make_) return absl::FailedPreconditionError("this server cannot build new head versions");
    if (w->weight.size() != weights_->weight.size()) return absl::InvalidArgumentError("new weight has another shape");
    if (w->bias.size() != weights_->bias.size()) return absl::InvalidArgumentError("new bias has another shape");
    if (!master_.empty()) SetMasters(*w);
    return Serve(std::move(w));
  }

  absl::StatusOr<std::shared_ptr<const HeadWeights>> Weights() override { return weights_; }

 protected:
  absl::StatusOr<std::unique_ptr<GradBuffer>> NewGradBuffer() override {
    auto buf = std::make_unique<HostGradBuffer>(grad_elements(), std::nothrow);
    if (buf->data() == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("no host memory for a pending gradient of ",
                                                       grad_elements() * 4, " bytes"));
    }
    return std::unique_ptr<GradBuffer>(std::move(buf));
  }
  absl::Status Zero(float* x) override {
    std::fill(x, x + grad_elements(), 0.0f);
    return absl::OkStatus();
  }
  absl::Status Scale(float* x, float s) override {
    const int64_t n = grad_elements();
    for (int64_t i = 0; i < n; ++i) x[i] *= s;
    return absl::OkStatus();
  }
  absl::Status AddScaled(float* y, const float* x, float s) override {
    const int64_t n = grad_elements();
    for (int64_t i = 0; i < n; ++i) y[i] += s * x[i];
    return absl::OkStatus();
  }
  absl::Status CopyRows(const float* buffer, int64_t first_row, int64_t rows, float* host) override {
    return CopyElements(buffer, first_row * shape_.hidden_size, rows * shape_.hidden_size, host);
  }
  absl::Status CopyElements(const float* buffer, int64_t first, int64_t n, float* host) override {
    std::memcpy(host, buffer + first, static_cast<size_t>(n) * sizeof(float));
    return absl::OkStatus();
  }

 private:
  // The host's dW-sized buffers. Not zeroed here: AcquirePending and ZeroGrad do that.
  class HostGradBuffer final : public GradBuffer {
   public:
    explicit HostGradBuffer(int64_t n) : data_(new float[static_cast<size_t>(n)]) {}
    HostGradBuffer(int64_t n, std::nothrow_t) : data_(new (std::nothrow) float[static_cast<size_t>(n)]) {}
    float* data() override { return data_.get(); }

   private:
    std::unique_ptr<float[]> data_;
  };

  // The fp32 masters [W | b] := the weight (and bias) of `w`.
  void SetMasters(const HeadWeights& w) {
    ConvertToFloat(w.weight.data(), shape_.dtype, weight_elements(), master_.data());
    std::copy(w.bias.begin(), w.bias.end(), master_.begin() + weight_elements());
  }

  absl::StatusOr<std::shared_ptr<LceEngine>> Serve(std::shared_ptr<const HeadWeights> w) {
    absl::StatusOr<std::shared_ptr<LceEngine>> e = make_(w);
    if (!e.ok()) return e.status();
    engine_ = *e;
    weights_ = std::move(w);
    return engine_;
  }

  std::shared_ptr<LceEngine> engine_;
  std::shared_ptr<const HeadWeights> weights_;  // the weight engine_ serves
  EngineMaker make_;
  std::vector<float> master_, m_, v_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<HeadTrainer>> CreateHeadTrainer(std::shared_ptr<LceEngine> engine,
                                                               std::shared_ptr<const HeadWeights> weights,
                                                               EngineMaker make_engine) {
  if (engine == nullptr || weights == nullptr) return absl::InvalidArgumentError("a trainer needs an engine and its weight");
  if (engine->backend() == "cpu") {
    return std::unique_ptr<HeadTrainer>(new CpuHeadTrainer(std::move(engine), std::move(weights), std::move(make_engine)));
  }
#ifdef LCE_WITH_CUDA
  if (engine->backend() == "cuda") return cuda::CreateCudaHeadTrainer(std::move(engine), std::move(weights));
#endif
  return absl::UnimplementedError(absl::StrCat("no head trainer for the '", std::string(engine->backend()), "' backend"));
}

float AggregationWeight(AggregationKind kind, int64_t seq_tokens, int64_t total_tokens, int64_t num_sequences) {
  switch (kind) {
    case AggregationKind::kTokenMean: return total_tokens > 0 ? 1.0f / static_cast<float>(total_tokens) : 0.0f;
    case AggregationKind::kSeqMeanTokenSum: return num_sequences > 0 ? 1.0f / static_cast<float>(num_sequences) : 0.0f;
    case AggregationKind::kSeqMeanTokenMean: {
      if (num_sequences <= 0 || seq_tokens <= 0) return 0.0f;
      int64_t n = 0;  // declared counts come from requests: their product may not be a number
      if (__builtin_mul_overflow(num_sequences, seq_tokens, &n)) {
        return static_cast<float>(1.0 / (static_cast<double>(num_sequences) * static_cast<double>(seq_tokens)));
      }
      return 1.0f / static_cast<float>(n);
    }
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
