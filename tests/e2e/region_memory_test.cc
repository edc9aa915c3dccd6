// "A session's server memory is freed when the session ends" (issue 22), measured where it matters:
// the resident memory of a server process (lce_server, not the in-process test server, whose
// memory would be mixed with the test's), not only its count of regions. Its data-plane regions
// are filled over the data plane, so that their pages are resident, and then the session ends:
// closed by its client, or cancelled as by a client that went away.
#include <sys/types.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "data_plane_connection.h"
#include "gtest/gtest.h"
#include "lce/client/lce_client.h"
#include "test_server.h"
#include "tp_processes.h"

namespace lce::e2e {
namespace {

constexpr int64_t kMiB = 1 << 20;
constexpr int64_t kRegionBytes = 32 * kMiB;
constexpr int kRegions = 4;  // 128 MiB a session

// The resident memory of `pid` (VmRSS), in MiB; -1 if unreadable.
double RssMib(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string key;
  while (in >> key) {
    if (key == "VmRSS:") {
      double kb = 0;
      in >> kb;
      return kb / 1024.0;
    }
    in.ignore(1 << 12, '\n');
  }
  return -1;
}

// Waits up to 20 s for the RSS of `pid` to come within `limit_mib`; returns the last reading.
double RssOnceAtMost(pid_t pid, double limit_mib) {
  double rss = RssMib(pid);
  for (int i = 0; i < 200 && rss > limit_mib; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    rss = RssMib(pid);
  }
  return rss;
}

using EndSession = std::function<void(std::unique_ptr<client::SharedMemorySession>&)>;

// A session holding kRegions regions of server memory, each written whole over the data plane;
// ended by `end`; returns the server's RSS while it held them (-1 after a failure).
double HoldAndEnd(client::LceClient& c, pid_t server, int data_port, const EndSession& end) {
  auto s = c.OpenSession();
  EXPECT_TRUE(s.ok()) << s.status();
  if (!s.ok()) return -1;
  auto dp = client::DataPlaneConnection::Connect("127.0.0.1", data_port, {(*s)->secret()});
  EXPECT_TRUE(dp.ok()) << dp.status();
  if (!dp.ok()) return -1;
  std::vector<uint8_t> piece(4 * kMiB, 0x5a);  // not zeros: every page of the region is written
  for (int r = 0; r < kRegions; ++r) {
    auto id = (*s)->AllocateServerMemory(kRegionBytes);
    EXPECT_TRUE(id.ok()) << id.status();
    if (!id.ok()) return -1;
    for (int64_t off = 0; off < kRegionBytes; off += static_cast<int64_t>(piece.size())) {
      absl::Status w = (*dp)->Write((*s)->id(), *id, off, piece);
      EXPECT_TRUE(w.ok()) << w;
      if (!w.ok()) return -1;
    }
  }
  const double held = RssMib(server);
  end(*s);
  return held;
}

TEST(RegionMemory, ServerMemoryIsFreedWhenItsSessionEnds) {
  // Under ASan a freed block waits in its quarantine (256 MiB by default) before the memory goes
  // back; without one the server's RSS shows what a plain build frees. Read by the server at start.
  std::string asan = std::getenv("ASAN_OPTIONS") != nullptr ? std::getenv("ASAN_OPTIONS") : "";
  setenv("ASAN_OPTIONS", (asan + ":quarantine_size_mb=0").c_str(), 1);
  TpGroup group(1, 30.0, "", {"--data-plane-bytes-per-session=" + std::to_string(kRegions * kRegionBytes)});
  const pid_t pid = group.pid(0);
  auto c = ConnectClient(group.target(), 4 << 20);
  auto info = c->GetInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_GT(info->data_port(), 0);
  // The warm level: one session's cycle done, so that the data plane's threads and buffers exist.
  const EndSession close = [](std::unique_ptr<client::SharedMemorySession>& s) { s.reset(); };
  const EndSession cancel = [](std::unique_ptr<client::SharedMemorySession>& s) { s->Cancel(); };
  HoldAndEnd(*c, pid, info->data_port(), close);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const double warm = RssMib(pid);
  ASSERT_GT(warm, 0);
  const double region_mib = kRegions * kRegionBytes / double(kMiB);
  for (const auto& [how, end] : std::vector<std::pair<const char*, EndSession>>{{"closed", close}, {"cancelled", cancel}}) {
    SCOPED_TRACE(how);
    const double held = HoldAndEnd(*c, pid, info->data_port(), end);
    // The regions' pages are resident while the session holds them: the measurement sees them.
    EXPECT_GT(held, warm + 0.9 * region_mib) << "warm " << warm << " MiB";
    // ... and leave with it: back to the warm level, give or take 16 MiB of the allocator's slack.
    const double after = RssOnceAtMost(pid, warm + 16);
    EXPECT_LE(after, warm + 16) << "the session held " << held << " MiB; warm " << warm << " MiB";
  }
  // The server still serves a session of the same size: nothing of the ended ones counts against it.
  EXPECT_GT(HoldAndEnd(*c, pid, info->data_port(), close), 0);
}

}  // namespace
}  // namespace lce::e2e
