// FittedEpilogueSwizzle (kernels.h): the swizzle width for configuration 4's scores that keeps CUTLASS's
// padded grid within 3% of the least padded one. The row counts are a TP-2 group's calls as the server made
// them for a 16384-row score (bench/results/session23_h200_2026-11-30.log call 10), on a rank's 75968-column
// shard of 151936 and on the whole vocabulary. Needs no GPU (plain C++ in the CUDA backend's library).
#include <cstdint>

#include "cuda/kernels.h"
#include "gtest/gtest.h"

namespace lce::cuda {
namespace {

TEST(FittedEpilogueSwizzle, WholeGroupsKeepTheWidestWidth) {
  for (int64_t cols : {75968, 151936}) {
    EXPECT_EQ(FittedEpilogueSwizzle(4096, cols), 8) << cols;
    EXPECT_EQ(FittedEpilogueSwizzle(16384, cols), 8) << cols;
    EXPECT_EQ(FittedEpilogueSwizzle(2048, cols), 8) << cols;
  }
}

TEST(FittedEpilogueSwizzle, PartGroupsTakeANarrowerOne) {
  // 2048-row groups of eight 256-row clusters: 2560 rows pad to 4096 at 8, to 3072 at 4, not at 2.
  EXPECT_EQ(FittedEpilogueSwizzle(2560, 75968), 2);
  EXPECT_EQ(FittedEpilogueSwizzle(3072, 75968), 4);
  EXPECT_EQ(FittedEpilogueSwizzle(3584, 75968), 2);
  EXPECT_EQ(FittedEpilogueSwizzle(1536, 75968), 2);
  EXPECT_EQ(FittedEpilogueSwizzle(1024, 75968), 4);
  EXPECT_EQ(FittedEpilogueSwizzle(512, 75968), 2);
}

TEST(FittedEpilogueSwizzle, OneClusterRowTakesNoSwizzle) {
  // One CTA row: CUTLASS takes width 1 whatever it is given, so any width is the same grid. Two (256 rows):
  // CUTLASS would take 2 and pad them to four, twice the work.
  EXPECT_EQ(FittedEpilogueSwizzle(1, 75968), 8);
  EXPECT_EQ(FittedEpilogueSwizzle(0, 75968), 8);
  EXPECT_EQ(FittedEpilogueSwizzle(256, 75968), 1);
}

TEST(FittedEpilogueSwizzle, TheColumnsPaddingCountsToo) {
  // 1000 rows (8 CTA rows: no row padding at 4) on 396 column tiles (75968 / 192, rounded up): 8 pads the rows to
  // 16 and the columns to 400; 4 pads neither.
  EXPECT_EQ(FittedEpilogueSwizzle(1000, 75968), 4);
}

}  // namespace
}  // namespace lce::cuda
