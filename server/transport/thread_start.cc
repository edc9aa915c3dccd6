#include "thread_start.h"

#include <atomic>
#include <cerrno>
#include <mutex>
#include <system_error>

#include "absl/strings/str_cat.h"

namespace lce::server {
namespace {

std::mutex test_mu;
int successes_for_test = 0, failures_for_test = 0;
std::atomic<bool> testing{false};  // the common case takes no lock

// Whether this start must fail, as a test asked.
bool TakeFailureForTest() {
  if (!testing.load(std::memory_order_relaxed)) return false;
  std::lock_guard<std::mutex> lock(test_mu);
  if (successes_for_test > 0) {
    --successes_for_test;
    return false;
  }
  if (failures_for_test == 0) return false;
  --failures_for_test;
  return true;
}

}  // namespace

absl::StatusOr<std::thread> StartThread(const char* what, std::function<void()> body) {
  try {
    if (TakeFailureForTest()) throw std::system_error(EAGAIN, std::generic_category(), "thread creation (test)");
    return std::thread(std::move(body));
  } catch (const std::system_error& e) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the server cannot start a thread for ", what, " (", e.what(),
                     "; a task limit such as pids.max or TasksMax?); retry later"));
  }
}

void FailThreadStartsForTest(int n, int after) {
  std::lock_guard<std::mutex> lock(test_mu);
  failures_for_test = n;
  successes_for_test = n > 0 ? after : 0;
  testing = n > 0;
}

}  // namespace lce::server
