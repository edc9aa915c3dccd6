// Groups of lce_server processes on loopback (tensor parallelism over Gloo, or NCCL on GPUs), for
// the tests that need real processes: tp_test.cc (groups of 2 and 3), save_crash_test.cc (a
// server SIGKILLed while it saves).
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <string>
#include <vector>

namespace lce::e2e {

// LCE_TEST_TP_BACKEND=cuda runs the same groups on GPUs (one per rank, NCCL); default cpu (Gloo).
std::string TpBackend();

// The lce_server binary: $LCE_SERVER_BIN (a tree copied elsewhere, e.g. to a GPU machine), else the
// one this build made.
std::string ServerPath();

// k lce_server ranks with the seeded fp32 head kVocab x kHidden (seed 7); the front's address is
// target(). The destructor SIGKILLs what still runs.
class TpGroup {
 public:
  // `extra`: more flags for every rank (later ones win over the defaults above them).
  TpGroup(int k, double timeout_seconds, const std::string& head_file = "", const std::vector<std::string>& extra = {});
  ~TpGroup();
  const std::string& target() const { return target_; }
  // The port of the front's /metrics, read from its output (each rank's stdout goes to a file of the
  // group's directory); 0 when the ranks were started without --metrics-port.
  int FrontMetricsPort() const;
  // What `rank` wrote to stderr so far (its request log, with --log-requests=true); every rank's is
  // printed when the test has failed.
  std::string Stderr(int rank) const;
  pid_t pid(int rank) const { return pids_[rank]; }
  void Signal(int rank, int sig) const;
  // Exit code of `rank` once it exits within `seconds`, or -1.
  int WaitExit(int rank, double seconds);

 private:
  // Where `rank`'s stdout (ext ".out") or stderr (".err") goes.
  std::filesystem::path RankFile(int rank, const char* ext) const;
  static inline int counter_ = 0;
  std::filesystem::path dir_;
  std::vector<pid_t> pids_;
  std::string target_;
};

}  // namespace lce::e2e
