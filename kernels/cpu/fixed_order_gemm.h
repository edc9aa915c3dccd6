// Internal: the CPU engine's matrix product. Every element of C is one chain of fused multiply-adds
// over p = 0, 1, ..., k-1, started from C (accumulate) or from +0: its bits depend on its own row of
// A and column of B alone — never on m, n, the blocking, the thread count or the instruction set
// (AVX-512, AVX2 and the scalar fallback run the same chain). That is what makes the CPU engine's
// results independent of the batch around a row (DESIGN.md, "Guarantees"); a BLAS chooses its
// kernels and blocking from the shape, so its results change with the row count.
#pragma once

#include <cstdint>

namespace lce::cpu {

// A read-only matrix whose element (i, p) is data[i * row_stride + p * col_stride].
struct StridedMatrix {
  const float* data = nullptr;
  int64_t row_stride = 0;
  int64_t col_stride = 0;
};

// C[m, n] = (accumulate ? C : 0) + A[m, k] · B[k, n]. B is row-major with leading dimension ldb,
// C row-major with leading dimension ldc. Rows of C are split over `threads` OpenMP threads.
void FixedOrderGemm(int64_t m, int64_t n, int64_t k, StridedMatrix a, const float* b, int64_t ldb,
                    float* c, int64_t ldc, bool accumulate, int threads);

// The instruction set FixedOrderGemm runs on here: "avx512", "avx2" or "scalar".
const char* FixedOrderGemmIsa();

// Tests: run on `isa` ("avx512", "avx2", "scalar") from now on; false when this CPU lacks it.
bool UseFixedOrderGemmIsaForTesting(const char* isa);

}  // namespace lce::cpu
