// lce_cli: command-line client of lce-serve.
//   lce_cli health|info|score|forward-backward|bench --target=HOST:PORT [options]
//   lce_cli load-head|zero-grad|get-grad|step|update-weights|save-head --target=HOST:PORT [options]
// Exit code 0 on success; on a failed call, 1 with the gRPC status code name and message on
// stderr; 2 for bad usage.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>

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
using lce::client::cli::Args;
namespace v1 = lce::v1;

constexpr char kUsage[] = R"(usage: lce_cli COMMAND --target=HOST:PORT [options]     (lce_cli COMMAND --help for its options)

commands:
  health             grpc.health.v1 check of the server (exit 0 when SERVING)
  info               head and server description
  score              logprobs and entropy of a batch; prints a table of the first rows
  forward-backward   cross-entropy loss, per-token losses and the norm of d_hidden of a batch
  bench              throughput of repeated score or train (forward-backward) requests

training the head on the server (admin RPCs; all go to the front, the first target):
  load-head          add or replace a head: from a safetensors file, a clone, or a seed
  zero-grad          zero the head's gradient buffer
  get-grad           the accumulated gradient dW: its norm, and written to .npy / .safetensors / raw
  step               one AdamW step (--lr, betas, eps, weight decay, clipping)
  update-weights     replace the head's weight with one from a file
  save-head          write the head as safetensors on the server

Flags are --name=value or --name value. Exit code: 0 ok, 1 a call failed (gRPC status code and
message on stderr), 2 bad usage.
)";

constexpr char kConnection[] = R"(connection:
  --target=HOST:PORT         server address (default 127.0.0.1:50051); replicas: several, comma-separated
                             (scoring calls are spread over them, training calls go to the first)
  --load-balancing=round_robin   --target is one name with several addresses (dns:///NAME:PORT), spread
                             by gRPC's round_robin policy (training calls: its first address that answers)
  --max-attempts=N           scoring calls failing with UNAVAILABLE are sent again to the next replica,
                             N attempts in all (default 3 over replicas, 1 for one server; 1: no retries)
  --timeout-seconds=S        deadline of each call (default 600)
  --token-file=PATH          bearer token, read from the file's first line (sent as authorization metadata)
  --admin-token-file=PATH    bearer token for the training commands (default: --token-file's)
  --tls-ca=PATH              use TLS, trusting the PEM roots in PATH (on the data plane too, where the
                             server serves it over TLS: lce_server --data-plane-tls)
  --tls-cert=PATH --tls-key=PATH   client certificate and key for mutual TLS (with --tls-ca)
  --streams=N                split a large request over up to N streams and connections (default 1)
  --data-plane=1             carry hidden states and d_hidden over the server's data plane (plain TCP
                             beside gRPC; the server runs with --data-port) (default 0)
  --data-plane-sockets=K     sockets per direction per stream on the data plane, 1..16 (default 4)
)";

constexpr char kBatch[] = R"(batch:
  --head=NAME                head to use (default: the server's default head)
  --hidden-file=PATH         raw little-endian hidden states [rows, hidden] in the head's dtype
  --targets-file=PATH        raw little-endian int32 target ids [rows] (goes with --hidden-file)
  --rows=N --seed=S          or generate N rows (default 16, seed 0): hidden ~ N(0, 0.5^2) rounded to
                             the head's dtype, targets uniform in [0, vocab)
  --temperature=T            softmax temperature (default 1)
  --softcap=S                logit soft-capping (default 0: off)
  --head-version=N           run only on this head version (FAILED_PRECONDITION otherwise; default 0: any)
  --ignore-index=I           target id meaning "no target" (default -100)
  --chunk-bytes=N            hidden bytes per streamed chunk (default 4194304)
  --first-chunk-bytes=N      a smaller first chunk: the server starts sooner (default 0: a full one)
  --last-chunk-bytes=N       a smaller last chunk: a shorter tail (default 0: what is left)
  --grow-chunks=0|1          after the first chunk, each twice the one before up to --chunk-bytes,
                             and what is left in one chunk once it fits (default 0)
)";

const std::set<std::string> kConnectionFlags = {"target",     "timeout-seconds", "token-file",     "tls-ca",
                                                "tls-cert",   "tls-key",         "streams",        "data-plane",
                                                "data-plane-sockets", "load-balancing", "max-attempts",
                                                "admin-token-file"};
const std::set<std::string> kBatchFlags = {"head",        "hidden-file", "targets-file", "rows",       "seed",
                                           "temperature", "softcap",     "ignore-index", "chunk-bytes",
                                           "first-chunk-bytes", "last-chunk-bytes", "grow-chunks", "head-version"};

struct Command {
  const char* help;
  std::set<std::string> flags;  // besides the connection flags
  bool batch;                   // takes the batch flags
  bool training = false;        // one of lce::client::cli::TrainingCommands()
};

const std::map<std::string, Command>& Commands() {
  static const auto* commands = [] {
    auto* m = new std::map<std::string, Command>{
      {"health", {"lce_cli health [--service=NAME]: grpc.health.v1 Check; prints SERVING or NOT_SERVING\n"
                  "  --service=NAME             service to check (default \"\": the server as a whole)\n",
                  {"service"}, false}},
      {"info", {"lce_cli info [--head=NAME]: server version, backend, TP size, limits and every head\n", {"head"},
                false}},
      {"score", {"lce_cli score: per-row logprob of the target and entropy; prints the first rows and a summary\n"
                 "  --show=N                   rows printed (default 16)\n",
                 {"show"}, true}},
      {"forward-backward",
       {"lce_cli forward-backward: reduced loss, valid tokens, per-token loss of the first rows, |d_hidden|\n"
        "  --reduction=none|sum|mean  (default mean)\n"
        "  --label-smoothing=E        in [0, 1) (default 0)\n"
        "  --z-loss=L                 z-loss coefficient (default 0)\n"
        "  --accumulate-weight-grad=0|1   also add dW into the head's gradient buffer (on the front; default 0)\n"
        "  --show=N                   rows printed (default 16)\n",
        {"reduction", "label-smoothing", "z-loss", "accumulate-weight-grad", "show"}, true}},
      {"bench", {"lce_cli bench: throughput of repeated requests on one batch; prints ms per request, rows/s and\n"
                 "GB/s each way (hidden + targets up; logprob + entropy, or d_hidden + loss, down)\n"
                 "  --op=score|train|wire      Score, or ForwardBackward with REDUCTION_SUM (default score); wire: the\n"
                 "                             data plane's sockets alone, no engine: the batch's hidden bytes\n"
                 "                             written to server memory and read back over --data-plane-sockets\n"
                 "                             sockets (plain, or TLS against lce_server --data-plane-tls)\n"
                 "  --iterations=N             timed requests (default 5)\n"
                 "  --warmup=N                 untimed requests first (default 1)\n",
                 {"op", "iterations", "warmup"}, true}},
    };
    for (const lce::client::cli::TrainingCommand& t : lce::client::cli::TrainingCommands()) {
      (*m)[t.name] = Command{t.help, t.flags, false, true};
    }
    return m;
  }();
  return *commands;
}

void PrintHelp(const std::string& command) {
  auto it = Commands().find(command);
  if (it == Commands().end()) {
    std::cout << kUsage << "\n" << kConnection;
    return;
  }
  std::cout << it->second.help << kConnection;
  if (it->second.batch) std::cout << kBatch;
}

int Failed(const absl::Status& s) {
  std::cerr << "lce_cli: " << absl::StatusCodeToString(s.code()) << ": " << s.message() << std::endl;
  return 1;
}

std::string g_command;  // for the hint in usage errors

int Usage(const absl::Status& s) {
  const bool known = Commands().count(g_command) != 0;
  std::cerr << "lce_cli: " << s.message() << " (see lce_cli " << (known ? g_command + " " : "") << "--help)"
            << std::endl;
  return 2;
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
  if (H <= 0 || es == 0) return absl::FailedPreconditionError("the server described a head without a hidden size or dtype");
  if (a.Has("hidden-file") || a.Has("targets-file")) {
    if (!a.Has("hidden-file") || !a.Has("targets-file")) {
      return absl::InvalidArgumentError("--hidden-file and --targets-file go together");
    }
    absl::StatusOr<std::string> h = lce::client::ReadWholeFile(a.Get("hidden-file"));
    if (!h.ok()) return h.status();
    absl::StatusOr<std::string> t = lce::client::ReadWholeFile(a.Get("targets-file"));
    if (!t.ok()) return t.status();
    if (t->size() % 4 != 0 || static_cast<int64_t>(h->size()) != static_cast<int64_t>(t->size() / 4) * H * es) {
      return absl::InvalidArgumentError(absl::StrCat("the files hold ", h->size(), " hidden bytes and ", t->size(),
                                                     " target bytes; expected rows x ", H, " x ", es,
                                                     " (head '", head.name(), "', ", v1::DType_Name(head.dtype()),
                                                     ") and rows x 4"));
    }
    b.hidden.assign(h->begin(), h->end());
    b.targets.resize(t->size() / 4);
    std::memcpy(b.targets.data(), t->data(), t->size());
  } else {
    absl::StatusOr<int64_t> rows = a.Int("rows", 16, 1, int64_t{1} << 31);
    if (!rows.ok()) return rows.status();
    absl::StatusOr<int64_t> seed = a.Int("seed", 0);
    if (!seed.ok()) return seed.status();
    std::mt19937_64 rng(static_cast<uint64_t>(*seed));
    std::normal_distribution<float> normal(0.0f, 0.5f);
    std::uniform_int_distribution<int32_t> tgt(0, static_cast<int32_t>(head.vocab_size() - 1));
    std::vector<float> h(static_cast<size_t>(*rows * H));
    for (float& x : h) x = normal(rng);
    b.hidden = lce::client::EncodeFloats(h.data(), *rows * H, head.dtype());
    b.targets.resize(static_cast<size_t>(*rows));
    for (int32_t& y : b.targets) y = tgt(rng);
  }
  b.view = {head.dtype(), static_cast<int64_t>(b.targets.size()), H, absl::MakeConstSpan(b.hidden),
            absl::MakeConstSpan(b.targets)};
  return b;
}

absl::StatusOr<v1::RequestHeader> Header(const Args& a) {
  v1::RequestHeader h;
  h.set_head(a.Get("head"));
  if (a.Has("temperature")) {
    absl::StatusOr<double> t = a.Number("temperature", 1);
    if (!t.ok()) return t.status();
    h.set_temperature(static_cast<float>(*t));
  }
  absl::StatusOr<double> softcap = a.Number("softcap", 0);
  if (!softcap.ok()) return softcap.status();
  h.set_softcap(static_cast<float>(*softcap));
  if (a.Has("ignore-index")) {
    absl::StatusOr<int64_t> ii = a.Int("ignore-index", -100, INT32_MIN, INT32_MAX);
    if (!ii.ok()) return ii.status();
    h.set_ignore_index(static_cast<int32_t>(*ii));
  }
  absl::StatusOr<int64_t> version = a.Int("head-version", 0, 0);
  if (!version.ok()) return version.status();
  h.set_head_version(*version);
  return h;
}

// The first line of a token file.
absl::StatusOr<std::string> ReadToken(const std::string& path) {
  absl::StatusOr<std::string> tok = lce::client::ReadWholeFile(path);
  if (!tok.ok()) return tok.status();
  return tok->substr(0, tok->find_first_of("\r\n"));
}

// Bearer tokens and TLS credentials from their files.
absl::Status SetCredentials(const Args& a, lce::client::ClientOptions& o) {
  for (auto [flag, token] : {std::pair{"token-file", &o.bearer_token}, std::pair{"admin-token-file", &o.admin_token}}) {
    if (!a.Has(flag)) continue;
    absl::StatusOr<std::string> tok = ReadToken(a.Get(flag));
    if (!tok.ok()) return tok.status();
    *token = *tok;
  }
  if (a.Has("tls-ca")) {
    grpc::SslCredentialsOptions ssl;
    absl::StatusOr<std::string> ca = lce::client::ReadWholeFile(a.Get("tls-ca"));
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *ca;
    if (a.Has("tls-cert") != a.Has("tls-key")) return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
    if (a.Has("tls-cert")) {
      absl::StatusOr<std::string> cert = lce::client::ReadWholeFile(a.Get("tls-cert"));
      absl::StatusOr<std::string> key = lce::client::ReadWholeFile(a.Get("tls-key"));
      if (!cert.ok()) return cert.status();
      if (!key.ok()) return key.status();
      ssl.pem_cert_chain = *cert;
      ssl.pem_private_key = *key;
    }
    o.credentials = grpc::SslCredentials(ssl);
    o.data_plane_tls_ca = a.Get("tls-ca");  // a data plane served over TLS (--data-plane-tls) carries the same certificate
  } else if (a.Has("tls-cert") || a.Has("tls-key")) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key need --tls-ca");
  }
  return absl::OkStatus();
}

absl::StatusOr<lce::client::ClientOptions> Options(const Args& a) {
  lce::client::ClientOptions o;
  o.target = a.Get("target", "127.0.0.1:50051");
  absl::StatusOr<int64_t> chunk = a.Int("chunk-bytes", 4 << 20, 1);
  if (!chunk.ok()) return chunk.status();
  o.chunk_bytes = *chunk;
  absl::StatusOr<int64_t> first = a.Int("first-chunk-bytes", 0, 0), last = a.Int("last-chunk-bytes", 0, 0);
  if (!first.ok()) return first.status();
  if (!last.ok()) return last.status();
  o.first_chunk_bytes = *first;
  o.last_chunk_bytes = *last;
  absl::StatusOr<int64_t> grow = a.Int("grow-chunks", 0, 0, 1);
  if (!grow.ok()) return grow.status();
  o.grow_chunks = *grow == 1;
  absl::StatusOr<int64_t> streams = a.Int("streams", 1, 1, 64);
  if (!streams.ok()) return streams.status();
  o.streams = static_cast<int>(*streams);
  absl::StatusOr<int64_t> data_plane = a.Int("data-plane", 0, 0, 1);
  if (!data_plane.ok()) return data_plane.status();
  o.data_plane = *data_plane == 1;
  absl::StatusOr<int64_t> sockets = a.Int("data-plane-sockets", 4, 1, 16);
  if (!sockets.ok()) return sockets.status();
  o.data_plane_sockets = static_cast<int>(*sockets);
  absl::StatusOr<double> timeout = a.Number("timeout-seconds", 600);
  if (!timeout.ok()) return timeout.status();
  if (*timeout <= 0) return absl::InvalidArgumentError("--timeout-seconds must be > 0");
  o.timeout = absl::Seconds(*timeout);
  o.load_balancing = a.Get("load-balancing");
  absl::StatusOr<int64_t> attempts = a.Int("max-attempts", 0, 1, 100);
  if (!attempts.ok()) return attempts.status();
  o.max_attempts = static_cast<int>(*attempts);
  if (absl::Status s = SetCredentials(a, o); !s.ok()) return s;
  return o;
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

int Main(const Args& a) {
  auto cmd = Commands().find(a.command);
  if (cmd == Commands().end()) return Usage(absl::InvalidArgumentError(absl::StrCat("unknown command '", a.command, "'")));
  std::set<std::string> allowed = kConnectionFlags;
  allowed.insert(cmd->second.flags.begin(), cmd->second.flags.end());
  if (cmd->second.batch) allowed.insert(kBatchFlags.begin(), kBatchFlags.end());
  if (absl::Status s = lce::client::cli::CheckKnownFlags(a, allowed); !s.ok()) return Usage(s);
  // Every value is checked before anything is sent, so that a typo is a usage error (exit 2).
  for (const char* name : {"rows", "seed", "show", "iterations", "warmup", "ignore-index", "chunk-bytes",
                           "first-chunk-bytes", "last-chunk-bytes", "grow-chunks", "data-plane-sockets",
                           "head-version", "max-attempts"}) {
    if (!a.Has(name)) continue;
    if (absl::StatusOr<int64_t> v = a.Int(name, 0); !v.ok()) return Usage(v.status());
  }
  for (const char* name : {"temperature", "softcap", "label-smoothing", "z-loss", "timeout-seconds"}) {
    if (!a.Has(name)) continue;
    if (absl::StatusOr<double> v = a.Number(name, 0); !v.ok()) return Usage(v.status());
  }
  if (a.Has("reduction") && a.Get("reduction") != "none" && a.Get("reduction") != "sum" && a.Get("reduction") != "mean") {
    return Usage(absl::InvalidArgumentError(absl::StrCat("--reduction must be none, sum or mean, got '", a.Get("reduction"), "'")));
  }
  if (absl::StatusOr<int64_t> v = a.Int("accumulate-weight-grad", 0, 0, 1); !v.ok()) return Usage(v.status());
  if (absl::StatusOr<int64_t> v = a.Int("head-version", 0, 0); !v.ok()) return Usage(v.status());
  if (absl::Status s = lce::client::cli::CheckTrainingFlags(a); !s.ok()) return Usage(s);

  absl::StatusOr<lce::client::ClientOptions> o = Options(a);
  if (!o.ok()) return Usage(o.status());
  absl::StatusOr<std::unique_ptr<LceClient>> client = LceClient::Create(*o);
  if (!client.ok()) return Usage(client.status());
  LceClient& c = **client;

  if (cmd->second.training) {
    const lce::client::cli::Outcome out = lce::client::cli::RunTrainingCommand(a, c);
    if (out.exit_code == 2) return Usage(out.status);
    return out.exit_code == 1 ? Failed(out.status) : 0;
  }
  if (a.command == "health") {
    absl::StatusOr<bool> ok = c.Health(a.Get("service"));
    if (!ok.ok()) return Failed(ok.status());
    std::cout << (*ok ? "SERVING" : "NOT_SERVING") << std::endl;
    return *ok ? 0 : 1;
  }
  absl::StatusOr<v1::GetInfoResponse> info = c.GetInfo(a.Get("head"));
  if (!info.ok()) return Failed(info.status());
  if (a.command == "info") {
    std::cout << "server " << info->server_version() << ", backend " << info->backend() << ", tp_size "
              << info->tp_size() << ", max message " << info->max_message_bytes() << " bytes, max rows/request "
              << (info->max_rows_per_request() ? absl::StrCat(info->max_rows_per_request()) : "unlimited") << "\n";
    for (const auto& h : info->heads()) {
      std::cout << lce::client::cli::DescribeHead(h) << (h.name() == info->head().name() ? " (default)" : "") << "\n";
    }
    return 0;
  }

  absl::StatusOr<v1::RequestHeader> header = Header(a);
  if (!header.ok()) return Usage(header.status());
  absl::StatusOr<int64_t> show_flag = a.Int("show", 16, 0);
  if (!show_flag.ok()) return Usage(show_flag.status());
  absl::StatusOr<OwnedBatch> batch = MakeBatch(a, info->head());
  if (!batch.ok()) return absl::IsInvalidArgument(batch.status()) || absl::IsNotFound(batch.status())
                              ? Usage(batch.status())
                              : Failed(batch.status());
  const HiddenBatch& view = batch->view;
  const int64_t show = std::min(*show_flag, view.rows);
  const int32_t ignore = header->has_ignore_index() ? header->ignore_index() : -100;
  int64_t valid = 0;
  for (int32_t y : batch->targets) valid += y != ignore;

  if (a.command == "score") {
    absl::StatusOr<lce::client::ScoreResult> r = c.Score(view, *header);
    if (!r.ok()) return Failed(r.status());
    const bool has_lp = !r->logprobs.empty(), has_ent = !r->entropy.empty();
    std::printf("%8s %8s %12s %12s\n", "row", "target", "logprob", "entropy");
    for (int64_t i = 0; i < show; ++i) {
      std::printf("%8lld %8d %12.5f %12.5f\n", static_cast<long long>(i), batch->targets[i],
                  has_lp ? r->logprobs[i] : NAN, has_ent ? r->entropy[i] : NAN);
    }
    double lp = 0, ent = 0;
    for (int64_t i = 0; i < view.rows; ++i) {
      if (has_lp && batch->targets[i] != ignore) lp += r->logprobs[i];
      if (has_ent) ent += r->entropy[i];
    }
    std::printf("rows %lld (valid %lld), head '%s' %s: mean logprob %.6f, mean entropy %.6f, loss (mean -logprob) %.6f\n",
                static_cast<long long>(view.rows), static_cast<long long>(valid), info->head().name().c_str(),
                v1::DType_Name(view.dtype).c_str(), valid ? lp / valid : 0.0, ent / view.rows, valid ? -lp / valid : 0.0);
    return 0;
  }

  if (a.command == "forward-backward") {
    v1::RequestHeader h = *header;
    const std::string red = a.Get("reduction", "mean");
    if (red == "none") {
      h.set_reduction(v1::REDUCTION_NONE);
    } else if (red == "sum") {
      h.set_reduction(v1::REDUCTION_SUM);
    } else if (red == "mean") {
      h.set_reduction(v1::REDUCTION_MEAN);
    } else {
      return Usage(absl::InvalidArgumentError(absl::StrCat("--reduction must be none, sum or mean, got '", red, "'")));
    }
    absl::StatusOr<double> eps = a.Number("label-smoothing", 0), z = a.Number("z-loss", 0);
    if (!eps.ok()) return Usage(eps.status());
    if (!z.ok()) return Usage(z.status());
    h.set_label_smoothing(static_cast<float>(*eps));
    h.set_z_loss(static_cast<float>(*z));
    h.set_accumulate_weight_grad(*a.Int("accumulate-weight-grad", 0, 0, 1) == 1);  // checked above
    absl::StatusOr<lce::client::ForwardBackwardResult> r = c.ForwardBackward(view, h);
    if (!r.ok()) return Failed(r.status());
    const std::vector<float> dh = lce::client::DecodeFloats(r->d_hidden.data(),
                                                             static_cast<int64_t>(r->d_hidden.size()) /
                                                                 lce::client::WireDTypeSize(view.dtype),
                                                             view.dtype);
    double norm = 0;
    for (float x : dh) norm += static_cast<double>(x) * x;
    std::printf("loss (%s) %.6f over %lld valid tokens of %lld rows; |d_hidden| %.6e; head '%s' version %lld\n",
                red.c_str(), r->reduced_loss, static_cast<long long>(r->valid_tokens),
                static_cast<long long>(view.rows), std::sqrt(norm), info->head().name().c_str(),
                static_cast<long long>(r->head_version));
    if (!r->loss.empty()) {
      std::printf("%8s %8s %12s\n", "row", "target", "loss");
      for (int64_t i = 0; i < show; ++i) {
        std::printf("%8lld %8d %12.5f\n", static_cast<long long>(i), batch->targets[i], r->loss[i]);
      }
    }
    return 0;
  }

  // bench
  const std::string op = a.Get("op", "score");
  if (op != "score" && op != "train" && op != "wire") {
    return Usage(absl::InvalidArgumentError(absl::StrCat("--op must be score, train or wire, got '", op, "'")));
  }
  absl::StatusOr<int64_t> iters = a.Int("iterations", 5, 1), warmup = a.Int("warmup", 1, 0);
  if (!iters.ok()) return Usage(iters.status());
  if (!warmup.ok()) return Usage(warmup.status());
  if (op == "wire") return BenchWire(c, *o, *info, absl::MakeConstSpan(batch->hidden), *iters, *warmup);
  const bool train = op == "train";
  v1::RequestHeader h = *header;
  if (train) h.set_reduction(v1::REDUCTION_SUM);
  auto once = [&]() -> absl::Status {
    return train ? c.ForwardBackward(view, h).status() : c.Score(view, h).status();
  };
  for (int64_t i = 0; i < *warmup; ++i) {
    if (absl::Status s = once(); !s.ok()) return Failed(s);
  }
  double best = 1e30, total = 0;
  for (int64_t i = 0; i < *iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    if (absl::Status s = once(); !s.ok()) return Failed(s);
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, dt);
    total += dt;
  }
  const double n = static_cast<double>(*iters);
  const double bytes_up = static_cast<double>(batch->hidden.size() + batch->targets.size() * 4);
  const double bytes_down = train ? static_cast<double>(batch->hidden.size()) + view.rows * 4.0 : view.rows * 8.0;
  std::printf("%s: %lld rows x %lld hidden (%s), %lld iterations: %.3f ms/request (best %.3f), %.0f rows/s, "
              "%.3f GB/s up, %.3f GB/s down\n",
              op.c_str(), static_cast<long long>(view.rows), static_cast<long long>(view.hidden_size),
              v1::DType_Name(view.dtype).c_str(), static_cast<long long>(*iters), 1e3 * total / n, 1e3 * best,
              view.rows * n / total, bytes_up * n / total / 1e9, bytes_down * n / total / 1e9);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::StatusOr<Args> a = lce::client::cli::Parse(std::vector<std::string>(argv + 1, argv + argc));
  if (!a.ok()) return Usage(a.status());
  g_command = a->command;
  if (a->help) {
    PrintHelp(a->command);
    return 0;
  }
  if (a->command.empty()) {
    std::cerr << kUsage;
    return 2;
  }
  return Main(*a);
}
