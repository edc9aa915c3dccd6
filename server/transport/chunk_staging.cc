#include "chunk_staging.h"

#include <cstring>
#include <map>
#include <vector>

#ifdef LCE_WITH_CUDA
#include "cuda/cuda_check.h"
#endif

namespace lce::server {
namespace {

class HostStaging final : public ChunkStaging {
 public:
  bool device() const override { return false; }
  void* stream() override { return nullptr; }
  absl::StatusOr<void*> Buffer(int slot, int64_t bytes) override {
    std::vector<uint8_t>& b = buffers_[slot];
    if (static_cast<int64_t>(b.size()) < bytes) b.resize(static_cast<size_t>(bytes));
    return static_cast<void*>(b.data());
  }
  absl::Status UploadAsync(void* dst, const void* src, int64_t bytes) override {
    if (bytes > 0 && dst != src) std::memcpy(dst, src, static_cast<size_t>(bytes));
    return absl::OkStatus();
  }
  absl::Status DownloadAsync(void* dst, const void* src, int64_t bytes) override { return UploadAsync(dst, src, bytes); }
  absl::Status Sync() override { return absl::OkStatus(); }

 private:
  std::map<int, std::vector<uint8_t>> buffers_;
};

#ifdef LCE_WITH_CUDA
class DeviceStaging final : public ChunkStaging {
 public:
  explicit DeviceStaging(cudaStream_t s) : stream_(s) {}
  ~DeviceStaging() override {
    for (auto& [_, b] : buffers_) cudaFree(b.first);
    cudaStreamDestroy(stream_);
  }
  bool device() const override { return true; }
  void* stream() override { return stream_; }
  absl::StatusOr<void*> Buffer(int slot, int64_t bytes) override {
    auto& b = buffers_[slot];
    if (b.second < bytes) {
      LCE_CUDA_CHECK(cudaFree(b.first));
      b = {nullptr, 0};
      LCE_CUDA_CHECK(cudaMalloc(&b.first, static_cast<size_t>(bytes)));
      b.second = bytes;
    }
    return b.first;
  }
  absl::Status UploadAsync(void* dst, const void* src, int64_t bytes) override {
    if (bytes == 0) return absl::OkStatus();
    LCE_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyHostToDevice, stream_));
    return absl::OkStatus();
  }
  absl::Status DownloadAsync(void* dst, const void* src, int64_t bytes) override {
    if (bytes == 0) return absl::OkStatus();
    LCE_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToHost, stream_));
    return absl::OkStatus();
  }
  absl::Status Sync() override {
    LCE_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

 private:
  cudaStream_t stream_;
  std::map<int, std::pair<void*, int64_t>> buffers_;
};
#endif

}  // namespace

std::unique_ptr<ChunkStaging> CreateHostStaging() { return std::make_unique<HostStaging>(); }

#ifdef LCE_WITH_CUDA
absl::StatusOr<std::unique_ptr<ChunkStaging>> CreateDeviceStaging(int device) {
  LCE_CUDA_CHECK(cudaSetDevice(device));
  cudaStream_t s;
  LCE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return std::unique_ptr<ChunkStaging>(new DeviceStaging(s));
}
#endif

}  // namespace lce::server
