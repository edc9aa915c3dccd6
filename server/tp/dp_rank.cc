#include "dp_rank.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "status_macros.h"
#include "tp_group.h"

namespace lce::server {
namespace {

namespace fs = std::filesystem;

// dW moves between replicas in pieces of this many floats (each one collective, under its timeout).
constexpr int64_t kPieceFloats = int64_t{16} << 20;

fs::path FormedMarker(const DpOptions& o) { return fs::path(o.rendezvous) / "formed"; }

// "replica 1, replica 3": the replicas whose slot in `slots` is non-zero.
std::string NameReplicas(const std::vector<float>& slots) {
  std::vector<std::string> names;
  for (size_t d = 0; d < slots.size(); ++d) {
    if (slots[d] != 0.0f) names.push_back(absl::StrCat("replica ", d));
  }
  return absl::StrJoin(names, ", ");
}

}  // namespace

absl::Status CheckRendezvousDirectory(const std::string& dir) {
  if (dir.empty()) return absl::InvalidArgumentError("a data-parallel job needs --dp-rendezvous");
  std::error_code ec;
  const fs::path parent = fs::path(dir).parent_path();
  if (!parent.empty()) fs::create_directories(parent, ec);
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return absl::PermissionDeniedError(absl::StrCat("cannot create --dp-rendezvous ", dir, ": ", std::strerror(errno)));
  }
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) {
    return absl::PermissionDeniedError(absl::StrCat("cannot stat --dp-rendezvous ", dir, ": ", std::strerror(errno)));
  }
  // Whoever can write it can name any address as a front's: the job's calls, with the clients'
  // tokens, would go there.
  if (!S_ISDIR(st.st_mode) || st.st_uid != ::geteuid() || (st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    return absl::PermissionDeniedError(absl::StrCat(
        "--dp-rendezvous ", dir, " is not this job's to trust: it must be a directory (not a link) owned by uid ",
        ::geteuid(), " and writable by no one else (it is ", S_ISDIR(st.st_mode) ? "a directory" : "not a directory",
        " of uid ", st.st_uid, ", mode ", absl::StrFormat("%04o", st.st_mode & 07777),
        "); use a fresh directory of your own"));
  }
  return absl::OkStatus();
}

TpBootstrap DpBootstrap(const DpOptions& o, const std::string& sub, const std::string& group) {
  TpBootstrap b;
  b.rank = o.replica;
  b.world_size = o.size;
  b.rendezvous_dir = (fs::path(o.rendezvous) / sub).string();
  b.host = o.host;
  b.timeout = o.timeout;
  b.join_timeout = o.join_timeout;
  b.group = group;
  b.member = "replica";
  return b;
}

absl::Status CheckDpJobIsNew(const DpOptions& o) {
  if (!fs::exists(FormedMarker(o))) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "the data-parallel job in ", o.rendezvous, " formed before this process started: a replica that restarts alone ",
      "cannot join it again; restart the whole job with a fresh --dp-rendezvous directory"));
}

absl::Status MarkDpJobFormed(const DpOptions& o) {
  std::ofstream out(FormedMarker(o));
  out << "formed\n";
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", FormedMarker(o).string()));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<DpRank>> DpRank::Join(const DpOptions& o, int tp_rank, bool cuda, int device) {
  LCE_RETURN_IF_ERROR(CheckRendezvousDirectory(o.rendezvous));  // before any link reads it
  const TpBootstrap b = DpBootstrap(o, absl::StrCat("tp-", tp_rank), absl::StrCat("data-parallel link of rank ", tp_rank));
  absl::StatusOr<std::unique_ptr<TpCommunicator>> comm;
  std::unique_ptr<ChunkStaging> staging;
  if (cuda) {
#ifdef LCE_WITH_CUDA
    absl::StatusOr<std::unique_ptr<ChunkStaging>> st = CreateDeviceStaging(device);
    if (!st.ok()) return st.status();
    staging = *std::move(st);
    comm = CreateNcclCommunicator(b, device);
#else
    (void)device;
    return absl::FailedPreconditionError("data-parallel links between GPUs need a CUDA build (NCCL)");
#endif
  } else {
    staging = CreateHostStaging();
    comm = CreateGlooCommunicator(b);
  }
  if (!comm.ok()) return comm.status();
  return std::unique_ptr<DpRank>(new DpRank(o, *std::move(comm), std::move(staging)));
}

absl::Status DpRank::health() const {
  std::lock_guard<std::mutex> lock(mu_);
  return health_;
}

absl::Status DpRank::Lose(const absl::Status& why) {
  comm_->Abort();  // the other replicas' collectives on this link then fail at once
  std::lock_guard<std::mutex> lock(mu_);
  if (health_.ok()) {
    health_ = absl::AbortedError(absl::StrCat("replica ", options_.replica, "'s training is down until the job restarts: ",
                                              why.message()));
  }
  return health_;
}

absl::StatusOr<std::vector<float>> DpRank::ReplicasNotReady(bool group_ready) {
  std::vector<float> slots(static_cast<size_t>(options_.size), 0.0f);
  slots[options_.replica] = group_ready ? 0.0f : 1.0f;
  absl::Status s = AllReduceFloats(*comm_, *staging_, slots.data(), options_.size, ReduceOp::kMax);
  if (!s.ok()) return s;
  return slots;
}

absl::Status DpRank::SumGrad(HeadTrainer& trainer) {
  const bool device = trainer.grad_space() == MemorySpace::kDevice;
  if (device != comm_->device_memory()) {
    return absl::FailedPreconditionError(absl::StrCat("dW is in ", device ? "device" : "host", " memory, which the ",
                                                      "data-parallel link does not move"));
  }
  float* grad = trainer.grad();
  const int64_t n = trainer.grad_elements();
  for (int64_t i = 0; i < n; i += kPieceFloats) {
    const int64_t count = std::min(kPieceFloats, n - i);
    LCE_RETURN_IF_ERROR(comm_->AllReduce(grad + i, count, ReduceOp::kSum, device, trainer.stream()));
  }
  return absl::OkStatus();
}

absl::Status DpRank::Reduce(const absl::Status& ready, HeadTrainer* trainer, TpCommunicator* tp, ChunkStaging* tp_staging) {
  // This replica's group first: can every rank step, and are all their links up?
  float group[2] = {ready.ok() ? 0.0f : 1.0f, health().ok() ? 0.0f : 1.0f};
  if (tp != nullptr) {
    LCE_RETURN_IF_ERROR(AllReduceFloats(*tp, *tp_staging, group, 2, ReduceOp::kMax));  // the group's
  }
  if (group[1] != 0.0f) return Lose(absl::AbortedError("a data-parallel link of this replica failed before"));
  // Then every replica's group; dW is summed only when all can step, so that a step not taken leaves
  // every replica's dW as it was.
  absl::StatusOr<std::vector<float>> not_ready = ReplicasNotReady(group[0] == 0.0f);
  absl::Status link = not_ready.status();
  const bool all_ready = link.ok() && NameReplicas(*not_ready).empty();
  if (all_ready) link = SumGrad(*trainer);
  // A link that failed on any rank of this replica takes the replica's training down on all of them.
  float lost = link.ok() ? 0.0f : 1.0f;
  if (tp != nullptr) {
    LCE_RETURN_IF_ERROR(AllReduceFloats(*tp, *tp_staging, &lost, 1, ReduceOp::kMax));
  }
  if (lost != 0.0f) return Lose(link.ok() ? absl::AbortedError("another rank's data-parallel link failed") : link);
  if (!ready.ok()) return ready;
  if (!all_ready) {
    return absl::FailedPreconditionError(absl::StrCat("the step was not taken: ", NameReplicas(*not_ready),
                                                      " could not prepare it (its log says why)"));
  }
  return absl::OkStatus();
}

}  // namespace lce::server
