// The memory trimmer gives back what threads' arenas hold free, and its thread stops cleanly.
#include "memory_trimmer.h"

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace lce::server {
namespace {

// The sanitizers bring their own allocator (gcc names them with __SANITIZE_*__, clang 14 only
// through __has_feature).
#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
#define LCE_SANITIZED_ALLOCATOR 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define LCE_SANITIZED_ALLOCATOR 1
#endif
#ifdef LCE_SANITIZED_ALLOCATOR
constexpr bool kGlibcMalloc = false;
#else
constexpr bool kGlibcMalloc = true;
#endif

// 8 threads each fill their arena with 32 MB of 64 KB blocks (below glibc's mmap threshold, so
// they come from the arenas), each followed by a small block that lives on, and free the large
// ones, as request threads do: the live small blocks keep the arenas from shrinking at free().
// Returns the small blocks; the caller frees them.
std::vector<std::unique_ptr<char[]>> FillAndFreeArenas() {
  std::vector<std::vector<std::unique_ptr<char[]>>> kept(8);
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&kept, t] {
      std::vector<std::unique_ptr<char[]>> blocks;
      for (int i = 0; i < 512; ++i) {
        blocks.emplace_back(new char[64 << 10]);
        for (int b = 0; b < (64 << 10); b += 4096) blocks.back()[b] = static_cast<char>(i);  // resident
        kept[t].emplace_back(new char[64]);
      }
    });
  }
  for (auto& t : threads) t.join();
  std::vector<std::unique_ptr<char[]>> small;
  for (auto& k : kept) {
    for (auto& b : k) small.push_back(std::move(b));
  }
  return small;
}

TEST(MemoryTrimmer, GivesBackWhatArenasHoldFree) {
  if (!kGlibcMalloc) GTEST_SKIP() << "SKIPPED: a sanitizer's allocator, not glibc's, serves this build";
  MemoryTrimmer::TrimNow();
  const int64_t base = MemoryTrimmer::ResidentBytes();
  ASSERT_GT(base, 0);
  const auto small = FillAndFreeArenas();
  const int64_t held = MemoryTrimmer::ResidentBytes();
  const int64_t returned = MemoryTrimmer::TrimNow();
  const int64_t after = MemoryTrimmer::ResidentBytes();
  // 256 MB were freed; glibc may have given some back at free() (the top of an arena).
  EXPECT_GT(returned, int64_t{64} << 20) << "held " << held - base << " bytes over the base";
  EXPECT_LT(after, base + (int64_t{64} << 20)) << "still " << after - base << " bytes over the base";
}

TEST(MemoryTrimmer, ThreadTrimsAndStops) {
  if (!kGlibcMalloc) GTEST_SKIP() << "SKIPPED: a sanitizer's allocator, not glibc's, serves this build";
  metrics::Registry registry;
  {
    MemoryTrimmer trimmer(0.05, &registry);
    const auto small = FillAndFreeArenas();
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }  // joins its thread
  const std::string text = registry.Render();
  const std::string name = "\nlce_memory_returned_bytes_total ";
  const size_t at = text.find(name);
  ASSERT_NE(at, std::string::npos) << text;
  EXPECT_GT(std::stod(text.substr(at + name.size())), double{int64_t{64} << 20}) << text.substr(at, 80);
}

TEST(MemoryTrimmer, ZeroIntervalStartsNoThread) {
  MemoryTrimmer trimmer(0, nullptr);  // destructs at once with nothing to join
}

}  // namespace
}  // namespace lce::server
