// Device memory that another process on this host shares with us through CUDA IPC
// (cudaIpcGetMemHandle there, cudaIpcOpenMemHandle here): co-located clients hand the server their
// GPU tensors this way, so hidden states and d_hidden never cross a wire or the host.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace lce {

// Bytes of a cudaIpcMemHandle_t.
inline constexpr size_t kCudaIpcHandleBytes = 64;

// An opened allocation of another process; closed (cudaIpcCloseMemHandle) when destroyed.
class ImportedDeviceMemory {
 public:
  virtual ~ImportedDeviceMemory() = default;
  // Device pointer to the start of the exporter's allocation (valid on `device()`).
  virtual uint8_t* data() const = 0;
  // Size of that allocation in bytes, as the driver reports it (bounds for every slice).
  virtual int64_t size() const = 0;
  virtual int device() const = 0;
};

// Host memory registered with CUDA (cudaHostRegister: page-locked and mapped for DMA), so that
// copies between it and a GPU run at the bus's speed; unregistered when destroyed.
class PinnedHostRange {
 public:
  virtual ~PinnedHostRange() = default;
};

// Pins [data, data + bytes) for copies to and from `device`'s context. UNIMPLEMENTED without CUDA;
// INTERNAL when the driver refuses (e.g. over the locked-memory limit).
absl::StatusOr<std::unique_ptr<PinnedHostRange>> PinHostMemory(void* data, int64_t bytes, int device);

// Device memory of our own (cudaMalloc), freed when destroyed.
class DeviceBuffer {
 public:
  virtual ~DeviceBuffer() = default;
  virtual uint8_t* data() const = 0;
  virtual int64_t size() const = 0;
};

// Total memory of `device`, in bytes (what caps a head's size there). UNIMPLEMENTED without CUDA;
// FAILED_PRECONDITION: no such device.
absl::StatusOr<int64_t> DeviceMemoryBytes(int device);

// `bytes` of device memory on `device`. RESOURCE_EXHAUSTED: the GPU has not that much free;
// UNIMPLEMENTED without CUDA.
absl::StatusOr<std::unique_ptr<DeviceBuffer>> AllocateDeviceBuffer(int64_t bytes, int device);

// Moves bytes between a host-side producer or consumer (a socket) and device memory, piece by piece
// through two page-locked bounce buffers, so that each piece's copy to or from the GPU overlaps the
// host side's work on the next one. One transfer at a time; one per thread.
class DeviceTransfer {
 public:
  virtual ~DeviceTransfer() = default;
  // Fills [dst, dst + bytes) of device memory: `produce(p, n)` writes the next n bytes at p
  // (false: it failed; the transfer stops and CANCELLED is returned). Complete on return.
  virtual absl::Status ToDevice(uint8_t* dst, int64_t bytes, const std::function<bool(uint8_t*, size_t)>& produce) = 0;
  // Drains [src, src + bytes) of device memory: `consume(p, n)` takes the next n bytes from p.
  virtual absl::Status FromDevice(const uint8_t* src, int64_t bytes,
                                  const std::function<bool(const uint8_t*, size_t)>& consume) = 0;
};

// A transfer on `device` with pieces of `piece_bytes`. UNIMPLEMENTED without CUDA.
absl::StatusOr<std::unique_ptr<DeviceTransfer>> CreateDeviceTransfer(int device, int64_t piece_bytes);

// Opens `handle` (kCudaIpcHandleBytes bytes) on CUDA device `device`. INVALID_ARGUMENT: a handle of
// the wrong length, or one the driver refuses (not exported, already freed, this process's own);
// UNIMPLEMENTED: a build without CUDA; FAILED_PRECONDITION: no such device.
absl::StatusOr<std::unique_ptr<ImportedDeviceMemory>> ImportCudaIpcMemory(absl::string_view handle, int device);

}  // namespace lce
