// Internal: what the CUDA engine decides once for a call (CallPlan) and for each row block (BlockIo).
// A call runs as phases over them (cuda_engine.cc, CudaEngine::Compute): plan, stage, forward, merge,
// finalize, backward, copy out.
#pragma once

#include <cstdint>

#include "cuda/kernels.h"
#include "cuda/workspace.h"
#include "lce/engine.h"

namespace lce::cuda {

// Rankings on the epilogue GEMM's path (engine_rankings.cc): each row's list of candidates [cap] of
// (v, id) with its count, the threshold a first pass over `sample` columns set, and the rows whose
// lists overflowed (taken by the fallback). For k = 1 none of these: the GEMM writes each row's argmax
// of every tile into tile_arg [rows, ntile] instead. Device rows over several blocks take the first pass
// once for the whole call (call_*: every row's sample list [rows, call_cap] and count, then thresholds);
// a block then reads its rows' thresholds from call_thr.
struct RankLists {
  int32_t* tile_arg = nullptr;
  float* list = nullptr;
  unsigned* count = nullptr;
  float* thr = nullptr;
  uint8_t* overflowed = nullptr;
  int64_t cap = 0;
  int64_t sample = 0;
  float* call_list = nullptr;
  unsigned* call_count = nullptr;
  float* call_thr = nullptr;
  int64_t call_cap = 0;
};

struct CallPlan {
  // The call's arguments.
  const RowsView& rows;
  const LceOptions& o;
  const Upstream& up;
  const RowOutputs& out;
  const GradOutputs& grads;
  // ZeroFreshDWeight: the first row block's dW products write d_weight (beta 0).
  bool dw_fresh = false;
  // PlanCall.
  bool host = false;          // rows in host memory: staged through pinned memory and s.hidden
  bool backward = false;      // a gradient is wanted and has somewhere to go
  bool entropy = false;       // the epilogue GEMM computes Q (the entropy's statistic)
  bool fast = false;          // the fast loss path (fast_grad.cu), unless a block's logits overflow it
  bool target_apart = false;  // bf16 general path: the target's term kept out of the bf16 dA
  bool dh_chunks = false;     // d_hidden's product over the leaves (DHiddenProduct), its partials after the scratch
  ScratchLayout layout;
  int64_t R = 0;              // rows a block
  int64_t tile = 0, ldz = 0;  // logit tile columns and their leading dimension
  int debug_skip = 0;         // CudaTuning::debug_skip
  LogitTransform tf;
  // PrepareCall.
  const float* class_weight = nullptr;  // [V] on the device (host rows': copied to class_weight_)
  const float* smoothing_u = nullptr;   // class weights with label smoothing: [Σ w_j W_j | Σ w_j b_j | Σ w_j]
  float* d_bias = nullptr;              // dB on the device: the caller's, or host rows' copy in bias_grad_
  // Rankings (top_k > 0): a block's candidates [R, rank_slots, k] (this rank's from slot rank_slot0), and
  // host rows' outputs staged on the device (argmax [R], then top tokens and logprobs [R, k]).
  float* cand = nullptr;
  int64_t rank_slots = 0, rank_slot0 = 0;
  uint8_t* rank_out = nullptr;
  RankLists ranks;                         // the epilogue GEMM's path
  bool targets_pending = false;            // device rows' targets: read with block 0's flags
  unsigned long long* bad_host = nullptr;  // host rows: the flags' copy in pinned memory
};

// One row block's inputs and outputs, on the device (host rows: their staged copies).
struct BlockIo {
  int64_t r0 = 0, nr = 0;
  float dw_beta = 1.0f;  // 0 where the block writes a fresh d_weight
  bool trace = false;    // CudaTuning::trace, first block
  bool fast = false;     // this block on the fast loss path
  const void* h = nullptr;
  const int32_t* y = nullptr;
  const float* gl = nullptr;
  const float* glp = nullptr;
  const float* ge = nullptr;
  float* o_logprob = nullptr;
  float* o_entropy = nullptr;
  float* o_lse = nullptr;
  float* o_loss = nullptr;
  float* o_z_loss = nullptr;
};

}  // namespace lce::cuda
