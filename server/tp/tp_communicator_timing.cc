// TimeCollectives: a TpCommunicator decorator that feeds lce_collective_seconds_total and
// lce_collective_bytes_total.
#include <chrono>

#include "tp_communicator.h"

namespace lce::server {
namespace {

class TimedCommunicator final : public TpCommunicator {
 public:
  TimedCommunicator(std::unique_ptr<TpCommunicator> inner, metrics::Counter* seconds, metrics::Counter* bytes)
      : inner_(std::move(inner)), seconds_(seconds), bytes_(bytes) {}
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  bool device_memory() const override { return inner_->device_memory(); }
  void Abort() override { inner_->Abort(); }
  absl::Status AllReduce(float* data, int64_t count, ReduceOp op, bool device, void* stream) override {
    bytes_->Increment(static_cast<double>(count) * sizeof(float));
    return Timed([&] { return inner_->AllReduce(data, count, op, device, stream); });
  }
  absl::Status ReduceSumToRoot(float* data, int64_t count, bool device, void* stream) override {
    bytes_->Increment(static_cast<double>(count) * sizeof(float));
    return Timed([&] { return inner_->ReduceSumToRoot(data, count, device, stream); });
  }
  absl::Status AllReduceMaxBytes(uint8_t* data, int64_t count, bool device, void* stream) override {
    bytes_->Increment(static_cast<double>(count));
    return Timed([&] { return inner_->AllReduceMaxBytes(data, count, device, stream); });
  }
  absl::Status AllReduceSumInt32(int32_t* data, int64_t count, bool device, void* stream) override {
    bytes_->Increment(static_cast<double>(count) * sizeof(int64_t));
    return Timed([&] { return inner_->AllReduceSumInt32(data, count, device, stream); });
  }
  absl::Status ReduceSumInt32ToRoot(int32_t* data, int64_t count, bool device, void* stream) override {
    bytes_->Increment(static_cast<double>(count) * sizeof(int64_t));
    return Timed([&] { return inner_->ReduceSumInt32ToRoot(data, count, device, stream); });
  }
  absl::Status Broadcast(void* data, int64_t bytes, bool device, void* stream, int root) override {
    bytes_->Increment(static_cast<double>(bytes));
    return Timed([&] { return inner_->Broadcast(data, bytes, device, stream, root); });
  }

 private:
  template <typename F>
  absl::Status Timed(F&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status s = f();
    seconds_->Increment(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    return s;
  }
  std::unique_ptr<TpCommunicator> inner_;
  metrics::Counter* seconds_;
  metrics::Counter* bytes_;
};

}  // namespace

std::unique_ptr<TpCommunicator> TimeCollectives(std::unique_ptr<TpCommunicator> inner, metrics::Counter* seconds,
                                                metrics::Counter* bytes) {
  return std::make_unique<TimedCommunicator>(std::move(inner), seconds, bytes);
}

}  // namespace lce::server
