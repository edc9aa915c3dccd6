#include "lce/device_memory.h"

#include "absl/strings/str_cat.h"

#ifdef LCE_WITH_CUDA
#include <cuda.h>  // types of the driver entry point only: libcuda is reached through cudart
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>

#include "cuda/cuda_check.h"
#endif

namespace lce {

#ifdef LCE_WITH_CUDA
namespace {

// Makes `device` current for a scope, and restores the previous one. status(): whether that worked.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    get_ = cudaGetDevice(&prev_);
    if (get_ == cudaSuccess) set_ = cudaSetDevice(device);
  }
  ~DeviceScope() {
    if (get_ == cudaSuccess) cudaSetDevice(prev_);
  }
  absl::Status status() const {
    if (get_ != cudaSuccess) return cuda::ToStatus(get_, "cudaGetDevice", __FILE__, __LINE__);
    return cuda::ToStatus(set_, "cudaSetDevice", __FILE__, __LINE__);
  }

 private:
  int prev_ = 0;
  cudaError_t get_ = cudaSuccess, set_ = cudaSuccess;
};

class CudaIpcMemory final : public ImportedDeviceMemory {
 public:
  CudaIpcMemory(void* p, int64_t size, int device) : p_(p), size_(size), device_(device) {}
  ~CudaIpcMemory() override {
    DeviceScope scope(device_);
    cudaIpcCloseMemHandle(p_);  // nothing to do about a failure while closing
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

class CudaDeviceBuffer final : public DeviceBuffer {
 public:
  CudaDeviceBuffer(void* p, int64_t size, int device) : p_(p), size_(size), device_(device) {}
  ~CudaDeviceBuffer() override {
    DeviceScope scope(device_);
    cudaFree(p_);
  }
  uint8_t* data() const override { return static_cast<uint8_t*>(p_); }
  int64_t size() const override { return size_; }

 private:
  void* p_;
  int64_t size_;
  int device_;
};

class CudaDeviceTransfer final : public DeviceTransfer {
 public:
  CudaDeviceTransfer(int device, int64_t piece) : device_(device), piece_(piece) {}
  ~CudaDeviceTransfer() override {
    DeviceScope scope(device_);
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    for (int i = 0; i < 2; ++i) {
      if (bounce_[i] != nullptr) cudaFreeHost(bounce_[i]);
      if (done_[i] != nullptr) cudaEventDestroy(done_[i]);
    }
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  absl::Status Init() {
    DeviceScope scope(device_);
    LCE_CUDA_CHECK(scope.status());
    LCE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    for (int i = 0; i < 2; ++i) {
      LCE_CUDA_CHECK(cudaHostAlloc(&bounce_[i], static_cast<size_t>(piece_), cudaHostAllocDefault));
      LCE_CUDA_CHECK(cudaEventCreateWithFlags(&done_[i], cudaEventDisableTiming));
    }
    return absl::OkStatus();
  }

  absl::Status ToDevice(uint8_t* dst, int64_t bytes, const std::function<bool(uint8_t*, size_t)>& produce) override {
    DeviceScope scope(device_);
    LCE_CUDA_CHECK(scope.status());
    bool produced = true;
    for (int64_t off = 0, i = 0; off < bytes && produced; off += piece_, ++i) {
      const int b = static_cast<int>(i & 1);
      const size_t n = static_cast<size_t>(std::min(piece_, bytes - off));
      LCE_CUDA_CHECK(cudaEventSynchronize(done_[b]));  // the copy out of this bounce buffer is done
      produced = produce(static_cast<uint8_t*>(bounce_[b]), n);
      if (produced) {
        LCE_CUDA_CHECK(cudaMemcpyAsync(dst + off, bounce_[b], n, cudaMemcpyHostToDevice, stream_));
        LCE_CUDA_CHECK(cudaEventRecord(done_[b], stream_));
      }
    }
    LCE_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return produced ? absl::OkStatus() : absl::CancelledError("the host side of the transfer stopped");
  }

  absl::Status FromDevice(const uint8_t* src, int64_t bytes,
                          const std::function<bool(const uint8_t*, size_t)>& consume) override {
    DeviceScope scope(device_);
    LCE_CUDA_CHECK(scope.status());
    const int64_t pieces = (bytes + piece_ - 1) / piece_;
    auto issue = [&](int64_t i) -> absl::Status {
      const int b = static_cast<int>(i & 1);
      const int64_t off = i * piece_;
      LCE_CUDA_CHECK(cudaMemcpyAsync(bounce_[b], src + off, static_cast<size_t>(std::min(piece_, bytes - off)),
                                     cudaMemcpyDeviceToHost, stream_));
      LCE_CUDA_CHECK(cudaEventRecord(done_[b], stream_));
      return absl::OkStatus();
    };
    if (pieces > 0) LCE_CUDA_CHECK(issue(0));
    for (int64_t i = 0; i < pieces; ++i) {
      // The next piece comes over while this one goes out; its buffer's last consumer is done.
      if (i + 1 < pieces) LCE_CUDA_CHECK(issue(i + 1));
      const int b = static_cast<int>(i & 1);
      LCE_CUDA_CHECK(cudaEventSynchronize(done_[b]));
      if (!consume(static_cast<const uint8_t*>(bounce_[b]), static_cast<size_t>(std::min(piece_, bytes - i * piece_)))) {
        LCE_CUDA_CHECK(cudaStreamSynchronize(stream_));
        return absl::CancelledError("the host side of the transfer stopped");
      }
    }
    return absl::OkStatus();
  }

 private:
  int device_;
  int64_t piece_;
  cudaStream_t stream_ = nullptr;
  void* bounce_[2] = {nullptr, nullptr};
  cudaEvent_t done_[2] = {nullptr, nullptr};
};

}  // namespace

absl::StatusOr<int64_t> DeviceMemoryBytes(int device) {
  cudaDeviceProp prop{};
  const cudaError_t e = cudaGetDeviceProperties(&prop, device);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat("CUDA device ", device, " is not available: ", cudaGetErrorName(e)));
  }
  return static_cast<int64_t>(prop.totalGlobalMem);
}

absl::StatusOr<std::unique_ptr<DeviceBuffer>> AllocateDeviceBuffer(int64_t bytes, int device) {
  if (bytes <= 0) return absl::InvalidArgumentError(absl::StrCat("device buffer of ", bytes, " bytes"));
  DeviceScope scope(device);
  if (!scope.status().ok()) {
    return absl::FailedPreconditionError(absl::StrCat("CUDA device ", device, " is not available"));
  }
  void* p = nullptr;
  LCE_CUDA_CHECK(cudaMalloc(&p, static_cast<size_t>(bytes)));
  return std::unique_ptr<DeviceBuffer>(new CudaDeviceBuffer(p, bytes, device));
}

absl::StatusOr<std::unique_ptr<DeviceTransfer>> CreateDeviceTransfer(int device, int64_t piece_bytes) {
  if (piece_bytes <= 0) return absl::InvalidArgumentError(absl::StrCat("transfer pieces of ", piece_bytes, " bytes"));
  auto t = std::make_unique<CudaDeviceTransfer>(device, piece_bytes);
  if (absl::Status s = t->Init(); !s.ok()) return s;
  return std::unique_ptr<DeviceTransfer>(std::move(t));
}

absl::StatusOr<std::unique_ptr<PinnedHostRange>> PinHostMemory(void* data, int64_t bytes, int device) {
  DeviceScope scope(device);
  LCE_CUDA_CHECK(scope.status());
  const cudaError_t e = cudaHostRegister(data, static_cast<size_t>(bytes), cudaHostRegisterDefault);
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
  DeviceScope scope(device);
  LCE_CUDA_CHECK(scope.status());
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), kCudaIpcHandleBytes);
  void* p = nullptr;
  const cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls do not see it
    return absl::InvalidArgumentError(absl::StrCat("cudaIpcOpenMemHandle refused the handle: ", cudaGetErrorName(e),
                                                   " (", cudaGetErrorString(e),
                                                   "); it must come from cudaIpcGetMemHandle in another live process "
                                                   "on this host, for memory that is still allocated"));
  }
  absl::StatusOr<int64_t> size = AllocationSize(p);
  if (!size.ok()) {
    cudaIpcCloseMemHandle(p);
    return size.status();
  }
  return std::unique_ptr<ImportedDeviceMemory>(new CudaIpcMemory(p, *size, device));
}

#else

absl::StatusOr<int64_t> DeviceMemoryBytes(int) { return absl::UnimplementedError("this build has no CUDA backend"); }

absl::StatusOr<std::unique_ptr<DeviceBuffer>> AllocateDeviceBuffer(int64_t, int) {
  return absl::UnimplementedError("this build has no CUDA backend");
}

absl::StatusOr<std::unique_ptr<DeviceTransfer>> CreateDeviceTransfer(int, int64_t) {
  return absl::UnimplementedError("this build has no CUDA backend");
}

absl::StatusOr<std::unique_ptr<PinnedHostRange>> PinHostMemory(void*, int64_t, int) {
  return absl::UnimplementedError("this build has no CUDA backend");
}

absl::StatusOr<std::unique_ptr<ImportedDeviceMemory>> ImportCudaIpcMemory(absl::string_view, int) {
  return absl::UnimplementedError("this build has no CUDA backend: CUDA IPC regions are not available");
}

#endif

}  // namespace lce
