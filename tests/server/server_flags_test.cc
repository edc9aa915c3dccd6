#include "server_flags.h"

#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>
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


// The flags are absl flags: --help lists every one with its default, values are typed, and a bad
// value, an unknown flag or a missing value is INVALID_ARGUMENT naming the flag.
TEST(ServerFlags, HelpListsEveryFlagWithItsDefault) {
  absl::StatusOr<ServerFlags> f = Parse({"--help"});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE(f->help);
  const std::string usage = ServerUsage();
  for (const char* line : {"--port (default: 50051)", "--head-dtype (default: bf16)", "--data-port (default: -1)",
                           "--batch-invariant (default: false)", "--dp-join-timeout-seconds (default: 600)",
                           "--grpc-channel-args", "--max-head-bytes (default: 0)"}) {
    EXPECT_NE(usage.find(line), std::string::npos) << line << " not in\n" << usage;
  }
}

TEST(ServerFlags, DefaultsTypedValuesAndClearErrors) {
  absl::StatusOr<ServerFlags> d = Parse({});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->port, 50051);
  EXPECT_EQ(d->host, "0.0.0.0");
  EXPECT_EQ(d->max_message_bytes, 64 << 20);
  EXPECT_EQ(d->data_port, -1);
  EXPECT_TRUE(d->log_requests);
  EXPECT_EQ(d->head.tensor, "lm_head.weight");
  EXPECT_EQ(d->grpc_idle_threads, 0) << "0: 64 over all completion queues";
  absl::StatusOr<ServerFlags> f = Parse({"--port", "7", "--port_file=/tmp/p", "--log-requests=false",
                                         "--grpc-channel-args=a.b=1,c=2", "--seed-head=10x4", "--head-dtype=fp16",
                                         "--grpc-idle-threads=16"});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->port, 7);
  EXPECT_EQ(f->port_file, "/tmp/p");
  EXPECT_FALSE(f->log_requests);
  ASSERT_EQ(f->grpc_channel_args.size(), 2u);
  EXPECT_EQ(f->grpc_channel_args[1], (std::pair<std::string, int>{"c", 2}));
  EXPECT_EQ(f->head.seed_vocab, 10);
  EXPECT_EQ(f->head.dtype, DType::kFloat16);
  EXPECT_EQ(f->grpc_idle_threads, 16);
  // Each parse starts from the defaults.
  EXPECT_EQ(Parse({})->port, 50051);
  const std::vector<std::pair<std::vector<std::string>, std::string>> bad = {
      {{"--port=abc"}, "--port"},           {{"--port=99999"}, "--port"},
      {{"--log-requests=maybe"}, "--log-requests"}, {{"--no-such-flag=1"}, "unknown flag --no-such-flag"},
      {{"--port"}, "needs a value"},         {{"--head-dtype=int8"}, "--head-dtype"},
      {{"--grpc-channel-args=x"}, "--grpc-channel-args"}, {{"stray"}, "unexpected argument 'stray'"},
      {{"--grpc-idle-threads=-1"}, "--grpc-idle-threads"},
  };
  for (const auto& [args, what] : bad) {
    absl::Status s = Parse(args).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << args[0];
    EXPECT_NE(s.message().find(what), std::string::npos) << s;
  }
}

// A boolean flag alone means true (README: --batch-invariant), before another flag or at the end;
// followed by a value it takes it; --version is no flag to set.
TEST(ServerFlags, BareBooleansAndVersion) {
  absl::StatusOr<ServerFlags> f = Parse({"--tp-invariant", "false", "--port=7", "--batch-invariant"});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE(f->batch_invariant);
  EXPECT_FALSE(f->tp_invariant);  // on by default: the value turns it off
  EXPECT_EQ(f->port, 7);
  f = Parse({"--log-requests", "false", "--version"});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_FALSE(f->log_requests);
  EXPECT_TRUE(f->version);
  EXPECT_FALSE(Parse({})->version);
}

TEST(ServerFlags, FlagfileExpandsInPlace) {
  const std::string path = ::testing::TempDir() + "/lce_server.flags";
  FILE* out = fopen(path.c_str(), "w");
  ASSERT_NE(out, nullptr);
  fputs("# a comment\n--port=9\n\n  --metrics-port=0  \n", out);
  fclose(out);
  absl::StatusOr<ServerFlags> f = Parse({"--flagfile=" + path, "--port=10"});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->port, 10);  // later words win
  EXPECT_EQ(f->metrics_port, 0);
  EXPECT_EQ(Parse({"--flagfile=/no/such/file"}).status().code(), absl::StatusCode::kInvalidArgument);
}

// docs/OPERATING.md's flag table is the flags' own (ServerFlagsMarkdown: name, default and help as
// declared), so the docs cannot drift from the binary. After changing a flag, regenerate it:
//   LCE_UPDATE_DOCS=1 build/bin/server_test --gtest_filter='ServerFlags.OperatingDoc*'
TEST(ServerFlags, OperatingDocTableIsTheFlags) {
  const std::string path = std::string(LCE_SOURCE_DIR) + "/docs/OPERATING.md";
  std::stringstream text;
  text << std::ifstream(path).rdbuf();
  std::string doc = text.str();
  const std::string begin =
      "<!-- server flags: generated from server/ops/server_flags.cc, see tests/server/server_flags_test.cc -->\n";
  const std::string end = "<!-- end of server flags -->";
  const size_t b = doc.find(begin), e = doc.find(end);
  ASSERT_TRUE(b != std::string::npos && e != std::string::npos && b < e) << path << " has no flag table markers";
  const std::string want = ServerFlagsMarkdown();
  if (std::getenv("LCE_UPDATE_DOCS") != nullptr) {
    doc.replace(b + begin.size(), e - b - begin.size(), want);
    std::ofstream(path) << doc;
    return;
  }
  EXPECT_EQ(doc.substr(b + begin.size(), e - b - begin.size()), want)
      << path << "'s flag table differs from the flags; regenerate it: LCE_UPDATE_DOCS=1 "
      << "build/bin/server_test "
      << "--gtest_filter='ServerFlags.OperatingDoc*'";
}

// The flags the docs and deploy configs pass to lce_server exist: a command line written in
// README.md, docs/, deploy/ or docker-compose.yml (after "lce_server"), or a k8s container
// argument ("- --name"), names a flag --help lists; the systemd unit's flagfile parses.
TEST(ServerFlags, DocsAndDeployConfigsNameRealFlags) {
  const std::string usage = ServerUsage();
  const std::regex command_flag("--([a-z0-9-]+)"), k8s_arg("^\\s*- --([a-z0-9-]+)");
  int checked = 0;
  for (const char* file : {"README.md", "docs/OPERATING.md", "docs/TRANSPORT.md", "docs/MATH.md", "deploy/README.md",
                           "docker-compose.yml", "deploy/k8s/statefulset.yaml", "deploy/k8s/dp/statefulset.yaml"}) {
    std::ifstream in(std::string(LCE_SOURCE_DIR) + "/" + file);
    ASSERT_TRUE(in) << file;
    for (std::string line; std::getline(in, line);) {
      std::vector<std::string> names;
      std::smatch m;
      if (std::string(file).find("k8s/") != std::string::npos && std::regex_search(line, m, k8s_arg)) {
        names.push_back(m[1]);
      }
      const size_t at = line.find("lce_server ");
      if (at != std::string::npos) {
        const std::string rest = line.substr(at, line.find('`', at) - at);  // to the end of a code span
        for (std::sregex_iterator it(rest.begin(), rest.end(), command_flag), end; it != end; ++it) {
          names.push_back((*it)[1]);
        }
      }
      for (const std::string& name : names) {
        if (name == "help" || name == "version" || name == "flagfile") continue;
        ++checked;
        EXPECT_NE(usage.find("  --" + name + " (default: "), std::string::npos)
            << file << " passes --" << name << ", which lce_server does not have: " << line;
      }
    }
  }
  EXPECT_GT(checked, 20) << "the scan found the command lines";
  // The .deb's config is a flagfile: it parses whole, values included.
  const std::string conf = std::string(LCE_SOURCE_DIR) + "/deploy/systemd/lce-serve.conf";
  absl::StatusOr<ServerFlags> installed = Parse({"--flagfile=" + conf});
  EXPECT_TRUE(installed.ok()) << conf << ": " << installed.status();
}

}  // namespace
}  // namespace lce::server
