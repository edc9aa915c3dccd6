// TpCommunicator over NCCL (one process per GPU). Rank 0 writes the NCCL unique id into the
// rendezvous directory (nccl-id, written atomically); the other ranks wait for it. Every
// collective is enqueued on the caller's stream and then watched: if it has not completed within
// the timeout, or NCCL reports an asynchronous error, the communicator is aborted (ncclCommAbort)
// and the call returns UNAVAILABLE naming the dead rank where it can be identified.
#include <nccl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "cuda/cuda_check.h"
#include "tp_communicator.h"

namespace lce::cuda {
inline absl::Status ToStatus(ncclResult_t e, const char* what, const char* file, int line) {
  if (e == ncclSuccess) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat("NCCL error ", ncclGetErrorString(e), " in ", what, " at ", file, ":", line));
}
}  // namespace lce::cuda

namespace lce::server {
namespace {

namespace fs = std::filesystem;

class NcclCommunicator final : public TpCommunicator {
 public:
  NcclCommunicator(TpBootstrap b, ncclComm_t comm) : bootstrap_(std::move(b)), comm_(comm) {}
  ~NcclCommunicator() override {
    if (!aborted_.exchange(true)) ncclCommDestroy(comm_);  // an aborted communicator is already freed
  }

  int rank() const override { return bootstrap_.rank; }
  int world_size() const override { return bootstrap_.world_size; }
  bool device_memory() const override { return true; }

  absl::Status AllReduce(float* data, int64_t count, ReduceOp op, bool device_memory, void* stream) override {
    if (!device_memory) return absl::InvalidArgumentError("the NCCL communicator takes device memory only");
    if (aborted_) return Down();
    LCE_CUDA_CHECK(ncclAllReduce(data, data, static_cast<size_t>(count), ncclFloat,
                                 op == ReduceOp::kSum ? ncclSum : ncclMax, comm_, static_cast<cudaStream_t>(stream)));
    return Watch(static_cast<cudaStream_t>(stream), "all-reduce");
  }

  absl::Status ReduceSumToRoot(float* data, int64_t count, bool device_memory, void* stream) override {
    if (!device_memory) return absl::InvalidArgumentError("the NCCL communicator takes device memory only");
    if (aborted_) return Down();
    LCE_CUDA_CHECK(ncclReduce(data, data, static_cast<size_t>(count), ncclFloat, ncclSum, /*root=*/0, comm_,
                              static_cast<cudaStream_t>(stream)));
    return Watch(static_cast<cudaStream_t>(stream), "reduce");
  }

  absl::Status AllReduceMaxBytes(uint8_t* data, int64_t count, bool device_memory, void* stream) override {
    return Collective(data, count, ncclUint8, ncclMax, /*root=*/-1, device_memory, stream);
  }
  absl::Status AllReduceSumInt32(int32_t* data, int64_t count, bool device_memory, void* stream) override {
    return Collective(data, count, ncclInt32, ncclSum, /*root=*/-1, device_memory, stream);
  }
  absl::Status ReduceSumInt32ToRoot(int32_t* data, int64_t count, bool device_memory, void* stream) override {
    return Collective(data, count, ncclInt32, ncclSum, /*root=*/0, device_memory, stream);
  }

  absl::Status Broadcast(void* data, int64_t bytes, bool device_memory, void* stream, int root) override {
    if (!device_memory) return absl::InvalidArgumentError("the NCCL communicator takes device memory only");
    if (aborted_) return Down();
    if (bytes == 0) return absl::OkStatus();
    LCE_CUDA_CHECK(ncclBroadcast(data, data, static_cast<size_t>(bytes), ncclUint8, root, comm_,
                                 static_cast<cudaStream_t>(stream)));
    return Watch(static_cast<cudaStream_t>(stream), "broadcast");
  }

  void Abort() override {
    if (!aborted_.exchange(true)) ncclCommAbort(comm_);
  }

 private:
  // An all-reduce (root < 0) or a reduce into root of `count` elements of `type`, watched.
  absl::Status Collective(void* data, int64_t count, ncclDataType_t type, ncclRedOp_t op, int root, bool device_memory,
                          void* stream) {
    if (!device_memory) return absl::InvalidArgumentError("the NCCL communicator takes device memory only");
    if (aborted_) return Down();
    const auto s = static_cast<cudaStream_t>(stream);
    if (root < 0) {
      LCE_CUDA_CHECK(ncclAllReduce(data, data, static_cast<size_t>(count), type, op, comm_, s));
      return Watch(s, "all-reduce");
    }
    LCE_CUDA_CHECK(ncclReduce(data, data, static_cast<size_t>(count), type, op, root, comm_, s));
    return Watch(s, "reduce");
  }

  absl::Status Down() const {
    return absl::UnavailableError(absl::StrCat(bootstrap_.group, " group is down (aborted after a peer failure)"));
  }

  // The watchdog: polls the stream until the collective is done; on timeout or an asynchronous
  // NCCL error, aborts the communicator so that nothing stays stuck on the GPU.
  absl::Status Watch(cudaStream_t stream, const char* what) {
    const auto deadline = std::chrono::steady_clock::now() + absl::ToChronoMilliseconds(bootstrap_.timeout);
    for (int spin = 0;; ++spin) {
      const cudaError_t q = cudaStreamQuery(stream);
      if (q == cudaSuccess) return absl::OkStatus();
      if (q != cudaErrorNotReady) LCE_CUDA_CHECK(q);
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async);
      const bool late = std::chrono::steady_clock::now() > deadline;
      if (async != ncclSuccess || late) {
        if (!aborted_.exchange(true)) ncclCommAbort(comm_);
        return absl::UnavailableError(absl::StrCat(bootstrap_.group, " ", what, " failed on ", bootstrap_.member, " ",
                                                   bootstrap_.rank, ": ",
                                                   DescribeDeadPeers(bootstrap_),
                                                   async != ncclSuccess ? absl::StrCat(" (NCCL: ", ncclGetErrorString(async), ")")
                                                                        : std::string(" (watchdog timeout)")));
      }
      if (spin > 64) std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  TpBootstrap bootstrap_;
  ncclComm_t comm_;
  std::atomic<bool> aborted_{false};
};

}  // namespace

absl::StatusOr<std::unique_ptr<TpCommunicator>> CreateNcclCommunicator(const TpBootstrap& b, int device) {
  if (b.world_size < 1 || b.rank < 0 || b.rank >= b.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("bad ", b.group, " ", b.member, " ", b.rank, " of ", b.world_size));
  }
  std::error_code ec;
  fs::create_directories(b.rendezvous_dir, ec);
  {
    std::ofstream pid(fs::path(b.rendezvous_dir) / absl::StrCat("rank-", b.rank, ".pid"));
    pid << ::getpid() << "\n";
  }
  LCE_CUDA_CHECK(cudaSetDevice(device));
  ncclUniqueId id;
  const fs::path id_path = fs::path(b.rendezvous_dir) / "nccl-id";
  if (b.rank == 0) {
    LCE_CUDA_CHECK(ncclGetUniqueId(&id));
    const fs::path tmp = fs::path(b.rendezvous_dir) / "nccl-id.tmp";
    std::ofstream(tmp, std::ios::binary).write(id.internal, sizeof(id.internal));
    fs::rename(tmp, id_path, ec);
    if (ec) return absl::InternalError(absl::StrCat("cannot publish the NCCL id in ", b.rendezvous_dir, ": ", ec.message()));
  } else {
    const absl::Duration join = b.join_timeout > absl::ZeroDuration() ? b.join_timeout : b.timeout;
    const auto deadline = std::chrono::steady_clock::now() + absl::ToChronoMilliseconds(join);
    while (!fs::exists(id_path)) {
      if (std::chrono::steady_clock::now() > deadline) {
        return absl::UnavailableError(absl::StrCat(b.member, " ", b.rank, ": ", b.member, " 0 published no NCCL id in ",
                                                   b.rendezvous_dir));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    std::ifstream(id_path, std::ios::binary).read(id.internal, sizeof(id.internal));
  }
  ncclComm_t comm;
  LCE_CUDA_CHECK(ncclCommInitRank(&comm, b.world_size, id, b.rank));
  return std::unique_ptr<TpCommunicator>(new NcclCommunicator(b, comm));
}

}  // namespace lce::server
