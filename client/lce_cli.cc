// lce_cli: command-line client of lce-serve.
//   lce_cli health|info|score|forward-backward|bench --target=HOST:PORT [options]
// Exit code 0 on success; on a failed call, 1 with the gRPC status code and message on stderr;
// 2 for bad usage.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <random>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "lce/client/lce_client.h"
#include "wire_codec.h"

namespace {

using lce::client::HiddenBatch;
using lce::client::LceClient;
namespace v1 = lce::v1;

constexpr char kUsage[] = R"(lce_cli COMMAND --target=HOST:PORT [options]

commands:
  health             grpc.health.v1 check of the server
  info               head and server description
  score              logprobs and entropy of a batch; prints a table of the first rows
  forward-backward   loss and d_hidden of a batch
  bench              throughput of repeated requests (--op=score|train)

batch (score, forward-backward, bench):
  --hidden-file=PATH --targets-file=PATH   raw little-endian hidden states (the head's dtype) and int32 targets
  --rows=N --seed=S                         or generated: hidden ~ N(0, 0.5^2), uniform targets (default 16 rows)
options:
  --head=NAME --temperature=T --softcap=S --chunk-bytes=N --timeout-seconds=S --show=N (rows printed)
  --token-file=PATH                         bearer token (read from a file)
  forward-backward: --reduction=none|sum|mean --label-smoothing=E --z-loss=L --ignore-index=I
  bench: --iterations=N --op=score|train
)";

struct Args {
  std::string command;
  std::map<std::string, std::string> flags;
  std::string Get(const std::string& k, const std::string& def = "") const {
    auto it = flags.find(k);
    return it == flags.end() ? def : it->second;
  }
  double Num(const std::string& k, double def) const {
    double v = def;
    auto it = flags.find(k);
    if (it != flags.end() && !absl::SimpleAtod(it->second, &v)) {
      std::cerr << "lce_cli: --" << k << " needs a number, got '" << it->second << "'\n";
      std::exit(2);
    }
    return v;
  }
};

int Failed(const absl::Status& s) {
  std::cerr << "lce_cli: " << absl::StatusCodeToString(s.code()) << ": " << s.message() << std::endl;
  return 1;
}

struct OwnedBatch {
  std::vector<uint8_t> hidden;
  std::vector<int32_t> targets;
  HiddenBatch view;
};

absl::StatusOr<OwnedBatch> MakeBatch(const Args& a, const v1::HeadDescription& head) {
  OwnedBatch b;
  const int64_t H = head.hidden_size();
  const int64_t es = lce::client::WireDTypeSize(head.dtype());
  const std::string hidden_file = a.Get("hidden-file"), targets_file = a.Get("targets-file");
  if (!hidden_file.empty() || !targets_file.empty()) {
    if (hidden_file.empty() || targets_file.empty()) {
      return absl::InvalidArgumentError("--hidden-file and --targets-file go together");
    }
    auto slurp = [](const std::string& path, std::vector<uint8_t>& out) {
      std::ifstream in(path, std::ios::binary);
      out.assign(std::istreambuf_iterator<char>(in), {});
      return static_cast<bool>(in) || in.eof();
    };
    std::vector<uint8_t> t;
    if (!slurp(hidden_file, b.hidden) || !slurp(targets_file, t)) return absl::NotFoundError("cannot read the batch files");
    if (t.size() % 4 != 0 || b.hidden.size() != t.size() / 4 * H * es) {
      return absl::InvalidArgumentError(absl::StrCat("files hold ", b.hidden.size(), " hidden bytes and ", t.size(),
                                                     " target bytes; expected rows x ", H, " x ", es, " and rows x 4"));
    }
    b.targets.resize(t.size() / 4);
    std::memcpy(b.targets.data(), t.data(), t.size());
  } else {
    const int64_t rows = static_cast<int64_t>(a.Num("rows", 16));
    std::mt19937_64 rng(static_cast<uint64_t>(a.Num("seed", 0)));
    std::normal_distribution<float> normal(0.0f, 0.5f);
    std::uniform_int_distribution<int32_t> tgt(0, static_cast<int32_t>(head.vocab_size() - 1));
    std::vector<float> h(static_cast<size_t>(rows * H));
    for (float& x : h) x = normal(rng);
    b.hidden = lce::client::EncodeFloats(h.data(), rows * H, head.dtype());
    for (int64_t i = 0; i < rows; ++i) b.targets.push_back(tgt(rng));
  }
  b.view = {head.dtype(), static_cast<int64_t>(b.targets.size()), H, absl::MakeConstSpan(b.hidden),
            absl::MakeConstSpan(b.targets)};
  return b;
}

v1::RequestHeader Header(const Args& a) {
  v1::RequestHeader h;
  h.set_head(a.Get("head"));
  if (a.flags.count("temperature")) h.set_temperature(static_cast<float>(a.Num("temperature", 1)));
  h.set_softcap(static_cast<float>(a.Num("softcap", 0)));
  if (a.flags.count("ignore-index")) h.set_ignore_index(static_cast<int32_t>(a.Num("ignore-index", -100)));
  return h;
}

int Main(const Args& a) {
  lce::client::ClientOptions o;
  o.target = a.Get("target", "127.0.0.1:50051");
  o.chunk_bytes = static_cast<int64_t>(a.Num("chunk-bytes", 4 << 20));
  o.timeout = absl::Seconds(a.Num("timeout-seconds", 600));
  if (!a.Get("token-file").empty()) {
    std::ifstream in(a.Get("token-file"));
    std::getline(in, o.bearer_token);
  }
  absl::StatusOr<std::unique_ptr<LceClient>> client = LceClient::Create(o);
  if (!client.ok()) return Failed(client.status());
  LceClient& c = **client;

  if (a.command == "health") {
    absl::StatusOr<bool> ok = c.Health();
    if (!ok.ok()) return Failed(ok.status());
    std::cout << (*ok ? "SERVING" : "NOT_SERVING") << std::endl;
    return *ok ? 0 : 1;
  }
  absl::StatusOr<v1::GetInfoResponse> info = c.GetInfo(a.Get("head"));
  if (!info.ok()) return Failed(info.status());
  if (a.command == "info") {
    std::cout << "server " << info->server_version() << ", backend " << info->backend() << ", tp_size "
              << info->tp_size() << ", max message " << info->max_message_bytes() << " bytes\n";
    for (const auto& h : info->heads()) {
      std::cout << "head '" << h.name() << "' version " << h.version() << ": vocab " << h.vocab_size() << " x hidden "
                << h.hidden_size() << " " << v1::DType_Name(h.dtype()) << (h.has_bias() ? " (bias)" : "") << "\n";
    }
    return 0;
  }
  absl::StatusOr<OwnedBatch> batch = MakeBatch(a, info->head());
  if (!batch.ok()) return Failed(batch.status());
  const int64_t show = std::min<int64_t>(static_cast<int64_t>(a.Num("show", 16)), batch->view.rows);

  if (a.command == "score") {
    absl::StatusOr<lce::client::ScoreResult> r = c.Score(batch->view, Header(a));
    if (!r.ok()) return Failed(r.status());
    std::printf("%6s %8s %12s %10s\n", "row", "target", "logprob", "entropy");
    for (int64_t i = 0; i < show; ++i) {
      std::printf("%6lld %8d %12.5f %10.5f\n", static_cast<long long>(i), batch->targets[i], r->logprobs[i], r->entropy[i]);
    }
    double lp = 0, ent = 0;
    for (int64_t i = 0; i < batch->view.rows; ++i) {
      lp += r->logprobs[i];
      ent += r->entropy[i];
    }
    std::printf("rows %lld  mean logprob %.5f  mean entropy %.5f  loss (mean -logprob) %.5f\n",
                static_cast<long long>(batch->view.rows), lp / batch->view.rows, ent / batch->view.rows,
                -lp / batch->view.rows);
    return 0;
  }
  if (a.command == "forward-backward") {
    v1::RequestHeader h = Header(a);
    const std::string red = a.Get("reduction", "mean");
    h.set_reduction(red == "none" ? v1::REDUCTION_NONE : red == "sum" ? v1::REDUCTION_SUM : v1::REDUCTION_MEAN);
    h.set_label_smoothing(static_cast<float>(a.Num("label-smoothing", 0)));
    h.set_z_loss(static_cast<float>(a.Num("z-loss", 0)));
    absl::StatusOr<lce::client::ForwardBackwardResult> r = c.ForwardBackward(batch->view, h);
    if (!r.ok()) return Failed(r.status());
    const std::vector<float> dh = lce::client::DecodeFloats(r->d_hidden.data(), batch->view.rows * batch->view.hidden_size,
                                                             batch->view.dtype);
    double norm = 0;
    for (float x : dh) norm += double(x) * x;
    std::printf("loss (%s) %.6f over %lld valid tokens; |d_hidden| %.6e; head version %lld\n", red.c_str(),
                r->reduced_loss, static_cast<long long>(r->valid_tokens), std::sqrt(norm),
                static_cast<long long>(r->head_version));
    for (int64_t i = 0; i < show && i < static_cast<int64_t>(r->loss.size()); ++i) {
      std::printf("  row %lld target %d loss %.5f\n", static_cast<long long>(i), batch->targets[i], r->loss[i]);
    }
    return 0;
  }
  if (a.command == "bench") {
    const int iters = static_cast<int>(a.Num("iterations", 5));
    const bool train = a.Get("op", "score") == "train";
    v1::RequestHeader h = Header(a);
    if (train) h.set_reduction(v1::REDUCTION_SUM);
    double best = 1e30, total = 0;
    for (int i = 0; i < iters; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      absl::Status s = train ? c.ForwardBackward(batch->view, h).status() : c.Score(batch->view, h).status();
      if (!s.ok()) return Failed(s);
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best = std::min(best, dt);
      total += dt;
    }
    const double bytes_in = static_cast<double>(batch->hidden.size() + batch->targets.size() * 4);
    const double bytes_out = train ? static_cast<double>(batch->hidden.size()) : batch->view.rows * 8.0;
    std::printf("%s: %lld rows x %d iterations: %.2f ms/request (best %.2f), %.0f rows/s, %.3f GB/s in, %.3f GB/s out\n",
                train ? "train" : "score", static_cast<long long>(batch->view.rows), iters, 1e3 * total / iters,
                1e3 * best, batch->view.rows * iters / total, bytes_in * iters / total / 1e9,
                bytes_out * iters / total / 1e9);
    return 0;
  }
  std::cerr << "lce_cli: unknown command '" << a.command << "'\n" << kUsage;
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    if (s == "--help" || s == "-h") {
      std::cout << kUsage;
      return 0;
    }
    if (s.rfind("--", 0) == 0) {
      std::string name = s.substr(2), value;
      const size_t eq = name.find('=');
      if (eq != std::string::npos) {
        value = name.substr(eq + 1);
        name = name.substr(0, eq);
      } else if (i + 1 < argc) {
        value = argv[++i];
      }
      a.flags[name] = value;
    } else if (a.command.empty()) {
      a.command = s;
    } else {
      std::cerr << "lce_cli: unexpected argument '" << s << "'\n";
      return 2;
    }
  }
  if (a.command.empty()) {
    std::cerr << kUsage;
    return 2;
  }
  return Main(a);
}
