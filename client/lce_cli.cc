// lce_cli: command-line client of lce-serve.
//   lce_cli health|info|score|forward-backward|bench --target=HOST:PORT [options]
//   lce_cli load-head|zero-grad|get-grad|step|update-weights|save-head --target=HOST:PORT [options]
// Its commands and flags (absl flags) are in cli_args.cc; `lce_cli [COMMAND] --help` lists them.
// Exit code 0 on success; on a failed call, 1 with the gRPC status code name and message on
// stderr; 2 for bad usage.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <optional>
#include <random>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "cli_args.h"
#include "cli_training.h"
#include "data_plane_connection.h"
#include "grpcpp/security/credentials.h"
#include "lce/client/lce_client.h"
#include "tensor_file.h"
#include "wire_codec.h"

namespace {

using lce::client::HiddenBatch;
using lce::client::LceClient;
using lce::client::cli::Command;
namespace v1 = lce::v1;

int Failed(const absl::Status& s) {
  std::cerr << "lce_cli: " << absl::StatusCodeToString(s.code()) << ": " << s.message() << std::endl;
  return 1;
}

std::string g_command;  // for the hint in usage errors

int Usage(const absl::Status& s) {
  const bool known = lce::client::cli::FindCommand(g_command) != nullptr;
  std::cerr << "lce_cli: " << s.message() << " (see lce_cli " << (known ? g_command + " " : "") << "--help)"
            << std::endl;
  return 2;
}

struct OwnedBatch {
  std::vector<uint8_t> hidden;
  std::vector<int32_t> targets;
  HiddenBatch view;
};

// The batch of --hidden-file and --targets-file, checked against the head's shape.
absl::Status ReadBatch(const v1::HeadDescription& head, OwnedBatch& b) {
  const std::string hidden_file = absl::GetFlag(FLAGS_hidden_file), targets_file = absl::GetFlag(FLAGS_targets_file);
  if (hidden_file.empty() || targets_file.empty()) {
    return absl::InvalidArgumentError("--hidden-file and --targets-file go together");
  }
  absl::StatusOr<std::string> h = lce::client::ReadWholeFile(hidden_file);
  if (!h.ok()) return h.status();
  absl::StatusOr<std::string> t = lce::client::ReadWholeFile(targets_file);
  if (!t.ok()) return t.status();
  const int64_t H = head.hidden_size(), es = lce::client::WireDTypeSize(head.dtype());
  if (t->size() % 4 != 0 || static_cast<int64_t>(h->size()) != static_cast<int64_t>(t->size() / 4) * H * es) {
    return absl::InvalidArgumentError(absl::StrCat("the files hold ", h->size(), " hidden bytes and ", t->size(),
                                                   " target bytes; expected rows x ", H, " x ", es,
                                                   " (head '", head.name(), "', ", v1::DType_Name(head.dtype()),
                                                   ") and rows x 4"));
  }
  b.hidden.assign(h->begin(), h->end());
  b.targets.resize(t->size() / 4);
  std::memcpy(b.targets.data(), t->data(), t->size());
  return absl::OkStatus();
}

// --rows generated rows: hidden ~ N(0, 0.5^2) in the head's dtype, targets uniform in [0, vocab).
void GenerateBatch(const v1::HeadDescription& head, OwnedBatch& b) {
  const int64_t rows = absl::GetFlag(FLAGS_rows), H = head.hidden_size();
  std::mt19937_64 rng(static_cast<uint64_t>(absl::GetFlag(FLAGS_seed).value_or(0)));
  std::normal_distribution<float> normal(0.0f, 0.5f);
  std::uniform_int_distribution<int32_t> tgt(0, static_cast<int32_t>(head.vocab_size() - 1));
  std::vector<float> h(static_cast<size_t>(rows * H));
  for (float& x : h) x = normal(rng);
  b.hidden = lce::client::EncodeFloats(h.data(), rows * H, head.dtype());
  b.targets.resize(static_cast<size_t>(rows));
  for (int32_t& y : b.targets) y = tgt(rng);
}

absl::StatusOr<OwnedBatch> MakeBatch(const v1::HeadDescription& head) {
  OwnedBatch b;
  const int64_t H = head.hidden_size();
  if (H <= 0 || lce::client::WireDTypeSize(head.dtype()) == 0) {
    return absl::FailedPreconditionError("the server described a head without a hidden size or dtype");
  }
  if (!absl::GetFlag(FLAGS_hidden_file).empty() || !absl::GetFlag(FLAGS_targets_file).empty()) {
    if (absl::Status s = ReadBatch(head, b); !s.ok()) return s;
  } else {
    GenerateBatch(head, b);
  }
  b.view = {head.dtype(), static_cast<int64_t>(b.targets.size()), H, absl::MakeConstSpan(b.hidden),
            absl::MakeConstSpan(b.targets)};
  return b;
}

v1::RequestHeader Header() {
  v1::RequestHeader h;
  h.set_head(absl::GetFlag(FLAGS_head));
  if (const std::optional<double> t = absl::GetFlag(FLAGS_temperature)) h.set_temperature(static_cast<float>(*t));
  h.set_softcap(static_cast<float>(absl::GetFlag(FLAGS_softcap)));
  if (const std::optional<int32_t> ii = absl::GetFlag(FLAGS_ignore_index)) h.set_ignore_index(*ii);
  h.set_head_version(absl::GetFlag(FLAGS_head_version));
  return h;
}

// The first line of a token file.
absl::StatusOr<std::string> ReadToken(const std::string& path) {
  absl::StatusOr<std::string> tok = lce::client::ReadWholeFile(path);
  if (!tok.ok()) return tok.status();
  return tok->substr(0, tok->find_first_of("\r\n"));
}

// Bearer tokens and TLS credentials from their files.
absl::Status SetCredentials(lce::client::ClientOptions& o) {
  for (auto [flag, token] :
       {std::pair{&FLAGS_token_file, &o.bearer_token}, std::pair{&FLAGS_admin_token_file, &o.admin_token}}) {
    if (absl::GetFlag(*flag).empty()) continue;
    absl::StatusOr<std::string> tok = ReadToken(absl::GetFlag(*flag));
    if (!tok.ok()) return tok.status();
    *token = *tok;
  }
  const std::string ca_file = absl::GetFlag(FLAGS_tls_ca), cert_file = absl::GetFlag(FLAGS_tls_cert),
                    key_file = absl::GetFlag(FLAGS_tls_key);
  if (ca_file.empty()) {
    return cert_file.empty() && key_file.empty() ? absl::OkStatus()
                                                 : absl::InvalidArgumentError("--tls-cert and --tls-key need --tls-ca");
  }
  if (cert_file.empty() != key_file.empty()) return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  grpc::SslCredentialsOptions ssl;
  absl::StatusOr<std::string> ca = lce::client::ReadWholeFile(ca_file);
  if (!ca.ok()) return ca.status();
  ssl.pem_root_certs = *ca;
  if (!cert_file.empty()) {
    absl::StatusOr<std::string> cert = lce::client::ReadWholeFile(cert_file);
    absl::StatusOr<std::string> key = lce::client::ReadWholeFile(key_file);
    if (!cert.ok()) return cert.status();
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *cert;
    ssl.pem_private_key = *key;
  }
  o.credentials = grpc::SslCredentials(ssl);
  return absl::OkStatus();
}

absl::StatusOr<lce::client::ClientOptions> Options() {
  lce::client::ClientOptions o;  // the values' ranges are checked by cli::SetFlags
  o.target = absl::GetFlag(FLAGS_target);
  o.chunk_bytes = absl::GetFlag(FLAGS_chunk_bytes);
  o.first_chunk_bytes = absl::GetFlag(FLAGS_first_chunk_bytes);
  o.last_chunk_bytes = absl::GetFlag(FLAGS_last_chunk_bytes);
  o.grow_chunks = absl::GetFlag(FLAGS_grow_chunks);
  o.streams = absl::GetFlag(FLAGS_streams);
  o.data_plane = absl::GetFlag(FLAGS_data_plane);
  o.data_plane_sockets = absl::GetFlag(FLAGS_data_plane_sockets);
  o.data_plane_streams = absl::GetFlag(FLAGS_data_plane_streams);
  o.timeout = absl::Seconds(absl::GetFlag(FLAGS_timeout_seconds));
  o.load_balancing = absl::GetFlag(FLAGS_load_balancing);
  o.max_attempts = absl::GetFlag(FLAGS_max_attempts).value_or(0);  // 0: the client's default
  // A data plane served over TLS (lce_server --data-plane-tls) carries the same certificate.
  o.data_plane_tls_ca = absl::GetFlag(FLAGS_tls_ca);
  if (absl::Status s = SetCredentials(o); !s.ok()) return s;
  return o;
}

int Info(LceClient& c) {
  absl::StatusOr<v1::GetInfoResponse> info = c.GetInfo(absl::GetFlag(FLAGS_head));
  if (!info.ok()) return Failed(info.status());
  std::cout << "server " << info->server_version() << ", backend " << info->backend() << ", tp_size "
            << info->tp_size() << ", max message " << info->max_message_bytes() << " bytes, max rows/request "
            << (info->max_rows_per_request() ? absl::StrCat(info->max_rows_per_request()) : "unlimited") << "\n";
  for (const auto& h : info->heads()) {
    std::cout << lce::client::cli::DescribeHead(h) << (h.name() == info->head().name() ? " (default)" : "") << "\n";
  }
  return 0;
}

// What score, forward-backward and bench run on: the head, its batch and the request header.
struct BatchCall {
  v1::HeadDescription head;
  OwnedBatch batch;
  v1::RequestHeader header;
  int32_t ignore_index = -100;
  int64_t show = 0;   // rows printed
  int64_t valid = 0;  // rows whose target is not ignore_index
};

// --top-k: each shown row's ranking, and the token accuracy over the valid rows.
void PrintRankings(const lce::client::Rankings& rk, const BatchCall& b, int32_t k) {
  for (int64_t i = 0; i < b.show; ++i) {
    std::printf("%8lld top %d:", static_cast<long long>(i), k);
    for (int32_t j = 0; j < k; ++j) std::printf(" %d (%.4f)", rk.top_tokens[i * k + j], rk.top_logprobs[i * k + j]);
    std::printf("\n");
  }
  int64_t right = 0;
  for (size_t i = 0; i < rk.argmax.size(); ++i) {
    right += b.batch.targets[i] != b.ignore_index && rk.argmax[i] == b.batch.targets[i] ? 1 : 0;
  }
  std::printf("token accuracy %.6f (%lld of %lld valid rows: argmax = target)\n",
              b.valid ? static_cast<double>(right) / static_cast<double>(b.valid) : 0.0, static_cast<long long>(right),
              static_cast<long long>(b.valid));
}

int Score(LceClient& c, const BatchCall& b) {
  const HiddenBatch& view = b.batch.view;
  v1::RequestHeader h = b.header;
  const int32_t k = absl::GetFlag(FLAGS_top_k);
  if (k != 0) {
    h.add_outputs(v1::OUTPUT_LOGPROBS);
    h.add_outputs(v1::OUTPUT_ENTROPY);
    h.add_outputs(v1::OUTPUT_ARGMAX);
    h.add_outputs(v1::OUTPUT_TOP_K);
    h.set_top_k(k);
  }
  absl::StatusOr<lce::client::ScoreResult> r = c.Score(view, h);
  if (!r.ok()) return Failed(r.status());
  const bool has_lp = !r->logprobs.empty(), has_ent = !r->entropy.empty();
  std::printf("%8s %8s %12s %12s\n", "row", "target", "logprob", "entropy");
  for (int64_t i = 0; i < b.show; ++i) {
    std::printf("%8lld %8d %12.5f %12.5f\n", static_cast<long long>(i), b.batch.targets[i],
                has_lp ? r->logprobs[i] : NAN, has_ent ? r->entropy[i] : NAN);
  }
  double lp = 0, ent = 0;
  for (int64_t i = 0; i < view.rows; ++i) {
    if (has_lp && b.batch.targets[i] != b.ignore_index) lp += r->logprobs[i];
    if (has_ent) ent += r->entropy[i];
  }
  const double valid = static_cast<double>(b.valid);
  std::printf("rows %lld (valid %lld), head '%s' %s: mean logprob %.6f, mean entropy %.6f, loss (mean -logprob) %.6f\n",
              static_cast<long long>(view.rows), static_cast<long long>(b.valid), b.head.name().c_str(),
              v1::DType_Name(view.dtype).c_str(), valid ? lp / valid : 0.0, ent / view.rows, valid ? -lp / valid : 0.0);
  if (k != 0) PrintRankings(r->rankings, b, k);
  return 0;
}

// A class-weighted mean as one pass computes it, the Python client's convention (lce_client/
// _weighted_mean.py; docs/MATH.md, "Class weights"): the rows' sum (REDUCTION_NONE) with upstream
// gradient 1 / divisor each and the z-loss coefficient λ / z_scale, where divisor = Σ w_y over the valid
// rows (their count where that is 0; 1 with none) and z_scale = valid / divisor: the cross-entropy is
// divided by Σ w_y (PyTorch), the z-loss by the valid count (Liger-Kernel).
struct WeightedMean {
  double divisor = 1, z_scale = 1;
};

WeightedMean WeightedMeanOf(const std::vector<float>& weights, const BatchCall& b) {
  if (b.valid == 0) return {};
  double total = 0;  // targets out of [0, vocab) are the server's INVALID_ARGUMENT
  for (int32_t y : b.batch.targets) {
    if (y != b.ignore_index && y >= 0 && y < static_cast<int64_t>(weights.size())) total += weights[y];
  }
  const double divisor = total != 0 ? total : static_cast<double>(b.valid);
  return {divisor, static_cast<double>(b.valid) / divisor};
}

// forward-backward's header from its flags: reduction, label smoothing, z-loss (and its output), class
// weights; a mean with class weights is asked as `wm` says (grad_loss: its rows' upstream gradients).
v1::RequestHeader ForwardBackwardHeader(const BatchCall& b, const std::vector<float>& weights,
                                        std::optional<WeightedMean>& wm, std::vector<float>& grad_loss) {
  v1::RequestHeader h = b.header;
  const std::string red = absl::GetFlag(FLAGS_reduction);  // none, sum or mean (CheckCommandFlags)
  h.set_reduction(red == "none" ? v1::REDUCTION_NONE : red == "sum" ? v1::REDUCTION_SUM : v1::REDUCTION_MEAN);
  const double z_loss = absl::GetFlag(FLAGS_z_loss);
  h.set_label_smoothing(static_cast<float>(absl::GetFlag(FLAGS_label_smoothing)));
  h.set_z_loss(static_cast<float>(z_loss));
  h.set_accumulate_weight_grad(absl::GetFlag(FLAGS_accumulate_weight_grad));
  if (z_loss != 0) {
    h.add_outputs(v1::OUTPUT_LOSS);
    h.add_outputs(v1::OUTPUT_Z_LOSS);
  }
  h.mutable_class_weights()->Add(weights.begin(), weights.end());
  if (!weights.empty() && red == "mean") {
    wm = WeightedMeanOf(weights, b);
    h.set_reduction(v1::REDUCTION_NONE);
    h.set_z_loss(static_cast<float>(z_loss / wm->z_scale));
    grad_loss.assign(static_cast<size_t>(b.batch.view.rows), static_cast<float>(1.0 / wm->divisor));
  }
  return h;
}

// A weighted mean's answer as the caller's options define it: the rows' z-loss (and so their loss)
// with the coefficient given, and the reduced loss.
void UnscaleWeightedMean(const WeightedMean& wm, lce::client::ForwardBackwardResult& r) {
  double sum = 0;
  for (size_t i = 0; i < r.loss.size(); ++i) {
    sum += r.loss[i];
    if (r.z_loss.empty()) continue;
    const double z = r.z_loss[i] * wm.z_scale;
    r.loss[i] = static_cast<float>(r.loss[i] - r.z_loss[i] + z);
    r.z_loss[i] = static_cast<float>(z);
  }
  r.reduced_loss = sum / wm.divisor;
}

int ForwardBackward(LceClient& c, const BatchCall& b) {
  const HiddenBatch& view = b.batch.view;
  const std::string weights_file = absl::GetFlag(FLAGS_class_weights_file);
  absl::StatusOr<std::vector<float>> weights =
      weights_file.empty() ? std::vector<float>{} : lce::client::ReadVectorFile(weights_file);
  if (!weights.ok()) return Usage(weights.status());
  std::optional<WeightedMean> wm;
  std::vector<float> grad_loss;
  const v1::RequestHeader h = ForwardBackwardHeader(b, *weights, wm, grad_loss);
  absl::StatusOr<lce::client::ForwardBackwardResult> r = c.ForwardBackward(view, h, grad_loss);
  if (!r.ok()) return Failed(r.status());
  if (wm) UnscaleWeightedMean(*wm, *r);
  const int64_t dh_count = static_cast<int64_t>(r->d_hidden.size()) / lce::client::WireDTypeSize(view.dtype);
  const std::vector<float> dh = lce::client::DecodeFloats(r->d_hidden.data(), dh_count, view.dtype);
  double norm = 0;
  for (float x : dh) norm += static_cast<double>(x) * x;
  const std::string red = absl::GetFlag(FLAGS_reduction);
  std::printf("loss (%s) %.6f over %lld valid tokens of %lld rows; |d_hidden| %.6e; head '%s' version %lld\n",
              red.c_str(), r->reduced_loss, static_cast<long long>(r->valid_tokens), static_cast<long long>(view.rows),
              std::sqrt(norm), b.head.name().c_str(), static_cast<long long>(r->head_version));
  if (wm) std::printf("class-weighted mean: cross-entropy over sum of the targets' weights %.6f\n", wm->divisor);
  const bool has_z = !r->z_loss.empty();
  if (has_z) {
    double z = 0;
    for (float x : r->z_loss) z += x;
    std::printf("z-loss part (%s) %.6f\n", red.c_str(), red == "mean" && b.valid ? z / b.valid : z);
  }
  if (!r->loss.empty()) {
    std::printf("%8s %8s %12s%s\n", "row", "target", "loss", has_z ? "       z_loss" : "");
    for (int64_t i = 0; i < b.show; ++i) {
      std::printf("%8lld %8d %12.5f", static_cast<long long>(i), b.batch.targets[i], r->loss[i]);
      if (has_z) std::printf(" %12.5e", r->z_loss[i]);
      std::printf("\n");
    }
  }
  return 0;
}

int Bench(LceClient& c, const BatchCall& b) {
  const HiddenBatch& view = b.batch.view;
  const bool train = absl::GetFlag(FLAGS_op) == "train";
  const int64_t iters = absl::GetFlag(FLAGS_iterations), warmup = absl::GetFlag(FLAGS_warmup);
  v1::RequestHeader h = b.header;
  if (train) {
    h.set_reduction(v1::REDUCTION_SUM);
    h.set_accumulate_weight_grad(absl::GetFlag(FLAGS_accumulate_weight_grad));
    h.set_defer_weight_grad(absl::GetFlag(FLAGS_defer_weight_grad));
  }
  // d_hidden into one buffer, reused, as a trainer's gradient buffer is: a new result's 128 MiB (16384 x
  // 4096 bf16) costs its allocation and first touch, tens of ms, in the request (--fresh-d-hidden).
  std::vector<uint8_t> d_hidden;
  HiddenBatch train_view = view;
  if (train && !absl::GetFlag(FLAGS_fresh_d_hidden)) {
    d_hidden.assign(static_cast<size_t>(view.rows * view.hidden_size * lce::client::WireDTypeSize(view.dtype)), 0);
    train_view.d_hidden_out = absl::MakeSpan(d_hidden);
  }
  auto once = [&]() -> absl::Status {
    if (!train) return c.Score(view, h).status();
    absl::StatusOr<lce::client::ForwardBackwardResult> r = c.ForwardBackward(train_view, h);
    if (!r.ok()) return r.status();
    for (uint64_t id : r->pending_grads) {  // as a trainer's backward would, with an upstream gradient of 1
      if (absl::Status s = c.CommitGrad(h.head(), id, 1.0f); !s.ok()) return s;
    }
    return absl::OkStatus();
  };
  for (int64_t i = 0; i < warmup; ++i) {
    if (absl::Status s = once(); !s.ok()) return Failed(s);
  }
  double best = 1e30, total = 0;
  for (int64_t i = 0; i < iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    if (absl::Status s = once(); !s.ok()) return Failed(s);
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, dt);
    total += dt;
  }
  const double n = static_cast<double>(iters);
  const double bytes_up = static_cast<double>(b.batch.hidden.size() + b.batch.targets.size() * 4);
  const double bytes_down = train ? static_cast<double>(b.batch.hidden.size()) + view.rows * 4.0 : view.rows * 8.0;
  std::printf("%s: %lld rows x %lld hidden (%s), %lld iterations: %.3f ms/request (best %.3f), %.0f rows/s, "
              "%.3f GB/s up, %.3f GB/s down\n",
              train ? "train" : "score", static_cast<long long>(view.rows), static_cast<long long>(view.hidden_size),
              v1::DType_Name(view.dtype).c_str(), static_cast<long long>(iters), 1e3 * total / n, 1e3 * best,
              view.rows * n / total, bytes_up * n / total / 1e9, bytes_down * n / total / 1e9);
  return 0;
}

// lce_cli bench --op=wire: `bytes` written into a server-memory region and read back over k data-plane
// sockets at once, each moving its share in chunk-sized transfers (as a request's stream does);
// prints GB/s each way. The transfer term of a data-plane request, TLS or not, without the engine.
int BenchWire(LceClient& c, const lce::client::ClientOptions& o, const v1::GetInfoResponse& info,
              absl::Span<const uint8_t> bytes, int64_t iters, int64_t warmup) {
  if (info.data_port() <= 0) return Failed(absl::FailedPreconditionError("--op=wire: the server has no --data-port"));
  absl::StatusOr<std::unique_ptr<lce::client::SharedMemorySession>> s = c.OpenSession();
  if (!s.ok()) return Failed(s.status());
  const int64_t n = static_cast<int64_t>(bytes.size());
  absl::StatusOr<uint64_t> region = (*s)->AllocateServerMemory(n, "wire");
  if (!region.ok()) return Failed(region.status());
  std::string host = o.target.substr(0, o.target.rfind(':'));
  if (host.size() >= 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
  const int k = o.data_plane_sockets;
  std::vector<std::unique_ptr<lce::client::DataPlaneConnection>> conns;
  for (int i = 0; i < k; ++i) {
    auto conn = lce::client::DataPlaneConnection::Connect(
        host, info.data_port(), {(*s)->secret(), info.data_plane_tls(), o.data_plane_tls_ca});
    if (!conn.ok()) return Failed(conn.status());
    conns.push_back(*std::move(conn));
  }
  std::vector<uint8_t> back(bytes.size());
  auto move = [&](bool up) {
    std::vector<absl::Status> st(static_cast<size_t>(k));
    std::vector<std::thread> t;
    for (int i = 0; i < k; ++i) {
      t.emplace_back([&, i] {
        for (int64_t at = n * i / k, end = n * (i + 1) / k; at < end && st[i].ok(); at += o.chunk_bytes) {
          const int64_t len = std::min(o.chunk_bytes, end - at);
          st[i] = up ? conns[i]->Write((*s)->id(), *region, at, bytes.subspan(at, len))
                     : conns[i]->Read((*s)->id(), *region, at, absl::MakeSpan(back).subspan(at, len));
        }
      });
    }
    for (auto& x : t) x.join();
    for (const absl::Status& e : st) {
      if (!e.ok()) return e;
    }
    return absl::OkStatus();
  };
  double secs[2] = {0, 0};
  for (int64_t i = 0; i < warmup + iters; ++i) {
    for (int dir = 0; dir < 2; ++dir) {
      const auto t0 = std::chrono::steady_clock::now();
      if (absl::Status e = move(dir == 0); !e.ok()) return Failed(e);
      if (i >= warmup) secs[dir] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
  }
  if (!std::equal(back.begin(), back.end(), bytes.begin())) {
    return Failed(absl::DataLossError("--op=wire: the bytes read back differ from those written"));
  }
  std::printf("wire: %lld bytes over %d socket(s) a direction%s, %lld iterations: %.3f GB/s up, %.3f GB/s down\n",
              static_cast<long long>(n), k, info.data_plane_tls() ? " (TLS)" : "", static_cast<long long>(iters),
              n * iters / secs[0] / 1e9, n * iters / secs[1] / 1e9);
  return 0;
}

// score, forward-backward or bench: the head described, the batch made, then the calls.
int RunBatchCommand(const Command& cmd, LceClient& c) {
  absl::StatusOr<v1::GetInfoResponse> info = c.GetInfo(absl::GetFlag(FLAGS_head));
  if (!info.ok()) return Failed(info.status());
  BatchCall b{info->head(), {}, Header()};
  absl::StatusOr<OwnedBatch> batch = MakeBatch(b.head);
  if (!batch.ok()) {
    return absl::IsInvalidArgument(batch.status()) || absl::IsNotFound(batch.status()) ? Usage(batch.status())
                                                                                       : Failed(batch.status());
  }
  b.batch = *std::move(batch);
  b.show = std::min(absl::GetFlag(FLAGS_show), b.batch.view.rows);
  b.ignore_index = absl::GetFlag(FLAGS_ignore_index).value_or(-100);
  for (int32_t y : b.batch.targets) b.valid += y != b.ignore_index;
  const std::string name = cmd.name;
  if (name == "bench" && absl::GetFlag(FLAGS_op) == "wire") {
    absl::StatusOr<lce::client::ClientOptions> o = Options();
    if (!o.ok()) return Usage(o.status());
    return BenchWire(c, *o, *info, absl::MakeConstSpan(b.batch.hidden), absl::GetFlag(FLAGS_iterations),
                     absl::GetFlag(FLAGS_warmup));
  }
  return name == "score" ? Score(c, b) : name == "forward-backward" ? ForwardBackward(c, b) : Bench(c, b);
}

// The values that only one command's flags can take, checked before anything is sent.
absl::Status CheckCommandFlags(const Command& cmd) {
  if (cmd.training) return lce::client::cli::CheckTrainingFlags(cmd.name);
  const std::string red = absl::GetFlag(FLAGS_reduction), op = absl::GetFlag(FLAGS_op);
  if (red != "none" && red != "sum" && red != "mean") {
    return absl::InvalidArgumentError(absl::StrCat("--reduction must be none, sum or mean, got '", red, "'"));
  }
  if (op != "score" && op != "train" && op != "wire") {
    return absl::InvalidArgumentError(absl::StrCat("--op must be score, train or wire, got '", op, "'"));
  }
  return absl::OkStatus();
}

int Main(const Command& cmd) {
  if (absl::Status s = CheckCommandFlags(cmd); !s.ok()) return Usage(s);
  absl::StatusOr<lce::client::ClientOptions> o = Options();
  if (!o.ok()) return Usage(o.status());
  absl::StatusOr<std::unique_ptr<LceClient>> client = LceClient::Create(*o);
  if (!client.ok()) return Usage(client.status());
  LceClient& c = **client;
  if (cmd.training) {
    const lce::client::cli::Outcome out = lce::client::cli::RunTrainingCommand(cmd.name, c);
    if (out.exit_code == 2) return Usage(out.status);
    return out.exit_code == 1 ? Failed(out.status) : 0;
  }
  if (std::string(cmd.name) == "health") {
    absl::StatusOr<bool> ok = c.Health(absl::GetFlag(FLAGS_service));
    if (!ok.ok()) return Failed(ok.status());
    std::cout << (*ok ? "SERVING" : "NOT_SERVING") << std::endl;
    return *ok ? 0 : 1;
  }
  if (std::string(cmd.name) == "info") return Info(c);
  return RunBatchCommand(cmd, c);
}

}  // namespace

int main(int argc, char** argv) {
  absl::StatusOr<lce::client::cli::Args> a = lce::client::cli::Parse(std::vector<std::string>(argv + 1, argv + argc));
  if (!a.ok()) return Usage(a.status());
  g_command = a->command;
  const Command* cmd = lce::client::cli::FindCommand(a->command);
  if (a->version) {
    std::cout << "lce_cli " << LCE_SERVE_VERSION << std::endl;
    return 0;
  }
  if (a->help) {
    std::cout << (cmd != nullptr ? lce::client::cli::CommandHelp(*cmd) : lce::client::cli::Help());
    return 0;
  }
  if (a->command.empty()) {
    std::cerr << lce::client::cli::Synopsis();
    return 2;
  }
  if (absl::Status s = lce::client::cli::SetFlags(*a); !s.ok()) return Usage(s);
  return Main(*cmd);
}
