#include "tp_processes.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>
#include <thread>

#include "gtest/gtest.h"
#include "test_server.h"

extern char** environ;

namespace lce::e2e {

namespace fs = std::filesystem;

std::string TpBackend() {
  const char* b = std::getenv("LCE_TEST_TP_BACKEND");
  return b != nullptr && *b != 0 ? b : "cpu";
}

std::string ServerPath() {
  const char* env = std::getenv("LCE_SERVER_BIN");
  return env != nullptr && *env != 0 ? env : LCE_SERVER_PATH;
}

TpGroup::TpGroup(int k, double timeout_seconds, const std::string& head_file, const std::vector<std::string>& extra)
    : dir_(fs::temp_directory_path() / ("lce_tp_" + std::to_string(::getpid()) + "_" + std::to_string(counter_++))) {
  fs::remove_all(dir_);
  fs::create_directories(dir_);
  const std::string port_file = (dir_ / "port").string();
  for (int r = 0; r < k; ++r) {
    const std::string server = ServerPath();
    std::vector<std::string> args = {server, "--port=0", "--port-file=" + port_file, "--backend=" + TpBackend(),
                                     "--device=" + std::to_string(r),
                                     "--seed-head=" + std::to_string(kVocab) + "x" + std::to_string(kHidden), "--seed=7",
                                     "--head-dtype=fp32", "--cpu-threads=1", "--tp-size=" + std::to_string(k),
                                     "--tp-rank=" + std::to_string(r), "--tp-rendezvous=" + (dir_ / "rdv").string(),
                                     "--tp-timeout-seconds=" + std::to_string(timeout_seconds), "--host=127.0.0.1",
                                     "--log-requests=false", "--data-port=0"};
    if (!head_file.empty()) args.push_back("--head-file=" + head_file);
    args.insert(args.end(), extra.begin(), extra.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t out;
    posix_spawn_file_actions_init(&out);
    const std::string log = RankFile(r, ".out").string();
    const std::string err = RankFile(r, ".err").string();
    posix_spawn_file_actions_addopen(&out, STDOUT_FILENO, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_addopen(&out, STDERR_FILENO, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    pid_t pid = 0;
    EXPECT_EQ(posix_spawn(&pid, server.c_str(), &out, nullptr, argv.data(), environ), 0);
    posix_spawn_file_actions_destroy(&out);
    pids_.push_back(pid);
  }
  for (int i = 0; i < 300 && !fs::exists(port_file); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::ifstream in(port_file);
  int port = 0;
  in >> port;
  EXPECT_GT(port, 0) << "the front never wrote its port";
  target_ = "127.0.0.1:" + std::to_string(port);
}

TpGroup::~TpGroup() {
  for (pid_t p : pids_) {
    if (p > 0) ::kill(p, SIGKILL);  // never kill(-1): that signals every process we may
  }
  for (pid_t p : pids_) {
    if (p > 0) ::waitpid(p, nullptr, 0);
  }
  if (::testing::Test::HasFailure()) {  // what the ranks said, for the failure's story
    for (size_t r = 0; r < pids_.size(); ++r) std::cerr << "---- rank " << r << "'s stderr:\n" << Stderr(r);
  }
  fs::remove_all(dir_);
}

int TpGroup::FrontMetricsPort() const {
  std::ifstream in(RankFile(0, ".out"));
  const std::string marker = "metrics on http://127.0.0.1:";
  for (std::string line; std::getline(in, line);) {
    const size_t at = line.find(marker);
    if (at != std::string::npos) return std::atoi(line.c_str() + at + marker.size());
  }
  return 0;
}

std::string TpGroup::Stderr(int rank) const {
  std::ifstream in(RankFile(rank, ".err"));
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

fs::path TpGroup::RankFile(int rank, const char* ext) const { return dir_ / ("rank_" + std::to_string(rank) + ext); }

void TpGroup::Signal(int rank, int sig) const {
  if (pids_[rank] > 0) ::kill(pids_[rank], sig);
}

int TpGroup::WaitExit(int rank, double seconds) {
  for (int i = 0; i < seconds * 10; ++i) {
    int status = 0;
    if (::waitpid(pids_[rank], &status, WNOHANG) == pids_[rank]) {
      pids_[rank] = -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return -1;
}

}  // namespace lce::e2e
