// Collectives over the ranks of a tensor-parallel group, as the engine needs them. Implemented
// outside kernels/ (NCCL on GPUs, Gloo on CPUs); the engine only calls this interface.
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace lce {

enum class ReduceOp : uint8_t { kSum, kMax };

class Collectives {
 public:
  virtual ~Collectives() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // In-place all-reduce of `count` floats. `device_memory` says whether data is device memory (then
  // `stream` is the cudaStream_t the reduction is ordered on) or host memory (stream unused).
  virtual absl::Status AllReduce(float* data, int64_t count, ReduceOp op, bool device_memory,
                                 void* stream) = 0;
  // In-place sum of `count` floats into rank 0's `data`; the other ranks' `data` is left unspecified.
  // This default all-reduces (every rank gets the sum); a reduce moves half an all-reduce's bytes.
  virtual absl::Status ReduceSumToRoot(float* data, int64_t count, bool device_memory, void* stream) {
    return AllReduce(data, count, ReduceOp::kSum, device_memory, stream);
  }
  // Exact all-reduces for results that must not depend on the group (d_hidden's exact leaf sum): the
  // element-wise max of `count` bytes, and the sum of `count` int32 (integers: any order, the same sum).
  // The defaults say the communicator has none.
  virtual absl::Status AllReduceMaxBytes(uint8_t* data, int64_t count, bool device_memory, void* stream) {
    (void)data, (void)count, (void)device_memory, (void)stream;
    return absl::UnimplementedError("this communicator has no byte max all-reduce");
  }
  virtual absl::Status AllReduceSumInt32(int32_t* data, int64_t count, bool device_memory, void* stream) {
    (void)data, (void)count, (void)device_memory, (void)stream;
    return absl::UnimplementedError("this communicator has no int32 sum all-reduce");
  }
  // Into rank 0's `data` alone (the others' left unspecified); this default all-reduces.
  virtual absl::Status ReduceSumInt32ToRoot(int32_t* data, int64_t count, bool device_memory, void* stream) {
    return AllReduceSumInt32(data, count, device_memory, stream);
  }
};

}  // namespace lce
