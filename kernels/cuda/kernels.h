// Host-side launchers of the CUDA backend's kernels (one kernel family per .cu file). Every launcher
// checks its arguments' shapes on the host, launches on `stream`, checks the launch, and returns an
// absl::Status. Pointers are device pointers unless said otherwise.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "lce/head.h"

namespace lce::cuda {

// Columns of one reduction segment: the softmax statistics are kept per (row, segment) and merged.
// Vocabulary tiles are whole multiples of it. 1536 = 8 × 192 = 6 × 256 = 12 × 128: every epilogue GEMM
// configuration's column tiles divide it.
inline constexpr int kSegment = 1536;

// Per-row record kept between the forward and the backward (floats, kRowInfo per row):
// global max m, log S = lse − m, and the backward coefficients A, B, C, D of
//   dL/dz_ij = A_i·p_ij + B_i·p_ij·(z_ij − m_i) − C_i·1[j = y_i] − D_i,   p_ij = exp((z_ij − m_i) − log S_i).
// log S, not lse: exp(z − lse) of fp32 z and lse cancels their magnitude, and lse = m + log S rounded
// at |lse| ~ 2.7e3 is off by up to 1.2e-4 (half an ulp): that much relative error in every p, more than
// the logit GEMM's own rounding causes (CudaTest.ExtremeLogits, fp32: d_hidden 1.2e-4 from float64 on
// the H200; a CPU replica of these kernels' fp32 arithmetic gives 1.2e-4 that way and 1.4e-5 this way,
// as much as float64 from the fp32-rounded logits). z − m comes from the stored z − m_group plus
// m_group − m (exact near the row max), and log S is small.
inline constexpr int kRowInfo = 8;
// Fast loss path (StoreMode::kExpBf16): dL/da_ij = s_i·exp(z_ij − c_i) − t_i·1[j = y_i], with
// s_i = A_i·exp((c_i − m_i) − log S_i)/T in kInfoScale and t_i = C_i/T in kInfoTarget. The general path
// of a bf16 head (FinalizeArgs::target_apart) keeps its target term apart the same way: s_i = 1 and
// t_i = C_i·f_i/T (f_i = 1 − tanh² of the target's logit with a softcap, else 1), added in fp32 around
// the products where the copy in bf16 would round it with the rest.
enum RowInfoSlot : int {
  kInfoMax = 0, kInfoLogS = 1, kInfoA = 2, kInfoB = 3, kInfoC = 4, kInfoD = 5, kInfoScale = 6, kInfoTarget = 7
};

// Per-row packed partials summed across ranks: S, Q, Σz, z_y.
inline constexpr int kPacked = 4;

// a -> z: z = (softcap > 0 ? softcap·tanh(a/softcap) : a) · inv_temperature, a = logit + bias.
struct LogitTransform {
  const float* bias = nullptr;  // shard bias (indexed by shard column) or null
  float softcap = 0.0f;
  float temperature = 1.0f;
  // Class weights indexed by shard column, or null. Set, the statistics' Σz is Σ_j w_j z_j: class weights
  // with label smoothing and a softcap, and only then (without one the sum comes from z's linearity in h).
  const float* sum_weight = nullptr;
};

// What TileStats keeps of z for the backward.
enum class StoreMode : int {
  kShiftedHalf = 0,   // fp16 z − m_segment (16-bit heads, general path)
  kShiftedFloat = 1,  // fp32 z − m_segment (fp32 heads)
  kExpBf16 = 2,       // bf16 exp(z − c_row), c_row = max of the row's first segment + kExpLift
};

// tile_stats.cu. Reduces the fp32 logit tile `logits` [rows, nv] (leading dimension ldz, a multiple
// of 4) holding shard columns [v0, v0 + nv) (v0 a multiple of kSegment) to per-(row, segment)
// partials part[(r·nseg + v0/kSegment + s)·4 + {0,1,2,3}] = (m, S, Q, Σz) of z, writes z_y into
// packed[r·kPacked + 3] for rows whose target lies in the tile, and, when `store` is not null, writes
// into store[r·lds + v0 + c] what `mode` says. kExpBf16: the launch holding shard column 0 must hold
// only segment 0 (it writes row_c[r]); later launches read row_c and set *overflow = 1 when a
// segment's max exceeds c_row by more than kExpHeadroom (exp could overflow the products); *overflow
// holds the bits of 1.0f then, so that ranks can all-reduce it as a float (max).
// c_row = (max of the row's first segment) + kExpLift, so that a row max up to kExpLift + kExpHeadroom
// above the first segment's still fits, and e^{c − lse} stays far from fp32/bf16 underflow.
inline constexpr float kExpHeadroom = 60.0f;
inline constexpr float kExpLift = 30.0f;
absl::Status LaunchTileStats(const float* logits, int64_t ldz, int64_t rows, int64_t v0, int64_t nv,
                             const LogitTransform& tf, const int32_t* targets, int32_t ignore_index,
                             int64_t vocab_begin, float* part, int64_t nseg, float* packed, void* store,
                             int64_t lds, StoreMode mode, float* row_c, unsigned* overflow, cudaStream_t stream);

// epilogue_stats_gemm.cu (sm_90a, CUTLASS; compiled where its headers are found: LCE_WITH_CUTLASS).
// One GEMM of rows of h [rows, hidden] against the shard W [cols, hidden] (bf16, K-major, 16-byte
// aligned, hidden a multiple of 8) whose epilogue reduces each fp32 logit tile in registers: per
// (row, column tile of EpilogueStatsTileCols(config) columns) tile_part[(r·ntile + t)·4 + {0,1,2,3}] =
// (m, S, Q, Σz) of z = transform(logit) (LogitTransform), and z_y into packed[r·kPacked + 3] for rows
// whose target lies in the shard (packed zeroed by the caller). With store, it also writes the
// backward's copy ([rows, lds], lds a multiple of 8): z − m_tile in fp16 (m_tile the tile's m above;
// LaunchWriteGrad with tile_part and tile_cols) or exp(z − c_row) in bf16 (below: the fast loss path). No split-K, and
// the same arithmetic for a row in configurations 1 to 3, and in 4 and 5: a row's partials are the same bits
// whatever the batch.
struct EpilogueStatsArgs {
  const void* hidden = nullptr;
  const void* weight = nullptr;
  int64_t rows = 0, cols = 0, hidden_size = 0;
  LogitTransform tf;
  const int32_t* targets = nullptr;
  int32_t ignore_index = -100;
  int64_t vocab_begin = 0;
  float* tile_part = nullptr;
  int64_t ntile = 0;  // ceil(cols / EpilogueStatsTileCols(config))
  float* packed = nullptr;
  void* store = nullptr;  // [rows, lds]: fp16 z − m_tile, or (with first) bf16 exp(z − c_row); or null
  int64_t lds = 0;
  // The fast loss path's copy: c_row = first[4·r] (the m of the row's first columns, e.g. from this GEMM
  // over them folded by LaunchFoldTilePartials) + kExpLift, written to row_c;
  // *overflow = 1.0f where a tile's max passes c_row by more than kExpHeadroom.
  const float* first = nullptr;
  float* row_c = nullptr;
  unsigned* overflow = nullptr;
  // Q, the entropy's statistic: false where the call needs no entropy (a multiply-add a logit saved;
  // Q is then 0, m and S the same bits).
  bool entropy = true;
  bool timing_skip = false;  // timing aid only (results are wrong): the epilogue does nothing
  // Rankings (rankings.cu): every column of row r whose v = softcap(logit + bias) is >= rank_thr[r] is
  // appended to the row's list rank_list[r · rank_cap ...] as the pair (v, id as int bits) at places
  // counted by rank_count[r] (which counts on past rank_cap: the row overflowed, and its candidates were
  // dropped). With rank_thr null (the first pass over a sample of columns) only the lists are written:
  // each lane's two best v of the row among its columns of the tile, nothing else.
  float* rank_list = nullptr;
  unsigned* rank_count = nullptr;
  const float* rank_thr = nullptr;
  int64_t rank_cap = 0;
  // The rankings' fallback: the GEMM writes every v into dump [rows, ld_dump] (fp32) and nothing else.
  float* dump = nullptr;
  int64_t ld_dump = 0;
  // A ranking of k = 1 (not with rank_list or dump): tile_arg[r · ntile + t] = the lowest column within tile t
  // (EpilogueStatsTileCols wide) whose v is row r's max over it (the m of its partials), the tile's width where
  // none is.
  int32_t* tile_arg = nullptr;
  // Kernel configuration (epilogue_stats_gemm.cu): 0 ping-pong 128×128 tiles, 1 cooperative 128×256,
  // 2 ping-pong 64×256, 3 as 1 with W's tiles multicast, 4 ping-pong 128×192 (W's tiles multicast),
  // 5 ping-pong 64×192; −1 (automatic): large_config's few-row partner of the same tile width (2 for 1 and 3,
  // 5 for 4) for rows <= small_rows, else large_config. 1, 2 and 3 give a row the same bits, and 4 and 5.
  int config = -1;
  int64_t small_rows = 128;
  int large_config = 4;
  // Tile scheduler: swizzle width (0 automatic: 8 for configuration 4's scores at H <= 4096, else 1; −1 the same
  // but FittedEpilogueSwizzle's width for those scores; or 1, 2, 4, 8) and raster (0 automatic: along N for
  // configuration 4's scores at H <= 4096, else along M unless W's columns fit in L2 and h's rows do not; 1 along
  // M, 2 along N).
  int swizzle = 0;
  int raster = 0;
};
// The swizzle width for configuration 4's scores in QuACK's order fitted to a call of rows × cols: CUTLASS's
// persistent scheduler pads the grid's CTA rows to swizzle × 2 (its clusters) and its column tiles to swizzle,
// and the padded tiles run (a 2560-row call at width 8 takes a 4096-row call's time, bench/NOTES.md e31). The
// widest of 8, 4, 2 whose grid is within 3% of the least padded one, else 1.
int FittedEpilogueSwizzle(int64_t rows, int64_t cols);
// The column tiles' width of a configuration (0-5; automatic: of its large_config).
int EpilogueStatsTileCols(int config);
absl::Status LaunchEpilogueStatsGemm(const EpilogueStatsArgs& args, cudaStream_t stream);

// row_finalize.cu. Folds per-(row, column tile) partials tile_part [rows, ntile, 4] (tiles of
// tile_cols columns, tile_cols dividing kSegment) into the per-(row, segment) partials part
// [rows, nseg, 4] that LaunchTileStats writes, tile by tile in order.
absl::Status LaunchFoldTilePartials(const float* tile_part, int64_t ntile, int tile_cols, int64_t rows, float* part,
                                    int64_t nseg, cudaStream_t stream);

// row_finalize.cu. Merges the nseg partials of each row: m_local[r] = m[r] = max, packed S, Q, Σz.
absl::Status LaunchMergeSegments(const float* part, int64_t nseg, int64_t rows, float* m_local, float* m,
                                 float* packed, cudaStream_t stream);

// row_finalize.cu. Tensor parallel, in global segment order: spreads this rank's segment partials
// (segments [seg_begin, seg_begin + nseg) of the head) into part_global [rows, nseg_global, 4] and each
// row's target logit into zy [rows], −inf everywhere this rank holds nothing (a NaN max becomes +inf,
// so that it survives), ready for a max all-reduce that gathers every rank's values exactly.
absl::Status LaunchSpreadPartials(const float* part, int64_t nseg, int64_t seg_begin, const float* packed,
                                  const int32_t* targets, int32_t ignore_index, int64_t vocab_begin,
                                  int64_t vocab_end, int64_t rows, float* part_global, int64_t nseg_global,
                                  float* zy, cudaStream_t stream);
// After the gather: packed[r·kPacked + 3] = zy[r] (0 where no rank held the target: ignored rows).
absl::Status LaunchTakeGatheredTargets(const float* zy, int64_t rows, float* packed, cudaStream_t stream);

// row_finalize.cu. Tensor parallel: after m holds the global max, rescales this rank's S and Q
// (docs/MATH.md, "Vocab-parallel") so that a sum over ranks gives the global values.
absl::Status LaunchRescalePartials(const float* m_local, const float* m, int64_t rows, float* packed,
                                   cudaStream_t stream);

enum class GradKind : int { kNone = 0, kLoss = 1, kGeneric = 2 };

struct FinalizeArgs {
  int64_t rows = 0;
  const int32_t* targets = nullptr;
  int32_t ignore_index = -100;
  int64_t vocab_size = 0;  // global V
  float label_smoothing = 0.0f;
  float z_loss = 0.0f;
  GradKind grad = GradKind::kNone;
  const float* grad_loss = nullptr;      // [rows] or null (ones)
  const float* grad_logprob = nullptr;   // [rows] or null (zeros)
  const float* grad_entropy = nullptr;   // [rows] or null (zeros)
  float* lse = nullptr;                  // outputs, [rows] each, null = not wanted
  float* logprob = nullptr;
  float* entropy = nullptr;
  float* loss = nullptr;
  float* z_loss_out = nullptr;  // [rows] z_loss·lse² (0 for ignored rows), or null
  // [V] class weights (global ids) or null: the loss and its coefficients take w_y (docs/MATH.md,
  // "Class weights"); with label smoothing packed's Σz is Σ_j w_j z_j (LaunchSmoothingRowSums) and
  // class_weight_sum points at Σ_j w_j.
  const float* class_weight = nullptr;
  const float* class_weight_sum = nullptr;
  const float* row_c = nullptr;          // fast loss path: c_i (else null)
  float temperature = 1.0f;
  float softcap = 0.0f;
  bool target_apart = false;             // general path: t_i into kInfoTarget, s_i = 1 (RowInfoSlot)
};

// row_finalize.cu. Per-row outputs and backward coefficients from m and packed; rows whose lse or
// Σz is not finite set *bad_row = min(*bad_row, r) (an unsigned long long the caller initialised).
absl::Status LaunchFinalizeRows(const FinalizeArgs& args, const float* m, const float* packed,
                                float* row_info, unsigned long long* bad_row, cudaStream_t stream);

// write_grad.cu. Turns columns [v0, v0 + nc) of store (z − m_group, fp16 for 16-bit heads, fp32 for
// fp32 heads) [rows, lds] (lds a multiple of 8, v0 a multiple of kSegment) into dL/da in the head's
// dtype, in place. m_group is the m of part [rows, ngroup, 4], the partials of groups of group_cols
// columns: kSegment (LaunchTileStats's segments) or the epilogue GEMM's column tiles. target_apart: the
// target's −C term is left out (added in fp32 by LaunchFinishDHidden and LaunchScatterTargetDW). class_weight:
// [V] (global ids) or null; label smoothing's term −D becomes −D·w_j.
absl::Status LaunchWriteGrad(DType dtype, void* store, int64_t lds, int64_t rows, int64_t v0, int64_t nc,
                             const float* part, int64_t ngroup, int group_cols, const float* row_info,
                             const int32_t* targets, int32_t ignore_index, int64_t vocab_begin,
                             const float* class_weight, float softcap, float temperature, bool target_apart,
                             cudaStream_t stream);

// fast_grad.cu (fast loss path, bf16 heads). h_scaled[r, :] = bf16(s_r · h[r, :]).
absl::Status LaunchScaleRows(const void* h, int64_t rows, int64_t hidden, const float* row_info, void* h_scaled,
                             cudaStream_t stream);
// fast_grad.cu. dh[r, :] = s_r · dh[r, :] − t_r · W[y_r − vocab_begin, :] (the target term only where
// y_r lies in this shard). W is the shard's bf16 weight [shard_rows, hidden].
absl::Status LaunchFinishDHidden(float* dh, int64_t rows, int64_t hidden, const float* row_info, const void* w,
                                 const int32_t* targets, int32_t ignore_index, int64_t vocab_begin,
                                 int64_t shard_rows, cudaStream_t stream);
// fast_grad.cu. d_weight[y_r − vocab_begin, :] −= t_r · h[r, :] for rows whose target lies in the shard,
// in a fixed order: the rows sorted by target (stably), one writer a target row adding its rows in row
// order, so dW is the same bits however the GPU schedules it. `scratch` holds TargetOrderBytes(rows).
int64_t TargetOrderBytes(int64_t rows);
absl::Status LaunchScatterTargetDW(float* d_weight, int64_t rows, int64_t hidden, const float* row_info,
                                   const void* h, const int32_t* targets, int32_t ignore_index,
                                   int64_t vocab_begin, int64_t shard_rows, void* scratch, int64_t scratch_bytes,
                                   cudaStream_t stream);

// bias_grad.cu. d_bias[j] = beta·d_bias[j] + Σ_r (s_r·stored[r, j] − t_r·1[j = y_r]) over the shard's columns j,
// the rows r in order (each product and sum rounded on its own); beta 0 reads nothing of d_bias. stored
// [rows, lds] in dtype: dA, or the fast path's q; s_r (kInfoScale) with `scale`, else 1; the target's term
// t_r (kInfoTarget) with `target` (kept apart from the copy), else none.
absl::Status LaunchBiasGrad(float* d_bias, float beta, const void* stored, DType dtype, int64_t lds, int64_t rows,
                            int64_t shard_rows, const float* row_info, bool scale, bool target, const int32_t* targets,
                            int32_t ignore_index, int64_t vocab_begin, cudaStream_t stream);

// weighted_smoothing.cu (class weights with label smoothing). seg_sums [⌈V/kSegment⌉, H + 2]: the rows of
// this shard's global segments get Σ_j w_j·[W_j | b_j | 1] over the segment's rows in the shard, in order,
// in columns [first_col, H + 2) (others untouched: the caller zeroes them; bias may be null). An ordered sum
// over the segments gives u = [Σ w_j W_j | Σ w_j b_j | Σ w_j]; first_col = H skips the head's read where
// only Σ w_j is wanted (with a softcap the tiles weight their own sums).
absl::Status LaunchSmoothingSegmentSums(const void* w, DType dtype, int64_t hidden, const float* bias,
                                        const float* class_weight, int64_t vocab_begin, int64_t shard_rows,
                                        int64_t first_col, float* seg_sums, cudaStream_t stream);
// weighted_smoothing.cu. packed[r, 2] = (h_r · u[0:H] + u[H]) / temperature = Σ_j w_j z_rj for every row,
// replacing the merged Σz (the loss's smoothing term with class weights).
absl::Status LaunchSmoothingRowSums(const void* h, DType dtype, int64_t rows, int64_t hidden, const float* u,
                                    float temperature, float* packed, cudaStream_t stream);

// tree_sum.cu. dst[i] = parts[i] + parts[n + i] + ... + parts[(count − 1)·n + i], left to right (each sum
// rounded on its own), for n floats.
absl::Status LaunchOrderedSum(float* dst, const float* parts, int count, int64_t n, cudaStream_t stream);
// exact_sum.cu: d_hidden's leaves [leaves, n] summed in fixed point (exact_fixed.h). total_terms: the
// element's terms in every place (the same on one GPU and in any group: it sets the scale).
// finish (info non-null): the terms are s_r · P_l and −t_r · W[y_r] (y_r in this shard, bf16 W), the fast
// loss path's LaunchFinishDHidden inside the sum; n is then whole rows of `hidden`.
struct DhFinish {
  const float* info = nullptr;
  const int32_t* targets = nullptr;
  int32_t ignore_index = 0;
  const void* weight = nullptr;
  int64_t vocab_begin = 0, shard_rows = 0, hidden = 0;
};
absl::Status LaunchExactLeafSum(float* dst, const float* parts, int leaves, int total_terms, int64_t n,
                                const DhFinish& finish, cudaStream_t stream);
// A group's rank: its terms' largest code an element (the group max all-reduces them), then its terms at
// that scale (the group sums them in int64), then one rounding (LaunchFixedToFloat): one GPU's bits.
absl::Status LaunchLeafCodes(uint8_t* codes, const float* parts, int leaves, int64_t n, const DhFinish& finish,
                             cudaStream_t stream);
absl::Status LaunchFixedLeafSum(int32_t* q, const uint8_t* codes, const float* parts, int leaves, int total_terms,
                                int64_t n, const DhFinish& finish, cudaStream_t stream);
absl::Status LaunchFixedToFloat(float* dst, const int32_t* q, const uint8_t* codes, int total_terms, int64_t n,
                                cudaStream_t stream);
// tree_sum.cu. dst[i] = value for n floats.
absl::Status LaunchFillFloats(float* dst, float value, int64_t n, cudaStream_t stream);

// grad_commit.cu. y[i] += s·x[i] for n floats (each product and sum rounded on its own); y[i] *= s
// when x is null.
absl::Status LaunchScaleAdd(float* y, const float* x, float s, int64_t n, cudaStream_t stream);

// convert.cu. dst[i] = (dtype) src[i] (round to nearest even) for n elements.
absl::Status LaunchFloatToDType(const float* src, DType dtype, void* dst, int64_t n, cudaStream_t stream);

// convert.cu. dst[i] = (float) src[i] for n elements of `dtype`.
absl::Status LaunchDTypeToFloat(const void* src, DType dtype, float* dst, int64_t n, cudaStream_t stream);

// adamw.cu. The constants of one AdamW step (lce::AdamWCoefficientsAt and the hyper-parameters).
struct AdamWKernelArgs {
  float grad_scale = 1, decay = 1, beta1 = 0.9f, one_minus_beta1 = 0.1f, beta2 = 0.999f, one_minus_beta2 = 0.001f;
  float bc2_sqrt = 1, eps = 1e-8f, step_size = 0;
};
// adamw.cu. One AdamW step over n parameters (every pointer 16-byte aligned): master, exp_avg and
// exp_avg_sq updated in place from grad (fp32), and serving[i] = (dtype) master[i], in one pass.
absl::Status LaunchAdamW(float* master, float* exp_avg, float* exp_avg_sq, const float* grad, DType dtype,
                         void* serving, int64_t n, const AdamWKernelArgs& args, cudaStream_t stream);

// grad_norm.cu. The vocabulary tiles of a gradient shard x [shard_rows, hidden] (lce::ShardTiles):
// tile first_tile + t is the shard's rows [max(0, (first_tile + t)·tile_rows − vocab_begin),
// min(shard_rows, (first_tile + t + 1)·tile_rows − vocab_begin)).
struct TileNormShape {
  int64_t hidden = 0, first_tile = 0, tiles = 0, tile_rows = 1, vocab_begin = 0, shard_rows = 0;
};
// grad_norm.cu. out[t] = Σ x² over tile t (t < tiles), in double, in a fixed order that depends on the
// tile alone; `scratch` holds tiles·kTileChunks doubles.
inline constexpr int kTileChunks = 64;
absl::Status LaunchTileSquaredNorms(const float* x, const TileNormShape& shape, double* scratch, double* out,
                                    cudaStream_t stream);

// validate.cu. Finds the first row whose target is neither ignore_index nor in [0, vocab_size):
// *bad_row = min(*bad_row, row) (initialised by the caller to ULLONG_MAX).
absl::Status LaunchCheckTargets(const int32_t* targets, int64_t rows, int64_t vocab_size,
                                int32_t ignore_index, unsigned long long* bad_row, cudaStream_t stream);

// rankings.cu (docs/MATH.md, "Rankings"). Candidates are (z, id as float) pairs, −inf in both where a
// slot holds none: a row has `slots` slots of k, one a segment of kSegment columns (a group's ranks
// each write theirs at rank · slots/world, then all-reduce them with max; on the epilogue GEMM's path
// one slot a rank, its shard's k best). RankingSlots: the segment slots every rank of a group of
// `world` agrees on.
int64_t RankingSlots(int64_t vocab_size, int world);
absl::Status LaunchFillRankings(float* cand, int64_t rows, int64_t slots, int k, cudaStream_t stream);
// The k best z of each segment of the fp32 logit tile [rows, nv] (leading dimension ldz) of shard columns
// [v0, v0 + nv) (v0 a multiple of kSegment), transformed as TileStats does, into slot slot0 + column/kSegment.
absl::Status LaunchSegmentTopK(const float* logits, int64_t ldz, int64_t rows, int64_t v0, int64_t nv,
                               const LogitTransform& tf, int k, int64_t vocab_begin, float* cand, int64_t slots,
                               int64_t slot0, cudaStream_t stream);
// The epilogue GEMM's path (EpilogueStatsArgs::rank_list): from the lists of (v, id) a first pass over
// a sample of each row's columns wrote, thr[r] = the smallest v whose z = v / T reaches the sample's
// k-th best z (−inf where the sample has fewer than k): every column of the shard's k best is at or
// above it.
absl::Status LaunchRankThreshold(float* list, const unsigned* count, int64_t cap, int64_t rows, int k,
                                 float temperature, float* thr, cudaStream_t stream);
// After the main pass: each row's k best of its list (z = v / T) into slot slot0 of cand [rows, slots, k];
// overflowed[r] = 1 where the row's count passed cap (its slot left as it was).
absl::Status LaunchRankSelect(float* list, const unsigned* count, int64_t cap, int64_t rows, int k, float temperature,
                              float* cand, int64_t slots, int64_t slot0, unsigned char* overflowed,
                              cudaStream_t stream);
// Each row's k best of its `from` slots of k (src [rows, from, k]) into slot slot0 of cand [rows, slots, k].
absl::Status LaunchReduceSlots(const float* src, int64_t from, int64_t rows, int k, float* cand, int64_t slots,
                               int64_t slot0, cudaStream_t stream);
// k = 1 after an epilogue GEMM with tile_arg: each row's best tile (the largest m of tile_part [rows, ntile, 4],
// the lowest tile of equal ones) as (m, vocab_begin + t · tile_cols + tile_arg) into slot slot0 of cand
// [rows, slots, 1]: the (z, id) that LaunchRankSelect gives for k = 1.
absl::Status LaunchTileArgmax(const float* tile_part, const int32_t* tile_arg, int64_t ntile, int tile_cols,
                              int64_t rows, int64_t vocab_begin, float* cand, int64_t slots, int64_t slot0,
                              cudaStream_t stream);
// Each row's k best over its slots, with logprob (z − m) − log S from row_info (kInfoMax, kInfoLogS);
// any output may be null.
absl::Status LaunchMergeTopK(float* cand, int64_t rows, int64_t slots, int k, const float* row_info, int32_t* argmax,
                             int32_t* top_tokens, float* top_logprobs, cudaStream_t stream);

}  // namespace lce::cuda
