// The CUDA engine's tuning table (lce/cuda_tuning.h): CudaTuningFromEnv reads each LCE_CUDA_* variable
// into its field, unset or empty ones keep the defaults, and docs/OPERATING.md lists every variable.
// Needs no GPU (the table is plain C++); built with the GPU tests since only a CUDA build's engine reads it.
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "lce/cuda_tuning.h"

namespace lce {
namespace {

// Sets the named variables for a scope; every LCE_CUDA_* variable of the table is unset inside it and
// restored after, so that the test reads neither the caller's settings nor leaves its own.
class ScopedTuningEnv {
 public:
  explicit ScopedTuningEnv(const std::vector<std::pair<std::string, std::string>>& set) {
    for (const CudaTuningVariable& var : CudaTuningVariables()) {
      const char* v = std::getenv(var.name);
      saved_.push_back({var.name, v != nullptr, v != nullptr ? v : ""});
      unsetenv(var.name);
    }
    for (const auto& [name, value] : set) setenv(name.c_str(), value.c_str(), 1);
  }
  ~ScopedTuningEnv() {
    for (const Saved& s : saved_) {
      if (s.had)
        setenv(s.name.c_str(), s.value.c_str(), 1);
      else
        unsetenv(s.name.c_str());
    }
  }

 private:
  struct Saved {
    std::string name;
    bool had;
    std::string value;
  };
  std::vector<Saved> saved_;
};

TEST(CudaTuningTest, UnsetOrEmptyVariablesKeepTheDefaults) {
  ScopedTuningEnv env({{"LCE_CUDA_MAX_ROWS", ""}, {"LCE_CUDA_TRACE", ""}});
  const CudaTuning t = CudaTuningFromEnv();
  const CudaTuning d;
  EXPECT_EQ(t.vocab_tile, 8192);
  EXPECT_EQ(t.max_rows, d.max_rows);
  EXPECT_EQ(t.backward_chunk, 16384);
  EXPECT_TRUE(t.fast_loss_path && t.target_apart && t.dh_beside && t.dh_fixed_order && t.gemm_tune &&
              t.epilogue_stats && t.slice_blocks);
  EXPECT_FALSE(t.gemm_ex || t.trace || t.gemm_log);
  EXPECT_EQ(t.epi_kernel, -1);
  EXPECT_EQ(t.debug_skip, 0);
  EXPECT_FALSE(t.batch_invariant.has_value());
  EXPECT_FALSE(t.tp_invariant.has_value());
}

TEST(CudaTuningTest, EachVariableSetsItsField) {
  ScopedTuningEnv env(
      {{"LCE_CUDA_VOCAB_TILE", "4096"}, {"LCE_CUDA_MAX_ROWS", "7"},        {"LCE_CUDA_BWD_CHUNK", "2048"},
       {"LCE_CUDA_STATS_SMS", "16"},    {"LCE_CUDA_NO_FAST", "1"},         {"LCE_CUDA_TARGET_APART", "0"},
       {"LCE_CUDA_DH_BESIDE", "0"},     {"LCE_CUDA_DH_FIXED_ORDER", "0"},  {"LCE_CUDA_GEMMEX", "1"},
       {"LCE_CUDA_NO_GEMM_TUNE", "1"},  {"LCE_CUDA_GEMM_LOG", "1"},        {"LCE_CUDA_EPILOGUE_STATS", "0"},
       {"LCE_CUDA_EPI_KERNEL", "2"},    {"LCE_CUDA_EPI_SMALL_ROWS", "64"}, {"LCE_CUDA_EPI_LARGE", "3"},
       {"LCE_CUDA_EPI_SWIZZLE", "8"},   {"LCE_CUDA_EPI_RASTER", "1"},      {"LCE_CUDA_DEBUG_SKIP", "5"},
       {"LCE_CUDA_TRACE", "1"},         {"LCE_CUDA_BATCH_INVARIANT", "1"}, {"LCE_CUDA_TP_INVARIANT", "0"},
       {"LCE_CUDA_SLICE_BLOCKS", "0"}});
  const CudaTuning t = CudaTuningFromEnv();
  EXPECT_EQ(t.vocab_tile, 4096);
  EXPECT_EQ(t.max_rows, 7);
  EXPECT_EQ(t.backward_chunk, 2048);
  EXPECT_FALSE(t.slice_blocks);
  EXPECT_EQ(t.stats_sms, 16);
  EXPECT_FALSE(t.fast_loss_path);
  EXPECT_FALSE(t.target_apart);
  EXPECT_FALSE(t.dh_beside);
  EXPECT_FALSE(t.dh_fixed_order);
  EXPECT_TRUE(t.gemm_ex);
  EXPECT_FALSE(t.gemm_tune);
  EXPECT_TRUE(t.gemm_log);
  EXPECT_FALSE(t.epilogue_stats);
  EXPECT_EQ(t.epi_kernel, 2);
  EXPECT_EQ(t.epi_small_rows, 64);
  EXPECT_EQ(t.epi_large, 3);
  EXPECT_EQ(t.epi_swizzle, 8);
  EXPECT_EQ(t.epi_raster, 1);
  EXPECT_EQ(t.debug_skip, 5);
  EXPECT_TRUE(t.trace);
  ASSERT_TRUE(t.batch_invariant.has_value() && t.tp_invariant.has_value());
  EXPECT_TRUE(*t.batch_invariant);
  EXPECT_FALSE(*t.tp_invariant);
}

TEST(CudaTuningTest, OperatingDocListsEveryVariable) {
  std::ifstream in(std::string(LCE_SOURCE_DIR) + "/docs/OPERATING.md");
  ASSERT_TRUE(in.good()) << "docs/OPERATING.md not found under " << LCE_SOURCE_DIR;
  std::stringstream doc;
  doc << in.rdbuf();
  std::set<std::string> names;
  for (const CudaTuningVariable& var : CudaTuningVariables()) {
    EXPECT_TRUE(names.insert(var.name).second) << var.name << " twice in the table";
    EXPECT_NE(doc.str().find(std::string("`") + var.name + "`"), std::string::npos)
        << var.name << " is not in docs/OPERATING.md's CUDA tuning table";
  }
  EXPECT_EQ(names.size(), 23u);
}

}  // namespace
}  // namespace lce
