// End-to-end transport benchmark (issue 7): the same score and train requests, timed
//   engine   in this process: the CUDA engine on the server's head (same seed), inputs already in
//            device memory: the floor of every path below;
//   grpc-S   lce_server over gRPC on loopback, hidden states and d_hidden as bytes, the request split
//            over S streams/connections (ClientOptions.streams; S=1 is one stream);
//   tcp-S    lce_server's data plane (ClientOptions.data_plane): the bytes over plain TCP sockets into
//            and out of server memory, one per direction per stream, the messages over gRPC naming
//            slices of it; S streams as for grpc (the server needs --data-port);
//   wire     the data plane's sockets alone (no engine, no gRPC): 64 MiB up, down, and both at
//            once over S sockets per direction: the transfer term of max(transfer, compute);
//   shm      co-located, host memory: hidden states and d_hidden in POSIX shared-memory regions;
//   ipc      co-located, GPU memory: hidden states and d_hidden in this process's cudaMalloc memory,
//            registered with the server through CUDA IPC (no bytes anywhere but on the GPU).
// score = logprobs + entropy; train = ForwardBackward (mean loss, per-row loss, d_hidden), which is
// what the engine row times as well. Each path's answers are compared with the engine's (max
// |logprob| and |d_hidden| differences), so that a fast wrong path shows.
//
// Usage (server already running with --backend=cuda --seed-head=VxH --seed=S --head-dtype=bf16):
//   lce_transport_bench --target=127.0.0.1:PORT --vocab=V --hidden=H --seed=S [--rows=8192]
//       [--streams=1,2,4,8] [--single-message-calls=1 (0: always stream; 1,0: both)] [--tcp-streams=1,2,4]
//       [--tcp-sockets=4] [--grow-chunks=0 (1: growing chunks; 0,1: both)]
//       [--chunk-bytes=4194304] [--iterations=5] [--warmup=1]
//       [--modes=engine,grpc,tcp,wire,shm,ipc]
//       [--http2-window-bytes=0] [--grpc-channel-args=K=V,...] [--first-chunk-bytes=0] [--last-chunk-bytes=0]
//       [--tls-ca=PATH (a server with --tls-cert and --data-plane-tls: gRPC and the data plane over TLS,
//        trusting this CA; run once with and once without against the two servers for TLS's cost)]
//       [--trace-file=PATH (one JSON line per timed request: its start and end and its streams' points,
//        steady_clock microseconds, to line up with the server's request log: bench/transport_trace_summary.py)]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <thread>

#include "bench_check.h"
#include "data_plane_connection.h"
#include "grpcpp/security/credentials.h"
#include "head_source.h"
#include "lce/client/lce_client.h"
#include "lce/engine.h"
#include "lce/numeric.h"

namespace v1 = lce::v1;

namespace {

template <typename T>
T Check(absl::StatusOr<T> v, const char* what) {
  if (!v.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, v.status().ToString().c_str());
    std::exit(1);
  }
  return *std::move(v);
}
void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

std::map<std::string, std::string> ParseFlags(int argc, char** argv) {
  std::map<std::string, std::string> f;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0 || a.find('=') == std::string::npos) {
      std::fprintf(stderr, "flags are --name=value, got '%s'\n", a.c_str());
      std::exit(2);
    }
    f[a.substr(2, a.find('=') - 2)] = a.substr(a.find('=') + 1);
  }
  return f;
}

std::vector<std::string> Split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');) out.push_back(x);
  return out;
}

struct Timing {
  double mean_ms = 0, best_ms = 1e30;
};

// --trace-file: the timed requests' start and end and their streams' points (ClientOptions.stream_trace).
struct RequestTracer {
  FILE* file = nullptr;
  std::string path, op;  // of the requests timed next
  std::mutex mu;
  std::vector<lce::client::StreamTrace> streams;  // of the request in flight

  static long long Us(std::chrono::steady_clock::time_point t) {
    return t == std::chrono::steady_clock::time_point{}
               ? 0
               : std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
  }
  void OnStream(const lce::client::StreamTrace& t) {
    std::lock_guard<std::mutex> l(mu);
    streams.push_back(t);
  }
  void Write(std::chrono::steady_clock::time_point start, std::chrono::steady_clock::time_point end) {
    std::lock_guard<std::mutex> l(mu);
    if (file != nullptr) {
      std::fprintf(file, "{\"path\": \"%s\", \"op\": \"%s\", \"start_us\": %lld, \"end_us\": %lld, \"streams\": [",
                   path.c_str(), op.c_str(), Us(start), Us(end));
      for (size_t i = 0; i < streams.size(); ++i) {
        const auto& t = streams[i];
        std::fprintf(
            file,
            "%s{\"start_us\": %lld, \"opened_us\": %lld, \"first_chunk_sent_us\": %lld, "
            "\"last_chunk_sent_us\": %lld, \"first_answer_us\": %lld, \"last_answer_us\": %lld, \"ended_us\": %lld}",
            i ? ", " : "", Us(t.start), Us(t.opened), Us(t.first_chunk_sent), Us(t.last_chunk_sent), Us(t.first_answer),
            Us(t.last_answer), Us(t.ended));
      }
      std::fprintf(file, "]}\n");
    }
    streams.clear();
  }
};
RequestTracer tracer;

Timing Time(int warmup, int iterations, const std::function<void()>& once) {
  for (int i = 0; i < warmup; ++i) {
    once();
    std::lock_guard<std::mutex> l(tracer.mu);
    tracer.streams.clear();
  }
  Timing t;
  for (int i = 0; i < iterations; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    once();
    const auto t1 = std::chrono::steady_clock::now();
    const double ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
    tracer.Write(t0, t1);
    t.mean_ms += ms / iterations;
    t.best_ms = std::min(t.best_ms, ms);
  }
  return t;
}

// Outputs of one path, to compare with the engine's.
struct Answers {
  std::vector<float> logprobs, loss;
  std::vector<uint16_t> d_hidden;
};

double MaxDiff(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(static_cast<double>(a[i]) - b[i]));
  return m;
}
double MaxDiffBf16(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  if (a.size() != b.size()) return INFINITY;
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i)
    m = std::max(m, std::fabs(static_cast<double>(lce::Bf16ToFloat(a[i])) - lce::Bf16ToFloat(b[i])));
  return m;
}

// What the flags ask for. The lists are split here; numbers that only some modes use stay text and are
// parsed where those modes run, so that a bad one stops the run only when its mode runs.
struct Config {
  std::string target;
  int64_t N = 0, H = 0, V = 0;
  uint64_t seed = 0;
  int64_t chunk_bytes = 0;
  int iterations = 0, warmup = 0;
  std::vector<std::string> modes;
  int64_t bytes = 0;  // of the hidden states (and of d_hidden), bf16
  std::optional<std::string> trace_file;
  std::string tls_ca;
  std::vector<std::string> single_message_calls, streams, grow_chunks, tcp_streams, grpc_channel_args;
  std::string first_chunk_bytes, last_chunk_bytes, http2_window_bytes, tcp_sockets;

  bool Has(const char* mode) const { return std::find(modes.begin(), modes.end(), mode) != modes.end(); }
};

Config ParseConfig(int argc, char** argv) {
  auto f = ParseFlags(argc, argv);
  auto get = [&](const char* k, const char* d) { return f.count(k) ? f[k] : std::string(d); };
  Config c;
  c.target = get("target", "127.0.0.1:50051");
  c.N = std::stoll(get("rows", "8192"));
  c.H = std::stoll(get("hidden", "4096"));
  c.V = std::stoll(get("vocab", "128256"));
  c.seed = std::stoull(get("seed", "0"));
  c.chunk_bytes = std::stoll(get("chunk-bytes", "4194304"));
  c.iterations = std::stoi(get("iterations", "5"));
  c.warmup = std::stoi(get("warmup", "1"));
  c.modes = Split(get("modes", "engine,grpc,tcp,wire,shm,ipc"));
  c.bytes = c.N * c.H * 2;
  if (f.count("trace-file")) c.trace_file = f["trace-file"];
  c.tls_ca = get("tls-ca", "");
  c.single_message_calls = Split(get("single-message-calls", "1"));
  c.streams = Split(get("streams", "1,2,4,8"));
  c.grow_chunks = Split(get("grow-chunks", "0"));
  c.tcp_streams = Split(get("tcp-streams", "1,2,4"));
  c.grpc_channel_args = Split(get("grpc-channel-args", ""));
  c.first_chunk_bytes = get("first-chunk-bytes", "0");
  c.last_chunk_bytes = get("last-chunk-bytes", "0");
  c.http2_window_bytes = get("http2-window-bytes", "0");
  c.tcp_sockets = get("tcp-sockets", "4");
  return c;
}

void OpenTrace(const Config& cfg) {
  if (!cfg.trace_file) return;
  tracer.file = std::fopen(cfg.trace_file->c_str(), "w");
  if (tracer.file == nullptr) Check(absl::InvalidArgumentError("cannot open --trace-file"), "trace");
}

struct Inputs {
  std::vector<uint16_t> hidden;
  std::vector<int32_t> targets;
  int64_t valid = 0;  // targets not ignored

  const uint8_t* hidden_bytes() const { return reinterpret_cast<const uint8_t*>(hidden.data()); }
};

// h ~ 0.5·N(0, 1) in bf16, targets uniform with 5% ignored (as bench/lce_bench).
Inputs MakeInputs(const Config& cfg) {
  std::mt19937_64 rng(1234);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(cfg.V - 1));
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  Inputs in;
  in.hidden.resize(cfg.N * cfg.H);
  for (auto& x : in.hidden) x = lce::FloatToBf16(normal(rng));
  in.targets.resize(cfg.N);
  for (auto& y : in.targets) {
    y = u(rng) < 0.05f ? -100 : tok(rng);
    in.valid += y != -100;
  }
  return in;
}

struct Row {
  std::string path, op;
  Timing t;
  double in_gbs, out_gbs, lp_diff, dh_diff;
};

struct WireRow {
  int sockets;
  Timing up, down, both;
};

v1::RequestHeader TrainHeader() {
  v1::RequestHeader h;
  h.set_reduction(v1::REDUCTION_MEAN);
  h.add_outputs(v1::OUTPUT_LOSS);
  return h;
}

// What every stage reads (the flags, the inputs) and what it adds to (the rows of the tables, the
// engine's answers that the paths after it are compared with).
struct Bench {
  const Config& cfg;
  const Inputs& in;
  lce::client::HiddenBatch wire;  // the inputs as bytes on the wire
  std::vector<Row> rows;
  std::vector<WireRow> wire_rows;
  Answers ref_score, ref_train;     // empty: no engine row
  const v1::RequestHeader score_h;  // default outputs: logprobs and entropy
  const v1::RequestHeader train_h = TrainHeader();

  Bench(const Config& c, const Inputs& i)
      : cfg(c),
        in(i),
        wire{v1::DTYPE_BFLOAT16, c.N, c.H, absl::MakeConstSpan(i.hidden_bytes(), c.bytes),
             absl::MakeConstSpan(i.targets)} {}

  // Max differences from the engine's answers: logprobs (score), or loss and d_hidden (train).
  std::pair<double, double> Diff(const Answers& a, bool train) const {
    if (ref_score.logprobs.empty()) return {NAN, NAN};
    if (!train) return {MaxDiff(a.logprobs, ref_score.logprobs), NAN};
    return {MaxDiff(a.loss, ref_train.loss), MaxDiffBf16(a.d_hidden, ref_train.d_hidden)};
  }
};

// --- engine only: this process, the server's head, device-resident inputs.
void RunEngineOnly(Bench& b) {
  const Config& cfg = b.cfg;
  const int64_t N = cfg.N, bytes = cfg.bytes;
  tracer.path = "engine only";
  tracer.op = "score";
  lce::server::HeadSource src;
  src.seed_vocab = cfg.V;
  src.seed_hidden = cfg.H;
  src.seed = cfg.seed;
  src.dtype = lce::DType::kBFloat16;
  auto weights = Check(lce::server::LoadHead(src, 0, 1), "seeded head");
  lce::EngineConfig ecfg;
  auto engine = Check(lce::CreateEngine(lce::Backend::kCuda, weights, ecfg), "CUDA engine");
  void *d_h = nullptr, *d_y = nullptr, *d_dh = nullptr, *d_g = nullptr, *d_lp = nullptr, *d_ent = nullptr,
       *d_loss = nullptr;
  CHECK_CUDA(cudaMalloc(&d_h, bytes));
  CHECK_CUDA(cudaMalloc(&d_dh, bytes));
  CHECK_CUDA(cudaMalloc(&d_y, N * 4));
  CHECK_CUDA(cudaMalloc(&d_g, N * 4));
  CHECK_CUDA(cudaMalloc(&d_lp, N * 4));
  CHECK_CUDA(cudaMalloc(&d_ent, N * 4));
  CHECK_CUDA(cudaMalloc(&d_loss, N * 4));
  CHECK_CUDA(cudaMemcpy(d_h, b.in.hidden.data(), bytes, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_y, b.in.targets.data(), N * 4, cudaMemcpyHostToDevice));
  std::vector<float> g(N, 1.0f / static_cast<float>(b.in.valid));  // the mean, as the server passes it
  CHECK_CUDA(cudaMemcpy(d_g, g.data(), N * 4, cudaMemcpyHostToDevice));
  const lce::RowsView view{d_h, static_cast<const int32_t*>(d_y), N, lce::MemorySpace::kDevice};
  lce::LceOptions opt;
  Timing ts = Time(cfg.warmup, cfg.iterations, [&] {
    Check(engine->Compute(view, opt, {}, {static_cast<float*>(d_lp), static_cast<float*>(d_ent), nullptr, nullptr}, {}),
          "engine score");
  });
  lce::Upstream up{lce::GradMode::kLoss, static_cast<const float*>(d_g), nullptr, nullptr};
  tracer.op = "train";
  Timing tt = Time(cfg.warmup, cfg.iterations, [&] {
    Check(engine->Compute(view, opt, up, {nullptr, nullptr, nullptr, static_cast<float*>(d_loss)}, {d_dh, nullptr}),
          "engine train");
  });
  b.ref_score.logprobs.resize(N);
  b.ref_train.loss.resize(N);
  b.ref_train.d_hidden.resize(N * cfg.H);
  CHECK_CUDA(cudaMemcpy(b.ref_score.logprobs.data(), d_lp, N * 4, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(b.ref_train.loss.data(), d_loss, N * 4, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(b.ref_train.d_hidden.data(), d_dh, bytes, cudaMemcpyDeviceToHost));
  for (void* p : {d_h, d_dh, d_y, d_g, d_lp, d_ent, d_loss}) cudaFree(p);
  engine.reset();  // give the GPU back to the server for the paths below
  b.rows.push_back({"engine only", "score", ts, 0, 0, 0, 0});
  b.rows.push_back({"engine only", "train", tt, 0, 0, 0, 0});
}

std::vector<uint16_t> ToBf16(const std::vector<uint8_t>& b) {
  std::vector<uint16_t> v(b.size() / 2);
  std::memcpy(v.data(), b.data(), b.size());
  return v;
}

// Runs score and train through `c` with `batch`; `read_dh` fetches d_hidden when it is not on the wire.
void RunPath(Bench& b, const std::string& name, lce::client::LceClient& c, const lce::client::HiddenBatch& batch,
             const std::function<std::vector<uint16_t>()>& read_dh) {
  const int64_t bytes = b.cfg.bytes;
  Answers s, t;
  lce::client::HiddenBatch score_batch = batch;  // Score returns no d_hidden
  score_batch.d_hidden_region.reset();
  tracer.path = name;
  tracer.op = "score";
  Timing ts = Time(b.cfg.warmup, b.cfg.iterations, [&] {
    auto r = Check(c.Score(score_batch, b.score_h), (name + " score").c_str());
    s.logprobs = std::move(r.logprobs);
  });
  // d_hidden from the wire lands in a buffer of ours, as a trainer's would (touched once here, so
  // that no request pays for first-touch page faults).
  std::vector<uint8_t> dh_out;
  lce::client::HiddenBatch train_batch = batch;
  if (!batch.d_hidden_region) {
    dh_out.assign(static_cast<size_t>(bytes), 0);
    train_batch.d_hidden_out = absl::MakeSpan(dh_out);
  }
  tracer.op = "train";
  Timing tt = Time(b.cfg.warmup, b.cfg.iterations, [&] {
    auto r = Check(c.ForwardBackward(train_batch, b.train_h), (name + " train").c_str());
    t.loss = std::move(r.loss);
  });
  t.d_hidden = read_dh ? read_dh() : ToBf16(dh_out);
  const bool wire = !batch.hidden_region.has_value();
  auto [lp, _] = b.Diff(s, false);
  auto [loss, dh] = b.Diff(t, true);
  const double in = wire ? bytes / 1e9 : 0.0;
  const double out_train = wire && !batch.d_hidden_region ? bytes / 1e9 : 0.0;
  b.rows.push_back({name, "score", ts, in / (ts.mean_ms / 1e3), 0, lp, NAN});
  b.rows.push_back({name, "train", tt, in / (tt.mean_ms / 1e3), out_train / (tt.mean_ms / 1e3), loss, dh});
}

// TLS to a server with --tls-cert (and --data-plane-tls): gRPC and the data plane trust --tls-ca.
void Secure(const Config& cfg, lce::client::ClientOptions& o) {
  if (cfg.tls_ca.empty()) return;
  std::ifstream in(cfg.tls_ca);
  std::stringstream pem;
  pem << in.rdbuf();
  o.credentials = grpc::SslCredentials(grpc::SslCredentialsOptions{pem.str(), "", ""});
  o.data_plane_tls_ca = cfg.tls_ca;
}

// A client's options as the flags say: the server, the chunk size, TLS, and each stream traced (--trace-file).
lce::client::ClientOptions BaseOptions(const Config& cfg) {
  lce::client::ClientOptions o;
  o.target = cfg.target;
  o.chunk_bytes = cfg.chunk_bytes;
  o.stream_trace = [](const lce::client::StreamTrace& t) { tracer.OnStream(t); };
  Secure(cfg, o);
  return o;
}

// A remote client's options: the request over `streams` streams, chunked as the flags say.
lce::client::ClientOptions Streamed(const Config& cfg, const std::string& streams) {
  lce::client::ClientOptions o = BaseOptions(cfg);
  o.first_chunk_bytes = std::stoll(cfg.first_chunk_bytes);
  o.last_chunk_bytes = std::stoll(cfg.last_chunk_bytes);
  o.streams = std::stoi(streams);
  o.min_stream_bytes = std::min<int64_t>(8 << 20, cfg.bytes / o.streams);
  return o;
}

void RunGrpcPaths(Bench& b) {
  for (const std::string& calls : b.cfg.single_message_calls) {
    for (const std::string& s : b.cfg.streams) {
      lce::client::ClientOptions o = Streamed(b.cfg, s);
      o.single_message_calls = calls != "0";
      o.http2_window_bytes = std::stoll(b.cfg.http2_window_bytes);
      for (const std::string& kv : b.cfg.grpc_channel_args) {
        o.channel_args.emplace_back(kv.substr(0, kv.find('=')), std::stoi(kv.substr(kv.find('=') + 1)));
      }
      auto c = Check(lce::client::LceClient::Create(o), "client");
      RunPath(b, "grpc, " + s + (s == "1" ? " stream" : " streams") + (calls != "0" ? "" : ", never a Call"), *c,
              b.wire, nullptr);
    }
  }
}

void RunTcpPaths(Bench& b) {
  for (const std::string& grow : b.cfg.grow_chunks) {
    for (const std::string& s : b.cfg.tcp_streams) {
      lce::client::ClientOptions o = Streamed(b.cfg, s);
      o.data_plane = true;
      o.data_plane_streams = o.streams;  // the path's own stream count (the client's default is 1)
      o.data_plane_sockets = std::stoi(b.cfg.tcp_sockets);
      o.grow_chunks = grow != "0";
      auto c = Check(lce::client::LceClient::Create(o), "client");
      RunPath(b,
              "data plane (TCP), " + s + (s == "1" ? " stream" : " streams") + (grow != "0" ? ", growing chunks" : ""),
              *c, b.wire, nullptr);
    }
  }
}

// One wire row's sockets: k per direction, into the server memory regions `in` and `out` of a session.
struct WireLink {
  std::unique_ptr<lce::client::SharedMemorySession> session;
  uint64_t in = 0, out = 0;
  std::vector<std::unique_ptr<lce::client::DataPlaneConnection>> up, down;
};

WireLink ConnectWire(const Config& cfg, lce::client::LceClient& c1, const v1::GetInfoResponse& info, int k) {
  const std::string host = cfg.target.substr(0, cfg.target.rfind(':'));
  WireLink l;
  l.session = Check(c1.OpenSession(), "OpenSession");
  l.in = Check(l.session->AllocateServerMemory(cfg.bytes, "wire-in"), "wire region");
  l.out = Check(l.session->AllocateServerMemory(cfg.bytes, "wire-out"), "wire region");
  for (int i = 0; i < k; ++i) {
    const lce::client::DataPlaneAuth auth{l.session->secret(), info.data_plane_tls(), cfg.tls_ca};
    l.up.push_back(
        Check(lce::client::DataPlaneConnection::Connect(host, info.data_port(), auth), "data plane connect"));
    l.down.push_back(
        Check(lce::client::DataPlaneConnection::Connect(host, info.data_port(), auth), "data plane connect"));
  }
  return l;
}

// Socket i moves the i-th share of the bytes, in chunk-sized transfers, as a request's stream does: up
// from the hidden states into region `in`, down from region `from` into `back`.
void MoveBytes(const Bench& b, const WireLink& l, std::vector<uint8_t>& back, bool send, bool recv, uint64_t from) {
  const int64_t bytes = b.cfg.bytes, chunk_bytes = b.cfg.chunk_bytes;
  const uint8_t* hidden_bytes = b.in.hidden_bytes();
  const int k = static_cast<int>(l.up.size());
  std::vector<std::thread> t;
  for (int i = 0; i < k; ++i) {
    const int64_t lo = bytes * i / k, hi = bytes * (i + 1) / k;
    if (send) {
      t.emplace_back([&, i, lo, hi] {
        for (int64_t o = lo; o < hi; o += chunk_bytes) {
          const int64_t n = std::min(chunk_bytes, hi - o);
          Check(l.up[i]->Write(l.session->id(), l.in, o, absl::MakeConstSpan(hidden_bytes + o, n)), "wire write");
        }
      });
    }
    if (recv) {
      t.emplace_back([&, i, lo, hi] {
        for (int64_t o = lo; o < hi; o += chunk_bytes) {
          const int64_t n = std::min(chunk_bytes, hi - o);
          Check(l.down[i]->Read(l.session->id(), from, o, absl::MakeSpan(back.data() + o, n)), "wire read");
        }
      });
    }
  }
  for (auto& x : t) x.join();
}

void RunWire(Bench& b, lce::client::LceClient& c1) {
  const Config& cfg = b.cfg;
  const v1::GetInfoResponse info = Check(c1.GetInfo(), "GetInfo");
  if (info.data_port() <= 0) Check(absl::FailedPreconditionError("the server has no data plane (--data-port)"), "wire");
  std::vector<uint8_t> back(static_cast<size_t>(cfg.bytes));
  for (const std::string& s : cfg.tcp_streams) {
    const int k = std::stoi(s);
    const WireLink l = ConnectWire(cfg, c1, info, k);
    WireRow w{k};
    tracer.path = "wire " + s;
    tracer.op = "up";
    w.up = Time(cfg.warmup, cfg.iterations, [&] { MoveBytes(b, l, back, true, false, l.in); });
    tracer.op = "down";
    w.down = Time(cfg.warmup, cfg.iterations, [&] { MoveBytes(b, l, back, false, true, l.in); });
    if (std::memcmp(back.data(), b.in.hidden_bytes(), static_cast<size_t>(cfg.bytes)) != 0) {
      Check(absl::DataLossError("bytes read back differ from those written"), "wire");
    }
    tracer.op = "both";
    w.both = Time(cfg.warmup, cfg.iterations, [&] { MoveBytes(b, l, back, true, true, l.out); });
    b.wire_rows.push_back(w);
  }
}

void RunShm(Bench& b, lce::client::LceClient& c1) {
  const int64_t bytes = b.cfg.bytes;
  auto session = Check(c1.OpenSession(), "OpenSession");
  auto in = Check(session->CreateRegion(bytes, "hidden"), "shm hidden");
  auto out = Check(session->CreateRegion(bytes, "d_hidden"), "shm d_hidden");
  std::memcpy(in.bytes.data(), b.in.hidden.data(), bytes);
  lce::client::HiddenBatch batch = b.wire;
  batch.hidden = {};
  batch.hidden_region = in.Ref();
  batch.d_hidden_region = out.Ref();
  RunPath(b, "co-located, shm (host)", c1, batch, [&] {
    std::vector<uint16_t> v(b.cfg.N * b.cfg.H);
    std::memcpy(v.data(), out.bytes.data(), bytes);
    return v;
  });
}

void RunIpc(Bench& b, lce::client::LceClient& c1) {
  const int64_t bytes = b.cfg.bytes;
  void *d_in = nullptr, *d_out = nullptr;
  CHECK_CUDA(cudaMalloc(&d_in, bytes));
  CHECK_CUDA(cudaMalloc(&d_out, bytes));
  CHECK_CUDA(cudaMemcpy(d_in, b.in.hidden.data(), bytes, cudaMemcpyHostToDevice));
  cudaIpcMemHandle_t hin, hout;
  CHECK_CUDA(cudaIpcGetMemHandle(&hin, d_in));
  CHECK_CUDA(cudaIpcGetMemHandle(&hout, d_out));
  auto session = Check(c1.OpenSession(), "OpenSession");
  const uint64_t in_id =
      Check(session->RegisterCudaIpc(absl::string_view(reinterpret_cast<const char*>(&hin), 64), 0, bytes, "hidden"),
            "ipc hidden");
  const uint64_t out_id =
      Check(session->RegisterCudaIpc(absl::string_view(reinterpret_cast<const char*>(&hout), 64), 0, bytes, "d_hidden"),
            "ipc d_hidden");
  lce::client::HiddenBatch batch = b.wire;
  batch.hidden = {};
  batch.hidden_region = lce::client::RegionRef{session->id(), in_id, 0};
  batch.d_hidden_region = lce::client::RegionRef{session->id(), out_id, 0};
  RunPath(b, "co-located, CUDA IPC (GPU)", c1, batch, [&] {
    std::vector<uint16_t> v(b.cfg.N * b.cfg.H);
    CHECK_CUDA(cudaMemcpy(v.data(), d_out, bytes, cudaMemcpyDeviceToHost));
    return v;
  });
  session.reset();
  cudaFree(d_in);
  cudaFree(d_out);
}

void PrintTables(const Bench& b) {
  const int64_t bytes = b.cfg.bytes;
  double engine_ms[2] = {NAN, NAN};
  for (const Row& r : b.rows) {
    if (r.path == "engine only") engine_ms[r.op == "train"] = r.t.mean_ms;
  }
  std::printf(
      "\n| path | op | mean ms | best ms | x engine | GB/s in | GB/s out | "
      "max |d logprob or loss| | max |d d_hidden| |\n");
  std::printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
  for (const Row& r : b.rows) {
    std::printf("| %s | %s | %.2f | %.2f | %.2f | %.2f | %.2f | %.2e | %.2e |\n", r.path.c_str(), r.op.c_str(),
                r.t.mean_ms, r.t.best_ms, r.t.mean_ms / engine_ms[r.op == "train"], r.in_gbs, r.out_gbs, r.lp_diff,
                r.dh_diff);
  }
  if (!b.wire_rows.empty()) {
    std::printf(
        "\n| data plane wire only | up GB/s | down GB/s | both at once, GB/s each way |\n| --- | --- | --- | --- |\n");
    for (const WireRow& w : b.wire_rows) {
      std::printf("| %d socket%s per direction | %.2f | %.2f | %.2f |\n", w.sockets, w.sockets == 1 ? "" : "s",
                  bytes / 1e6 / w.up.mean_ms, bytes / 1e6 / w.down.mean_ms, bytes / 1e6 / w.both.mean_ms);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const Config cfg = ParseConfig(argc, argv);
  OpenTrace(cfg);
  const Inputs in = MakeInputs(cfg);
  std::printf("transport bench: %lld rows x %lld hidden, vocab %lld, bf16: %.1f MiB of hidden states each way\n",
              static_cast<long long>(cfg.N), static_cast<long long>(cfg.H), static_cast<long long>(cfg.V),
              cfg.bytes / 1048576.0);
  Bench b(cfg, in);
  if (cfg.Has("engine")) RunEngineOnly(b);
  if (cfg.Has("grpc")) RunGrpcPaths(b);
  if (cfg.Has("tcp")) RunTcpPaths(b);
  auto c1 = Check(lce::client::LceClient::Create(BaseOptions(cfg)), "client");  // wire, shm, ipc
  if (cfg.Has("wire")) RunWire(b, *c1);
  if (cfg.Has("shm")) RunShm(b, *c1);
  if (cfg.Has("ipc")) RunIpc(b, *c1);
  PrintTables(b);
  if (tracer.file != nullptr) std::fclose(tracer.file);
  return 0;
}
