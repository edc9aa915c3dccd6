// lce_cli's training commands: load-head, zero-grad, get-grad, step, update-weights, save-head.
// Their flags follow the Python client's calls (Client.load_head, zero_grad, get_grad,
// optimizer_step, update_weights, save_head).
#pragma once

#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "cli_args.h"
#include "lce/client/lce_client.h"

namespace lce::client::cli {

// How a command ended: exit code 0 (done), 1 (a call failed: `status`) or 2 (bad usage: `status`).
struct Outcome {
  int exit_code = 0;
  absl::Status status;
};

struct TrainingCommand {
  const char* name;
  const char* help;              // printed by `lce_cli NAME --help`, before the connection flags
  std::set<std::string> flags;   // besides the connection flags
};
const std::vector<TrainingCommand>& TrainingCommands();

// Checks a training command's flags (values, required ones, exclusive ones) before anything is
// sent: INVALID_ARGUMENT naming the flag.
absl::Status CheckTrainingFlags(const Args& args);

// Runs a training command against the client's front, printing what it did on stdout.
Outcome RunTrainingCommand(const Args& args, LceClient& client);

// "head 'NAME' version N: vocab V x hidden H DTYPE[ with bias]".
std::string DescribeHead(const v1::HeadDescription& head);

}  // namespace lce::client::cli
