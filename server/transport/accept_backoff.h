// What an accept loop does when accept4 fails. A shortage (EMFILE, ENFILE, ENOBUFS, ENOMEM) passes:
// the loop sleeps a little (1 ms, doubling to 100 ms) and accepts again, so that a client that once
// exhausted the server's descriptors cannot stop a listener for good (issue 35, item 3). Each failure
// is counted in lce_accept_errors_total{listener,errno}.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "service_metrics.h"

namespace lce::server {

class AcceptBackoff {
 public:
  // `listener` names the loop in the metric ("data_plane", "shm_socket"); `metrics` may be null.
  AcceptBackoff(std::string listener, ServiceMetrics* metrics) : listener_(std::move(listener)), metrics_(metrics) {}
  // After accept4 failed with `err`: true to accept again (after the back-off for a shortage),
  // false to stop (the listener was shut down, `stopping` is set, or the error is not transient).
  bool Retry(int err, const std::atomic<bool>& stopping);
  // After an accept succeeded: the next shortage starts with the shortest wait.
  void Accepted() { delay_ms_ = 0; }
  // Shortages seen so far.
  int64_t shortages() const { return shortages_.load(); }

 private:
  const std::string listener_;
  ServiceMetrics* const metrics_;
  int delay_ms_ = 0;
  std::atomic<int64_t> shortages_{0};
};

}  // namespace lce::server
