// lce_cli as a process, without a server: --help, usage errors (exit 2) and a failed call (exit 1
// with the gRPC status code name on stderr).
#include <sys/wait.h>

#include <cstdio>
#include <fstream>
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
  for (const char* cmd : {"health", "info", "score", "forward-backward", "bench", "load-head", "zero-grad", "get-grad",
                          "step", "update-weights", "save-head"}) {
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
  r = Cli("step --help");
  EXPECT_EQ(r.code, 0);
  for (const char* flag : {"--lr", "--beta1", "--beta2", "--eps", "--weight-decay", "--max-grad-norm", "--zero-grad",
                           "--admin-token-file", "--max-attempts"}) {
    EXPECT_NE(r.output.find(flag), std::string::npos) << flag << ": " << r.output;
  }
  r = Cli("load-head --help");
  for (const char* flag : {"--safetensors-file", "--clone-of", "--seeded", "--tensor", "--dtype"}) {
    EXPECT_NE(r.output.find(flag), std::string::npos) << flag << ": " << r.output;
  }
}

// --help lists the flags with their defaults (every flag: CliArgs.HelpListsEveryFlagWithItsDefault).
TEST(Cli, HelpListsTheFlagsWithTheirDefaults) {
  CliRun r = Cli("--help");
  EXPECT_EQ(r.code, 0);
  for (const char* line : {"  --target (default: 127.0.0.1:50051)\n", "  --rows (default: 16)\n",
                           "  --reduction (default: mean)\n", "  --beta2 (default: 0.999)\n", "  --tensor\n",
                           "  --directory\n"}) {
    EXPECT_NE(r.output.find(line), std::string::npos) << line << r.output;
  }
  r = Cli("bench --help");
  EXPECT_NE(r.output.find("  --iterations (default: 5)\n"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("  --chunk-bytes (default: 4194304)\n"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("--lr"), std::string::npos) << "bench takes no --lr";
}

// A bad value is a usage error naming the flag, before any call.
TEST(Cli, BadValueIsAClearError) {
  for (const auto& [args, message] :
       {std::pair{"score --rows=many", "lce_cli: bad value 'many' for --rows (see lce_cli score --help)"},
        std::pair{"bench --iterations=0", "--iterations must be >= 1, got 0"},
        std::pair{"score --temperature=nan", "--temperature must be a finite number"},
        std::pair{"health --data-plane=maybe", "bad value 'maybe' for --data-plane"}}) {
    CliRun r = Cli(std::string(args) + " --target=127.0.0.1:1");
    EXPECT_EQ(r.code, 2) << args << ": " << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << args << ": " << r.output;
  }
}

TEST(Cli, Flagfile) {
  const std::string path = testing::TempDir() + "/cli_test_flags";
  std::ofstream(path) << "# lce_cli's flags\n--target=127.0.0.1:1\n--timeout-seconds=5\n";
  CliRun r = Cli("health --flagfile=" + path);
  EXPECT_EQ(r.code, 1) << r.output;  // it reached the --target of the file
  EXPECT_NE(r.output.find("127.0.0.1:1"), std::string::npos) << r.output;
  std::ofstream(path) << "--rows=0\n";
  r = Cli("score --flagfile=" + path);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("--rows must be in"), std::string::npos) << r.output;
  r = Cli("score --flagfile=/nonexistent/flags");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("cannot read --flagfile /nonexistent/flags"), std::string::npos) << r.output;
}

// Bad flags of the training commands: exit 2 with a message naming the problem, before any call.
TEST(Cli, TrainingCommandUsageErrorsExitTwo) {
  const std::pair<const char*, const char*> cases[] = {
      {"step", "step needs --lr"},
      {"step --lr=abc", "bad value 'abc' for --lr"},
      {"step --lr=0.1 --beta1=-1", "--beta1 must be >= 0"},
      {"step --lr=0.1 --zero-grad=2", "bad value '2' for --zero-grad"},
      {"load-head --seeded=8x4", "load-head needs --head=NAME"},
      {"load-head --head=h", "load-head needs one source"},
      {"load-head --head=h --seeded=8x4 --clone-of=g", "load-head needs one source"},
      {"load-head --head=h --seeded=8by4", "--seeded must be VOCABxHIDDEN"},
      {"load-head --head=h --seeded=8x4 --dtype=fp8", "--dtype must be bf16, fp16 or fp32"},
      {"load-head --head=h --clone-of=g --seed=3", "--seed goes with --seeded"},
      {"load-head --head=h --clone-of=g --tensor=w", "--tensor goes with --safetensors-file"},
      {"get-grad --output=g.pt", "cannot tell the format of 'g.pt'"},
      {"get-grad --format=npy", "--format goes with --output"},
      {"get-grad --output=g --format=pickle", "--format must be npy, safetensors or raw"},
      {"update-weights", "update-weights needs --weight-file"},
      {"update-weights --weight-file=w.npy --expected-version=-1", "--expected-version must be >= 0"},
      {"save-head", "save-head needs --directory"},
      {"zero-grad --lr=1", "unknown flag --lr for 'zero-grad'"},
      {"forward-backward --accumulate-weight-grad=maybe", "bad value 'maybe' for --accumulate-weight-grad"},
      {"score --head-version=-2", "--head-version must be >= 0"},
      {"score --max-attempts=0", "--max-attempts must be in [1, 100]"},
      {"score --load-balancing=random", "load_balancing must be"},
      {"score --target=a:1,,b:2", "an empty target"},
      {"score --load-balancing=round_robin --data-plane=1", "data_plane needs the replicas listed"},
  };
  for (const auto& [args, message] : cases) {
    CliRun r = Cli(std::string(args) + " --timeout-seconds=5");
    EXPECT_EQ(r.code, 2) << "'" << args << "': " << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << "'" << args << "': " << r.output;
  }
}

TEST(Cli, TrainingCommandsAgainstNoServerExitOne) {
  for (const char* args : {"zero-grad", "step --lr=0.1", "get-grad", "save-head --directory=/tmp",
                           "load-head --head=h --seeded=8x4"}) {
    CliRun r = Cli(std::string(args) + " --target=127.0.0.1:1 --timeout-seconds=5");
    EXPECT_EQ(r.code, 1) << "'" << args << "': " << r.output;
    EXPECT_NE(r.output.find("UNAVAILABLE"), std::string::npos) << r.output;
  }
}

TEST(Cli, UsageErrorsExitTwo) {
  for (const char* args :
       {"", "frobnicate", "score --rows", "score --row=3", "health --rows=3", "score --target=127.0.0.1:1 --rows=abc",
        "score --target 127.0.0.1:1 extra", "forward-backward --target=127.0.0.1:1 --reduction=avg",
        "score --target=127.0.0.1:1 --streams=0", "score --target=127.0.0.1:1 --data-plane=1 --data-plane-sockets=17",
        "score --target=127.0.0.1:1 --data-plane=1 --data-plane-streams=0",
        "score --target=127.0.0.1:1 --first-chunk-bytes=-1", "score --target=127.0.0.1:1 --grow-chunks=2"}) {
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
