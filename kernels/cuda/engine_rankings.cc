// The CUDA engine's rankings (argmax, top-k; docs/MATH.md, "Rankings").
//
// On the logit-tile path each segment of a tile keeps its k best (ForwardTiles). On the epilogue GEMM's
// path nothing holds the logits, so the GEMM writes candidates: a first pass over each row's first
// `sample` columns (their logits, the same bits the whole pass gives them; each lane's two best of
// them) sets the row's threshold at the k-th best of those, at most the sample's k-th best, which the
// shard's k best all reach (for device rows over several blocks, one first pass for the whole call);
// the whole pass then appends every
// column at or above it to the row's list (~k · shard / sample of them), and a warp a row picks the k
// best. A row whose list overflows (a sample far below the rest of its row; many equal logits) is
// redone exactly from its logits written out in full, a few rows at a time. For k = 1 (argmax, accuracy)
// none of this: the GEMM writes each row's first column holding its tile max, and a warp a row picks the
// best tile (training calls too). Either way a rank's slot holds its shard's exact k best, so groups merge
// them as before, the same bits for any group size.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_engine_impl.h"

namespace lce::cuda {

absl::Status CudaEngine::PrepareRankings(CallPlan& p) {
  const int world = GroupSize();
  const int rank = config_.collectives != nullptr ? config_.collectives->rank() : 0;
  const int64_t k = p.o.top_k, R = p.R;
  // The logit-tile path keeps a segment's k best a slot; the epilogue GEMM's, its shard's k best in one
  // (fewer slots to fill, merge and all-reduce: 77 a row at V = 151936 before).
  p.rank_slots = p.layout.epi ? world : RankingSlots(shape_.vocab_size, world);
  p.rank_slot0 = rank * (p.rank_slots / world);
  const int64_t cand_bytes = RoundUp(R * p.rank_slots * k * 8, 256);
  const int64_t out_bytes = RoundUp(R * (1 + 2 * k) * 4, 256);
  const bool argmax = p.layout.epi && k == 1;
  const bool lists = p.layout.epi && !argmax;
  const int64_t list_bytes = lists    ? R * kRankCap * 8 + RoundUp(R * 9, 256)  // + count, thr, overflowed
                             : argmax ? R * EpiTiles() * 4
                                      : 0;
  const int64_t sample = lists ? RankSample(k) : 0;
  // Device rows over several blocks: one first pass for the call (its waves filled, one launch, instead
  // of a 1-2 wave GEMM a block), its lists [rows, call_cap] (a tile's four lanes' two best a row) apart.
  const int64_t n = p.rows.rows;
  const int64_t call_cap = 8 * ((sample + EpiTileCols() - 1) / EpiTileCols());
  const bool call_pass = lists && !p.host && !p.layout.stage && n > R && n * call_cap * 8 <= kRankCallListBytes;
  const int64_t call_bytes = call_pass ? RoundUp(n * call_cap * 8, 256) + RoundUp(n * 8, 256) : 0;
  const int64_t need = cand_bytes + out_bytes + list_bytes + call_bytes;
  LCE_CUDA_CHECK(GrowDeviceBuffer(rank_buf_, need));
  uint8_t* base = rank_buf_->data();
  p.cand = reinterpret_cast<float*>(base);
  p.rank_out = base + cand_bytes;
  RankLists& l = p.ranks;
  if (argmax) l.tile_arg = reinterpret_cast<int32_t*>(base + cand_bytes + out_bytes);
  if (!lists) return absl::OkStatus();
  l.list = reinterpret_cast<float*>(base + cand_bytes + out_bytes);
  l.count = reinterpret_cast<unsigned*>(l.list + R * kRankCap * 2);
  l.thr = reinterpret_cast<float*>(l.count + R);
  l.overflowed = reinterpret_cast<uint8_t*>(l.thr + R);
  l.cap = kRankCap;
  l.sample = sample;
  LCE_CUDA_CHECK(rank_flags_.Ensure(R, config_.device));
  if (!call_pass) return absl::OkStatus();
  l.call_cap = call_cap;
  l.call_list = reinterpret_cast<float*>(base + cand_bytes + out_bytes + list_bytes);
  l.call_count = reinterpret_cast<unsigned*>(l.call_list + RoundUp(n * call_cap * 8, 256) / 4);
  l.call_thr = reinterpret_cast<float*>(l.call_count + n);
  return absl::OkStatus();
}

// A sample of 3 · k · shard / cap columns leaves ~cap / 3 candidates a row; at least 1024 columns and
// 32 · k (its lanes' two best a 64 columns: k of them at least), at most a list's worth.
int64_t CudaEngine::RankSample(int64_t k) const {
  const int64_t want = tuning_.rank_sample > 0 ? RoundUp(tuning_.rank_sample, EpiTileCols())
                                               : RoundUp(3 * k * shape_.shard_rows / kRankCap + 1, EpiTileCols());
  return std::min({std::max<int64_t>({want, 1024, RoundUp(32 * k, EpiTileCols())}), kRankCap, shape_.shard_rows});
}

// The first pass: each lane's two best of the sample's columns into the lists (the epilogue GEMM's sampled
// kernel: no statistics), their k-th best the threshold (−inf where fewer than k: every column a candidate).
absl::Status CudaEngine::RankThreshold(const CallPlan& p, Scratch& s, const BlockIo& b) {
  const RankLists& l = p.ranks;
  LCE_CUDA_CHECK(cudaMemsetAsync(l.count, 0, b.nr * sizeof(unsigned), stream_));
  if (l.call_thr != nullptr) return absl::OkStatus();  // RankThresholdsForCall set every row's
  LCE_CUDA_CHECK(RankSamplePass(p, s, b.h, b.y, b.nr, l.list, l.count, l.cap, l.thr));
  LCE_CUDA_CHECK(cudaMemsetAsync(l.count, 0, b.nr * sizeof(unsigned), stream_));
  return absl::OkStatus();
}

// The first pass over all of a call's rows at once (device rows, several blocks; PrepareRankings): the
// same GEMM and threshold as RankThreshold, so the same thresholds, into l.call_thr.
absl::Status CudaEngine::RankThresholdsForCall(const CallPlan& p, Scratch& s) {
  const RankLists& l = p.ranks;
  const int64_t n = p.rows.rows;
  LCE_CUDA_CHECK(cudaMemsetAsync(l.call_count, 0, n * sizeof(unsigned), stream_));
  if (tuning_.trace) LCE_CUDA_CHECK(cudaEventRecord(trace_[0], stream_));
  LCE_CUDA_CHECK(
      RankSamplePass(p, s, p.rows.hidden, p.rows.targets, n, l.call_list, l.call_count, l.call_cap, l.call_thr));
  if (tuning_.trace) {
    float ms = 0;
    LCE_CUDA_CHECK(cudaEventRecord(trace_[1], stream_));
    LCE_CUDA_CHECK(cudaEventSynchronize(trace_[1]));
    LCE_CUDA_CHECK(cudaEventElapsedTime(&ms, trace_[0], trace_[1]));
    std::fprintf(stderr, "lce trace: rankings' first pass for the call's %ld rows: %.3f ms\n", static_cast<long>(n),
                 ms);
  }
  return absl::OkStatus();
}

// The sampled GEMM over n rows (it writes the lists [n, cap] and their counts only: no tile partials, no
// target logits), then each row's threshold into thr.
absl::Status CudaEngine::RankSamplePass(const CallPlan& p, Scratch& s, const void* h, const int32_t* y, int64_t n,
                                        float* list, unsigned* count, int64_t cap, float* thr) {
#if defined(LCE_WITH_CUTLASS)
  EpilogueStatsArgs a = EpiArgs(s, h, n, y, p.o.ignore_index, p.tf);
  a.cols = p.ranks.sample;
  a.ntile = (a.cols + EpiTileCols() - 1) / EpiTileCols();
  a.entropy = false;
  a.rank_list = list;
  a.rank_count = count;
  a.rank_cap = cap;
  LCE_CUDA_CHECK(LaunchEpilogueStatsGemm(a, stream_));
  return LaunchRankThreshold(list, count, cap, n, static_cast<int>(p.o.top_k), p.tf.temperature, thr, stream_);
#else
  (void)p, (void)s, (void)h, (void)y, (void)n, (void)list, (void)count, (void)cap, (void)thr;
  return absl::InternalError("built without CUTLASS: no epilogue-statistics GEMM");
#endif
}

absl::Status CudaEngine::RankSelect(const CallPlan& p, const Scratch& s, const BlockIo& b) {
  const RankLists& l = p.ranks;
  if (l.tile_arg != nullptr) {
    return LaunchTileArgmax(s.tile_part, l.tile_arg, EpiTiles(), EpiTileCols(), b.nr, shape_.vocab_begin, p.cand,
                            p.rank_slots, p.rank_slot0, stream_);
  }
  LCE_CUDA_CHECK(LaunchRankSelect(l.list, l.count, l.cap, b.nr, static_cast<int>(p.o.top_k), p.tf.temperature, p.cand,
                                  p.rank_slots, p.rank_slot0, l.overflowed, stream_));
  // Read by RankOverflowedRows after Finalize's sync (one sync a block, not two).
  LCE_CUDA_CHECK(cudaMemcpyAsync(rank_flags_.get(), l.overflowed, b.nr, cudaMemcpyDeviceToHost, stream_));
  return absl::OkStatus();
}

// Rows whose lists overflowed, kRankDumpRows at a time: their v over the whole shard written out by the
// same GEMM (the same bits), each segment's k best (as the logit-tile path), then their k best into this
// rank's slot.
absl::Status CudaEngine::RankOverflowedRows(const CallPlan& p, Scratch& s, const BlockIo& b) {
#if defined(LCE_WITH_CUTLASS)
  const uint8_t* over = rank_flags_.get();  // RankSelect's copy, landed by Finalize's sync
  const int64_t Vs = shape_.shard_rows, ld = RoundUp(Vs, 4), k = p.o.top_k;
  const int64_t esz = DTypeSize(shape_.dtype), H = shape_.hidden_size;
  for (int64_t r0 = 0; r0 < b.nr; r0 += kRankDumpRows) {
    const int64_t nc = std::min(kRankDumpRows, b.nr - r0);
    if (std::none_of(over + r0, over + r0 + nc, [](uint8_t o) { return o != 0; })) continue;
    const int64_t segs = RankingSlots(shape_.vocab_size, 1);  // ≥ the shard's segments
    LCE_CUDA_CHECK(GrowDeviceBuffer(rank_dump_, kRankDumpRows * (ld + segs * k * 2) * 4));
    float* dump = reinterpret_cast<float*>(rank_dump_->data());
    float* seg_best = dump + kRankDumpRows * ld;  // [nc, segs, k] (z, id)
    EpilogueStatsArgs a =
        EpiArgs(s, static_cast<const uint8_t*>(b.h) + r0 * H * esz, nc, b.y + r0, p.o.ignore_index, p.tf);
    a.dump = dump;
    a.ld_dump = ld;
    LCE_CUDA_CHECK(LaunchEpilogueStatsGemm(a, stream_));
    LCE_CUDA_CHECK(LaunchFillRankings(seg_best, nc, segs, static_cast<int>(k), stream_));
    const LogitTransform as_is{nullptr, 0.0f, p.tf.temperature};  // dump holds v: bias and softcap applied
    LCE_CUDA_CHECK(LaunchSegmentTopK(dump, ld, nc, 0, Vs, as_is, static_cast<int>(k), shape_.vocab_begin, seg_best,
                                     segs, 0, stream_));
    LCE_CUDA_CHECK(LaunchReduceSlots(seg_best, segs, nc, static_cast<int>(k), p.cand + r0 * p.rank_slots * k * 2,
                                     p.rank_slots, p.rank_slot0, stream_));
  }
  return absl::OkStatus();
#else
  (void)p, (void)s, (void)b;
  return absl::InternalError("built without CUTLASS: no epilogue-statistics GEMM");
#endif
}

absl::Status CudaEngine::Rank(const CallPlan& p, Scratch& s, const BlockIo& b) {
  const int64_t nr = b.nr, k = p.o.top_k;
  if (b.trace) LCE_CUDA_CHECK(cudaEventRecord(trace_[5], stream_));
  if (p.layout.epi && p.ranks.tile_arg == nullptr) LCE_CUDA_CHECK(RankOverflowedRows(p, s, b));
  if (config_.collectives != nullptr) {
    LCE_CUDA_CHECK(config_.collectives->AllReduce(p.cand, nr * p.rank_slots * k * 2, ReduceOp::kMax, true, stream_));
  }
  int32_t* argmax = p.out.argmax != nullptr ? p.out.argmax + b.r0 : nullptr;
  int32_t* tokens = p.out.top_tokens != nullptr ? p.out.top_tokens + b.r0 * k : nullptr;
  float* logprobs = p.out.top_logprobs != nullptr ? p.out.top_logprobs + b.r0 * k : nullptr;
  int32_t* staged_argmax = reinterpret_cast<int32_t*>(p.rank_out);
  int32_t* staged_tokens = staged_argmax + p.R;
  float* staged_logprobs = reinterpret_cast<float*>(staged_tokens + p.R * k);
  LCE_CUDA_CHECK(LaunchMergeTopK(p.cand, nr, p.rank_slots, static_cast<int>(k), s.info,
                                 p.host && argmax ? staged_argmax : argmax, p.host && tokens ? staged_tokens : tokens,
                                 p.host && logprobs ? staged_logprobs : logprobs, stream_));
  if (b.trace) LCE_CUDA_CHECK(cudaEventRecord(trace_[6], stream_));
  if (p.host) {
    const std::pair<void*, const void*> copies[] = {
        {argmax, staged_argmax}, {tokens, staged_tokens}, {logprobs, staged_logprobs}};
    for (int i = 0; i < 3; ++i) {
      if (copies[i].first == nullptr) continue;
      const int64_t bytes = (i == 0 ? nr : nr * k) * 4;
      LCE_CUDA_CHECK(cudaMemcpyAsync(copies[i].first, copies[i].second, bytes, cudaMemcpyDeviceToHost, stream_));
    }
  }
  return absl::OkStatus();
}

}  // namespace lce::cuda
