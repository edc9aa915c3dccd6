// The CUDA backend's tuning knobs as one typed config (EngineConfig::cuda_tuning). The engine takes
// them once, at Init: the config's when it sets them, else CudaTuningFromEnv(): these defaults, each
// overridden by its LCE_CUDA_* environment variable (the table in cuda_tuning.cc, listed in
// docs/OPERATING.md, "CUDA tuning"), so that bench scripts and servers steer an engine without code.
// Defaults are the measured best (bench/NOTES.md); the others are for experiments and comparisons.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace lce {

class LceEngine;

struct CudaTuning {
  int64_t vocab_tile = 8192;       // logit tile columns (rounded up to whole 1536-column segments)
  int64_t max_rows = 0;            // cap on a row block's rows (> 0); 0: as many as the workspace holds
  bool slice_blocks = true;        // one GPU, 2048 <= H <= 3584: training blocks of whole d_hidden slices
  int64_t backward_chunk = 16384;  // general path: dA columns written per chunk before its dW product
  int64_t stats_sms = 0;           // multiprocessors the forward GEMMs leave to TileStats (<= half)
  bool fast_loss_path = true;      // bf16 kLoss without softcap or smoothing skips the dA pass
  bool target_apart = true;        // bf16 general path: the target's term added in fp32, not in the copy
  bool dh_beside = true;           // fast path, device rows: d_hidden's product beside dW's
  bool dh_fixed_order = true;      // d_hidden over fixed vocabulary leaves in fixed point: batch and TP invariant
  bool gemm_ex = false;            // cublasGemmEx instead of tuned cuBLASLt (for comparison)
  bool gemm_tune = true;           // time cuBLASLt's candidates (else its heuristic's first)
  bool gemm_log = false;           // each timed product's candidates, their times and the pick, to stderr
  // The epilogue-statistics GEMM (sm_90, bf16, built with CUTLASS) and its kernel choices
  // (EpilogueStatsArgs: config, small_rows, large_config, swizzle, raster; the same defaults).
  bool epilogue_stats = true;
  int epi_kernel = -1;
  int64_t epi_small_rows = 128;
  int epi_large = 4;
  int epi_swizzle = 0;
  int epi_raster = 0;
  int debug_skip = 0;  // timing aid only, results wrong: bits 1 TileStats, 2 WriteGrad, 4 epilogue
  bool trace = false;  // phase times of a call's first row block, to stderr
  int64_t rank_sample = 0;  // rankings on the epilogue GEMM: the first pass's columns (0: automatic)
  // Overrides of EngineConfig::batch_invariant / tp_invariant; unset: the config's.
  std::optional<bool> batch_invariant;
  std::optional<bool> tp_invariant;
};

// One row of the environment table: the variable, its type and default as written in the docs,
// what it sets, and how its integer value is applied.
struct CudaTuningVariable {
  const char* name;
  const char* type;
  const char* default_value;
  const char* meaning;
  void (*apply)(CudaTuning& tuning, int64_t value);
};

// Every LCE_CUDA_* variable the engine reads, in the order of docs/OPERATING.md's table.
const std::vector<CudaTuningVariable>& CudaTuningVariables();

// CudaTuning{} with each variable of the table that is set and not empty applied (its value read as a
// base-10 integer, as the engine always read them).
CudaTuning CudaTuningFromEnv();

// Replaces the tuning of a CUDA engine between calls (waits for a call in flight): for tests and
// benches that compare settings on one engine, whose tuned GEMM algorithms another engine might not
// share. INVALID_ARGUMENT: not a CUDA engine, or its workspace too small for a row under `tuning`;
// UNIMPLEMENTED in a build without CUDA.
absl::Status SetCudaTuning(LceEngine& engine, const CudaTuning& tuning);

}  // namespace lce
