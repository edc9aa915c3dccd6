#include "cli_training.h"

#include <cmath>
#include <cstdio>
#include <iostream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
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
absl::StatusOr<v1::SeededHead> ParseSeeded(const Args& a) {
  std::vector<std::string> dims = absl::StrSplit(a.Get("seeded"), 'x');
  int64_t vocab = 0, hidden = 0;
  if (dims.size() != 2 || !absl::SimpleAtoi(dims[0], &vocab) || !absl::SimpleAtoi(dims[1], &hidden) || vocab <= 0 ||
      hidden <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("--seeded must be VOCABxHIDDEN (e.g. 32000x512), got '",
                                                   a.Get("seeded"), "'"));
  }
  absl::StatusOr<int64_t> seed = a.Int("seed", 0, 0);
  if (!seed.ok()) return seed.status();
  absl::StatusOr<v1::DType> dtype = ParseDType(a.Get("dtype", "bf16"));
  if (!dtype.ok()) return dtype.status();
  v1::SeededHead s;
  s.set_vocab_size(vocab);
  s.set_hidden_size(hidden);
  s.set_seed(static_cast<uint64_t>(*seed));
  s.set_dtype(*dtype);
  return s;
}

absl::StatusOr<v1::LoadHeadRequest> LoadHeadRequest(const Args& a) {
  if (!a.Has("head") || a.Get("head").empty()) return absl::InvalidArgumentError("load-head needs --head=NAME");
  const int sources = a.Has("safetensors-file") + a.Has("clone-of") + a.Has("seeded");
  if (sources != 1) {
    return absl::InvalidArgumentError("load-head needs one source: --safetensors-file, --clone-of or --seeded");
  }
  for (const char* flag : {"seed", "dtype"}) {
    if (a.Has(flag) && !a.Has("seeded")) return absl::InvalidArgumentError(absl::StrCat("--", flag, " goes with --seeded"));
  }
  if (a.Has("tensor") && !a.Has("safetensors-file")) {
    return absl::InvalidArgumentError("--tensor goes with --safetensors-file");
  }
  v1::LoadHeadRequest req;
  req.set_name(a.Get("head"));
  req.set_tensor(a.Get("tensor"));
  if (a.Has("safetensors-file")) req.set_safetensors_file(a.Get("safetensors-file"));
  if (a.Has("clone-of")) req.set_clone_of(a.Get("clone-of"));
  if (a.Has("seeded")) {
    absl::StatusOr<v1::SeededHead> seeded = ParseSeeded(a);
    if (!seeded.ok()) return seeded.status();
    *req.mutable_seeded() = *seeded;
  }
  return req;
}

absl::StatusOr<v1::OptimizerStepRequest> StepRequest(const Args& a) {
  if (!a.Has("lr")) return absl::InvalidArgumentError("step needs --lr");
  v1::OptimizerStepRequest req;
  req.set_head(a.Get("head"));
  struct Param {
    const char* flag;
    double def;
    void (v1::OptimizerStepRequest::*set)(float);
  };
  for (const Param& p : {Param{"lr", 0, &v1::OptimizerStepRequest::set_lr},
                         Param{"beta1", 0.9, &v1::OptimizerStepRequest::set_beta1},
                         Param{"beta2", 0.999, &v1::OptimizerStepRequest::set_beta2},
                         Param{"eps", 1e-8, &v1::OptimizerStepRequest::set_eps},
                         Param{"weight-decay", 0, &v1::OptimizerStepRequest::set_weight_decay},
                         Param{"max-grad-norm", 0, &v1::OptimizerStepRequest::set_max_grad_norm}}) {
    absl::StatusOr<double> v = a.Number(p.flag, p.def);
    if (!v.ok()) return v.status();
    if (*v < 0) return absl::InvalidArgumentError(absl::StrCat("--", p.flag, " must be >= 0, got ", *v));
    (req.*p.set)(static_cast<float>(*v));
  }
  absl::StatusOr<int64_t> zero = a.Int("zero-grad", 1, 0, 1);
  if (!zero.ok()) return zero.status();
  req.set_zero_grad(*zero == 1);
  return req;
}

// The file flag of get-grad (--output) or update-weights (--weight-file), and its format.
absl::StatusOr<TensorFormat> FileFormat(const Args& a, const char* flag) {
  if (a.Has("format") && !a.Has(flag)) return absl::InvalidArgumentError(absl::StrCat("--format goes with --", flag));
  return ParseTensorFormat(a.Get("format"), a.Get(flag));
}

Outcome GetGrad(const Args& a, LceClient& c) {
  absl::StatusOr<Gradient> g = c.GetGrad(a.Get("head"));
  if (!g.ok()) return CallFailed(g.status());
  double norm = 0;
  for (float x : g->values) norm += static_cast<double>(x) * x;
  std::printf("gradient of head '%s': %lld x %lld fp32, |dW| %.9e\n", a.Get("head", "(default)").c_str(),
              static_cast<long long>(g->rows), static_cast<long long>(g->cols), std::sqrt(norm));
  if (!a.Has("output")) return {};
  const TensorFormat format = *FileFormat(a, "output");  // checked by CheckTrainingFlags
  const auto* bytes = reinterpret_cast<const uint8_t*>(g->values.data());
  if (absl::Status s = WriteTensorFile(a.Get("output"), format, a.Get("tensor", "grad"), v1::DTYPE_FLOAT32, g->rows,
                                       g->cols, absl::MakeConstSpan(bytes, g->values.size() * 4));
      !s.ok()) {
    return CallFailed(s);
  }
  std::printf("written to %s\n", a.Get("output").c_str());
  return {};
}

// The weight file of update-weights, in the head's dtype (converted, round to nearest even, when
// the file holds another).
absl::StatusOr<Tensor2D> WeightFile(const Args& a, const v1::HeadDescription& head) {
  const TensorFormat format = *FileFormat(a, "weight-file");
  absl::StatusOr<Tensor2D> w = ReadTensorFile(a.Get("weight-file"), format, a.Get("tensor"), head.dtype(),
                                              head.hidden_size());
  if (!w.ok() || w->dtype == head.dtype()) return w;
  const int64_t n = w->rows * w->cols;
  const std::vector<float> values = DecodeFloats(w->bytes.data(), n, w->dtype);
  std::printf("converting %s to the head's %s\n", v1::DType_Name(w->dtype).c_str(), v1::DType_Name(head.dtype()).c_str());
  w->bytes = EncodeFloats(values.data(), n, head.dtype());
  w->dtype = head.dtype();
  return w;
}

Outcome UpdateWeights(const Args& a, LceClient& c) {
  absl::StatusOr<v1::GetInfoResponse> info = c.GetInfo(a.Get("head"));
  if (!info.ok()) return CallFailed(info.status());
  absl::StatusOr<Tensor2D> w = WeightFile(a, info->head());
  if (!w.ok()) return absl::IsNotFound(w.status()) || absl::IsInvalidArgument(w.status()) ? UsageError(w.status())
                                                                                             : CallFailed(w.status());
  const int64_t expected = *a.Int("expected-version", 0, 0);
  absl::StatusOr<v1::HeadDescription> head =
      c.UpdateWeights(a.Get("head"), WeightTensor{w->dtype, w->rows, w->cols, absl::MakeConstSpan(w->bytes)}, expected);
  if (!head.ok()) return CallFailed(head.status());
  std::cout << "updated " << DescribeHead(*head) << std::endl;
  return {};
}

Outcome Step(const Args& a, LceClient& c) {
  absl::StatusOr<v1::OptimizerStepResponse> r = c.OptimizerStep(*StepRequest(a));
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

const std::vector<TrainingCommand>& TrainingCommands() {
  static const auto* commands = new std::vector<TrainingCommand>{
      {"load-head",
       "lce_cli load-head --head=NAME SOURCE: adds or replaces a head (version + 1 when it exists)\n"
       "  --head=NAME                the head to add or replace\n"
       "  SOURCE, one of:\n"
       "  --safetensors-file=PATH    a safetensors file on the server's file system\n"
       "    --tensor=NAME            its tensor (default lm_head.weight)\n"
       "  --clone-of=HEAD            a copy of another head's current weight (e.g. a frozen reference)\n"
       "  --seeded=VOCABxHIDDEN      a seeded random head\n"
       "    --seed=S --dtype=D       its seed (default 0) and dtype: bf16, fp16 or fp32 (default bf16)\n",
       {"head", "safetensors-file", "tensor", "clone-of", "seeded", "seed", "dtype"}},
      {"zero-grad", "lce_cli zero-grad [--head=NAME]: zeroes the head's fp32 gradient buffer\n", {"head"}},
      {"get-grad",
       "lce_cli get-grad [--head=NAME]: the head's accumulated fp32 gradient dW [vocab, hidden]; prints its norm\n"
       "  --output=PATH              also write it there: .npy, .safetensors, or raw little-endian fp32 (.raw)\n"
       "  --format=npy|safetensors|raw   the file's format when its name does not say\n"
       "  --tensor=NAME              the safetensors tensor's name (default grad)\n",
       {"head", "output", "format", "tensor"}},
      {"step",
       "lce_cli step --lr=LR [--head=NAME]: one AdamW step on the server's fp32 master weights (version + 1)\n"
       "  --beta1=B1 --beta2=B2      (default 0.9, 0.999)\n"
       "  --eps=E                    (default 1e-8)\n"
       "  --weight-decay=WD          decoupled, as torch.optim.AdamW (default 0)\n"
       "  --max-grad-norm=N          clip the gradient to this global L2 norm first (default 0: off)\n"
       "  --zero-grad=0|1            zero the gradient after the step (default 1)\n",
       {"head", "lr", "beta1", "beta2", "eps", "weight-decay", "max-grad-norm", "zero-grad"}},
      {"update-weights",
       "lce_cli update-weights --weight-file=PATH [--head=NAME]: replaces the head's weight (version + 1)\n"
       "  --weight-file=PATH         [vocab, hidden]: .npy (<f4, <f2, or <u2 holding bf16 bits), .safetensors\n"
       "                             (F32, F16, BF16), or raw little-endian bytes in the head's dtype (.raw);\n"
       "                             another dtype than the head's is converted (round to nearest even)\n"
       "  --format=npy|safetensors|raw   the file's format when its name does not say\n"
       "  --tensor=NAME              the safetensors tensor (default: the file's only one)\n"
       "  --expected-version=N       apply only if the head is at version N (FAILED_PRECONDITION otherwise)\n",
       {"head", "weight-file", "format", "tensor", "expected-version"}},
      {"save-head",
       "lce_cli save-head --directory=DIR [--head=NAME]: writes the head as safetensors on the server\n"
       "  --directory=DIR            a directory on the server: one file per tensor-parallel shard plus an index\n",
       {"head", "directory"}},
  };
  return *commands;
}

absl::Status CheckTrainingFlags(const Args& a) {
  if (a.command == "load-head") return LoadHeadRequest(a).status();
  if (a.command == "step") return StepRequest(a).status();
  if (a.command == "get-grad" && (a.Has("output") || a.Has("format"))) return FileFormat(a, "output").status();
  if (a.command == "update-weights") {
    if (!a.Has("weight-file")) return absl::InvalidArgumentError("update-weights needs --weight-file");
    if (absl::Status s = FileFormat(a, "weight-file").status(); !s.ok()) return s;
    return a.Int("expected-version", 0, 0).status();
  }
  if (a.command == "save-head" && a.Get("directory").empty()) {
    return absl::InvalidArgumentError("save-head needs --directory");
  }
  return absl::OkStatus();
}

Outcome RunTrainingCommand(const Args& a, LceClient& c) {
  if (absl::Status s = CheckTrainingFlags(a); !s.ok()) return UsageError(s);
  if (a.command == "load-head") {
    absl::StatusOr<v1::HeadDescription> h = c.LoadHead(*LoadHeadRequest(a));
    if (!h.ok()) return CallFailed(h.status());
    std::cout << "loaded " << DescribeHead(*h) << std::endl;
    return {};
  }
  if (a.command == "zero-grad") {
    if (absl::Status s = c.ZeroGrad(a.Get("head")); !s.ok()) return CallFailed(s);
    std::cout << "zeroed the gradient of head '" << a.Get("head", "(default)") << "'" << std::endl;
    return {};
  }
  if (a.command == "get-grad") return GetGrad(a, c);
  if (a.command == "step") return Step(a, c);
  if (a.command == "update-weights") return UpdateWeights(a, c);
  if (a.command == "save-head") {
    absl::StatusOr<v1::SaveHeadResponse> r = c.SaveHead(a.Get("head"), a.Get("directory"));
    if (!r.ok()) return CallFailed(r.status());
    std::cout << "index " << r->index_file() << "\n";
    for (const std::string& f : r->files()) std::cout << "file " << f << "\n";
    return {};
  }
  return UsageError(absl::InvalidArgumentError(absl::StrCat("'", a.command, "' is not a training command")));
}

}  // namespace lce::client::cli
