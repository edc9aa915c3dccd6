// CPU backend of the LCE engine. Rows are processed in blocks of kRowBlock; the vocabulary in tiles
// of kVocabTile. Pass 1 (forward) computes each logit tile and folds it into per-row online
// statistics; pass 2 (backward, when asked) recomputes each tile, turns it into dL/da in place and
// feeds the d_hidden and dW products. Tiles are held transposed ([vocab][row]), so the row loops
// vectorise and a row is one column. Invariance (DESIGN.md, "Guarantees"): every product runs
// through FixedOrderGemm; the tiles sit at fixed global offsets (VocabTile) and TP shards hold whole
// tiles; a row's per-tile partials are folded in global tile order, and its per-tile d_hidden sums
// are combined over one canonical binary tree of all the head's tiles, whose subtrees a rank
// computes for its own tiles. So a row's results do not depend on the rows around it, the chunking
// or the group size. Memory: O(kRowBlock·(tile + H·log2(tiles))).
#include "cpu/cpu_engine.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cpu/fixed_order_gemm.h"
#include "lce/numeric.h"
#include "tile_tree.h"

namespace lce {
namespace {

constexpr int64_t kRowBlock = 128;
// Transposed tiles are computed over whole groups of this many rows (the padding columns hold
// values of no row and are never read back): one GEMM tile width on every instruction set.
constexpr int64_t kColumnGroup = 32;
// The columns a block of nr rows computes: nr rounded up to whole groups.
int64_t BlockColumns(int64_t nr) { return std::min(kRowBlock, (nr + kColumnGroup - 1) / kColumnGroup * kColumnGroup); }

// Per-row statistics of the softmax over (this shard of) the vocabulary; see docs/MATH.md.
struct RowStats {
  float max = -std::numeric_limits<float>::infinity();
  float sum_exp = 0.0f;      // S = Σ exp(z − max)
  float sum_exp_z = 0.0f;    // Q = Σ exp(z − max)·(z − max)
  float sum_z = 0.0f;        // Σ z (label smoothing)
  float target_z = 0.0f;     // z_{y}, when y is in this shard
  float sum_wz = 0.0f;       // Σ w·z (label smoothing with class weights)
};

// Per-row partials of one vocabulary tile, relative to the tile's own max so that they do not depend
// on the tiles before it: what ranks exchange and fold in global tile order.
struct TilePartial {
  float max;        // +inf when the tile holds a NaN: the fold then fails the row
  float sum_exp;    // Σ exp(z − max)
  float sum_exp_z;  // Σ exp(z − max)·(z − max)
  float sum_z;
  float target_z;   // −inf when y is not in this tile
  float sum_wz;     // Σ w·z with class weights and label smoothing, else 0
};
constexpr int64_t kPartialFloats = sizeof(TilePartial) / sizeof(float);
static_assert(sizeof(TilePartial) == 6 * sizeof(float));

// One of a row's most probable tokens: its logit z and its global id, as a float so that ranks exchange
// candidates with the partials' max all-reduce (exact: ids < 2^24). Both −inf in a slot a rank does not
// own, or past a tile's last column.
struct Candidate {
  float z;
  float id;
};
// Ranking order: larger z first, then lower id; a total order, so the top k of any grouping of the
// candidates are the same.
inline bool Before(const Candidate& a, const Candidate& b) { return a.z > b.z || (a.z == b.z && a.id < b.id); }
// Inserts c into the sorted list top[0, k) if it ranks there.
inline void Offer(Candidate* top, int k, Candidate c) {
  if (!Before(c, top[k - 1])) return;
  int j = k - 1;
  for (; j > 0 && Before(c, top[j - 1]); --j) top[j] = top[j - 1];
  top[j] = c;
}

// A subtree of the canonical binary tree over the head's tiles: level ℓ, index j covers tiles
// [j·2^ℓ, (j+1)·2^ℓ); its value is the transposed d_hidden [H, cols] summed over those tiles,
// left + right (a right subtree past the last tile is absent, not zero).
struct TreeNode {
  int level = 0;
  int64_t index = 0;
  std::vector<float> value;
};

// Final per-row values derived from the merged statistics.
struct RowFinal {
  float lse;
  float mean_pz_shifted;  // Q / S = Σ p (z − max)
  float max;
  float log_sum_exp;      // log S: p = exp((z − max) − log S), not exp(z − lse) of two large numbers
};

// Backward coefficients of a row: dL/dz_j = a·p_j + b·p_j·(z_j − max) − c·1[j=y] − d·w_j
// (w_j = 1 without class weights).
struct RowCoef {
  float a = 0.0f, b = 0.0f, c = 0.0f, d = 0.0f;
};

// What a call's math needs beyond its options: the class weights and their sum over the vocabulary.
struct CallMath {
  const LceOptions& o;
  const float* class_weight;  // [V] global ids, or null
  float weight_total;         // Σ_c w_c (V without class weights)
  float Weight(int64_t id) const { return class_weight != nullptr ? class_weight[id] : 1.0f; }
  // Label smoothing with class weights: the tiles accumulate Σ w·z.
  bool WeightedSmoothing() const { return class_weight != nullptr && o.label_smoothing > 0.0f; }
};

// Scratch of a Compute call, kept by the engine between calls (a call of a few rows would otherwise spend
// most of its time zeroing and faulting in fresh pages). Row-block buffers are [.., kRowBlock] so a row is
// a column.
struct Workspace {
  Workspace(int64_t hidden, int64_t tile)
      : h(kRowBlock * hidden), h_t(hidden * kRowBlock, 0.0f), z_t(tile * kRowBlock, 0.0f),
        dh_t(hidden * kRowBlock), dh(kRowBlock * hidden) {}
  std::vector<float> h;     // [rows, H]: the block's hidden states in fp32
  std::vector<float> h_t;   // [H, kRowBlock]: the same, transposed
  std::vector<float> z_t;   // [tile, kRowBlock]: a logit tile; in pass 2, dL/da
  std::vector<float> dh_t;  // [H, cols]: d_hidden, transposed (the tree's sum)
  std::vector<float> dh;    // [rows, H]
};

class CpuEngine final : public LceEngine {
 public:
  CpuEngine(std::shared_ptr<const HeadWeights> weights, const EngineConfig& config)
      : weights_(std::move(weights)), shape_(weights_->shape), collectives_(config.collectives) {
    const int64_t n = shape_.shard_rows * shape_.hidden_size;
    w_.resize(n);
    ConvertToFloat(weights_->weight.data(), shape_.dtype, n, w_.data());
    threads_ = config.cpu_threads > 0 ? config.cpu_threads : omp_get_max_threads();
  }

  std::string_view backend() const override { return "cpu"; }
  const HeadShape& shape() const override { return shape_; }
  EngineMemory memory() const override {
    return {static_cast<int64_t>(w_.size() * sizeof(float) + weights_->weight.size()),
            (kRowBlock * (Tile() + 4 * shape_.hidden_size)) * static_cast<int64_t>(sizeof(float))};
  }

  EngineInvariance invariance() const override {
    const std::vector<std::string> all = {"logprob",  "entropy", "lse",        "loss",        "d_hidden",
                                          "d_weight", "argmax",  "top_tokens", "top_logprobs"};
    return {all, all};  // docs/MATH.md, "Order of reductions"
  }

  absl::Status Compute(const RowsView& rows, const LceOptions& options, const Upstream& upstream,
                       const RowOutputs& outputs, const GradOutputs& grads) override;

 private:
  absl::Status CheckCall(const RowsView& rows, const LceOptions& options) const;
  void LoadRows(const RowsView& rows, int64_t r0, int64_t nr, int64_t cols, Workspace& ws) const;
  void LogitTile(const Workspace& ws, int64_t cols, int64_t v0, int64_t nv, const LceOptions& o,
                 float* z_t) const;
  void TilePartials(const float* z_t, int64_t nr, int64_t v0, int64_t nv, const int32_t* y, const CallMath& m,
                    std::vector<TilePartial>& parts) const;
  void TileCandidates(const float* z_t, int64_t nr, int64_t v0, int64_t nv, int k, std::vector<Candidate>& cands) const;
  absl::Status FoldPartials(std::vector<TilePartial>& parts, int64_t nr,
                            std::vector<RowStats>& stats) const;
  absl::Status RankRows(std::vector<Candidate>& cands, int64_t r0, int64_t nr, int k, const std::vector<RowFinal>& fin,
                        const RowOutputs& out) const;
  absl::Status FinishRows(int64_t r0, int64_t nr, const int32_t* y, const CallMath& m,
                          const std::vector<RowStats>& stats, const RowOutputs& out, std::vector<RowFinal>& fin) const;
  void GradTile(float* z_t, int64_t nr, int64_t v0, int64_t nv, const int32_t* y, const CallMath& m,
                const std::vector<RowCoef>& coef, const std::vector<RowFinal>& fin,
                const std::vector<RowStats>& stats) const;
  absl::Status ForwardBlock(Workspace& ws, const RowsView& rows, int64_t r0, int64_t nr, const CallMath& m,
                            const RowOutputs& out, std::vector<RowStats>& stats, std::vector<RowFinal>& fin);
  absl::Status BackwardBlock(Workspace& ws, int64_t r0, int64_t nr, const int32_t* y, const CallMath& m,
                             const std::vector<RowCoef>& coef, const std::vector<RowFinal>& fin,
                             const std::vector<RowStats>& stats, const GradOutputs& grads);
  absl::Status CombineDHidden(std::vector<TreeNode> own, int64_t cols, Workspace& ws) const;

  int64_t Tile() const { return VocabTile(shape_.vocab_size); }
  int64_t Tiles() const { return VocabTileCount(shape_.vocab_size); }
  int64_t TileIndex(int64_t v0) const { return (shape_.vocab_begin + v0) / Tile(); }

  std::shared_ptr<const HeadWeights> weights_;
  HeadShape shape_;
  Collectives* collectives_;
  std::vector<float> w_;  // fp32 copy of the shard, [shard_rows, H]
  int threads_ = 1;
  std::mutex mu_;
  std::unique_ptr<Workspace> ws_;  // guarded by mu_; made by the first call
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

// Rows [r0, r0+nr) into ws.h (fp32) and, transposed, into the first nr of ws.h_t's `cols` columns; the
// columns past nr (the GEMMs' padding) are zeroed, whatever an earlier call left there.
void CpuEngine::LoadRows(const RowsView& rows, int64_t r0, int64_t nr, int64_t cols, Workspace& ws) const {
  const int64_t H = shape_.hidden_size;
  ConvertToFloat(static_cast<const uint8_t*>(rows.hidden) + r0 * H * DTypeSize(shape_.dtype),
                 shape_.dtype, nr * H, ws.h.data());
  for (int64_t r = 0; r < nr; ++r) {
    for (int64_t k = 0; k < H; ++k) ws.h_t[k * kRowBlock + r] = ws.h[r * H + k];
  }
  if (nr < cols) {
    for (int64_t k = 0; k < H; ++k) std::fill_n(ws.h_t.data() + k * kRowBlock + nr, cols - nr, 0.0f);
  }
}

// Transposed logit tile z_t[v, r] for vocab tile [v0, v0+nv) of the shard and the first `cols`
// columns of ws.h_t; applies bias, softcap and temperature.
void CpuEngine::LogitTile(const Workspace& ws, int64_t cols, int64_t v0, int64_t nv,
                          const LceOptions& o, float* z_t) const {
  const int64_t H = shape_.hidden_size;
  cpu::FixedOrderGemm(nv, cols, H, {w_.data() + v0 * H, H, 1}, ws.h_t.data(), kRowBlock, z_t,
                      kRowBlock, /*accumulate=*/false, threads_);
  const float* bias = weights_->bias.empty() ? nullptr : weights_->bias.data() + v0;
  const float inv_t = 1.0f / o.temperature;
  const float cap = o.softcap;
  if (bias == nullptr && cap == 0.0f && inv_t == 1.0f) return;
#pragma omp parallel for schedule(static) num_threads(threads_)
  for (int64_t v = 0; v < nv; ++v) {
    float* zv = z_t + v * kRowBlock;
    const float b = bias != nullptr ? bias[v] : 0.0f;
    for (int64_t r = 0; r < cols; ++r) {
      float a = zv[r] + b;
      if (cap > 0.0f) a = cap * std::tanh(a / cap);
      zv[r] = a * inv_t;
    }
  }
}

// Each row's partials of tile [v0, v0+nv) into parts[row · Tiles() + tile index].
void CpuEngine::TilePartials(const float* z_t, int64_t nr, int64_t v0, int64_t nv, const int32_t* y, const CallMath& m,
                             std::vector<TilePartial>& parts) const {
  const LceOptions& o = m.o;
  const int64_t tile = TileIndex(v0), tiles = Tiles(), vb = shape_.vocab_begin;
  const float* w = m.WeightedSmoothing() ? m.class_weight + vb + v0 : nullptr;
  const int64_t groups = (nr + kColumnGroup - 1) / kColumnGroup;
#pragma omp parallel for schedule(static) num_threads(static_cast<int>(std::min<int64_t>(threads_, groups)))
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t r0 = g * kColumnGroup, n = std::min(nr, r0 + kColumnGroup) - r0;
    float tmax[kColumnGroup], tsum_z[kColumnGroup], s[kColumnGroup], q[kColumnGroup], wz[kColumnGroup];
    for (int64_t r = 0; r < n; ++r) {
      tmax[r] = -std::numeric_limits<float>::infinity();
      tsum_z[r] = s[r] = q[r] = wz[r] = 0.0f;
    }
    for (int64_t v = 0; v < nv; ++v) {
      const float* zv = z_t + v * kRowBlock + r0;
      for (int64_t r = 0; r < n; ++r) {
        tmax[r] = std::max(tmax[r], zv[r]);
        tsum_z[r] += zv[r];
      }
      if (w != nullptr) {
        for (int64_t r = 0; r < n; ++r) wz[r] += w[v] * zv[r];
      }
    }
    for (int64_t v = 0; v < nv; ++v) {
      const float* zv = z_t + v * kRowBlock + r0;
      for (int64_t r = 0; r < n; ++r) {
        const float d = zv[r] - tmax[r];
        const float e = std::exp(d);
        s[r] += e;
        q[r] += e * d;
      }
    }
    for (int64_t r = 0; r < n; ++r) {
      const int64_t local = static_cast<int64_t>(y[r0 + r]) - vb - v0;
      const bool has_target = y[r0 + r] != o.ignore_index && local >= 0 && local < nv;
      parts[(r0 + r) * tiles + tile] = {
          std::isnan(tsum_z[r]) ? std::numeric_limits<float>::infinity() : tmax[r],
          s[r],
          q[r],
          tsum_z[r],
          has_target ? z_t[local * kRowBlock + r0 + r] : -std::numeric_limits<float>::infinity(),
          wz[r]};
    }
  }
}

// Each row's top k of tile [v0, v0+nv) into cands[(row · Tiles() + tile index) · k ...], ranked.
void CpuEngine::TileCandidates(const float* z_t, int64_t nr, int64_t v0, int64_t nv, int k,
                               std::vector<Candidate>& cands) const {
  const int64_t tile = TileIndex(v0), tiles = Tiles(), first_id = shape_.vocab_begin + v0;
  const float none = -std::numeric_limits<float>::infinity();
#pragma omp parallel for schedule(static) num_threads(static_cast <int>(std::min <int64_t>(threads_, nr)))
  for (int64_t r = 0; r < nr; ++r) {
    Candidate* top = cands.data() + (r * tiles + tile) * k;
    // Every finite logit ranks before an empty (−inf, −inf) slot, so Offer alone fills the list.
    std::fill_n(top, k, Candidate{none, none});
    for (int64_t v = 0; v < nv; ++v) Offer(top, k, Candidate{z_t[v * kRowBlock + r], static_cast<float>(first_id + v)});
  }
}

// Gathers the other ranks' tiles (slots left at −inf take the owner's value under max) and folds
// every row's partials in global tile order: the same fold whatever the group size.
absl::Status CpuEngine::FoldPartials(std::vector<TilePartial>& parts, int64_t nr,
                                     std::vector<RowStats>& stats) const {
  const int64_t tiles = Tiles();
  if (collectives_ != nullptr) {
    if (absl::Status s = collectives_->AllReduce(reinterpret_cast<float*>(parts.data()),
                                                 nr * tiles * kPartialFloats, ReduceOp::kMax, false,
                                                 nullptr);
        !s.ok()) {
      return s;
    }
  }
  stats.assign(nr, RowStats{});
  for (int64_t r = 0; r < nr; ++r) {
    RowStats& st = stats[r];
    for (int64_t t = 0; t < tiles; ++t) {
      const TilePartial& p = parts[r * tiles + t];
      const float m = std::max(st.max, p.max);
      const float scale_acc = st.sum_exp > 0.0f ? std::exp(st.max - m) : 0.0f;
      const float scale_tile = std::exp(p.max - m);
      const float q_acc =
          st.sum_exp > 0.0f ? (st.sum_exp_z + (st.max - m) * st.sum_exp) * scale_acc : 0.0f;
      st.sum_exp = st.sum_exp * scale_acc + p.sum_exp * scale_tile;
      st.sum_exp_z = q_acc + (p.sum_exp_z + (p.max - m) * p.sum_exp) * scale_tile;
      st.max = m;
      st.sum_z += p.sum_z;
      st.sum_wz += p.sum_wz;
      if (p.target_z != -std::numeric_limits<float>::infinity()) st.target_z = p.target_z;
    }
  }
  return absl::OkStatus();
}

// Gathers the other ranks' candidates (as FoldPartials does) and ranks each row's: its k best over the
// whole vocabulary, whatever the group size (Before is a total order).
absl::Status CpuEngine::RankRows(std::vector<Candidate>& cands, int64_t r0, int64_t nr, int k,
                                 const std::vector<RowFinal>& fin, const RowOutputs& out) const {
  const int64_t tiles = Tiles();
  if (collectives_ != nullptr) {
    if (absl::Status s = collectives_->AllReduce(reinterpret_cast<float*>(cands.data()), nr * tiles * k * 2,
                                                 ReduceOp::kMax, false, nullptr);
        !s.ok()) {
      return s;
    }
  }
  const float none = -std::numeric_limits<float>::infinity();
  std::vector<Candidate> top(k);
  for (int64_t r = 0; r < nr; ++r) {
    std::fill(top.begin(), top.end(), Candidate{none, none});
    const Candidate* row = cands.data() + r * tiles * k;
    for (int64_t i = 0; i < tiles * k; ++i) {
      if (row[i].id >= 0.0f) Offer(top.data(), k, row[i]);
    }
    if (out.argmax != nullptr) out.argmax[r0 + r] = static_cast<int32_t>(top[0].id);
    for (int j = 0; j < k; ++j) {
      const int64_t at = (r0 + r) * k + j;
      if (out.top_tokens != nullptr) out.top_tokens[at] = static_cast<int32_t>(top[j].id);
      if (out.top_logprobs != nullptr) out.top_logprobs[at] = top[j].z - fin[r].lse;
    }
  }
  return absl::OkStatus();
}

// Per-row outputs of rows [r0, r0+nr) from their merged statistics; fills `fin` for pass 2.
absl::Status CpuEngine::FinishRows(int64_t r0, int64_t nr, const int32_t* y, const CallMath& m,
                                   const std::vector<RowStats>& stats, const RowOutputs& out,
                                   std::vector<RowFinal>& fin) const {
  const LceOptions& o = m.o;
  const float eps = o.label_smoothing;
  const float V = static_cast<float>(shape_.vocab_size);
  fin.resize(nr);
  for (int64_t r = 0; r < nr; ++r) {
    const RowStats& st = stats[r];
    const float log_s = std::log(st.sum_exp);
    const float lse = st.max + log_s;
    if (!std::isfinite(lse) || !std::isfinite(st.sum_z)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "row ", r0 + r, ": non-finite logits (NaN or Inf in the hidden states, or overflow)"));
    }
    fin[r] = {lse, st.sum_exp_z / st.sum_exp, st.max, log_s};
    const bool ignored = y[r] == o.ignore_index;
    const float logprob = ignored ? 0.0f : st.target_z - lse;
    if (out.lse != nullptr) out.lse[r0 + r] = lse;
    if (out.logprob != nullptr) out.logprob[r0 + r] = logprob;
    if (out.entropy != nullptr) out.entropy[r0 + r] = log_s - fin[r].mean_pz_shifted;
    const float z_loss = ignored ? 0.0f : o.z_loss * lse * lse;
    if (out.z_loss != nullptr) out.z_loss[r0 + r] = z_loss;
    if (out.loss != nullptr && ignored) out.loss[r0 + r] = 0.0f;
    if (out.loss != nullptr && !ignored) {
      // w_y·(1−ε)·(lse − z_y) + ε/V·Σ_c w_c·(lse − z_c) + λ·lse² (w = 1 without class weights)
      const float smooth = m.class_weight == nullptr ? lse - st.sum_z / V : (m.weight_total * lse - st.sum_wz) / V;
      out.loss[r0 + r] = -(1.0f - eps) * m.Weight(y[r]) * logprob + eps * smooth + z_loss;
    }
  }
  return absl::OkStatus();
}

// Backward coefficients (docs/MATH.md):
//   loss:    a = g((1−ε)·w_y + ε·W/V + 2λ·lse), b = 0, c = g(1−ε)·w_y, d = g·ε/V   (0 for ignored rows;
//            w = 1 and W = V without class weights)
//   generic: a = −u + e·Σp(z−max), b = −e, c = −u, d = 0           (u = 0 for ignored rows)
std::vector<RowCoef> BackwardCoefficients(int64_t r0, int64_t nr, const int32_t* y, const CallMath& m,
                                          const Upstream& up, int64_t vocab, const std::vector<RowFinal>& fin) {
  const LceOptions& o = m.o;
  const float eps = o.label_smoothing, V = static_cast<float>(vocab);
  std::vector<RowCoef> coef(nr);
  for (int64_t r = 0; r < nr; ++r) {
    const bool ignored = y[r] == o.ignore_index;
    RowCoef& c = coef[r];
    if (up.mode == GradMode::kLoss) {
      if (ignored) continue;
      const float g = up.grad_loss != nullptr ? up.grad_loss[r0 + r] : 1.0f;
      const float w_y = m.Weight(y[r]);
      c.a = m.class_weight == nullptr
                ? g * (1.0f + 2.0f * o.z_loss * fin[r].lse)
                : g * ((1.0f - eps) * w_y + eps * m.weight_total / V + 2.0f * o.z_loss * fin[r].lse);
      c.c = g * (1.0f - eps) * w_y;
      c.d = g * eps / V;
    } else {
      const float u = (ignored || up.grad_logprob == nullptr) ? 0.0f : up.grad_logprob[r0 + r];
      const float e = up.grad_entropy != nullptr ? up.grad_entropy[r0 + r] : 0.0f;
      c.a = -u + e * fin[r].mean_pz_shifted;
      c.b = -e;
      c.c = -u;
    }
  }
  return coef;
}

// Turns the transposed logit tile z_t into dL/da in place.
void CpuEngine::GradTile(float* z_t, int64_t nr, int64_t v0, int64_t nv, const int32_t* y, const CallMath& m,
                         const std::vector<RowCoef>& coef, const std::vector<RowFinal>& fin,
                         const std::vector<RowStats>& stats) const {
  const LceOptions& o = m.o;
  const float inv_t = 1.0f / o.temperature;
  const float* w = m.class_weight != nullptr ? m.class_weight + shape_.vocab_begin + v0 : nullptr;
#pragma omp parallel for schedule(static) num_threads(threads_)
  for (int64_t v = 0; v < nv; ++v) {
    float* zv = z_t + v * kRowBlock;
    const float w_v = w != nullptr ? w[v] : 1.0f;
    for (int64_t r = 0; r < nr; ++r) {
      const RowCoef& c = coef[r];
      const float zz = zv[r];
      const float p = std::exp((zz - fin[r].max) - fin[r].log_sum_exp);
      const float dz = c.a * p + c.b * p * (zz - fin[r].max) - c.d * w_v;
      float da = dz * inv_t;
      if (o.softcap > 0.0f) {
        const float t = zz * o.temperature / o.softcap;  // tanh(a / s)
        da *= 1.0f - t * t;
      }
      zv[r] = da;
    }
  }
  const int64_t vb = shape_.vocab_begin;
  for (int64_t r = 0; r < nr; ++r) {
    const int64_t local = static_cast<int64_t>(y[r]) - vb - v0;
    if (y[r] == o.ignore_index || local < 0 || local >= nv || coef[r].c == 0.0f) continue;
    float dcorr = -coef[r].c * inv_t;
    if (o.softcap > 0.0f) {
      const float t = stats[r].target_z * o.temperature / o.softcap;  // z was overwritten
      dcorr *= 1.0f - t * t;
    }
    z_t[local * kRowBlock + r] += dcorr;
  }
}

// dB_tile[v] += Σ_r dA_t[v, r], each element summing the rows in order (the same order whatever the
// chunking: a fresh one starts from 0 at the call's first block).
void AddBiasGrad(const float* dA_t, int64_t nr, int64_t nv, float* d_bias, bool fresh) {
  for (int64_t v = 0; v < nv; ++v) {
    float acc = fresh ? 0.0f : d_bias[v];
    for (int64_t r = 0; r < nr; ++r) acc += dA_t[v * kRowBlock + r];
    d_bias[v] = acc;
  }
}

// Adds a tile's node to the stack of subtrees (tile_tree.h), summing siblings' values.
void PushTile(std::vector<TreeNode>& stack, TreeNode node) {
  PushTreeNode(stack, std::move(node), [](TreeNode& left, TreeNode& right) {
    for (size_t i = 0; i < left.value.size(); ++i) left.value[i] += right.value[i];
  });
}

// Canonical sum of subtree (level, index) into `out` from the subtrees held; false when it covers
// no tile of the head.
bool SumSubtree(const std::vector<TreeNode>& held, int level, int64_t index, int64_t tiles,
                std::vector<float>& out) {
  if ((index << level) >= tiles) return false;
  for (const TreeNode& n : held) {
    if (n.level == level && n.index == index) {
      out = n.value;
      return true;
    }
  }
  SumSubtree(held, level - 1, 2 * index, tiles, out);
  std::vector<float> right;
  if (SumSubtree(held, level - 1, 2 * index + 1, tiles, right)) {
    for (size_t i = 0; i < out.size(); ++i) out[i] += right[i];
  }
  return true;
}

// d_hidden_t of the whole head into ws.dh_t: the ranks' subtrees gathered (each rank fills its
// slots, −inf elsewhere, and a max all-reduce copies them), then summed over the canonical tree:
// the same additions in the same order for any group size.
absl::Status CpuEngine::CombineDHidden(std::vector<TreeNode> own, int64_t cols, Workspace& ws) const {
  std::vector<TreeNode> held = std::move(own);
  if (collectives_ != nullptr) {
    const int64_t node_floats = shape_.hidden_size * cols;
    std::vector<TreeNode> all;
    int64_t mine = 0;  // where this rank's subtrees start in `all` (same order as `held`)
    for (int r = 0; r < collectives_->world_size(); ++r) {
      if (r == collectives_->rank()) mine = static_cast<int64_t>(all.size());
      for (const TileTreeNode& n : RankSubtrees(shape_.vocab_size, r, collectives_->world_size())) {
        all.push_back({n.level, n.index, {}});
      }
    }
    std::vector<float> buf(all.size() * node_floats, -std::numeric_limits<float>::infinity());
    for (size_t i = 0; i < held.size(); ++i) {
      std::copy(held[i].value.begin(), held[i].value.end(), buf.begin() + (mine + i) * node_floats);
    }
    if (absl::Status s = collectives_->AllReduce(buf.data(), static_cast<int64_t>(buf.size()),
                                                 ReduceOp::kMax, false, nullptr);
        !s.ok()) {
      return s;
    }
    for (size_t i = 0; i < all.size(); ++i) {
      all[i].value.assign(buf.begin() + i * node_floats, buf.begin() + (i + 1) * node_floats);
    }
    held = std::move(all);
  }
  SumSubtree(held, TileTreeRootLevel(Tiles()), 0, Tiles(), ws.dh_t);
  return absl::OkStatus();
}

// Pass 2 over the shard's vocabulary for one block: d_hidden (written) and dW (accumulated).
absl::Status CpuEngine::BackwardBlock(Workspace& ws, int64_t r0, int64_t nr, const int32_t* y, const CallMath& m,
                                      const std::vector<RowCoef>& coef, const std::vector<RowFinal>& fin,
                                      const std::vector<RowStats>& stats, const GradOutputs& grads) {
  const int64_t H = shape_.hidden_size;
  const int64_t cols = BlockColumns(nr);
  std::vector<TreeNode> subtrees;
  for (int64_t v0 = 0; v0 < shape_.shard_rows; v0 += Tile()) {
    const int64_t nv = std::min(Tile(), shape_.shard_rows - v0);
    LogitTile(ws, cols, v0, nv, m.o, ws.z_t.data());
    GradTile(ws.z_t.data(), nr, v0, nv, y, m, coef, fin, stats);
    // This tile's d_hidden_t[H, r] = W_tileᵀ[H, nv] · dA_t[nv, r], each element summed in order.
    // [H, cols], not [H, kRowBlock]: a call of a few rows zeroes and adds its tiles' nodes at its own width.
    TreeNode node{0, TileIndex(v0), std::vector<float>(H * cols, 0.0f)};
    cpu::FixedOrderGemm(H, cols, nv, {w_.data() + v0 * H, 1, H}, ws.z_t.data(), kRowBlock,
                        node.value.data(), cols, /*accumulate=*/false, threads_);
    PushTile(subtrees, std::move(node));
    if (grads.d_bias != nullptr) AddBiasGrad(ws.z_t.data(), nr, nv, grads.d_bias + v0, grads.d_weight_fresh && r0 == 0);
    // dW_tile[nv, H] += dA_t[nv, rows] · h[rows, H]: each element sums the rows in order.
    if (grads.d_weight != nullptr) {
      // A fresh d_weight is written by the first block (each element's sum starts from 0 either way).
      cpu::FixedOrderGemm(nv, H, nr, {ws.z_t.data(), kRowBlock, 1}, ws.h.data(), H,
                          grads.d_weight + v0 * H, H, /*accumulate=*/!(grads.d_weight_fresh && r0 == 0), threads_);
    }
  }
  if (absl::Status s = CombineDHidden(std::move(subtrees), cols, ws); !s.ok()) return s;
  if (grads.d_hidden == nullptr) return absl::OkStatus();
  for (int64_t r = 0; r < nr; ++r) {
    for (int64_t k = 0; k < H; ++k) ws.dh[r * H + k] = ws.dh_t[k * cols + r];
  }
  ConvertFromFloat(ws.dh.data(), nr * H, shape_.dtype,
                   static_cast<uint8_t*>(grads.d_hidden) + r0 * H * DTypeSize(shape_.dtype));
  return absl::OkStatus();
}

// Pass 1 for one block: logit tiles into partials (and ranking candidates), folded over the group;
// the block's per-row outputs; `stats` and `fin` for pass 2.
absl::Status CpuEngine::ForwardBlock(Workspace& ws, const RowsView& rows, int64_t r0, int64_t nr, const CallMath& m,
                                     const RowOutputs& out, std::vector<RowStats>& stats, std::vector<RowFinal>& fin) {
  const int32_t* y = rows.targets + r0;
  const int k = m.o.top_k;
  LoadRows(rows, r0, nr, BlockColumns(nr), ws);
  const float none = -std::numeric_limits<float>::infinity();
  std::vector<TilePartial> parts(nr * Tiles(), TilePartial{none, none, none, none, none, none});
  std::vector<Candidate> cands(k > 0 ? nr * Tiles() * k : 0, Candidate{none, none});
  for (int64_t v0 = 0; v0 < shape_.shard_rows; v0 += Tile()) {
    const int64_t nv = std::min(Tile(), shape_.shard_rows - v0);
    LogitTile(ws, BlockColumns(nr), v0, nv, m.o, ws.z_t.data());
    TilePartials(ws.z_t.data(), nr, v0, nv, y, m, parts);
    if (k > 0) TileCandidates(ws.z_t.data(), nr, v0, nv, k, cands);
  }
  if (absl::Status s = FoldPartials(parts, nr, stats); !s.ok()) return s;
  if (absl::Status s = FinishRows(r0, nr, y, m, stats, out, fin); !s.ok()) return s;
  return k > 0 ? RankRows(cands, r0, nr, k, fin, out) : absl::OkStatus();
}

absl::Status CpuEngine::Compute(const RowsView& rows, const LceOptions& o, const Upstream& up,
                                const RowOutputs& out, const GradOutputs& grads) {
  if (absl::Status s = CheckCall(rows, o); !s.ok()) return s;
  if (absl::Status s = ValidateOutputs(o, out); !s.ok()) return s;
  if (grads.d_bias != nullptr && (!shape_.has_bias || grads.d_weight == nullptr)) {
    return absl::InvalidArgumentError("d_bias goes with d_weight, for a head with a bias");
  }
  std::lock_guard<std::mutex> lock(mu_);
  const bool backward = up.mode != GradMode::kNone;
  if (grads.d_weight != nullptr && grads.d_weight_fresh && (!backward || rows.rows == 0)) {
    std::fill(grads.d_weight, grads.d_weight + shape_.shard_rows * shape_.hidden_size, 0.0f);  // no block writes it
    if (grads.d_bias != nullptr) std::fill(grads.d_bias, grads.d_bias + shape_.shard_rows, 0.0f);
  }
  if (ws_ == nullptr) ws_ = std::make_unique<Workspace>(shape_.hidden_size, Tile());
  float weight_total = static_cast<float>(shape_.vocab_size);
  if (rows.class_weight != nullptr) {
    double total = 0.0;  // once a call, in id order: the same W for any group size
    for (int64_t c = 0; c < shape_.vocab_size; ++c) total += rows.class_weight[c];
    weight_total = static_cast<float>(total);
  }
  const CallMath m{o, rows.class_weight, weight_total};
  std::vector<RowStats> stats;
  std::vector<RowFinal> fin;
  for (int64_t r0 = 0; r0 < rows.rows; r0 += kRowBlock) {
    const int64_t nr = std::min(kRowBlock, rows.rows - r0);
    if (absl::Status s = ForwardBlock(*ws_, rows, r0, nr, m, out, stats, fin); !s.ok()) return s;
    if (!backward) continue;
    const std::vector<RowCoef> coef = BackwardCoefficients(r0, nr, rows.targets + r0, m, up, shape_.vocab_size, fin);
    if (absl::Status s = BackwardBlock(*ws_, r0, nr, rows.targets + r0, m, coef, fin, stats, grads); !s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<LceEngine>> CreateCpuEngine(std::shared_ptr<const HeadWeights> weights,
                                                           const EngineConfig& config) {
  const int64_t tile = VocabTile(weights->shape.vocab_size);
  if (weights->shape.vocab_begin % tile != 0 ||
      (weights->shape.vocab_end() % tile != 0 && weights->shape.vocab_end() != weights->shape.vocab_size)) {
    return absl::InvalidArgumentError(absl::StrCat("head shard [", weights->shape.vocab_begin, ", ",
                                                   weights->shape.vocab_end(), ") is not made of whole ",
                                                   tile, "-row vocabulary tiles"));
  }
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
