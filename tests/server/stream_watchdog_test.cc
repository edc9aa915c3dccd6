#include "stream_watchdog.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <vector>

namespace lce::server {
namespace {

using Clock = StreamWatchdog::Clock;

TEST(StreamWatchdog, AnExpiredWaitRunsItsActionOnceAndDisarmSaysSo) {
  StreamWatchdog dog;
  std::promise<void> ran;
  std::atomic<int> runs{0};
  const auto ticket = dog.Arm(Clock::now(), [&] {
    if (runs++ == 0) ran.set_value();
  });
  ran.get_future().wait();
  EXPECT_FALSE(dog.Disarm(ticket));
  EXPECT_EQ(runs.load(), 1);
}

TEST(StreamWatchdog, WaitsDisarmedInTimeNeverRun) {
  StreamWatchdog dog;
  std::atomic<int> runs{0};
  std::vector<StreamWatchdog::Ticket> tickets;
  // Many waits at once, in any deadline order, on one timer thread.
  for (int i = 0; i < 100; ++i) {
    tickets.push_back(dog.Arm(Clock::now() + std::chrono::hours(1 + i % 7), [&] { ++runs; }));
  }
  // A later-armed, sooner wait still expires (it moves the timer thread's wake-up).
  std::promise<void> soon;
  const auto soon_ticket = dog.Arm(Clock::now(), [&] { soon.set_value(); });
  soon.get_future().wait();
  EXPECT_FALSE(dog.Disarm(soon_ticket));
  for (const auto& t : tickets) EXPECT_TRUE(dog.Disarm(t));
  EXPECT_FALSE(dog.Disarm(tickets[0])) << "disarmed twice";
  EXPECT_EQ(runs.load(), 0);
}

TEST(StreamWatchdog, DestroyingItDropsWhatIsArmed) {
  std::atomic<int> runs{0};
  {
    StreamWatchdog dog;
    dog.Arm(Clock::now() + std::chrono::hours(1), [&] { ++runs; });
  }
  EXPECT_EQ(runs.load(), 0);
}

}  // namespace
}  // namespace lce::server
