// lce_cli as a process, without a server: --help, usage errors (exit 2) and a failed call (exit 1
// with the gRPC status code name on stderr).
#include <sys/wait.h>

#include <cstdio>
#include <string>

#include "gtest/gtest.h"

namespace {

struct CliRun {
  int code;
  std::string output;  // stdout and stderr
};

CliRun Cli(const std::string& args) {
  const std::string cmd = std::string(LCE_CLI_PATH) + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return {-1, "popen failed"};
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int st = pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

TEST(Cli, HelpForEachCommand) {
  CliRun r = Cli("--help");
  EXPECT_EQ(r.code, 0);
  for (const char* cmd : {"health", "info", "score", "forward-backward", "bench"}) {
    EXPECT_NE(r.output.find(cmd), std::string::npos) << cmd;
  }
  r = Cli("forward-backward --help");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.output.find("--reduction"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--hidden-file"), std::string::npos) << r.output;
  r = Cli("bench -h");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.output.find("--iterations"), std::string::npos) << r.output;
  r = Cli("health --help");
  EXPECT_EQ(r.code, 0);
  EXPECT_EQ(r.output.find("--hidden-file"), std::string::npos) << "health takes no batch";
}

TEST(Cli, UsageErrorsExitTwo) {
  for (const char* args : {"", "frobnicate", "score --rows", "score --row=3", "health --rows=3",
                           "score --target=127.0.0.1:1 --rows=abc", "score --target 127.0.0.1:1 extra",
                           "forward-backward --target=127.0.0.1:1 --reduction=avg",
                           "score --target=127.0.0.1:1 --streams=0",
                           "score --target=127.0.0.1:1 --data-plane=1 --data-plane-sockets=17",
                           "score --target=127.0.0.1:1 --first-chunk-bytes=-1",
                           "score --target=127.0.0.1:1 --grow-chunks=2"}) {
    CliRun r = Cli(args);
    EXPECT_EQ(r.code, 2) << "'" << args << "': " << r.output;
    EXPECT_FALSE(r.output.empty()) << args;
  }
  CliRun r = Cli("score --row=3");
  EXPECT_NE(r.output.find("--row"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("lce_cli score --help"), std::string::npos) << r.output;
}

TEST(Cli, FailedCallExitsOneWithTheStatusCode) {
  CliRun r = Cli("health --target=127.0.0.1:1 --timeout-seconds=5");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("UNAVAILABLE"), std::string::npos) << r.output;
  r = Cli("score --target 127.0.0.1:1 --timeout-seconds 5 --rows 4");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("UNAVAILABLE"), std::string::npos) << r.output;
}

}  // namespace
