#include "stream_watchdog.h"

namespace lce::server {

StreamWatchdog::StreamWatchdog() : thread_([this] { Run(); }) {}

StreamWatchdog::~StreamWatchdog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  changed_.notify_all();
  thread_.join();
}

StreamWatchdog::Ticket StreamWatchdog::Arm(Clock::time_point deadline, std::function<void()> on_expiry) {
  std::lock_guard<std::mutex> lock(mu_);
  const Ticket ticket{deadline, next_id_++};
  const bool soonest = armed_.empty() || deadline < armed_.begin()->first.first;
  armed_.emplace(std::make_pair(deadline, ticket.id), std::move(on_expiry));
  // Only a new soonest deadline moves the timer thread's wake-up.
  if (soonest) changed_.notify_all();
  return ticket;
}

bool StreamWatchdog::Disarm(const Ticket& ticket) {
  std::lock_guard<std::mutex> lock(mu_);
  return armed_.erase(std::make_pair(ticket.deadline, ticket.id)) == 1;
}

void StreamWatchdog::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (armed_.empty()) {
      changed_.wait(lock);
      continue;
    }
    const Clock::time_point soonest = armed_.begin()->first.first;
    if (Clock::now() < soonest) {
      changed_.wait_until(lock, soonest);
      continue;
    }
    // Expired: run it under the lock, so that its owner's Disarm waits for it to finish.
    std::function<void()> on_expiry = std::move(armed_.begin()->second);
    armed_.erase(armed_.begin());
    on_expiry();
  }
}

}  // namespace lce::server
