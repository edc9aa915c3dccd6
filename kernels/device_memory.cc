#include "lce/device_memory.h"

#include "absl/strings/str_cat.h"

#ifdef LCE_WITH_CUDA
#include <cuda.h>  // types of the driver entry point only: libcuda is reached through cudart
#include <cuda_runtime.h>

#include <cstring>

#include "cuda/cuda_check.h"
#endif

namespace lce {

#ifdef LCE_WITH_CUDA
namespace {

class CudaIpcMemory final : public ImportedDeviceMemory {
 public:
  CudaIpcMemory(void* p, int64_t size, int device) : p_(p), size_(size), device_(device) {}
  ~CudaIpcMemory() override {
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(device_);
    cudaIpcCloseMemHandle(p_);  // nothing to do about a failure while closing
    cudaSetDevice(prev);
  }
  uint8_t* data() const override { return static_cast<uint8_t*>(p_); }
  int64_t size() const override { return size_; }
  int device() const override { return device_; }

 private:
  void* p_;
  int64_t size_;
  int device_;
};

// The allocation's size, from the driver (cudart has no call for it). Found at run time so that
// nothing links libcuda directly.
absl::StatusOr<int64_t> AllocationSize(void* p) {
  using GetRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static GetRange get_range = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      fn = nullptr;
    }
    return reinterpret_cast<GetRange>(fn);
  }();
  if (get_range == nullptr) return absl::InternalError("the CUDA driver has no cuMemGetAddressRange");
  CUdeviceptr base = 0;
  size_t size = 0;
  const CUresult r = get_range(&base, &size, reinterpret_cast<CUdeviceptr>(p));
  if (r != CUDA_SUCCESS) return absl::InternalError(absl::StrCat("cuMemGetAddressRange failed with CUresult ", r));
  // The handle names an allocation; its mapping starts at p. A pointer inside a larger range would
  // mean the bounds below are not the allocation's.
  if (base != reinterpret_cast<CUdeviceptr>(p)) {
    return absl::InternalError("the opened IPC mapping does not start at its allocation's base");
  }
  return static_cast<int64_t>(size);
}

class CudaPinnedHostRange final : public PinnedHostRange {
 public:
  explicit CudaPinnedHostRange(void* p) : p_(p) {}
  ~CudaPinnedHostRange() override { cudaHostUnregister(p_); }

 private:
  void* p_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<PinnedHostRange>> PinHostMemory(void* data, int64_t bytes, int device) {
  int prev = 0;
  LCE_CUDA_CHECK(cudaGetDevice(&prev));
  LCE_CUDA_CHECK(cudaSetDevice(device));
  const cudaError_t e = cudaHostRegister(data, static_cast<size_t>(bytes), cudaHostRegisterDefault);
  cudaSetDevice(prev);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(absl::StrCat("cudaHostRegister of ", bytes, " bytes failed: ", cudaGetErrorName(e)));
  }
  return std::unique_ptr<PinnedHostRange>(new CudaPinnedHostRange(data));
}

absl::StatusOr<std::unique_ptr<ImportedDeviceMemory>> ImportCudaIpcMemory(absl::string_view handle, int device) {
  if (handle.size() != kCudaIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("a CUDA IPC handle has ", kCudaIpcHandleBytes, " bytes, got ",
                                                   handle.size()));
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || device < 0 || device >= count) {
    return absl::FailedPreconditionError(absl::StrCat("CUDA device ", device, " is not available (", count,
                                                      " visible)"));
  }
  int prev = 0;
  LCE_CUDA_CHECK(cudaGetDevice(&prev));
  LCE_CUDA_CHECK(cudaSetDevice(device));
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), kCudaIpcHandleBytes);
  void* p = nullptr;
  const cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls do not see it
    cudaSetDevice(prev);
    return absl::InvalidArgumentError(absl::StrCat("cudaIpcOpenMemHandle refused the handle: ", cudaGetErrorName(e),
                                                   " (", cudaGetErrorString(e),
                                                   "); it must come from cudaIpcGetMemHandle in another live process "
                                                   "on this host, for memory that is still allocated"));
  }
  absl::StatusOr<int64_t> size = AllocationSize(p);
  if (!size.ok()) cudaIpcCloseMemHandle(p);
  cudaSetDevice(prev);
  if (!size.ok()) return size.status();
  return std::unique_ptr<ImportedDeviceMemory>(new CudaIpcMemory(p, *size, device));
}

#else

absl::StatusOr<std::unique_ptr<PinnedHostRange>> PinHostMemory(void*, int64_t, int) {
  return absl::UnimplementedError("this build has no CUDA backend");
}

absl::StatusOr<std::unique_ptr<ImportedDeviceMemory>> ImportCudaIpcMemory(absl::string_view, int) {
  return absl::UnimplementedError("this build has no CUDA backend: CUDA IPC regions are not available");
}

#endif

}  // namespace lce
