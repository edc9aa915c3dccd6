// Deadlines for blocking waits that have none: gRPC's sync API reads and writes a stream without a
// timeout, so a client that goes silent would hold its handler (and its admission slot) for ever.
// A stream arms a wait before it blocks and disarms it after; a wait that expires runs its action
// (cancelling the call, which ends the blocked read or write). One timer thread serves every stream
// of the server, not a thread per stream.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

namespace lce::server {

class StreamWatchdog {
 public:
  using Clock = std::chrono::steady_clock;
  // One armed wait.
  struct Ticket {
    Clock::time_point deadline;
    uint64_t id = 0;
  };

  StreamWatchdog();
  // Drops what is still armed without running it.
  ~StreamWatchdog();
  StreamWatchdog(const StreamWatchdog&) = delete;
  StreamWatchdog& operator=(const StreamWatchdog&) = delete;

  // Runs `on_expiry` at `deadline` unless Disarm(ticket) comes first. It runs on the timer thread
  // under the watchdog's lock (so that it has finished whenever Disarm returns): it must be quick
  // and must not call the watchdog.
  Ticket Arm(Clock::time_point deadline, std::function<void()> on_expiry);
  // True when the wait was disarmed in time; false when its action has run.
  bool Disarm(const Ticket& ticket);

 private:
  void Run();

  std::mutex mu_;
  std::condition_variable changed_;
  std::map<std::pair<Clock::time_point, uint64_t>, std::function<void()>> armed_;  // soonest first
  uint64_t next_id_ = 0;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the members it uses
};

}  // namespace lce::server
