// The CUDA backend's environment table (lce/cuda_tuning.h). Built with or without CUDA: a config
// can name a tuning in any build; only a CUDA engine reads it.
#include "lce/cuda_tuning.h"

#include <cstdlib>

namespace lce {

const std::vector<CudaTuningVariable>& CudaTuningVariables() {
  static const std::vector<CudaTuningVariable> table = {
      {"LCE_CUDA_VOCAB_TILE", "int", "8192", "logit tile columns of the cuBLASLt forward (whole 1536-column segments)",
       [](CudaTuning& t, int64_t v) { t.vocab_tile = v; }},
      {"LCE_CUDA_MAX_ROWS", "int", "0", "cap on a row block's rows; 0: as many as workspace_bytes holds",
       [](CudaTuning& t, int64_t v) { t.max_rows = v; }},
      {"LCE_CUDA_SLICE_BLOCKS", "0/1", "1",
       "one GPU, 2048 <= H <= 3584: a training call's row blocks hold whole 2048-row d_hidden slices (0: as many "
       "rows as workspace_bytes holds)",
       [](CudaTuning& t, int64_t v) { t.slice_blocks = v != 0; }},
      {"LCE_CUDA_BWD_CHUNK", "int", "16384", "general backward: dA columns a chunk (each chunk's dW product behind it)",
       [](CudaTuning& t, int64_t v) { t.backward_chunk = v; }},
      {"LCE_CUDA_STATS_SMS", "int", "0", "multiprocessors the forward GEMMs leave to the tile reductions (<= half)",
       [](CudaTuning& t, int64_t v) { t.stats_sms = v; }},
      {"LCE_CUDA_NO_FAST", "0/1", "0", "1: no fast loss path (bf16 kLoss takes the general path's dA pass)",
       [](CudaTuning& t, int64_t v) { t.fast_loss_path = v == 0; }},
      {"LCE_CUDA_TARGET_APART", "0/1", "1", "bf16 general path: the target's term added in fp32 (0: in the bf16 copy)",
       [](CudaTuning& t, int64_t v) { t.target_apart = v != 0; }},
      {"LCE_CUDA_DH_BESIDE", "0/1", "1",
       "fast path, device rows: d_hidden's product beside dW's (0: one after the other)",
       [](CudaTuning& t, int64_t v) { t.dh_beside = v != 0; }},
      {"LCE_CUDA_DH_FIXED_ORDER", "0/1", "1",
       "d_hidden's product over fixed vocabulary leaves summed in fixed point, a row's bits the same in any "
       "batch and TP group of 2 and 4 (0: one product, cuBLAS's choice for the row count)",
       [](CudaTuning& t, int64_t v) { t.dh_fixed_order = v != 0; }},
      {"LCE_CUDA_GEMMEX", "0/1", "0", "1: cublasGemmEx instead of tuned cuBLASLt (comparison only)",
       [](CudaTuning& t, int64_t v) { t.gemm_ex = v != 0; }},
      {"LCE_CUDA_NO_GEMM_TUNE", "0/1", "0", "1: cuBLASLt's first heuristic algorithm, untimed",
       [](CudaTuning& t, int64_t v) { t.gemm_tune = v == 0; }},
      {"LCE_CUDA_GEMM_LOG", "0/1", "0",
       "1: each timed cuBLASLt product's candidates (algorithm, tile, stages, split-K), their times, the columns they "
       "were timed on and the pick, to stderr",
       [](CudaTuning& t, int64_t v) { t.gemm_log = v != 0; }},
      {"LCE_CUDA_EPILOGUE_STATS", "0/1", "1",
       "bf16 heads on sm_90 (CUTLASS builds): forward through the "
       "epilogue-statistics GEMM",
       [](CudaTuning& t, int64_t v) { t.epilogue_stats = v != 0; }},
      {"LCE_CUDA_EPI_KERNEL", "int", "-1", "its kernel configuration: -1 automatic, 0-5 fixed",
       [](CudaTuning& t, int64_t v) { t.epi_kernel = static_cast<int>(v); }},
      {"LCE_CUDA_EPI_SMALL_ROWS", "int", "128",
       "automatic choice: the large configuration's few-row partner (5 for 4, 2 for 1 and 3) up to this many rows",
       [](CudaTuning& t, int64_t v) { t.epi_small_rows = v; }},
      {"LCE_CUDA_EPI_LARGE", "int", "4", "automatic choice: the configuration above them (1, 3 or 4)",
       [](CudaTuning& t, int64_t v) { t.epi_large = static_cast<int>(v); }},
      {"LCE_CUDA_EPI_SWIZZLE", "int", "0",
       "its tile scheduler's swizzle width (0 automatic: 8 for configuration 4's scores at H <= 4096, else 1; -1 "
       "the same, fitted to each call's rows for those scores; 1, 2, 4, 8)",
       [](CudaTuning& t, int64_t v) { t.epi_swizzle = static_cast<int>(v); }},
      {"LCE_CUDA_EPI_RASTER", "int", "0",
       "its raster: 0 automatic (configuration 4's scores at H <= 4096 along N; else along M unless W's columns fit "
       "in L2 and h's rows do not), 1 along M, 2 along N",
       [](CudaTuning& t, int64_t v) { t.epi_raster = static_cast<int>(v); }},
      {"LCE_CUDA_DEBUG_SKIP", "bits", "0", "timing aid, wrong results: skip 1 TileStats, 2 WriteGrad, 4 the epilogue",
       [](CudaTuning& t, int64_t v) { t.debug_skip = static_cast<int>(v); }},
      {"LCE_CUDA_TRACE", "0/1", "0", "1: phase times of each call's first row block, to stderr",
       [](CudaTuning& t, int64_t v) { t.trace = v != 0; }},
      {"LCE_CUDA_RANK_SAMPLE", "int", "0",
       "rankings on the epilogue GEMM: columns of the first pass that sets each row's threshold (0: automatic, "
       "3·k·shard/8192; at least 1024 and 32·k, at most 8192)",
       [](CudaTuning& t, int64_t v) { t.rank_sample = v; }},
      {"LCE_CUDA_BATCH_INVARIANT", "0/1", "unset", "overrides EngineConfig::batch_invariant",
       [](CudaTuning& t, int64_t v) { t.batch_invariant = v != 0; }},
      {"LCE_CUDA_TP_INVARIANT", "0/1", "unset", "overrides EngineConfig::tp_invariant (on by default)",
       [](CudaTuning& t, int64_t v) { t.tp_invariant = v != 0; }},
  };
  return table;
}

CudaTuning CudaTuningFromEnv() {
  CudaTuning tuning;
  for (const CudaTuningVariable& var : CudaTuningVariables()) {
    const char* value = std::getenv(var.name);
    if (value == nullptr || *value == '\0') continue;
    var.apply(tuning, std::strtoll(value, nullptr, 10));
  }
  return tuning;
}

#if !defined(LCE_WITH_CUDA)
absl::Status SetCudaTuning(LceEngine&, const CudaTuning&) {
  return absl::UnimplementedError("this build has no CUDA backend");
}
#endif

}  // namespace lce
