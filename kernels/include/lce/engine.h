// The fused linear-cross-entropy engine: one interface, a CPU and a CUDA backend with identical
// semantics (docs/MATH.md). Knows nothing of gRPC; errors come back as absl::Status.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "lce/collectives.h"
#include "lce/cuda_tuning.h"
#include "lce/head.h"

namespace lce {

// Options of the math (docs/MATH.md). Validated by ValidateOptions before any engine call.
struct LceOptions {
  float temperature = 1.0f;     // T > 0
  float softcap = 0.0f;         // s >= 0; 0 = off
  float label_smoothing = 0.0f; // eps in [0, 1); used by the loss only
  float z_loss = 0.0f;          // lambda, finite (usually >= 0); used by the loss only
  int32_t ignore_index = -100;
  bool allow_tf32 = false;      // fp32 heads on CUDA only
  // The call ranks each row's top_k most probable tokens (RowOutputs::argmax, top_tokens,
  // top_logprobs); 0 = no ranking. In [0, kMaxTopK]. An option, not only an output, because a
  // group's ranks all take part in the ranking's exchange.
  int32_t top_k = 0;
};

inline constexpr int32_t kMaxTopK = 64;

absl::Status ValidateOptions(const LceOptions& options);

struct RowOutputs;
// The outputs a call asks for against its options (rankings need top_k >= 1).
absl::Status ValidateOutputs(const LceOptions& options, const RowOutputs& outputs);

// Where the pointers of one Compute call live. Every pointer of a call lives in the same place.
enum class MemorySpace : uint8_t { kHost, kDevice };

// A block of rows to score. hidden is [rows, hidden_size] row-major in the head's dtype.
struct RowsView {
  const void* hidden = nullptr;
  const int32_t* targets = nullptr;  // [rows]: in [0, vocab) or ignore_index
  int64_t rows = 0;
  MemorySpace space = MemorySpace::kHost;
  // The caller has checked every target (in [0, vocab) or ignore_index): the engine need not, which
  // on a GPU saves a kernel and a host round trip a call. Unchecked out-of-range targets with this
  // set are undefined behaviour.
  bool targets_checked = false;
  // Class weights w [vocab_size] (global ids, finite) in the rows' memory space, or null (all 1):
  // the loss of a row is PyTorch's CrossEntropyLoss(weight=w) term (docs/MATH.md, "Class weights").
  const float* class_weight = nullptr;
};

// Which gradient, if any, a call computes.
enum class GradMode : uint8_t {
  kNone,     // forward only
  kLoss,     // d/dh of sum_i g_i * loss_i          (g_i = grad_loss[i], or 1 when null)
  kGeneric,  // d/dh of sum_i u_i*logprob_i + e_i*entropy_i   (null arrays mean zeros)
};

struct Upstream {
  GradMode mode = GradMode::kNone;
  const float* grad_loss = nullptr;      // kLoss: [rows] or null (all ones)
  const float* grad_logprob = nullptr;   // kGeneric: [rows] or null
  const float* grad_entropy = nullptr;   // kGeneric: [rows] or null
};

// Per-row fp32 outputs; a null pointer means "not wanted". Rows whose target is ignore_index get
// logprob 0 and loss 0; their lse and entropy are still computed.
struct RowOutputs {
  float* logprob = nullptr;
  float* entropy = nullptr;
  float* lse = nullptr;
  float* loss = nullptr;
  // z_loss·lse² (0 for ignored rows): the z-loss part of loss.
  float* z_loss = nullptr;
  // Rankings; need LceOptions::top_k >= 1. argmax [rows]: the most probable token (the lowest id
  // among equal logits), for every row, ignored ones too. top_tokens / top_logprobs [rows, top_k]:
  // the top_k most probable tokens, most probable first (equal logits: lower id first), and their
  // logprobs z - lse.
  int32_t* argmax = nullptr;
  int32_t* top_tokens = nullptr;
  float* top_logprobs = nullptr;
};

// Gradient outputs; null means "not wanted".
struct GradOutputs {
  void* d_hidden = nullptr;   // [rows, hidden_size] in the head's dtype (overwritten)
  float* d_weight = nullptr;  // [shard_rows, hidden_size] fp32, ACCUMULATED into (+=)
  // The trainer's pending contribution d_weight belongs to (HeadTrainer::AcquirePending), for
  // engines that pass the call on to a group's other ranks, which accumulate into theirs.
  uint64_t d_weight_pending = 0;
  // d_weight's contents are undefined (a pending buffer handed out unzeroed): the call writes its dW
  // there (=) instead of adding to it, every element, which saves zeroing the buffer and reading it
  // in the first product. Undefined again when the call fails.
  bool d_weight_fresh = false;
  // dB [shard_rows] fp32 of a head with a bias, accumulated (fresh: written) with d_weight: the
  // trainer's buffers hold it after dW (HeadTrainer::grad_elements).
  float* d_bias = nullptr;
};

// The per-row outputs ("logprob", "entropy", "lse", "loss", "d_hidden", "d_weight") whose bits do
// not depend on a factor (DESIGN.md, "Guarantees"); what an engine does not list may differ in
// rounding.
struct EngineInvariance {
  // The other rows of a call, their number, and so the chunking, the streams and the transport.
  std::vector<std::string> across_batches;
  // The size of the tensor-parallel group the head is sharded over.
  std::vector<std::string> across_tp_sizes;
};

struct EngineConfig {
  // Upper bound on scratch memory (logit tiles, converted inputs), whatever the row count.
  int64_t workspace_bytes = int64_t{1} << 30;
  // CUDA device ordinal (CUDA backend).
  int device = 0;
  // Threads of the CPU backend; 0 = hardware concurrency.
  int cpu_threads = 0;
  // CUDA backend (the CPU backend is invariant by construction). batch_invariant: the logit-tile
  // path's GEMMs run one algorithm for every row count, so a row's results are the same bits in any
  // batch (the epilogue GEMM's path always is); off by default: 5-13% at some train shapes, up to 1.7x
  // on 64-row calls. tp_invariant (on the epilogue GEMM's path, or with batch_invariant): groups fold
  // their statistics in global segment order, take the fast loss path's c_row from the head's first
  // columns and sum d_hidden's leaves (leaf_plan.h) in fixed point, so logprob, entropy, lse, loss
  // and d_hidden are one GPU's bits in groups of 2 and 4 (V >= 98304); on by default: nothing on one
  // GPU, within the spread of a TP-2 train step (bench/RESULTS.md). CudaTuning's batch_invariant / tp_invariant
  // (LCE_CUDA_BATCH_INVARIANT / LCE_CUDA_TP_INVARIANT) override them.
  bool batch_invariant = false;
  bool tp_invariant = true;
  // CUDA backend's tuning (lce/cuda_tuning.h), taken at Init; unset: CudaTuningFromEnv().
  std::optional<CudaTuning> cuda_tuning;
  // Tensor parallelism: collectives over the ranks that hold the other vocabulary shards. Null
  // when the head is not sharded. Not owned; must outlive the engine.
  Collectives* collectives = nullptr;
  // Tensor parallelism: only rank 0's row outputs and d_hidden are read (a server's group, whose front
  // answers). The CUDA engine then sums d_hidden into rank 0 alone (Collectives::ReduceSumToRoot) and
  // leaves the other ranks' d_hidden as it was.
  bool rank0_outputs = false;
};

// Memory an engine holds (device memory for CUDA, host memory for the CPU backend).
struct EngineMemory {
  int64_t weights_bytes = 0;    // the head shard and any copy of it
  int64_t workspace_bytes = 0;  // scratch currently allocated
};

class LceEngine {
 public:
  virtual ~LceEngine() = default;

  // "cpu" or "cuda".
  virtual std::string_view backend() const = 0;
  virtual const HeadShape& shape() const = 0;
  // For metrics; engines that do not track it report zeros.
  virtual EngineMemory memory() const { return {}; }
  // What this engine guarantees bit for bit (GetInfo reports it).
  virtual EngineInvariance invariance() const = 0;

  // One block of rows: forward always; the gradient selected by upstream.mode. Thread-safe
  // (calls are serialised internally). Returns INVALID_ARGUMENT for bad shapes, targets out of
  // range, or non-finite logits (NaN/Inf in the hidden states), naming the first bad row.
  virtual absl::Status Compute(const RowsView& rows, const LceOptions& options,
                               const Upstream& upstream, const RowOutputs& outputs,
                               const GradOutputs& grads) = 0;
};

enum class Backend : uint8_t { kCpu, kCuda, kAuto };

absl::StatusOr<Backend> ParseBackend(std::string_view name);

// True when this build has the CUDA backend and a CUDA device is visible.
bool CudaAvailable();

// Builds an engine over `weights` (kept alive by the engine). kAuto picks CUDA when available.
absl::StatusOr<std::unique_ptr<LceEngine>> CreateEngine(Backend backend,
                                                        std::shared_ptr<const HeadWeights> weights,
                                                        const EngineConfig& config);

}  // namespace lce
