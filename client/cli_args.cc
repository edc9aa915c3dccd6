#include "cli_args.h"

#include <cmath>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace lce::client::cli {

std::string Args::Get(const std::string& name, const std::string& def) const {
  auto it = flags.find(name);
  return it == flags.end() ? def : it->second;
}

absl::StatusOr<double> Args::Number(const std::string& name, double def) const {
  auto it = flags.find(name);
  if (it == flags.end()) return def;
  double v = 0;
  if (!absl::SimpleAtod(it->second, &v) || !std::isfinite(v)) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a number, got '", it->second, "'"));
  }
  return v;
}

absl::StatusOr<int64_t> Args::Int(const std::string& name, int64_t def, int64_t lo, int64_t hi) const {
  auto it = flags.find(name);
  if (it == flags.end()) return def;
  int64_t v = 0;
  if (!absl::SimpleAtoi(it->second, &v)) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, " needs an integer, got '", it->second, "'"));
  }
  if (v < lo || v > hi) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, " must be in [", lo, ", ", hi, "], got ", v));
  }
  return v;
}

absl::StatusOr<Args> Parse(const std::vector<std::string>& words) {
  Args a;
  for (size_t i = 0; i < words.size(); ++i) {
    const std::string& w = words[i];
    if (w == "--help" || w == "-h") {
      a.help = true;
      continue;
    }
    if (w.rfind("--", 0) == 0 && w.size() > 2) {
      std::string name = w.substr(2), value;
      const size_t eq = name.find('=');
      if (eq != std::string::npos) {
        value = name.substr(eq + 1);
        name = name.substr(0, eq);
      } else if (i + 1 < words.size()) {
        value = words[++i];
      } else {
        return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value"));
      }
      if (name.empty()) return absl::InvalidArgumentError(absl::StrCat("bad flag '", w, "'"));
      a.flags[name] = value;
    } else if (a.command.empty()) {
      a.command = w;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", w, "' after command '", a.command, "'"));
    }
  }
  return a;
}

absl::Status CheckKnownFlags(const Args& args, const std::set<std::string>& allowed) {
  for (const auto& [name, value] : args.flags) {
    if (!allowed.count(name)) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown flag --", name, args.command.empty() ? "" : absl::StrCat(" for '", args.command, "'")));
    }
  }
  return absl::OkStatus();
}

}  // namespace lce::client::cli
