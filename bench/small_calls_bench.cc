// Small calls end to end (issue 21), C++ client (lce_client) against a running lce_server on
// loopback: for each row count, sequential Scores (one LceService.Call each) timed end to end
// against the server's own engine time of the same calls (lce_engine_seconds{op="score",
// phase="compute"} from its /metrics, read before and after); then the rate of 1-row Scores from
// C callers at once (threads sharing one client, or K clients of their own connections), with what
// the server's dynamic batcher did meanwhile (lce_batch_*) and the CPU time a call of this process
// and of the server (--server-pid). A unary GetInfo's round trip comes first: the floor under every
// Call. bench/small_calls.sh runs it (and bench/small_calls.py, the Python client's side) against a
// server with batching off and on.
//
// Usage: lce_small_calls_bench --target=127.0.0.1:PORT --metrics=127.0.0.1:MPORT [--rows=1,16,64]
//          [--iterations=200] [--warmup=20] [--concurrency=64] [--seconds=5] [--rate-rows=1] [--label=NAME]
//          [--clients=1] [--server-pid=PID] [--channel-args=NAME=INT,...] [--shm=1]
// --shm=1: each row count is timed a second time with its hidden states in a shared-memory region of a
// co-located session (OpenSession; the Call then carries a slice of it, not the bytes).
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "httplib.h"
#include "lce/client/lce_client.h"

namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "lce_small_calls_bench: %s\n", what.c_str());
  std::exit(1);
}

std::map<std::string, std::string> ParseFlags(int argc, char** argv) {
  std::map<std::string, std::string> f;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const size_t eq = a.find('=');
    if (a.rfind("--", 0) != 0 || eq == std::string::npos) Die("flags are --name=value, got '" + a + "'");
    f[a.substr(2, eq - 2)] = a.substr(eq + 1);
  }
  return f;
}

int64_t Int(const std::map<std::string, std::string>& f, const std::string& name, int64_t dflt) {
  auto it = f.find(name);
  int64_t v = dflt;
  if (it != f.end() && !absl::SimpleAtoi(it->second, &v)) Die("bad --" + name);
  return v;
}

// The sum of every series of the server's /metrics whose name and labels start with `prefix`.
class MetricsReader {
 public:
  explicit MetricsReader(const std::string& host_port) {
    const size_t colon = host_port.rfind(':');
    int port = 0;
    if (colon == std::string::npos || !absl::SimpleAtoi(host_port.substr(colon + 1), &port)) {
      Die("--metrics=HOST:PORT, got '" + host_port + "'");
    }
    client_ = std::make_unique<httplib::Client>(host_port.substr(0, colon), port);
  }
  std::string Scrape() {
    httplib::Result r = client_->Get("/metrics");
    if (!r || r->status != 200) Die("cannot read /metrics");
    return r->body;
  }
  static double Sum(const std::string& text, const std::string& prefix) {
    double total = 0;
    for (absl::string_view line : absl::StrSplit(text, '\n')) {
      if (line.substr(0, prefix.size()) != prefix) continue;
      const size_t sp = line.rfind(' ');
      double v = 0;
      if (sp != absl::string_view::npos && absl::SimpleAtod(line.substr(sp + 1), &v)) total += v;
    }
    return total;
  }

 private:
  std::unique_ptr<httplib::Client> client_;
};

const char kEngineSum[] = "lce_engine_seconds_sum{op=\"score\",phase=\"compute\"}";
const char kEngineCount[] = "lce_engine_seconds_count{op=\"score\",phase=\"compute\"}";

struct Rows {
  std::vector<uint8_t> hidden;
  std::vector<int32_t> targets;
  lce::client::HiddenBatch batch;
};

Rows MakeRows(const lce::v1::HeadDescription& head, int64_t n, uint64_t seed) {
  Rows r;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  const int64_t elems = n * head.hidden_size();
  const bool fp32 = head.dtype() == lce::v1::DTYPE_FLOAT32;
  r.hidden.resize(static_cast<size_t>(elems * (fp32 ? 4 : 2)));
  for (int64_t i = 0; i < elems; ++i) {
    const float x = normal(rng);
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    if (fp32) {
      std::memcpy(&r.hidden[i * 4], &bits, 4);
    } else {
      const uint16_t half = static_cast<uint16_t>(bits >> 16);  // bf16 (fp16 heads: any bits do)
      std::memcpy(&r.hidden[i * 2], &half, 2);
    }
  }
  std::uniform_int_distribution<int32_t> tgt(0, static_cast<int32_t>(head.vocab_size() - 1));
  for (int64_t i = 0; i < n; ++i) r.targets.push_back(tgt(rng));
  r.batch = {head.dtype(), n, head.hidden_size(), absl::MakeConstSpan(r.hidden), absl::MakeConstSpan(r.targets)};
  return r;
}

// CPU seconds (user + system) a process has used: this one (pid 0) or another, from /proc.
double CpuSeconds(int64_t pid) {
  if (pid == 0) {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
           1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
  }
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t close = text.rfind(')');  // the command name may hold spaces
  if (close == std::string::npos) return 0;
  std::vector<std::string> fields = absl::StrSplit(text.substr(close + 2), ' ');
  double utime = 0, stime = 0;  // fields 14 and 15 of stat, 12 and 13 after the name
  if (fields.size() < 13 || !absl::SimpleAtod(fields[11], &utime) || !absl::SimpleAtod(fields[12], &stime)) return 0;
  return (utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// Mean, p50 and p99 in ms of `iters` runs of `call` after `warmup` untimed ones.
struct Latency {
  double mean = 0, p50 = 0, p99 = 0;
};
template <typename F>
Latency TimeCalls(int64_t warmup, int64_t iters, F&& call) {
  for (int64_t i = 0; i < warmup; ++i) call();
  std::vector<double> ms;
  for (int64_t i = 0; i < iters; ++i) {
    const auto t0 = Clock::now();
    call();
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  Latency l;
  for (double x : ms) l.mean += x / static_cast<double>(ms.size());
  std::sort(ms.begin(), ms.end());
  l.p50 = ms[ms.size() / 2];
  l.p99 = ms[std::min(ms.size() - 1, ms.size() * 99 / 100)];
  return l;
}

void Check(const absl::Status& s) {
  if (!s.ok()) Die(std::string(s.message()));
}

template <typename T>
T Check(absl::StatusOr<T> r) {
  Check(r.status());
  return *std::move(r);
}

using Flags = std::map<std::string, std::string>;

// --channel-args=NAME=INT,...: gRPC channel arguments of the client (the server's: --grpc-channel-args).
lce::client::ClientOptions ClientOptionsFromFlags(const Flags& f) {
  lce::client::ClientOptions o;
  o.target = f.at("target");
  if (f.count("channel-args")) {
    for (absl::string_view kv : absl::StrSplit(f.at("channel-args"), ',', absl::SkipEmpty())) {
      const std::pair<absl::string_view, absl::string_view> p = absl::StrSplit(kv, absl::MaxSplits('=', 1));
      int value = 0;
      if (!absl::SimpleAtoi(p.second, &value)) Die("--channel-args=NAME=INT,..., got '" + std::string(kv) + "'");
      o.channel_args.emplace_back(std::string(p.first), value);
    }
  }
  return o;
}

// What every stage uses: the flags (each parsed where it is used), the client and the server's /metrics.
struct Bench {
  const Flags& f;
  const lce::client::ClientOptions& o;  // of `client`; the rate's other clients start from them
  lce::client::LceClient& client;
  MetricsReader& metrics;
  const lce::v1::HeadDescription& head;
  int64_t iters, warmup;
};

void PrintHeader(const Bench& b, const lce::v1::GetInfoResponse& info) {
  const std::string label = b.f.count("label") ? b.f.at("label") : "";
  std::printf("C++ client, %s head %lldx%lld (%s), %s: sequential Scores, one Call each, %lld after %lld warm-ups\n\n",
              info.backend().c_str(), static_cast<long long>(b.head.vocab_size()),
              static_cast<long long>(b.head.hidden_size()), lce::v1::DType_Name(b.head.dtype()).c_str(), label.c_str(),
              static_cast<long long>(b.iters), static_cast<long long>(b.warmup));
  std::printf(
      "| client | rows | mean ms | p50 ms | p99 ms | engine ms | mean - engine ms |\n"
      "| --- | --- | --- | --- | --- | --- | --- |\n");
}

// The floor under every row below: a unary GetInfo, no engine, through the same channel.
void TimeGetInfo(Bench& b) {
  const Latency l = TimeCalls(b.warmup, b.iters, [&] {
    if (!b.client.GetInfo().ok()) Die("GetInfo failed");
  });
  std::printf("| C++ GetInfo (no engine) | - | %.3f | %.3f | %.3f | - | - |\n", l.mean, l.p50, l.p99);
}

// Sequential Scores of `r`, against the server's engine time of the same calls.
void TimeScores(Bench& b, const char* name, const Rows& r) {
  auto score = [&] { Check(b.client.Score(r.batch, lce::v1::RequestHeader())); };
  for (int64_t i = 0; i < b.warmup; ++i) score();
  const std::string before = b.metrics.Scrape();
  const Latency l = TimeCalls(0, b.iters, score);
  const std::string after = b.metrics.Scrape();
  const double calls = MetricsReader::Sum(after, kEngineCount) - MetricsReader::Sum(before, kEngineCount);
  const double engine =
      calls > 0 ? 1e3 * (MetricsReader::Sum(after, kEngineSum) - MetricsReader::Sum(before, kEngineSum)) / calls : 0;
  std::printf("| %s | %lld | %.3f | %.3f | %.3f | %.3f | %+.3f |\n", name, static_cast<long long>(r.batch.rows), l.mean,
              l.p50, l.p99, engine, l.mean - engine);
}

// Each row count of --rows; with a co-located `session` (--shm=1), a second time from a region of it.
void TimeRowCounts(Bench& b, lce::client::SharedMemorySession* session) {
  for (absl::string_view rows_text : absl::StrSplit(b.f.count("rows") ? b.f.at("rows") : "1,16,64", ',')) {
    int64_t rows = 0;
    if (!absl::SimpleAtoi(rows_text, &rows) || rows < 1) Die("bad --rows");
    Rows r = MakeRows(b.head, rows, 7 + rows);
    TimeScores(b, "C++", r);
    if (session == nullptr) continue;
    const lce::client::SharedMemorySession::Region region =
        Check(session->CreateRegion(static_cast<int64_t>(r.hidden.size()), "bench"));
    std::memcpy(region.bytes.data(), r.hidden.data(), r.hidden.size());
    r.batch.hidden = {};
    r.batch.hidden_region = region.Ref();
    TimeScores(b, "C++ shm", r);
    Check(session->ReleaseRegion(region.id));
  }
}

// --clients=K: the callers spread over K clients, each its own connection (a distinct channel
// argument keeps gRPC from sharing one subchannel between them); these are the K - 1 besides b.client.
std::vector<std::unique_ptr<lce::client::LceClient>> OtherClients(const Bench& b) {
  std::vector<std::unique_ptr<lce::client::LceClient>> clients;
  for (int64_t k = 1; k < Int(b.f, "clients", 1); ++k) {
    lce::client::ClientOptions ok = b.o;
    ok.channel_args.emplace_back("lce.bench_client", static_cast<int>(k));
    clients.push_back(Check(lce::client::LceClient::Create(ok)));
  }
  return clients;
}

// `concurrency` callers Score `r` back to back for `seconds`, spread over b.client and `clients`; the
// calls they made.
int64_t CallFor(Bench& b, const std::vector<std::unique_ptr<lce::client::LceClient>>& clients, int64_t concurrency,
                int64_t seconds, const Rows& r) {
  std::atomic<int64_t> done{0};
  std::atomic<bool> stop{false};
  std::vector<std::thread> callers;
  for (int64_t c = 0; c < concurrency; ++c) {
    const size_t k = static_cast<size_t>(c) % (clients.size() + 1);
    lce::client::LceClient& mine = k == 0 ? b.client : *clients[k - 1];
    callers.emplace_back([&, &mine = mine] {
      while (!stop.load()) {
        Check(mine.Score(r.batch, lce::v1::RequestHeader()));
        ++done;
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::seconds(seconds));
  stop = true;
  for (auto& t : callers) t.join();
  return done.load();
}

// The rate of small Scores from `concurrency` callers at once.
void RunRate(Bench& b) {
  const int64_t concurrency = Int(b.f, "concurrency", 64), seconds = Int(b.f, "seconds", 5);
  Rows r = MakeRows(b.head, Int(b.f, "rate-rows", 1), 99);
  const std::vector<std::unique_ptr<lce::client::LceClient>> clients = OtherClients(b);
  // --server-pid: the server's CPU time too (a profile where none can run: CPU per call).
  const int64_t server_pid = Int(b.f, "server-pid", -1);
  const double client_cpu0 = CpuSeconds(0), server_cpu0 = server_pid > 0 ? CpuSeconds(server_pid) : 0;
  const std::string before = b.metrics.Scrape();
  const auto t0 = Clock::now();
  const int64_t done = CallFor(b, clients, concurrency, seconds, r);
  const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
  const std::string after = b.metrics.Scrape();
  const double calls = static_cast<double>(std::max<int64_t>(done, 1));
  const double client_us = 1e6 * (CpuSeconds(0) - client_cpu0) / calls;
  const std::string server_us =
      server_pid > 0 ? absl::StrFormat("%.0f", 1e6 * (CpuSeconds(server_pid) - server_cpu0) / calls) : "-";
  auto delta = [&](const std::string& name) {
    return MetricsReader::Sum(after, name) - MetricsReader::Sum(before, name);
  };
  const double engine_calls = delta(kEngineCount);
  const double batched = delta("lce_batch_requests_count{op=\"score\"}");
  std::printf(
      "\n| client | callers | rows a call | calls/s | engine calls/s | requests an engine call | engine busy "
      "| client CPU us a call | server CPU us a call |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
  std::printf("| C++ threads (%zu connections) | %lld | %lld | %.0f | %.0f | %.2f | %.0f%% | %.0f | %s |\n",
              clients.size() + 1, static_cast<long long>(concurrency), static_cast<long long>(r.batch.rows),
              static_cast<double>(done) / wall, engine_calls / wall,
              batched > 0 ? delta("lce_batch_requests_sum{op=\"score\"}") / batched : 1.0,
              100 * delta(kEngineSum) / wall, client_us, server_us.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  const Flags f = ParseFlags(argc, argv);
  if (!f.count("target") || !f.count("metrics")) Die("--target and --metrics are required");
  const lce::client::ClientOptions o = ClientOptionsFromFlags(f);
  const std::unique_ptr<lce::client::LceClient> client = Check(lce::client::LceClient::Create(o));
  const lce::v1::GetInfoResponse info = Check(client->GetInfo());
  MetricsReader metrics(f.at("metrics"));
  const int64_t iters = Int(f, "iterations", 200), warmup = Int(f, "warmup", 20);
  Bench b{f, o, *client, metrics, info.head(), iters, warmup};
  PrintHeader(b, info);
  TimeGetInfo(b);
  // Held by main, so that the session stays open through the rate run as well.
  std::unique_ptr<lce::client::SharedMemorySession> session;
  if (Int(f, "shm", 0) != 0) session = Check(client->OpenSession());
  TimeRowCounts(b, session.get());
  RunRate(b);
  return 0;
}
