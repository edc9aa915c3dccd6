// Gives the allocator's free memory back to the system every few seconds.
//
// glibc keeps what a thread freed in that thread's arena for the arena's next use, and makes up to
// 8 arenas a core: with gRPC's many threads a long run holds tens of MB it no longer uses (the
// 30-minute soak: RSS +76 MB over its warm level, of which ~60 MB free in 16 arenas). malloc_trim(0)
// returns every whole free page of every arena; a page used again costs one fault.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

#include "metrics.h"

namespace lce::server {

class MemoryTrimmer {
 public:
  // Trims every `interval_seconds` on a thread of its own (<= 0: never, no thread). Counts what it
  // returned in lce_memory_returned_bytes_total when `registry` is not null.
  MemoryTrimmer(double interval_seconds, metrics::Registry* registry);
  ~MemoryTrimmer();
  MemoryTrimmer(const MemoryTrimmer&) = delete;
  MemoryTrimmer& operator=(const MemoryTrimmer&) = delete;

  // One trim now: the resident bytes it gave back (0 if none, or if the allocator is not glibc's).
  static int64_t TrimNow();
  // The process's resident set, from /proc/self/statm (0 where it cannot be read).
  static int64_t ResidentBytes();

 private:
  void Loop(double interval_seconds);

  metrics::Counter* returned_ = nullptr;
  std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace lce::server
