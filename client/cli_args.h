// Command-line parsing of lce_cli, kept apart from main() so that it can be unit-tested.
//   lce_cli COMMAND [--name=value | --name value]... [--help]
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace lce::client::cli {

struct Args {
  std::string command;                       // first word that is not a flag
  std::map<std::string, std::string> flags;  // name without the dashes -> value
  bool help = false;                         // --help or -h anywhere

  bool Has(const std::string& name) const { return flags.count(name) != 0; }
  std::string Get(const std::string& name, const std::string& def = "") const;
  // The flag as a number (def when absent); INVALID_ARGUMENT naming the flag when it is not one.
  absl::StatusOr<double> Number(const std::string& name, double def) const;
  // The flag as an integer in [lo, hi] (def when absent).
  absl::StatusOr<int64_t> Int(const std::string& name, int64_t def, int64_t lo = INT64_MIN,
                              int64_t hi = INT64_MAX) const;
};

// Parses the words after the program name. Flags take a value, either `--name=value` or
// `--name value`; a flag with no value left is INVALID_ARGUMENT, as is a second command word.
absl::StatusOr<Args> Parse(const std::vector<std::string>& words);

// INVALID_ARGUMENT naming the first flag not in `allowed`.
absl::Status CheckKnownFlags(const Args& args, const std::set<std::string>& allowed);

}  // namespace lce::client::cli
