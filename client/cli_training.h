// lce_cli's training commands: load-head, zero-grad, get-grad, step, update-weights, save-head.
// Their flags follow the Python client's calls (Client.load_head, zero_grad, get_grad,
// optimizer_step, update_weights, save_head).
#pragma once

#include <string>

#include "absl/status/status.h"
#include "lce/client/lce_client.h"

namespace lce::client::cli {

// How a command ended: exit code 0 (done), 1 (a call failed: `status`) or 2 (bad usage: `status`).
struct Outcome {
  int exit_code = 0;
  absl::Status status;
};

// Checks a training command's flags together (required ones, exclusive ones, formats) before
// anything is sent: INVALID_ARGUMENT naming the flag. The flags are set (cli::SetFlags).
absl::Status CheckTrainingFlags(const std::string& command);

// Runs a training command against the client's front, printing what it did on stdout.
Outcome RunTrainingCommand(const std::string& command, LceClient& client);

// "head 'NAME' version N: vocab V x hidden H DTYPE[ with bias]".
std::string DescribeHead(const v1::HeadDescription& head);

}  // namespace lce::client::cli
