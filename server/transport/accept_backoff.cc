#include "accept_backoff.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

namespace lce::server {

bool AcceptBackoff::Retry(int err, const std::atomic<bool>& stopping) {
  if (stopping) return false;
  if (err == EINTR || err == ECONNABORTED) return true;
  if (err != EMFILE && err != ENFILE && err != ENOBUFS && err != ENOMEM) return false;  // shut down, or broken
  shortages_.fetch_add(1);
  if (metrics_ != nullptr) {
    const char* name = strerrorname_np(err);
    metrics_->accept_errors.WithLabels({listener_, name != nullptr ? name : std::to_string(err)}).Increment();
  }
  // The connection that found no descriptor stays in the backlog; waiting lets descriptors free up
  // without spinning on the same error. Slept in slices, so that shutdown is not held up.
  delay_ms_ = delay_ms_ == 0 ? 1 : std::min(delay_ms_ * 2, 100);
  for (int slept = 0; slept < delay_ms_ && !stopping; slept += 5) {
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(5, delay_ms_ - slept)));
  }
  return !stopping;
}

}  // namespace lce::server
