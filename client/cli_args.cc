#include "cli_args.h"

#include <algorithm>
#include <fstream>
#include <limits>
#include <type_traits>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"

// A help of several lines is indented as one in --help.
ABSL_FLAG(std::string, target, "127.0.0.1:50051",
          "server address; replicas: several, comma-separated (scoring calls are spread over them,\n"
          "training calls go to the first)");
ABSL_FLAG(std::string, load_balancing, "",
          "round_robin: --target is one name with several addresses (dns:///NAME:PORT), spread by\n"
          "gRPC's round_robin policy (training calls: its first address that answers)");
ABSL_FLAG(std::optional<int32_t>, max_attempts, std::nullopt,
          "scoring calls failing with UNAVAILABLE are sent again to the next replica, N attempts in\n"
          "all, 1 to 100 (unset: 3 over replicas, 1 for one server; 1: no retries)");
ABSL_FLAG(double, timeout_seconds, 600, "deadline of each call, > 0");
ABSL_FLAG(std::string, token_file, "",
          "bearer token, read from the file's first line (sent as authorization metadata)");
ABSL_FLAG(std::string, admin_token_file, "", "bearer token for the training commands (unset: --token-file's)");
ABSL_FLAG(std::string, tls_ca, "",
          "use TLS, trusting the PEM roots in this file (on the data plane too, where the server serves it over TLS: lce_server --data-plane-tls)");
ABSL_FLAG(std::string, tls_cert, "", "client certificate for mutual TLS (with --tls-key and --tls-ca)");
ABSL_FLAG(std::string, tls_key, "", "its private key");
ABSL_FLAG(int32_t, streams, 4,
          "split a large request (over 2 * 8 MiB of hidden states) over up to N streams and connections, 1 to 64");
ABSL_FLAG(bool, data_plane, false,
          "carry hidden states and d_hidden over the server's data plane (plain TCP beside gRPC;\n"
          "the server runs with --data-port)");
ABSL_FLAG(int32_t, data_plane_sockets, 4, "sockets per direction per stream on the data plane, 1 to 16");
ABSL_FLAG(int32_t, data_plane_streams, 1,
          "streams a request over the data plane is split over, at most --streams, 1 to 64 (1: measured best)");

ABSL_FLAG(std::string, head, "",
          "the head (unset: the server's default head; load-head: the head to add or replace)");
ABSL_FLAG(std::string, hidden_file, "",
          "raw little-endian hidden states [rows, hidden] in the head's dtype (with --targets-file)");
ABSL_FLAG(std::string, targets_file, "", "raw little-endian int32 target ids [rows] (with --hidden-file)");
ABSL_FLAG(int64_t, rows, 16,
          "or generate N rows, 1 to 2^31: hidden ~ N(0, 0.5^2) rounded to the head's dtype, targets\n"
          "uniform in [0, vocab)");
ABSL_FLAG(std::optional<int64_t>, seed, std::nullopt,
          "seed of the generated rows, or of load-head's --seeded head (>= 0 there) (unset: 0)");
ABSL_FLAG(std::optional<double>, temperature, std::nullopt, "softmax temperature (unset: the server's, 1)");
ABSL_FLAG(double, softcap, 0, "logit soft-capping (0: off)");
ABSL_FLAG(int64_t, head_version, 0, "run only on this head version (FAILED_PRECONDITION otherwise; 0: any)");
ABSL_FLAG(std::optional<int32_t>, ignore_index, std::nullopt, "target id meaning \"no target\" (unset: -100)");
ABSL_FLAG(int64_t, chunk_bytes, 4 << 20, "hidden bytes per streamed chunk, >= 1");
ABSL_FLAG(int64_t, first_chunk_bytes, 0, "a smaller first chunk: the server starts sooner (0: a full one)");
ABSL_FLAG(int64_t, last_chunk_bytes, 0, "a smaller last chunk: a shorter tail (0: what is left)");
ABSL_FLAG(bool, grow_chunks, false,
          "after the first chunk, each twice the one before up to --chunk-bytes, and what is left in\n"
          "one chunk once it fits");

ABSL_FLAG(std::string, service, "", "service to check (unset: the server as a whole)");
ABSL_FLAG(int64_t, show, 16, "rows printed");
ABSL_FLAG(int32_t, top_k, 0,
          "score: also each row's k most probable tokens and their logprobs, and the token "
          "accuracy (argmax = target), 0 to 64 (0: none)");
ABSL_FLAG(std::string, reduction, "mean", "none, sum or mean");
ABSL_FLAG(double, label_smoothing, 0, "in [0, 1)");
ABSL_FLAG(double, z_loss, 0, "z-loss coefficient; its part of each row's loss (lambda * lse^2) is printed too");
ABSL_FLAG(std::string, class_weights_file, "",
          "class weights, one per vocabulary id (PyTorch's CrossEntropyLoss(weight=)): .npy or\n"
          ".safetensors [vocab] (fp32, fp16, bf16) or raw little-endian fp32 (.raw); a mean divides\n"
          "the cross-entropy by the valid targets' weights and the z-loss by their count, as\n"
          "Liger-Kernel (docs/MATH.md, \"Class weights\")");
ABSL_FLAG(bool, accumulate_weight_grad, false, "also add dW into the head's gradient buffer (on the front)");
ABSL_FLAG(bool, defer_weight_grad, false,
          "bench --op=train with --accumulate-weight-grad: dW waits on the server (pending) and each\n"
          "request's is committed by CommitGrad, inside the timed request (a PyTorch trainer's road)");
ABSL_FLAG(bool, fresh_d_hidden, false,
          "bench --op=train: each request's d_hidden in a new result buffer (the client allocates and zeroes\n"
          "it, 128 MiB at 16384 x 4096 bf16) instead of one buffer of the caller's, reused (a trainer's)");
ABSL_FLAG(std::string, op, "score",
          "score, or train: ForwardBackward with REDUCTION_SUM, or wire: the data plane's sockets alone, no engine (the batch's hidden bytes written to server memory and read back over --data-plane-sockets sockets, plain or TLS)");
ABSL_FLAG(int64_t, iterations, 5, "timed requests, >= 1");
ABSL_FLAG(int64_t, warmup, 1, "untimed requests first");
ABSL_FLAG(std::string, safetensors_file, "", "a safetensors file on the server's file system");
ABSL_FLAG(std::optional<std::string>, tensor, std::nullopt,
          "the safetensors tensor: load-head's in --safetensors-file (unset: lm_head.weight),\n"
          "update-weights' in --weight-file (unset: the file's only one), get-grad's name for it in\n"
          "--output (unset: grad)");
ABSL_FLAG(std::string, clone_of, "", "a copy of another head's current weight (e.g. a frozen reference)");
ABSL_FLAG(std::string, seeded, "", "a seeded random head, VOCABxHIDDEN (e.g. 32000x512)");
ABSL_FLAG(std::optional<std::string>, dtype, std::nullopt, "the seeded head's dtype: bf16, fp16 or fp32 (unset: bf16)");
ABSL_FLAG(bool, bias, false,
          "load-head: the --seeded head has an fp32 bias, zeros (update-weights --bias-file sets it);\n"
          "get-grad: the bias's gradient dB [vocab, 1] instead of dW");
ABSL_FLAG(std::string, bias_file, "",
          "the head's new bias [vocab] (a head with a bias): .npy or .safetensors (fp32, fp16, bf16)\n"
          "or raw little-endian fp32 (.raw) (unset: the bias is kept)");
ABSL_FLAG(std::string, output, "",
          "also write it there: .npy, .safetensors, or raw little-endian fp32 (.raw)");
ABSL_FLAG(std::string, format, "", "npy, safetensors or raw: the file's format when its name does not say");
ABSL_FLAG(std::optional<double>, lr, std::nullopt, "learning rate, >= 0 (required)");
ABSL_FLAG(double, beta1, 0.9, "AdamW's beta1, >= 0");
ABSL_FLAG(double, beta2, 0.999, "AdamW's beta2, >= 0");
ABSL_FLAG(double, eps, 1e-8, "AdamW's eps, >= 0");
ABSL_FLAG(double, weight_decay, 0, "decoupled, as torch.optim.AdamW, >= 0");
ABSL_FLAG(double, max_grad_norm, 0, "clip the gradient to this global L2 norm first (0: off)");
ABSL_FLAG(bool, zero_grad, true, "zero the gradient after the step");
ABSL_FLAG(std::string, weight_file, "",
          "[vocab, hidden]: .npy (<f4, <f2, or <u2 holding bf16 bits), .safetensors (F32, F16,\n"
          "BF16), or raw little-endian bytes in the head's dtype (.raw); another dtype than the\n"
          "head's is converted (round to nearest even)");
ABSL_FLAG(int64_t, expected_version, 0,
          "apply only if the head is at version N (FAILED_PRECONDITION otherwise; 0: any)");
ABSL_FLAG(std::string, directory, "",
          "a directory on the server: one file per tensor-parallel shard plus an index");

namespace lce::client::cli {
namespace {

const std::vector<std::string> kConnectionFlags = {"target",
                                                   "load_balancing",
                                                   "max_attempts",
                                                   "timeout_seconds",
                                                   "token_file",
                                                   "admin_token_file",
                                                   "tls_ca",
                                                   "tls_cert",
                                                   "tls_key",
                                                   "streams",
                                                   "data_plane",
                                                   "data_plane_sockets",
                                                   "data_plane_streams"};
const std::vector<std::string> kBatchFlags = {"head",         "hidden_file", "targets_file",      "rows",
                                              "seed",         "temperature", "softcap",           "head_version",
                                              "ignore_index", "chunk_bytes", "first_chunk_bytes", "last_chunk_bytes",
                                              "grow_chunks"};

std::string Dashed(absl::string_view name) { return absl::StrReplaceAll(name, {{"_", "-"}}); }

// `--name` alone sets a boolean flag (`--name value` still takes true/false and the like after it).
bool IsBoolFlag(const std::string& dashed) {
  const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(absl::StrReplaceAll(dashed, {{"-", "_"}}));
  return flag != nullptr && flag->IsOfType<bool>();
}
bool IsBoolWord(absl::string_view w) {
  const std::string s = absl::AsciiStrToLower(w);
  return s == "true" || s == "false" || s == "1" || s == "0" || s == "yes" || s == "no" || s == "t" || s == "f" ||
         s == "y" || s == "n";
}

// "--name (default: D)" and its help, indented; flags whose default is empty say in their help
// what unset means.
std::string DescribeFlag(const std::string& name) {
  const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
  const std::string def = flag->DefaultValue();
  return absl::StrCat("  --", Dashed(name), def.empty() ? "" : absl::StrCat(" (default: ", def, ")"), "\n      ",
                      absl::StrReplaceAll(flag->Help(), {{"\n", "\n      "}}), "\n");
}

std::string DescribeFlags(const std::string& title, const std::vector<std::string>& names) {
  std::string out = absl::StrCat("\n", title, ":\n");
  for (const std::string& name : names) out += DescribeFlag(name);
  return out;
}

// A value within [lo, hi] (NaN never is); the message names the flag.
template <typename T>
absl::Status InRange(absl::string_view name, T v, T lo, T hi) {
  if (v >= lo && v <= hi) return absl::OkStatus();
  const std::string want = lo == std::numeric_limits<T>::lowest() && hi == std::numeric_limits<T>::max()
                               ? "be a finite number"
                           : hi == std::numeric_limits<T>::max() ? absl::StrCat("be >= ", lo)
                                                                  : absl::StrCat("be in [", lo, ", ", hi, "]");
  return absl::InvalidArgumentError(absl::StrCat("--", Dashed(name), " must ", want, ", got ", v));
}
template <typename T>
absl::Status InRange(const absl::Flag<T>& flag, std::type_identity_t<T> lo, std::type_identity_t<T> hi) {
  return InRange<T>(absl::GetFlagReflectionHandle(flag).Name(), absl::GetFlag(flag), lo, hi);
}
template <typename T>  // an unset optional flag is in range
absl::Status InRange(const absl::Flag<std::optional<T>>& flag, std::type_identity_t<T> lo, std::type_identity_t<T> hi) {
  const std::optional<T> v = absl::GetFlag(flag);
  return v ? InRange<T>(absl::GetFlagReflectionHandle(flag).Name(), *v, lo, hi) : absl::OkStatus();
}

// The ranges that the flags' types do not say; a command's own checks come later (cli_training.cc).
absl::Status CheckRanges() {
  constexpr double kMax = std::numeric_limits<double>::max();
  constexpr int64_t kMaxInt = std::numeric_limits<int64_t>::max();
  if (const double t = absl::GetFlag(FLAGS_timeout_seconds); !(t > 0 && t <= kMax)) {
    return absl::InvalidArgumentError(absl::StrCat("--timeout-seconds must be a finite number > 0, got ", t));
  }
  for (const absl::Status& s : {InRange(FLAGS_max_attempts, 1, 100),
                                InRange(FLAGS_streams, 1, 64),
                                InRange(FLAGS_data_plane_sockets, 1, 16),
                                InRange(FLAGS_data_plane_streams, 1, 64),
                                InRange(FLAGS_rows, 1, int64_t{1} << 31),
                                InRange(FLAGS_temperature, -kMax, kMax),
                                InRange(FLAGS_softcap, -kMax, kMax),
                                InRange(FLAGS_head_version, 0, kMaxInt),
                                InRange(FLAGS_chunk_bytes, 1, kMaxInt),
                                InRange(FLAGS_first_chunk_bytes, 0, kMaxInt),
                                InRange(FLAGS_last_chunk_bytes, 0, kMaxInt),
                                InRange(FLAGS_show, 0, kMaxInt),
                                InRange(FLAGS_label_smoothing, -kMax, kMax),
                                InRange(FLAGS_z_loss, -kMax, kMax),
                                InRange(FLAGS_iterations, 1, kMaxInt),
                                InRange(FLAGS_warmup, 0, kMaxInt),
                                InRange(FLAGS_lr, 0, kMax),
                                InRange(FLAGS_beta1, 0, kMax),
                                InRange(FLAGS_beta2, 0, kMax),
                                InRange(FLAGS_eps, 0, kMax),
                                InRange(FLAGS_weight_decay, 0, kMax),
                                InRange(FLAGS_max_grad_norm, 0, kMax),
                                InRange(FLAGS_expected_version, 0, kMaxInt)}) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

// The flags of a --flagfile, one a line.
absl::StatusOr<std::vector<std::string>> ReadFlagfile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("cannot read --flagfile ", path));
  std::vector<std::string> flags;
  for (std::string line; std::getline(in, line);) {
    absl::string_view t = absl::StripAsciiWhitespace(line);
    if (!t.empty() && t[0] != '#') flags.emplace_back(t);
  }
  return flags;
}

}  // namespace

const std::vector<Command>& Commands() {
  static const auto* commands = new std::vector<Command>{
      {"health",
       "grpc.health.v1 check of the server (exit 0 when SERVING)",
       "lce_cli health: grpc.health.v1 Check; prints SERVING or NOT_SERVING",
       {"service"}},
      {"info",
       "head and server description",
       "lce_cli info: server version, backend, TP size, limits and every head",
       {"head"}},
      {"score",
       "logprobs and entropy of a batch; prints a table of the first rows",
       "lce_cli score: per-row logprob of the target and entropy; prints the first rows and a summary; with\n"
       "--top-k, each row's k most probable tokens and the token accuracy",
       {"show", "top_k"},
       true},
      {"forward-backward",
       "cross-entropy loss, per-token losses and the norm of d_hidden of a batch",
       "lce_cli forward-backward: reduced loss, valid tokens, per-token loss (and z-loss, with --z-loss) of\n"
       "the first rows, |d_hidden|",
       {"reduction", "label_smoothing", "z_loss", "class_weights_file", "accumulate_weight_grad", "show"},
       true},
      {"bench",
       "throughput of repeated score or train (forward-backward) requests",
       "lce_cli bench: throughput of repeated requests on one batch; prints ms per request, rows/s and\n"
       "GB/s each way (hidden + targets up; logprob + entropy, or d_hidden + loss, down)",
       {"op", "iterations", "warmup", "accumulate_weight_grad", "defer_weight_grad", "fresh_d_hidden"},
       true},
      {"load-head",
       "add or replace a head: from a safetensors file, a clone, or a seed",
       "lce_cli load-head --head=NAME SOURCE: adds or replaces a head (version + 1 when it exists);\n"
       "SOURCE is one of --safetensors-file (with --tensor), --clone-of, --seeded (with --seed, --dtype,\n"
       "--bias)",
       {"head", "safetensors_file", "tensor", "clone_of", "seeded", "seed", "dtype", "bias"},
       false,
       true},
      {"zero-grad",
       "zero the head's gradient buffer",
       "lce_cli zero-grad: zeroes the head's fp32 gradient buffer",
       {"head"},
       false,
       true},
      {"get-grad",
       "the accumulated gradient dW: its norm, and written to .npy / .safetensors / raw",
       "lce_cli get-grad: the head's accumulated fp32 gradient dW [vocab, hidden] (or --bias: dB [vocab, 1]);\n"
       "prints its norm",
       {"head", "bias", "output", "format", "tensor"},
       false,
       true},
      {"step",
       "one AdamW step (--lr, betas, eps, weight decay, clipping)",
       "lce_cli step --lr=LR: one AdamW step on the server's fp32 master weights (version + 1)",
       {"head", "lr", "beta1", "beta2", "eps", "weight_decay", "max_grad_norm", "zero_grad"},
       false,
       true},
      {"update-weights",
       "replace the head's weight with one from a file",
       "lce_cli update-weights --weight-file=PATH: replaces the head's weight, and with --bias-file its\n"
       "bias (version + 1)",
       {"head", "weight_file", "bias_file", "format", "tensor", "expected_version"},
       false,
       true},
      {"save-head",
       "write the head as safetensors on the server",
       "lce_cli save-head --directory=DIR: writes the head as safetensors on the server",
       {"head", "directory"},
       false,
       true},
  };
  return *commands;
}

const Command* FindCommand(std::string_view name) {
  for (const Command& c : Commands()) {
    if (name == c.name) return &c;
  }
  return nullptr;
}

std::vector<std::string> FlagsOf(const Command* command) {
  std::vector<std::string> names = kConnectionFlags;
  auto add = [&names](const std::vector<std::string>& more) {
    for (const std::string& n : more) {
      if (std::find(names.begin(), names.end(), n) == names.end()) names.push_back(n);
    }
  };
  for (const Command& c : Commands()) {
    if (command != nullptr && command != &c) continue;
    if (c.batch) add(kBatchFlags);
    add(c.flags);
  }
  return names;
}

absl::StatusOr<Args> Parse(const std::vector<std::string>& given) {
  std::vector<std::string> words = given;  // each --flagfile's flags go in its place
  int flagfiles = 0;
  Args a;
  for (size_t i = 0; i < words.size(); ++i) {
    const std::string w = words[i];
    if (w == "--help" || w == "-h") {
      a.help = true;
    } else if (w == "--version") {
      a.version = true;
    } else if (w.rfind("--", 0) != 0 || w.size() == 2) {
      if (!a.command.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat("unexpected argument '", w, "' after command '", a.command, "'"));
      }
      a.command = w;
    } else {
      std::string name = w.substr(2), value;
      if (const size_t eq = name.find('='); eq != std::string::npos) {
        value = name.substr(eq + 1);
        name.resize(eq);
      } else if (IsBoolFlag(name) && (i + 1 == words.size() || !IsBoolWord(words[i + 1]))) {
        value = "true";  // a bare boolean
      } else if (i + 1 < words.size()) {
        value = words[++i];
      } else {
        return absl::InvalidArgumentError(absl::StrCat(w, " needs a value"));
      }
      if (name.empty()) return absl::InvalidArgumentError(absl::StrCat("bad flag '", w, "'"));
      name = absl::StrReplaceAll(name, {{"-", "_"}});
      if (name != "flagfile") {
        a.flags.emplace_back(name, value);
      } else if (++flagfiles > 100) {  // a flagfile naming itself
        return absl::InvalidArgumentError("more than 100 --flagfile reads");
      } else {
        absl::StatusOr<std::vector<std::string>> more = ReadFlagfile(value);
        if (!more.ok()) return more.status();
        words.insert(words.begin() + static_cast<std::ptrdiff_t>(i) + 1, more->begin(), more->end());
      }
    }
  }
  return a;
}

absl::Status SetFlags(const Args& args) {
  const Command* command = FindCommand(args.command);
  if (command == nullptr) return absl::InvalidArgumentError(absl::StrCat("unknown command '", args.command, "'"));
  const std::vector<std::string> all = FlagsOf(nullptr), taken = FlagsOf(command);
  for (const std::string& name : all) {
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    std::string error;
    flag->ParseFrom(flag->DefaultValue(), &error);
  }
  for (const auto& [name, value] : args.flags) {
    if (std::find(taken.begin(), taken.end(), name) == taken.end()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", Dashed(name), " for '", args.command, "'"));
    }
    std::string error;
    if (!absl::FindCommandLineFlag(name)->ParseFrom(value, &error)) {
      return absl::InvalidArgumentError(absl::StrCat("bad value '", value, "' for --", Dashed(name)));
    }
  }
  return CheckRanges();
}

std::string Synopsis() {
  std::string out =
      "usage: lce_cli COMMAND --target=HOST:PORT [--name=value | --name value | --flagfile=FILE]...\n"
      "       lce_cli COMMAND --help: its flags\n\ncommands:\n";
  for (const Command& c : Commands()) {
    absl::StrAppend(&out, "  ", c.name, std::string(19 - std::string_view(c.name).size(), ' '), c.summary, "\n");
  }
  return out +
         "Training commands are admin RPCs; all go to the front, the first target.\n"
         "Exit code: 0 ok, 1 a call failed (gRPC status code and message on stderr), 2 bad usage.\n";
}

std::string Help() {
  std::vector<std::string> own;  // the flags of one command or a few, each with the commands that take it
  for (const std::string& name : FlagsOf(nullptr)) {
    if (std::find(kConnectionFlags.begin(), kConnectionFlags.end(), name) != kConnectionFlags.end()) continue;
    if (std::find(kBatchFlags.begin(), kBatchFlags.end(), name) != kBatchFlags.end()) continue;
    own.push_back(name);
  }
  std::string out = Synopsis() + DescribeFlags("connection (every command)", kConnectionFlags) +
                    DescribeFlags("batch (score, forward-backward, bench)", kBatchFlags) + "\nper command:\n";
  std::string last_users;
  for (const std::string& name : own) {
    std::vector<std::string> users;
    for (const Command& c : Commands()) {
      if (std::find(c.flags.begin(), c.flags.end(), name) != c.flags.end()) users.push_back(c.name);
    }
    const std::string joined = absl::StrJoin(users, ", ");
    if (joined != last_users) absl::StrAppend(&out, "  [", joined, "]\n");
    last_users = joined;
    out += DescribeFlag(name);
  }
  return out;
}

std::string CommandHelp(const Command& command) {
  std::string out = absl::StrCat(command.help, "\n", DescribeFlags("flags", command.flags));
  if (command.batch) out += DescribeFlags("batch", kBatchFlags);
  return out + DescribeFlags("connection", kConnectionFlags);
}

}  // namespace lce::client::cli
