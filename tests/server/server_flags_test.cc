#include "server_flags.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace lce::server {
namespace {

absl::StatusOr<ServerFlags> Parse(std::vector<std::string> args) {
  args.insert(args.begin(), "lce_server");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  return ParseServerFlags(static_cast<int>(argv.size()), argv.data());
}

TEST(ServerFlags, EdgeLimitsHaveDefaultsAndTakeValues) {
  absl::StatusOr<ServerFlags> d = Parse({});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->stream_header_timeout_seconds, 10);
  EXPECT_EQ(d->stream_idle_timeout_seconds, 60);
  EXPECT_EQ(d->max_head_bytes, 0);
  absl::StatusOr<ServerFlags> f =
      Parse({"--stream-header-timeout-seconds=2.5", "--stream-idle-timeout-seconds=0", "--max-head-bytes=1048576"});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->stream_header_timeout_seconds, 2.5);
  EXPECT_EQ(f->stream_idle_timeout_seconds, 0);
  EXPECT_EQ(f->max_head_bytes, 1048576);
  for (const char* bad : {"--stream-header-timeout-seconds=-1", "--stream-idle-timeout-seconds=nan",
                          "--stream-idle-timeout-seconds=1e300", "--max-head-bytes=-5"}) {
    EXPECT_EQ(Parse({bad}).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

// A seeded head's shape from the command line is checked as LoadHead's is, and the refusal says why.
TEST(ServerFlags, SeedShapeTooLargeToBeASizeIsRefusedWithTheReason) {
  absl::Status s = Parse({"--seed-head=2305843009213693953x4"}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("not a valid size"), std::string::npos) << s;
  EXPECT_NE(s.message().find("--seed-head"), std::string::npos) << s;
}

TEST(ServerFlags, DataParallelFlagsAreCheckedTogether) {
  absl::StatusOr<ServerFlags> f = Parse({"--dp-size=3", "--dp-rank=2", "--dp-rendezvous=/tmp/job", "--dp-host=10.0.0.5",
                                         "--dp-timeout-seconds=5", "--dp-join-timeout-seconds=90"});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->dp_size, 3);
  EXPECT_EQ(f->dp_rank, 2);
  EXPECT_EQ(f->dp_rendezvous, "/tmp/job");
  EXPECT_EQ(f->dp_host, "10.0.0.5");
  EXPECT_EQ(f->dp_timeout_seconds, 5);
  EXPECT_EQ(f->dp_join_timeout_seconds, 90);
  const std::vector<std::vector<std::string>> bad = {
      {"--dp-size=2", "--dp-rank=2", "--dp-rendezvous=/tmp/job"},  // rank out of range
      {"--dp-size=0"},
      {"--dp-size=2", "--dp-rank=1"},  // no rendezvous
      {"--dp-size=2", "--dp-rendezvous=/tmp/job", "--dp-timeout-seconds=0"},
      {"--dp-size=2", "--dp-rendezvous=/tmp/job", "--tls-cert=c.pem", "--tls-key=k.pem"},  // no --dp-tls-ca
  };
  for (const auto& args : bad) EXPECT_EQ(Parse(args).status().code(), absl::StatusCode::kInvalidArgument) << args[0];
}

}  // namespace
}  // namespace lce::server
