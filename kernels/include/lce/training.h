// Training the head: AdamW on fp32 master weights (the host loop, and HeadTrainer: a head shard's
// gradient and optimizer state where its engine computes, with a CPU and a CUDA implementation of the
// same math), and the per-token RL policy loss (clipped surrogate, entropy bonus, KL penalty) with its
// gradients with respect to the logprob and entropy the engine produced. Formulas: docs/MATH.md.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "lce/engine.h"

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

// The per-step constants of that update, computed once on the host for both implementations (so that
// the CPU loop and the CUDA kernel do the same fp32 operations): step_size = lr / (1 − β1^t),
// bc2_sqrt = sqrt(1 − β2^t), decay = 1 − lr·wd.
struct AdamWCoefficients {
  float step_size = 0, bc2_sqrt = 1, decay = 1;
};
AdamWCoefficients AdamWCoefficientsAt(const AdamWParams& p, int64_t step);

// Σ grad² in double, summed in a fixed order (fixed blocks, then the blocks in order): the same bits
// whatever the thread count.
double SquaredNorm(const float* grad, int64_t n);

// The AdamW gradient scale of global-norm clipping (as torch.nn.utils.clip_grad_norm_):
// min(1, max_grad_norm / (norm + 1e-6)) when max_grad_norm > 0, else 1.
float ClipScale(double norm, float max_grad_norm);

// ‖dW‖² with the same bits however the head is sharded: each vocabulary tile's Σ dW² (tiles of
// VocabTile rows at fixed global offsets; a shard holds whole tiles) in float64 in a fixed order, sent
// between ranks as two fp32 halves (hi = fp32(s), lo = fp32(s − hi)) in a slot of its own of a vector
// over every tile of the head (2·VocabTileCount floats, one all-reduce), then hi + lo of every tile
// summed in global tile order.
struct TileSquaredNorms {
  int64_t first_tile = 0;    // global index of the shard's first tile
  std::vector<double> sums;  // one a tile of the shard, in order
};
// The tiles a shard overlaps: tile first_tile + i is the shard's rows [RowBegin(i), RowEnd(i)).
struct ShardTiles {
  int64_t first_tile = 0, count = 0, tile_rows = 1, vocab_begin = 0, shard_rows = 0;
  int64_t RowBegin(int64_t i) const { return std::max<int64_t>(0, (first_tile + i) * tile_rows - vocab_begin); }
  int64_t RowEnd(int64_t i) const { return std::min(shard_rows, (first_tile + i + 1) * tile_rows - vocab_begin); }
};
ShardTiles TilesOf(const HeadShape& shape);
// Writes the shard's tiles into their slots of `exchange` (leaves the others as they are: zero them).
void PackTileSquaredNorms(const TileSquaredNorms& tiles, float* exchange);
// Σ over the head's `tiles` tiles, in order, of hi + lo.
double CombineTileSquaredNorms(const float* exchange, int64_t tiles);

// Builds the engine of a new weight (the CPU trainer's next version).
using EngineMaker = std::function<absl::StatusOr<std::shared_ptr<LceEngine>>(std::shared_ptr<const HeadWeights>)>;

// A dW-sized fp32 buffer in a trainer's memory (host or device), freed when destroyed.
class GradBuffer {
 public:
  virtual ~GradBuffer() = default;
  virtual float* data() = 0;
};

// The gradient dW and the AdamW state of one head shard, kept where the shard's engine computes: host
// memory for the CPU engine, device memory for the CUDA engine (dW accumulated in place on the GPU,
// the step a kernel). Both do the same fp32 math (AdamWStep). Not thread-safe: the caller serialises
// every call here. The master weights and moments are made at the first step, from the current weight.
//
// Requests never accumulate into dW itself: each gets a pending buffer of its own (AcquirePending),
// and its contribution reaches dW only when committed with the upstream gradient's scale
// (docs/MATH.md, "When dW is committed"). A request that fails, a forward that is never
// backpropagated, a contribution that expires: its buffer is released and dW is untouched.
class HeadTrainer {
 public:
  virtual ~HeadTrainer() = default;
  // "cpu" or "cuda".
  virtual std::string_view backend() const = 0;
  // The gradient of the shard's parameters, fp32, in grad_space(): dW [shard_rows, hidden], then, for a
  // head with a bias, dB [shard_rows] (grad_elements() floats; every buffer here has that layout, and
  // the optimizer steps both). A caller may write through it (a data-parallel all-reduce), so it is no
  // longer known to be zero afterwards.
  float* grad() {
    grad_zero_ = false;
    return grad_->data();
  }
  virtual MemorySpace grad_space() const = 0;
  int64_t weight_elements() const { return shape_.shard_rows * shape_.hidden_size; }
  int64_t grad_elements() const { return weight_elements() + (shape_.has_bias ? shape_.shard_rows : 0); }
  // Where dB starts in a gradient buffer (null without a bias).
  float* BiasPart(float* buffer) const { return shape_.has_bias ? buffer + weight_elements() : nullptr; }
  // The cudaStream_t grad() is ordered on (null on the host), for collectives over it (e.g. a
  // data-parallel all-reduce of dW before a step). Every call here is complete when it returns.
  virtual void* stream() = 0;
  const HeadShape& shape() const { return shape_; }
  int64_t steps() const { return steps_; }

  absl::Status ZeroGrad();

  // The pending buffer of contribution `id` (> 0), for GradOutputs::d_weight of the engine calls of
  // one request: all zeros when first handed out, or, with `zeroed` false, undefined (the request's
  // first engine call then writes it: GradOutputs::d_weight_fresh); the same buffer for the same id
  // after that. A freed buffer is kept for the next contribution (one spare), so a loop of forwards
  // and backwards allocates nothing. RESOURCE_EXHAUSTED when the memory is not there.
  absl::StatusOr<float*> AcquirePending(uint64_t id, bool zeroed = true);
  // dW += scale × pending(id), in fp32, then the buffer is freed. Into a dW known to be zero with
  // scale 1 the buffer becomes dW (no pass over memory); scale 0 adds nothing. NOT_FOUND: no such id.
  absl::Status CommitPending(uint64_t id, float scale);
  // Frees pending(id) without touching dW; an unknown id is a no-op.
  void ReleasePending(uint64_t id);
  int64_t pending_count() const { return static_cast<int64_t>(pending_.size()); }
  // Memory held by pending buffers and the spare.
  int64_t pending_bytes() const {
    return (pending_count() + (spare_ != nullptr ? 1 : 0)) * grad_elements() * static_cast<int64_t>(sizeof(float));
  }

  // Σ dW² of each tile of this shard, in float64, in a fixed order (the CPU's and the GPU's differ).
  virtual absl::StatusOr<TileSquaredNorms> GradTileSquaredNorms() = 0;
  // ‖dW‖² of this shard as a group combines the tiles (a head of one rank: its global squared norm).
  absl::StatusOr<double> GradSquaredNorm();
  // Rows [first_row, first_row + rows) of this shard's dW into host memory.
  absl::Status CopyGrad(int64_t first_row, int64_t rows, float* host);
  // This shard's dB [shard_rows] into host memory (FAILED_PRECONDITION: the head has no bias).
  absl::Status CopyBiasGrad(float* host);
  // The same of pending contribution `id` (NOT_FOUND: none), and its buffer (grad_space()).
  absl::Status CopyPending(uint64_t id, int64_t first_row, int64_t rows, float* host);
  absl::StatusOr<float*> FindPending(uint64_t id);
  // Makes the AdamW state (fp32 masters from the current weight, zero moments) unless it exists: a
  // step that cannot have it fails here, before anything changes. Step calls it too.
  virtual absl::Status PrepareStep() = 0;
  // One AdamW step with g = dW·grad_scale. The new serving weight (the masters rounded to the dtype)
  // is written in the same pass; returns the engine that serves it: the same CUDA engine (its weight
  // rewritten in place, so no call may run on it meanwhile) or a new CPU engine.
  virtual absl::StatusOr<std::shared_ptr<LceEngine>> Step(const AdamWParams& p, float grad_scale) = 0;
  // Serves `weights` (this shard's rows) instead, e.g. a trainer's update: the master weights follow,
  // the moments and the step count stay. Returns the serving engine, as Step.
  virtual absl::StatusOr<std::shared_ptr<LceEngine>> SetWeight(std::shared_ptr<const HeadWeights> weights) = 0;
  // The current weight in host memory (SaveHead, clones).
  virtual absl::StatusOr<std::shared_ptr<const HeadWeights>> Weights() = 0;

 protected:
  explicit HeadTrainer(const HeadShape& shape) : shape_(shape) {}
  // The backend's memory primitives over dW-sized buffers: a new one (contents undefined), all zeros,
  // x *= s, and y += s·x (each element fp32(y + fp32(s·x))). Complete when they return.
  virtual absl::StatusOr<std::unique_ptr<GradBuffer>> NewGradBuffer() = 0;
  virtual absl::Status Zero(float* x) = 0;
  virtual absl::Status Scale(float* x, float s) = 0;
  virtual absl::Status AddScaled(float* y, const float* x, float s) = 0;
  // Rows of a dW-sized buffer into host memory (checked to lie in the shard).
  virtual absl::Status CopyRows(const float* buffer, int64_t first_row, int64_t rows, float* host) = 0;
  // Elements [first, first + n) of a gradient buffer into host memory.
  virtual absl::Status CopyElements(const float* buffer, int64_t first, int64_t n, float* host) = 0;
  // dW's own buffer, for the backend's use (grad() marks it possibly non-zero). Made by the backend.
  float* grad_data() { return grad_->data(); }

  HeadShape shape_;
  int64_t steps_ = 0;
  std::unique_ptr<GradBuffer> grad_;

 private:
  std::map<uint64_t, std::unique_ptr<GradBuffer>> pending_;
  std::unique_ptr<GradBuffer> spare_;  // a freed pending buffer, kept for the next
  bool spare_zero_ = false;            // ...and known to be all zeros (a dW swapped out after ZeroGrad)
  bool grad_zero_ = false;             // dW known to be all zeros: ZeroGrad's, until anything else
};

// A trainer for `engine` (a CPU or CUDA engine, by its backend()) serving `weights`. `make_engine`
// builds the CPU engine's new versions (unused by the CUDA trainer, which writes the weight in place).
absl::StatusOr<std::unique_ptr<HeadTrainer>> CreateHeadTrainer(std::shared_ptr<LceEngine> engine,
                                                               std::shared_ptr<const HeadWeights> weights,
                                                               EngineMaker make_engine);

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
