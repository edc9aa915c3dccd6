// TpCommunicator over Gloo (TCP, full mesh), bootstrapped through a file store.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gloo/allreduce.h"
#include "gloo/broadcast.h"
#include "gloo/math.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/file_store.h"
#include "gloo/transport/tcp/device.h"
#include "tp_communicator.h"

namespace lce::server {
namespace {

class GlooCommunicator final : public TpCommunicator {
 public:
  using ReduceFn = void (*)(void*, const void*, const void*, size_t);
  GlooCommunicator(TpBootstrap b, std::shared_ptr<gloo::rendezvous::Context> ctx)
      : bootstrap_(std::move(b)), ctx_(std::move(ctx)) {}

  int rank() const override { return bootstrap_.rank; }
  int world_size() const override { return bootstrap_.world_size; }

  absl::Status AllReduce(float* data, int64_t count, ReduceOp op, bool device_memory, void*) override {
    return HostAllReduce(
        data, count, device_memory,
        op == ReduceOp::kSum ? static_cast<ReduceFn>(&gloo::sum<float>) : static_cast<ReduceFn>(&gloo::max<float>));
  }
  absl::Status AllReduceMaxBytes(uint8_t* data, int64_t count, bool device_memory, void*) override {
    return HostAllReduce(data, count, device_memory, static_cast<ReduceFn>(&gloo::max<uint8_t>));
  }
  absl::Status AllReduceSumInt32(int32_t* data, int64_t count, bool device_memory, void*) override {
    return HostAllReduce(data, count, device_memory, static_cast<ReduceFn>(&gloo::sum<int32_t>));
  }

  absl::Status Broadcast(void* data, int64_t bytes, bool device_memory, void*, int root) override {
    if (device_memory) return absl::InvalidArgumentError("the Gloo communicator takes host memory only");
    if (bytes == 0) return absl::OkStatus();
    return Guard("broadcast", [&](const std::shared_ptr<gloo::rendezvous::Context>& ctx) {
      gloo::BroadcastOptions opts(ctx);
      opts.setOutput(static_cast<uint8_t*>(data), static_cast<size_t>(bytes));
      opts.setRoot(root);
      opts.setTag(2);
      gloo::broadcast(opts);
    });
  }

  // Also lets the context go, which closes its connections once no collective runs on it: the other
  // members' collectives then fail at once rather than at their timeout.
  void Abort() override {
    aborted_ = true;
    std::atomic_store(&ctx_, std::shared_ptr<gloo::rendezvous::Context>());
  }

 private:
  // A host all-reduce of `count` T with the reduction `fn` (gloo::sum / gloo::max of T).
  template <typename T>
  absl::Status HostAllReduce(T* data, int64_t count, bool device_memory, ReduceFn fn) {
    if (device_memory) return absl::InvalidArgumentError("the Gloo communicator takes host memory only");
    return Guard("all-reduce", [&](const std::shared_ptr<gloo::rendezvous::Context>& ctx) {
      gloo::AllreduceOptions opts(ctx);
      opts.setOutput(data, static_cast<size_t>(count));
      opts.setTag(1);
      opts.setReduceFunction(fn);
      gloo::allreduce(opts);
    });
  }
  template <typename F>
  absl::Status Guard(const char* what, F&& f) {
    std::shared_ptr<gloo::rendezvous::Context> ctx = std::atomic_load(&ctx_);
    if (aborted_ || ctx == nullptr) {
      return absl::UnavailableError(absl::StrCat(bootstrap_.group, " group is down (aborted after a peer failure)"));
    }
    try {
      f(ctx);
      return absl::OkStatus();
    } catch (const std::exception& e) {
      Abort();  // a failed Gloo context cannot be reused: the group restarts as a unit
      return absl::UnavailableError(absl::StrCat(bootstrap_.group, " ", what, " failed on ", bootstrap_.member, " ",
                                                 bootstrap_.rank, ": ", DescribeDeadPeers(bootstrap_), " (", e.what(), ")"));
    }
  }

  TpBootstrap bootstrap_;
  std::shared_ptr<gloo::rendezvous::Context> ctx_;
  std::atomic<bool> aborted_{false};
};

}  // namespace

namespace {

// A process is gone when it no longer exists or is a zombie (exited, not yet reaped).
bool ProcessGone(long pid) {
  if (::kill(static_cast<pid_t>(pid), 0) != 0) return errno == ESRCH;
  std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  std::getline(stat, line);
  const size_t paren = line.rfind(')');
  return paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'Z';
}

}  // namespace

std::string DescribeDeadPeers(const TpBootstrap& b) {
  std::vector<std::string> dead;
  // A killed peer's sockets close while it is still exiting, before it is a zombie: the reset that
  // brought us here can beat the process table, so look again for up to a second.
  for (int attempt = 0; attempt < 50 && dead.empty(); ++attempt) {
    if (attempt > 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    for (int r = 0; r < b.world_size; ++r) {
      if (r == b.rank) continue;
      std::ifstream in(std::filesystem::path(b.rendezvous_dir) / absl::StrCat("rank-", r, ".pid"));
      long pid = 0;
      if (in >> pid && pid > 0 && ProcessGone(pid)) {
        dead.push_back(absl::StrCat(b.member, " ", r, " (pid ", pid, ") exited"));
      }
    }
  }
  if (dead.empty()) {
    return absl::StrCat("a peer did not answer within ", absl::FormatDuration(b.timeout),
                        " (no dead ", b.member, " process found on this host)");
  }
  return absl::StrJoin(dead, ", ");
}

absl::StatusOr<std::unique_ptr<TpCommunicator>> CreateGlooCommunicator(const TpBootstrap& b) {
  if (b.world_size < 1 || b.rank < 0 || b.rank >= b.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("bad ", b.group, " ", b.member, " ", b.rank, " of ", b.world_size));
  }
  if (b.rendezvous_dir.empty()) return absl::InvalidArgumentError(absl::StrCat(b.group, " rendezvous directory is required"));
  std::error_code ec;
  std::filesystem::create_directories(b.rendezvous_dir, ec);
  {
    std::ofstream pid(std::filesystem::path(b.rendezvous_dir) / absl::StrCat("rank-", b.rank, ".pid"));
    pid << ::getpid() << "\n";
  }
  try {
    gloo::transport::tcp::attr attr(b.host.c_str());
    auto device = gloo::transport::tcp::CreateDevice(attr);
    auto ctx = std::make_shared<gloo::rendezvous::Context>(b.rank, b.world_size);
    const absl::Duration join = b.join_timeout > absl::ZeroDuration() ? b.join_timeout : b.timeout;
    ctx->setTimeout(absl::ToChronoMilliseconds(join));
    std::filesystem::create_directories(std::filesystem::path(b.rendezvous_dir) / "gloo", ec);
    gloo::rendezvous::FileStore store((std::filesystem::path(b.rendezvous_dir) / "gloo").string());
    // Every member announces itself and waits for all the others, as long as the join may take
    // (members start at different times: a replica's front joins after loading its head); the
    // mesh's own waits for addresses are store.get's fixed 30 s.
    std::vector<std::string> members;
    for (int r = 0; r < b.world_size; ++r) members.push_back(absl::StrCat("joined_", r));
    store.set(members[b.rank], {'1'});
    store.wait(members, absl::ToChronoMilliseconds(join));
    ctx->connectFullMesh(store, device);
    ctx->setTimeout(absl::ToChronoMilliseconds(b.timeout));  // every collective's, from now on
    return std::unique_ptr<TpCommunicator>(new GlooCommunicator(b, std::move(ctx)));
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat(b.group, " bootstrap of ", b.member, " ", b.rank, " of ", b.world_size,
                                               " failed: ", e.what()));
  }
}

}  // namespace lce::server
