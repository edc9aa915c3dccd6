#include "memory_trimmer.h"

#include <malloc.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>

namespace lce::server {

MemoryTrimmer::MemoryTrimmer(double interval_seconds, metrics::Registry* registry) {
  if (registry != nullptr) {
    returned_ = &registry
                     ->AddCounter("lce_memory_returned_bytes",
                                  "Resident memory the allocator held free and gave back to the system "
                                  "(--memory-trim-seconds).",
                                  {})
                     .WithLabels({});
  }
  if (interval_seconds > 0) thread_ = std::thread([this, interval_seconds] { Loop(interval_seconds); });
}

MemoryTrimmer::~MemoryTrimmer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void MemoryTrimmer::Loop(double interval_seconds) {
  const auto interval = std::chrono::duration<double>(interval_seconds);
  std::unique_lock<std::mutex> lock(mu_);
  while (!wake_.wait_for(lock, interval, [this] { return stop_; })) {
    lock.unlock();
    const int64_t returned = TrimNow();
    if (returned_ != nullptr && returned > 0) returned_->Increment(static_cast<double>(returned));
    lock.lock();
  }
}

int64_t MemoryTrimmer::TrimNow() {
  const int64_t before = ResidentBytes();
  malloc_trim(0);
  const int64_t after = ResidentBytes();
  return before > after ? before - after : 0;
}

int64_t MemoryTrimmer::ResidentBytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  long long size = 0, resident = 0;
  const int got = std::fscanf(f, "%lld %lld", &size, &resident);
  std::fclose(f);
  return got == 2 ? resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE)) : 0;
}

}  // namespace lce::server
