// The tensor-parallel group's communication: the engine's Collectives (all-reduce) plus the
// front's broadcast of each chunk to its peers. Gloo over TCP on CPUs; NCCL on GPUs.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "lce/collectives.h"
#include "metrics.h"

namespace lce::server {

class TpCommunicator : public Collectives {
 public:
  // Broadcasts `bytes` bytes from rank `root` to every rank, in place; complete on return (device memory:
  // with everything queued on `stream` before it).
  virtual absl::Status Broadcast(void* data, int64_t bytes, bool device_memory, void* stream, int root = 0) = 0;
  // Makes every later collective fail at once with UNAVAILABLE (after a peer failure).
  virtual void Abort() = 0;
  // True when collectives move device memory (NCCL): chunks are then staged on the GPU.
  virtual bool device_memory() const { return false; }
};

// How the ranks find each other: a directory every rank can read and write (one host, or a shared
// file system). Rank r writes rank-<r>.pid there; the Gloo file store (and NCCL's unique id, which
// rank 0 writes as nccl-id) live there too.
struct TpBootstrap {
  int rank = 0;
  int world_size = 1;
  std::string rendezvous_dir;
  std::string host = "127.0.0.1";        // address this rank listens on for its peers
  absl::Duration timeout = absl::Seconds(30);  // any collective that takes longer fails
  // How long to wait at start for the others to join (0: `timeout`).
  absl::Duration join_timeout = absl::ZeroDuration();
  // What messages call the group and its members (data-parallel links: "data-parallel", "replica").
  std::string group = "tensor-parallel";
  std::string member = "rank";
};

absl::StatusOr<std::unique_ptr<TpCommunicator>> CreateGlooCommunicator(const TpBootstrap& bootstrap);

#ifdef LCE_WITH_CUDA
// One process per GPU: `device` is this rank's CUDA device.
absl::StatusOr<std::unique_ptr<TpCommunicator>> CreateNcclCommunicator(const TpBootstrap& bootstrap, int device);
#endif

// Wraps a communicator so that the wall time of every collective is added to `seconds`, and to
// `bytes` what this rank put into them (an all-reduce's count × 4, a broadcast's bytes); every rank
// takes part in every collective with the same size, so one rank's count tells the group's traffic.
std::unique_ptr<TpCommunicator> TimeCollectives(std::unique_ptr<TpCommunicator> inner, metrics::Counter* seconds,
                                                metrics::Counter* bytes);

// After a collective failed: names the members whose process is gone (pid files in the rendezvous
// directory, same host), e.g. "rank 2 (pid 1234) exited"; or says none could be identified.
std::string DescribeDeadPeers(const TpBootstrap& bootstrap);

}  // namespace lce::server
