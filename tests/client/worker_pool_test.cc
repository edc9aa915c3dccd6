#include "worker_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <thread>

namespace lce::client {
namespace {

TEST(WorkerPoolTest, TasksThatWaitForEachOtherAllRun) {
  // Four tasks that each wait until all four have started: a fixed pool smaller than that would
  // never finish them (a call's writer waits for its uploaders).
  WorkerPool pool;
  std::atomic<int> started{0};
  TaskLatch done(4);
  for (int i = 0; i < 4; ++i) {
    pool.Run([&] {
      ++started;
      while (started.load() < 4) std::this_thread::yield();
      done.Done();
    });
  }
  done.Wait();
  EXPECT_EQ(started.load(), 4);
  EXPECT_GE(pool.workers(), 4);
}

TEST(WorkerPoolTest, IdleWorkersAreReusedAcrossCalls) {
  WorkerPool pool;
  std::mutex mu;
  std::set<std::thread::id> ids;
  for (int call = 0; call < 20; ++call) {
    TaskLatch done(3);
    for (int i = 0; i < 3; ++i) {
      pool.Run([&] {
        {
          std::lock_guard<std::mutex> l(mu);
          ids.insert(std::this_thread::get_id());
        }
        done.Done();
      });
    }
    done.Wait();
    // The workers go back to waiting after their task: the next call then finds them idle.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (pool.idle_workers() < pool.workers() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  // At most one worker per task of the first call (fewer when one finished before the next came).
  EXPECT_LE(pool.workers(), 3) << "each call's tasks should run on the workers made for the first";
  EXPECT_LE(static_cast<int64_t>(ids.size()), pool.workers());
  EXPECT_NE(ids.count(std::this_thread::get_id()), 1u);
}

TEST(WorkerPoolTest, DestructionWaitsForQueuedAndRunningTasks) {
  std::atomic<int> ran{0};
  {
    WorkerPool pool;
    for (int i = 0; i < 8; ++i) {
      pool.Run([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        ++ran;
      });
    }
  }
  EXPECT_EQ(ran.load(), 8);
}

}  // namespace
}  // namespace lce::client
