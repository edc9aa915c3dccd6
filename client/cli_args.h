// lce_cli's command line: its commands, its flags (absl flags, declared here so that the commands
// read them with absl::GetFlag), the parse and the generated help. Kept apart from main() so that it
// can be unit-tested.
//   lce_cli COMMAND [--name=value | --name value | --flagfile=FILE]... [--help]
// A flag that means something different per command, or whose absence means something, is an
// optional flag: unset, each command applies its own default (e.g. --tensor).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"

// Connection (every command).
ABSL_DECLARE_FLAG(std::string, target);
ABSL_DECLARE_FLAG(std::string, load_balancing);
ABSL_DECLARE_FLAG(std::optional<int32_t>, max_attempts);
ABSL_DECLARE_FLAG(double, timeout_seconds);
ABSL_DECLARE_FLAG(std::string, token_file);
ABSL_DECLARE_FLAG(std::string, admin_token_file);
ABSL_DECLARE_FLAG(std::string, tls_ca);
ABSL_DECLARE_FLAG(std::string, tls_cert);
ABSL_DECLARE_FLAG(std::string, tls_key);
ABSL_DECLARE_FLAG(int32_t, streams);
ABSL_DECLARE_FLAG(bool, data_plane);
ABSL_DECLARE_FLAG(int32_t, data_plane_sockets);
ABSL_DECLARE_FLAG(int32_t, data_plane_streams);
// The batch of score, forward-backward and bench.
ABSL_DECLARE_FLAG(std::string, head);
ABSL_DECLARE_FLAG(std::string, hidden_file);
ABSL_DECLARE_FLAG(std::string, targets_file);
ABSL_DECLARE_FLAG(int64_t, rows);
ABSL_DECLARE_FLAG(std::optional<int64_t>, seed);
ABSL_DECLARE_FLAG(std::optional<double>, temperature);
ABSL_DECLARE_FLAG(double, softcap);
ABSL_DECLARE_FLAG(int64_t, head_version);
ABSL_DECLARE_FLAG(std::optional<int32_t>, ignore_index);
ABSL_DECLARE_FLAG(int64_t, chunk_bytes);
ABSL_DECLARE_FLAG(int64_t, first_chunk_bytes);
ABSL_DECLARE_FLAG(int64_t, last_chunk_bytes);
ABSL_DECLARE_FLAG(bool, grow_chunks);
// Per command.
ABSL_DECLARE_FLAG(std::string, service);
ABSL_DECLARE_FLAG(int64_t, show);
ABSL_DECLARE_FLAG(int32_t, top_k);
ABSL_DECLARE_FLAG(std::string, reduction);
ABSL_DECLARE_FLAG(double, label_smoothing);
ABSL_DECLARE_FLAG(double, z_loss);
ABSL_DECLARE_FLAG(std::string, class_weights_file);
ABSL_DECLARE_FLAG(bool, accumulate_weight_grad);
ABSL_DECLARE_FLAG(bool, defer_weight_grad);
ABSL_DECLARE_FLAG(bool, fresh_d_hidden);
ABSL_DECLARE_FLAG(std::string, op);
ABSL_DECLARE_FLAG(int64_t, iterations);
ABSL_DECLARE_FLAG(int64_t, warmup);
ABSL_DECLARE_FLAG(std::string, safetensors_file);
ABSL_DECLARE_FLAG(std::optional<std::string>, tensor);
ABSL_DECLARE_FLAG(std::string, clone_of);
ABSL_DECLARE_FLAG(std::string, seeded);
ABSL_DECLARE_FLAG(std::optional<std::string>, dtype);
ABSL_DECLARE_FLAG(bool, bias);
ABSL_DECLARE_FLAG(std::string, bias_file);
ABSL_DECLARE_FLAG(std::string, output);
ABSL_DECLARE_FLAG(std::string, format);
ABSL_DECLARE_FLAG(std::optional<double>, lr);
ABSL_DECLARE_FLAG(double, beta1);
ABSL_DECLARE_FLAG(double, beta2);
ABSL_DECLARE_FLAG(double, eps);
ABSL_DECLARE_FLAG(double, weight_decay);
ABSL_DECLARE_FLAG(double, max_grad_norm);
ABSL_DECLARE_FLAG(bool, zero_grad);
ABSL_DECLARE_FLAG(std::string, weight_file);
ABSL_DECLARE_FLAG(int64_t, expected_version);
ABSL_DECLARE_FLAG(std::string, directory);

namespace lce::client::cli {

struct Command {
  const char* name;
  const char* summary;             // its line in `lce_cli --help`
  const char* help;                // what `lce_cli NAME --help` says before the flags
  std::vector<std::string> flags;  // its own (absl names), besides the connection and batch flags
  bool batch = false;              // takes the batch flags
  bool training = false;           // run by RunTrainingCommand (cli_training.h)
};
const std::vector<Command>& Commands();
const Command* FindCommand(std::string_view name);

// The flags a command takes (absl names, --help's order); every flag of lce_cli for nullptr.
std::vector<std::string> FlagsOf(const Command* command);

struct Args {
  std::string command;                                     // the first word that is not a flag
  std::vector<std::pair<std::string, std::string>> flags;  // absl name (dashes -> underscores), value
  bool help = false;                                       // --help or -h anywhere
  bool version = false;                                    // --version anywhere
};

// Splits the words after the program name: flags take a value, `--name=value` or `--name value`;
// each --flagfile=FILE is read in place (one flag a line; blank lines and '#' comments skipped).
// INVALID_ARGUMENT for a flag with no value left, a second command word, an unreadable flagfile.
absl::StatusOr<Args> Parse(const std::vector<std::string>& words);

// Every flag back to its default, then the given ones set: INVALID_ARGUMENT naming an unknown
// command, a flag the command does not take, a value of the wrong type or out of its range.
absl::Status SetFlags(const Args& args);

std::string Synopsis();                         // the usage line and the commands
std::string Help();                             // lce_cli --help: Synopsis() and every flag
std::string CommandHelp(const Command& command);  // lce_cli COMMAND --help

}  // namespace lce::client::cli
