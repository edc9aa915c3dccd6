// Where the tensor-parallel front and its peers hold a chunk while they broadcast and compute it:
// host memory for Gloo, device memory (and one CUDA stream) for NCCL.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"

namespace lce::server {

class ChunkStaging {
 public:
  virtual ~ChunkStaging() = default;
  // True when buffers are device memory (engine calls then use MemorySpace::kDevice).
  virtual bool device() const = 0;
  // The cudaStream_t collectives on these buffers are ordered on (null for host staging).
  virtual void* stream() = 0;
  // Buffer number `slot`, at least `bytes` long (grown as needed, contents not kept when grown).
  virtual absl::StatusOr<void*> Buffer(int slot, int64_t bytes) = 0;
  // Copies between the caller's host memory and a staging buffer, queued in order: the host memory
  // must stay as it is until Sync() returns, when every queued copy is complete. (One wait for all
  // the small arrays of a chunk, not one each: each wait is a GPU bubble between engine calls.)
  virtual absl::Status UploadAsync(void* dst, const void* host_src, int64_t bytes) = 0;
  virtual absl::Status DownloadAsync(void* host_dst, const void* src, int64_t bytes) = 0;
  virtual absl::Status Sync() = 0;
  // The same, complete on return.
  absl::Status Upload(void* dst, const void* host_src, int64_t bytes) {
    absl::Status s = UploadAsync(dst, host_src, bytes);
    return s.ok() ? Sync() : s;
  }
  absl::Status Download(void* host_dst, const void* src, int64_t bytes) {
    absl::Status s = DownloadAsync(host_dst, src, bytes);
    return s.ok() ? Sync() : s;
  }
};

std::unique_ptr<ChunkStaging> CreateHostStaging();
#ifdef LCE_WITH_CUDA
absl::StatusOr<std::unique_ptr<ChunkStaging>> CreateDeviceStaging(int device);
#endif

}  // namespace lce::server
