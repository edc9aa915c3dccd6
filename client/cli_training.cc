#include "cli_training.h"

#include <cmath>
#include <cstdio>
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cli_args.h"
#include "tensor_file.h"
#include "wire_codec.h"

namespace lce::client::cli {
namespace {

Outcome UsageError(absl::Status s) { return {2, std::move(s)}; }
Outcome CallFailed(absl::Status s) { return {1, std::move(s)}; }

absl::StatusOr<v1::DType> ParseDType(const std::string& name) {
  if (name == "bf16") return v1::DTYPE_BFLOAT16;
  if (name == "fp16") return v1::DTYPE_FLOAT16;
  if (name == "fp32") return v1::DTYPE_FLOAT32;
  return absl::InvalidArgumentError(absl::StrCat("--dtype must be bf16, fp16 or fp32, got '", name, "'"));
}

// --seeded=VOCABxHIDDEN [--seed=S] [--dtype=D] as a SeededHead.
absl::StatusOr<v1::SeededHead> ParseSeeded() {
  const std::string shape = absl::GetFlag(FLAGS_seeded);
  std::vector<std::string> dims = absl::StrSplit(shape, 'x');
  int64_t vocab = 0, hidden = 0;
  if (dims.size() != 2 || !absl::SimpleAtoi(dims[0], &vocab) || !absl::SimpleAtoi(dims[1], &hidden) || vocab <= 0 ||
      hidden <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--seeded must be VOCABxHIDDEN (e.g. 32000x512), got '", shape, "'"));
  }
  const int64_t seed = absl::GetFlag(FLAGS_seed).value_or(0);
  if (seed < 0) return absl::InvalidArgumentError(absl::StrCat("--seed must be >= 0 for --seeded, got ", seed));
  absl::StatusOr<v1::DType> dtype = ParseDType(absl::GetFlag(FLAGS_dtype).value_or("bf16"));
  if (!dtype.ok()) return dtype.status();
  v1::SeededHead s;
  s.set_vocab_size(vocab);
  s.set_hidden_size(hidden);
  s.set_seed(static_cast<uint64_t>(seed));
  s.set_dtype(*dtype);
  s.set_bias(absl::GetFlag(FLAGS_bias));
  return s;
}

absl::StatusOr<v1::LoadHeadRequest> LoadHeadRequest() {
  const std::string file = absl::GetFlag(FLAGS_safetensors_file), clone = absl::GetFlag(FLAGS_clone_of);
  const bool seeded = !absl::GetFlag(FLAGS_seeded).empty();
  if (absl::GetFlag(FLAGS_head).empty()) return absl::InvalidArgumentError("load-head needs --head=NAME");
  if (!file.empty() + !clone.empty() + seeded != 1) {
    return absl::InvalidArgumentError("load-head needs one source: --safetensors-file, --clone-of or --seeded");
  }
  if (!seeded && absl::GetFlag(FLAGS_seed)) return absl::InvalidArgumentError("--seed goes with --seeded");
  if (!seeded && absl::GetFlag(FLAGS_dtype)) return absl::InvalidArgumentError("--dtype goes with --seeded");
  if (!seeded && absl::GetFlag(FLAGS_bias)) {
    return absl::InvalidArgumentError("--bias goes with --seeded (a file's head has the bias the file holds)");
  }
  if (file.empty() && absl::GetFlag(FLAGS_tensor)) {
    return absl::InvalidArgumentError("--tensor goes with --safetensors-file");
  }
  v1::LoadHeadRequest req;
  req.set_name(absl::GetFlag(FLAGS_head));
  req.set_tensor(absl::GetFlag(FLAGS_tensor).value_or(""));  // the server's default: lm_head.weight
  if (!file.empty()) req.set_safetensors_file(file);
  if (!clone.empty()) req.set_clone_of(clone);
  if (seeded) {
    absl::StatusOr<v1::SeededHead> s = ParseSeeded();
    if (!s.ok()) return s.status();
    *req.mutable_seeded() = *s;
  }
  return req;
}

absl::StatusOr<v1::OptimizerStepRequest> StepRequest() {
  if (!absl::GetFlag(FLAGS_lr)) return absl::InvalidArgumentError("step needs --lr");
  v1::OptimizerStepRequest req;  // the values' ranges are checked by cli::SetFlags
  req.set_head(absl::GetFlag(FLAGS_head));
  req.set_lr(static_cast<float>(*absl::GetFlag(FLAGS_lr)));
  req.set_beta1(static_cast<float>(absl::GetFlag(FLAGS_beta1)));
  req.set_beta2(static_cast<float>(absl::GetFlag(FLAGS_beta2)));
  req.set_eps(static_cast<float>(absl::GetFlag(FLAGS_eps)));
  req.set_weight_decay(static_cast<float>(absl::GetFlag(FLAGS_weight_decay)));
  req.set_max_grad_norm(static_cast<float>(absl::GetFlag(FLAGS_max_grad_norm)));
  req.set_zero_grad(absl::GetFlag(FLAGS_zero_grad));
  return req;
}

// The format of get-grad's --output or update-weights' --weight-file (`path`).
absl::StatusOr<TensorFormat> FileFormat(const char* flag, const std::string& path) {
  const std::string format = absl::GetFlag(FLAGS_format);
  if (!format.empty() && path.empty()) return absl::InvalidArgumentError(absl::StrCat("--format goes with --", flag));
  return ParseTensorFormat(format, path);
}

// The head's name for messages.
std::string HeadName() {
  const std::string head = absl::GetFlag(FLAGS_head);
  return head.empty() ? "(default)" : head;
}

Outcome GetGrad(LceClient& c) {
  const bool bias = absl::GetFlag(FLAGS_bias);
  absl::StatusOr<Gradient> g = c.GetGrad(absl::GetFlag(FLAGS_head), bias);
  if (!g.ok()) return CallFailed(g.status());
  double norm = 0;
  for (float x : g->values) norm += static_cast<double>(x) * x;
  std::printf("%s of head '%s': %lld x %lld fp32, |%s| %.9e\n", bias ? "bias gradient" : "gradient", HeadName().c_str(),
              static_cast<long long>(g->rows), static_cast<long long>(g->cols), bias ? "dB" : "dW", std::sqrt(norm));
  const std::string output = absl::GetFlag(FLAGS_output);
  if (output.empty()) return {};
  const TensorFormat format = *FileFormat("output", output);  // checked by CheckTrainingFlags
  const auto* bytes = reinterpret_cast<const uint8_t*>(g->values.data());
  if (absl::Status s = WriteTensorFile(output, format, absl::GetFlag(FLAGS_tensor).value_or("grad"), v1::DTYPE_FLOAT32,
                                       g->rows, g->cols, absl::MakeConstSpan(bytes, g->values.size() * 4));
      !s.ok()) {
    return CallFailed(s);
  }
  std::printf("written to %s\n", output.c_str());
  return {};
}

// The weight file of update-weights, in the head's dtype (converted, round to nearest even, when
// the file holds another).
absl::StatusOr<Tensor2D> WeightFile(const v1::HeadDescription& head) {
  const std::string path = absl::GetFlag(FLAGS_weight_file);
  const TensorFormat format = *FileFormat("weight-file", path);  // checked by CheckTrainingFlags
  absl::StatusOr<Tensor2D> w =
      ReadTensorFile(path, format, absl::GetFlag(FLAGS_tensor).value_or(""), head.dtype(), head.hidden_size());
  if (!w.ok() || w->dtype == head.dtype()) return w;
  const int64_t n = w->rows * w->cols;
  const std::vector<float> values = DecodeFloats(w->bytes.data(), n, w->dtype);
  std::printf("converting %s to the head's %s\n", v1::DType_Name(w->dtype).c_str(), v1::DType_Name(head.dtype()).c_str());
  w->bytes = EncodeFloats(values.data(), n, head.dtype());
  w->dtype = head.dtype();
  return w;
}

Outcome UpdateWeights(LceClient& c) {
  absl::StatusOr<v1::GetInfoResponse> info = c.GetInfo(absl::GetFlag(FLAGS_head));
  if (!info.ok()) return CallFailed(info.status());
  absl::StatusOr<Tensor2D> w = WeightFile(info->head());
  if (!w.ok()) return absl::IsNotFound(w.status()) || absl::IsInvalidArgument(w.status()) ? UsageError(w.status())
                                                                                             : CallFailed(w.status());
  const std::string bias_file = absl::GetFlag(FLAGS_bias_file);
  absl::StatusOr<std::vector<float>> bias = bias_file.empty() ? std::vector<float>{} : ReadVectorFile(bias_file);
  if (!bias.ok()) return UsageError(bias.status());  // a bias of the wrong size is the server's INVALID_ARGUMENT
  absl::StatusOr<v1::HeadDescription> head = c.UpdateWeights(
      absl::GetFlag(FLAGS_head),
      WeightTensor{w->dtype, w->rows, w->cols, absl::MakeConstSpan(w->bytes), absl::MakeConstSpan(*bias)},
      absl::GetFlag(FLAGS_expected_version));
  if (!head.ok()) return CallFailed(head.status());
  std::cout << "updated " << DescribeHead(*head) << std::endl;
  return {};
}

Outcome Step(LceClient& c) {
  absl::StatusOr<v1::OptimizerStepResponse> r = c.OptimizerStep(*StepRequest());  // checked by CheckTrainingFlags
  if (!r.ok()) return CallFailed(r.status());
  std::printf("step %lld: grad norm %.9e (before clipping); ", static_cast<long long>(r->step()), r->grad_norm());
  std::cout << DescribeHead(r->head()) << std::endl;
  return {};
}

}  // namespace

std::string DescribeHead(const v1::HeadDescription& h) {
  return absl::StrCat("head '", h.name(), "' version ", h.version(), ": vocab ", h.vocab_size(), " x hidden ",
                      h.hidden_size(), " ", v1::DType_Name(h.dtype()), h.has_bias() ? " with bias" : "");
}

absl::Status CheckTrainingFlags(const std::string& command) {
  if (command == "load-head") return LoadHeadRequest().status();
  if (command == "step") return StepRequest().status();
  if (command == "get-grad") {
    const std::string output = absl::GetFlag(FLAGS_output);
    return output.empty() && absl::GetFlag(FLAGS_format).empty() ? absl::OkStatus()
                                                                 : FileFormat("output", output).status();
  }
  if (command == "update-weights") {
    const std::string weight_file = absl::GetFlag(FLAGS_weight_file);
    if (weight_file.empty()) return absl::InvalidArgumentError("update-weights needs --weight-file");
    return FileFormat("weight-file", weight_file).status();
  }
  if (command == "save-head" && absl::GetFlag(FLAGS_directory).empty()) {
    return absl::InvalidArgumentError("save-head needs --directory");
  }
  return absl::OkStatus();
}

Outcome RunTrainingCommand(const std::string& command, LceClient& c) {
  if (absl::Status s = CheckTrainingFlags(command); !s.ok()) return UsageError(s);
  const std::string head = absl::GetFlag(FLAGS_head);
  if (command == "load-head") {
    absl::StatusOr<v1::HeadDescription> h = c.LoadHead(*LoadHeadRequest());
    if (!h.ok()) return CallFailed(h.status());
    std::cout << "loaded " << DescribeHead(*h) << std::endl;
    return {};
  }
  if (command == "zero-grad") {
    if (absl::Status s = c.ZeroGrad(head); !s.ok()) return CallFailed(s);
    std::cout << "zeroed the gradient of head '" << HeadName() << "'" << std::endl;
    return {};
  }
  if (command == "get-grad") return GetGrad(c);
  if (command == "step") return Step(c);
  if (command == "update-weights") return UpdateWeights(c);
  if (command == "save-head") {
    absl::StatusOr<v1::SaveHeadResponse> r = c.SaveHead(head, absl::GetFlag(FLAGS_directory));
    if (!r.ok()) return CallFailed(r.status());
    std::cout << "index " << r->index_file() << "\n";
    for (const std::string& f : r->files()) std::cout << "file " << f << "\n";
    return {};
  }
  return UsageError(absl::InvalidArgumentError(absl::StrCat("'", command, "' is not a training command")));
}

}  // namespace lce::client::cli
