// The one way the CUDA backend checks a CUDA runtime or cuBLAS call: LCE_CUDA_CHECK(expr) returns an
// absl::Status (INTERNAL, naming the call, file and line) from the enclosing function on failure.
// No aborts, no exceptions.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace lce::cuda {

inline absl::Status ToStatus(cudaError_t e, const char* what, const char* file, int line) {
  if (e == cudaSuccess) return absl::OkStatus();
  const absl::StatusCode code =
      e == cudaErrorMemoryAllocation ? absl::StatusCode::kResourceExhausted : absl::StatusCode::kInternal;
  return absl::Status(code, absl::StrCat("CUDA error ", cudaGetErrorName(e), " (", cudaGetErrorString(e),
                                         ") in ", what, " at ", file, ":", line));
}

inline absl::Status ToStatus(cublasStatus_t e, const char* what, const char* file, int line) {
  if (e == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  const absl::StatusCode code =
      e == CUBLAS_STATUS_ALLOC_FAILED ? absl::StatusCode::kResourceExhausted : absl::StatusCode::kInternal;
  return absl::Status(code, absl::StrCat("cuBLAS error ", cublasGetStatusName(e), " (", cublasGetStatusString(e),
                                         ") in ", what, " at ", file, ":", line));
}

inline absl::Status ToStatus(absl::Status s, const char*, const char*, int) { return s; }

}  // namespace lce::cuda

// Evaluates expr (a cudaError_t, cublasStatus_t or absl::Status) and returns its status on failure.
#define LCE_CUDA_CHECK(expr)                                                                   \
  do {                                                                                         \
    ::absl::Status lce_cuda_status_ = ::lce::cuda::ToStatus((expr), #expr, __FILE__, __LINE__); \
    if (!lce_cuda_status_.ok()) return lce_cuda_status_;                                       \
  } while (0)
