// metrics.h (registry, families, text exposition 0.0.4) and metrics_http.h (the /metrics server).
#include "metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "metrics_http.h"

namespace lce::server::metrics {
namespace {

TEST(MetricsFormat, Values) {
  EXPECT_EQ(FormatValue(0), "0");
  EXPECT_EQ(FormatValue(1), "1");
  EXPECT_EQ(FormatValue(-2.5), "-2.5");
  EXPECT_EQ(FormatValue(-0.0), "0");
  EXPECT_EQ(FormatValue(1.5e9), "1500000000");
  EXPECT_EQ(FormatValue(1e21), "1e+21");
  EXPECT_EQ(FormatValue(0.005), "0.005");
  EXPECT_EQ(FormatValue(123456789), "123456789");
  EXPECT_EQ(FormatValue(0.1 + 0.2), "0.30000000000000004");  // round-trips, not %g's 0.3
  EXPECT_EQ(FormatValue(1e-7), "1e-07");
  EXPECT_EQ(FormatValue(std::numeric_limits<double>::infinity()), "+Inf");
  EXPECT_EQ(FormatValue(-std::numeric_limits<double>::infinity()), "-Inf");
  EXPECT_EQ(FormatValue(std::nan("")), "NaN");
  EXPECT_EQ(std::stod(FormatValue(1e300)), 1e300);
}

TEST(MetricsFormat, Escaping) {
  EXPECT_EQ(EscapeHelp("a\\b\nc\"d"), "a\\\\b\\nc\"d");  // help keeps double quotes
  EXPECT_EQ(EscapeLabelValue("a\\b\nc\"d"), "a\\\\b\\nc\\\"d");
  EXPECT_EQ(EscapeLabelValue("ünïcode ok"), "ünïcode ok");
}

TEST(MetricsRender, CounterGolden) {
  Registry r;
  auto& requests = r.AddCounter("lce_requests", "RPCs served, by method and status code.",
                                {"method", "code"});
  requests.WithLabels({"Score", "OK"}).Increment();
  requests.WithLabels({"Score", "OK"}).Increment(2);
  requests.WithLabels({"Backward", "INVALID_ARGUMENT"}).Increment();
  requests.WithLabels({"Score", "OK"}).Increment(-5);  // ignored: counters only go up
  auto& bytes = r.AddCounter("lce_bytes_received_total", "Request bytes.");
  bytes.WithLabels({}).Increment(1.5e9);
  EXPECT_EQ(r.Render(),
            "# HELP lce_requests_total RPCs served, by method and status code.\n"
            "# TYPE lce_requests_total counter\n"
            "lce_requests_total{method=\"Backward\",code=\"INVALID_ARGUMENT\"} 1\n"
            "lce_requests_total{method=\"Score\",code=\"OK\"} 3\n"
            "# HELP lce_bytes_received_total Request bytes.\n"
            "# TYPE lce_bytes_received_total counter\n"
            "lce_bytes_received_total 1500000000\n");
  EXPECT_EQ(requests.name(), "lce_requests_total");
  EXPECT_EQ(requests.WithLabels({"Score", "OK"}).Value(), 3);
}

TEST(MetricsRender, GaugeGolden) {
  Registry r;
  auto& inflight = r.AddGauge("lce_inflight_requests", "Requests being served.");
  auto& mem = r.AddGauge("lce_device_memory_bytes", "Device memory.", {"kind"});
  inflight.WithLabels({}).Increment();
  inflight.WithLabels({}).Increment(3);
  inflight.WithLabels({}).Decrement();
  mem.WithLabels({"workspace"}).Set(1073741824);
  mem.WithLabels({"head"}).Set(2.5e9);
  mem.WithLabels({"free"}).Set(-1);
  EXPECT_EQ(r.Render(),
            "# HELP lce_inflight_requests Requests being served.\n"
            "# TYPE lce_inflight_requests gauge\n"
            "lce_inflight_requests 3\n"
            "# HELP lce_device_memory_bytes Device memory.\n"
            "# TYPE lce_device_memory_bytes gauge\n"
            "lce_device_memory_bytes{kind=\"free\"} -1\n"
            "lce_device_memory_bytes{kind=\"head\"} 2500000000\n"
            "lce_device_memory_bytes{kind=\"workspace\"} 1073741824\n");
}

TEST(MetricsRender, HistogramGoldenCumulative) {
  Registry r;
  auto& h = r.AddHistogram("lce_request_duration_seconds", "RPC latency.", {"method"},
                           {0.25, 0.5, 1});
  Histogram& score = h.WithLabels({"Score"});
  for (double v : {0.125, 0.25 /* le is inclusive */, 0.375, 2.0}) score.Observe(v);
  h.WithLabels({"Backward"}).Observe(0.75);
  EXPECT_EQ(r.Render(),
            "# HELP lce_request_duration_seconds RPC latency.\n"
            "# TYPE lce_request_duration_seconds histogram\n"
            "lce_request_duration_seconds_bucket{method=\"Backward\",le=\"0.25\"} 0\n"
            "lce_request_duration_seconds_bucket{method=\"Backward\",le=\"0.5\"} 0\n"
            "lce_request_duration_seconds_bucket{method=\"Backward\",le=\"1\"} 1\n"
            "lce_request_duration_seconds_bucket{method=\"Backward\",le=\"+Inf\"} 1\n"
            "lce_request_duration_seconds_sum{method=\"Backward\"} 0.75\n"
            "lce_request_duration_seconds_count{method=\"Backward\"} 1\n"
            "lce_request_duration_seconds_bucket{method=\"Score\",le=\"0.25\"} 2\n"
            "lce_request_duration_seconds_bucket{method=\"Score\",le=\"0.5\"} 3\n"
            "lce_request_duration_seconds_bucket{method=\"Score\",le=\"1\"} 3\n"
            "lce_request_duration_seconds_bucket{method=\"Score\",le=\"+Inf\"} 4\n"
            "lce_request_duration_seconds_sum{method=\"Score\"} 2.75\n"
            "lce_request_duration_seconds_count{method=\"Score\"} 4\n");
  Histogram::Snapshot s = score.Collect();
  EXPECT_EQ(s.cumulative, (std::vector<uint64_t>{2, 3, 3, 4}));
  EXPECT_EQ(s.count, 4u);
}

TEST(MetricsRender, HistogramWithoutLabelsAndDefaultBuckets) {
  Registry r;
  auto& h = r.AddHistogram("lce_queue_wait_seconds", "Queue wait.");
  h.WithLabels({}).Observe(0.003);
  h.WithLabels({}).Observe(std::numeric_limits<double>::infinity());
  std::string text = r.Render();
  EXPECT_NE(text.find("lce_queue_wait_seconds_bucket{le=\"0.005\"} 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("lce_queue_wait_seconds_bucket{le=\"10\"} 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("lce_queue_wait_seconds_bucket{le=\"+Inf\"} 2\n"), std::string::npos) << text;
  EXPECT_NE(text.find("lce_queue_wait_seconds_sum +Inf\n"), std::string::npos) << text;
  EXPECT_NE(text.find("lce_queue_wait_seconds_count 2\n"), std::string::npos) << text;
  // Cumulative counts never decrease along the buckets.
  Histogram::Snapshot s = h.WithLabels({}).Collect();
  ASSERT_EQ(s.cumulative.size(), DefaultBuckets().size() + 1);
  for (size_t i = 1; i < s.cumulative.size(); ++i) EXPECT_GE(s.cumulative[i], s.cumulative[i - 1]);
}

TEST(MetricsRender, EscapingInOutput) {
  Registry r;
  auto& g = r.AddGauge("lce_head_version", "Version of a head.\nPath C:\\heads, \"quoted\".", {"head"});
  g.WithLabels({"we\"ird\\name\nx"}).Set(7);
  EXPECT_EQ(r.Render(),
            "# HELP lce_head_version Version of a head.\\nPath C:\\\\heads, \"quoted\".\n"
            "# TYPE lce_head_version gauge\n"
            "lce_head_version{head=\"we\\\"ird\\\\name\\nx\"} 7\n");
}

TEST(MetricsRender, EmptyLabeledFamilyIsOmittedAndRemoveWorks) {
  Registry r;
  auto& peers = r.AddGauge("lce_peer_up", "1 while the TP peer answers.", {"rank"});
  EXPECT_EQ(r.Render(), "");
  peers.WithLabels({"1"}).Set(1);
  peers.WithLabels({"2"}).Set(0);
  peers.Remove({"1"});
  EXPECT_EQ(r.Render(),
            "# HELP lce_peer_up 1 while the TP peer answers.\n"
            "# TYPE lce_peer_up gauge\n"
            "lce_peer_up{rank=\"2\"} 0\n");
}

TEST(MetricsRender, CollectHookRunsBeforeRender) {
  Registry r;
  auto& g = r.AddGauge("lce_tp_size", "Tensor-parallel group size.");
  int calls = 0;
  r.AddCollectHook([&] { g.WithLabels({}).Set(++calls * 2); });
  EXPECT_NE(r.Render().find("lce_tp_size 2\n"), std::string::npos);
  EXPECT_NE(r.Render().find("lce_tp_size 4\n"), std::string::npos);
}

TEST(MetricsRegistry, Misuse) {
  Registry r;
  EXPECT_THROW(r.AddCounter("9bad", "x"), std::invalid_argument);
  EXPECT_THROW(r.AddGauge("bad-name", "x"), std::invalid_argument);
  EXPECT_THROW(r.AddGauge("ok", "x", {"__reserved"}), std::invalid_argument);
  EXPECT_THROW(r.AddGauge("ok", "x", {"a", "a"}), std::invalid_argument);
  EXPECT_THROW(r.AddGauge("ok", "x", {"a:b"}), std::invalid_argument);
  EXPECT_THROW(r.AddHistogram("h", "x", {"le"}), std::invalid_argument);
  EXPECT_THROW(r.AddHistogram("h", "x", {}, {1, 1}), std::invalid_argument);
  EXPECT_THROW(r.AddHistogram("h", "x", {}, {2, 1}), std::invalid_argument);
  EXPECT_THROW(r.AddHistogram("h", "x", {}, {std::nan("")}), std::invalid_argument);
  EXPECT_THROW(ExponentialBuckets(0, 2, 3), std::invalid_argument);

  auto& c = r.AddCounter("lce_tokens", "Tokens.", {"op"});
  EXPECT_EQ(&r.AddCounter("lce_tokens_total", "Tokens.", {"op"}), &c);  // same shape: same family
  EXPECT_THROW(r.AddCounter("lce_tokens", "Tokens.", {"kind"}), std::invalid_argument);
  EXPECT_THROW(r.AddGauge("lce_tokens_total", "Tokens."), std::invalid_argument);
  EXPECT_THROW(c.WithLabels({}), std::invalid_argument);
  EXPECT_THROW(c.WithLabels({"score", "extra"}), std::invalid_argument);

  auto& h = r.AddHistogram("lce_engine_seconds", "x", {"op"}, {1, 2});
  EXPECT_EQ(&r.AddHistogram("lce_engine_seconds", "x", {"op"}, {1, 2}), &h);
  EXPECT_THROW(r.AddHistogram("lce_engine_seconds", "x", {"op"}, {1, 3}), std::invalid_argument);
  EXPECT_THROW(r.AddGauge("lce_engine_seconds_count", "x"), std::invalid_argument);  // collides

  EXPECT_EQ(ExponentialBuckets(1, 2, 4), (std::vector<double>{1, 2, 4, 8}));
  EXPECT_EQ(LinearBuckets(0, 0.5, 3), (std::vector<double>{0, 0.5, 1}));
  EXPECT_EQ(*r.AddHistogram("with_inf", "x", {}, {1, std::numeric_limits<double>::infinity()})
                 .bounds(),
            std::vector<double>{1});
}

TEST(MetricsConcurrency, EightThreadsSumRight) {
  Registry r;
  auto& c = r.AddCounter("lce_tokens", "Tokens.", {"op"});
  auto& g = r.AddGauge("lce_inflight_requests", "In flight.");
  auto& h = r.AddHistogram("lce_engine_seconds", "Engine time.", {"op", "phase"}, {0.5, 1.5});
  constexpr int kThreads = 8, kIters = 20000;
  std::atomic<bool> stop{false};
  std::thread renderer([&] {  // renders concurrently with the updates
    while (!stop.load()) ASSERT_FALSE(r.Render().empty());
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Counter& mine = c.WithLabels({"score"});  // a kept handle
      for (int i = 0; i < kIters; ++i) {
        mine.Increment();
        c.WithLabels({"train"}).Increment(2);   // looked up every time; new series races
        c.WithLabels({"t" + std::to_string(t % 3)}).Increment(0.5);
        g.WithLabels({}).Increment();
        h.WithLabels({"score", (i & 1) ? "forward" : "reduce"}).Observe(i % 3);  // 0, 1, 2
        g.WithLabels({}).Decrement();
      }
    });
  }
  for (auto& th : threads) th.join();
  stop = true;
  renderer.join();

  EXPECT_EQ(c.WithLabels({"score"}).Value(), kThreads * kIters);
  EXPECT_EQ(c.WithLabels({"train"}).Value(), 2.0 * kThreads * kIters);
  EXPECT_EQ(c.WithLabels({"t0"}).Value() + c.WithLabels({"t1"}).Value() +
                c.WithLabels({"t2"}).Value(),
            0.5 * kThreads * kIters);
  EXPECT_EQ(g.WithLabels({}).Value(), 0);
  uint64_t total = 0;
  double sum = 0;
  for (const char* phase : {"forward", "reduce"}) {
    Histogram::Snapshot s = h.WithLabels({"score", phase}).Collect();
    total += s.count;
    sum += s.sum;
  }
  EXPECT_EQ(total, uint64_t{kThreads} * kIters);
  double per_thread_sum = 0;
  for (int i = 0; i < kIters; ++i) per_thread_sum += i % 3;
  EXPECT_EQ(sum, kThreads * per_thread_sum);  // small integers: exact in double
  Histogram::Snapshot fwd = h.WithLabels({"score", "forward"}).Collect();  // odd i
  uint64_t zeros = 0;
  for (int i = 1; i < kIters; i += 2) zeros += (i % 3 == 0);
  EXPECT_EQ(fwd.cumulative[0], kThreads * zeros);
}

// ---- HTTP ----------------------------------------------------------------------------------------

struct HttpResponse {
  int status = 0;
  std::string headers, body;
};

// A connection to 127.0.0.1:port (-1 on failure); reads on it give up after 60 s, so that a server
// that never answers fails the test instead of hanging it.
int Connect(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval tv{60, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// A plain HTTP/1.0 client: one request, reads until the server closes.
HttpResponse HttpRequest(int port, const std::string& method, const std::string& path) {
  HttpResponse resp;
  const int fd = Connect(port);
  if (fd < 0) return resp;
  std::string req = method + " " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
  if (write(fd, req.data(), req.size()) != static_cast<ssize_t>(req.size())) {
    close(fd);
    return resp;
  }
  std::string raw;
  char buf[4096];
  for (ssize_t n; (n = read(fd, buf, sizeof buf)) > 0;) raw.append(buf, n);
  close(fd);
  size_t split = raw.find("\r\n\r\n");
  if (split == std::string::npos) return resp;
  resp.headers = raw.substr(0, split);
  resp.body = raw.substr(split + 4);
  if (sscanf(resp.headers.c_str(), "HTTP/1.%*d %d", &resp.status) != 1) resp.status = -1;
  return resp;
}

std::string Header(const HttpResponse& r, const std::string& name) {
  std::string lower_headers = r.headers;
  for (char& ch : lower_headers) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  std::string key = "\r\n" + name + ":";
  for (char& ch : key) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  size_t at = lower_headers.find(key);
  if (at == std::string::npos) return "";
  size_t start = r.headers.find_first_not_of(' ', at + key.size());
  size_t end = r.headers.find("\r\n", start);
  return r.headers.substr(start, end == std::string::npos ? std::string::npos : end - start);
}

// A registry with every metric type, awkward label values, NaN and infinities.
void Populate(Registry& r) {
  auto& req = r.AddCounter("lce_requests", "RPCs served, by method and status code.", {"method", "code"});
  req.WithLabels({"Score", "OK"}).Increment(41);
  req.WithLabels({"ForwardBackward", "RESOURCE_EXHAUSTED"}).Increment();
  auto& lat = r.AddHistogram("lce_request_duration_seconds", "RPC latency.\nFrom first message to status.",
                             {"method"}, ExponentialBuckets(0.001, 2, 12));
  for (double v : {0.0005, 0.003, 0.02, 0.5, 9.0}) lat.WithLabels({"Score"}).Observe(v);
  auto& mem = r.AddGauge("lce_device_memory_bytes", "Device memory in use, by kind.", {"kind"});
  mem.WithLabels({"workspace"}).Set(1 << 30);
  mem.WithLabels({"weird \"kind\" \\ with\nnewline"}).Set(std::nan(""));
  r.AddGauge("lce_tp_size", "Tensor-parallel group size.").WithLabels({}).Set(1);
  r.AddGauge("lce_free_ratio", "Something infinite.").WithLabels({}).Set(
      -std::numeric_limits<double>::infinity());
  r.AddCounter("lce_bytes_received", "Bytes of request messages.").WithLabels({}).Increment(1e21);
}

std::string FindPromtool() {
  if (const char* env = std::getenv("PROMTOOL"); env && *env) return env;
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "";
  dirs += ":/usr/bin:/usr/local/bin";
  size_t start = 0;
  while (start <= dirs.size()) {
    size_t end = dirs.find(':', start);
    if (end == std::string::npos) end = dirs.size();
    std::string cand = dirs.substr(start, end - start) + "/promtool";
    if (end > start && access(cand.c_str(), X_OK) == 0) return cand;
    start = end + 1;
  }
  return "";
}

TEST(MetricsHttp, ServesMetricsAndHealthOnPortZero) {
  Registry r;
  Populate(r);
  std::atomic<bool> healthy{true};
  MetricsHttpOptions o;
  o.host = "127.0.0.1";
  o.port = 0;
  o.healthy = [&] { return healthy.load(); };
  auto server = MetricsHttpServer::Start(&r, o);
  ASSERT_TRUE(server.ok()) << server.status();
  int port = (*server)->port();
  ASSERT_GT(port, 0);

  HttpResponse m = HttpRequest(port, "GET", "/metrics");
  ASSERT_EQ(m.status, 200) << m.headers;
  EXPECT_EQ(Header(m, "Content-Type"), "text/plain; version=0.0.4; charset=utf-8");
  EXPECT_EQ(m.body, r.Render());
  EXPECT_EQ(Header(m, "Content-Length"), std::to_string(m.body.size()));

  HttpResponse head = HttpRequest(port, "HEAD", "/metrics");
  EXPECT_EQ(head.status, 200);
  EXPECT_EQ(head.body, "");

  HttpResponse h = HttpRequest(port, "GET", "/healthz");
  EXPECT_EQ(h.status, 200);
  EXPECT_EQ(h.body, "ok\n");
  healthy = false;
  EXPECT_EQ(HttpRequest(port, "GET", "/healthz").status, 503);
  EXPECT_EQ(HttpRequest(port, "GET", "/nothing-here").status, 404);
  EXPECT_EQ(HttpRequest(port, "GET", "/metricsfoo").status, 404);
  EXPECT_EQ(HttpRequest(port, "POST", "/metrics").status, 405);

  // The live registry keeps moving between scrapes.
  r.AddCounter("lce_requests", "RPCs served, by method and status code.", {"method", "code"})
      .WithLabels({"Score", "OK"}).Increment();
  EXPECT_NE(HttpRequest(port, "GET", "/metrics").body.find(
                "lce_requests_total{method=\"Score\",code=\"OK\"} 42\n"),
            std::string::npos);
}

TEST(MetricsHttp, PortInUseIsAnError) {
  Registry r;
  auto first = MetricsHttpServer::Start(&r, {.host = "127.0.0.1", .port = 0});
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = MetricsHttpServer::Start(&r, {.host = "127.0.0.1", .port = (*first)->port()});
  EXPECT_FALSE(second.ok());
  EXPECT_NE(second.status().message().find(std::to_string((*first)->port())), std::string::npos)
      << second.status();
  EXPECT_FALSE(MetricsHttpServer::Start(&r, {.port = 70000}).ok());
  EXPECT_FALSE(MetricsHttpServer::Start(nullptr, {.port = 0}).ok());
}

// `slow` clients each send a request a byte at a time, more often than any per-read timeout, and
// never finish it; meanwhile `rounds` of /metrics and /healthz must be answered.
void ExpectAnswersDespiteSlowClients(const Registry& r, int port, int slow_clients, int rounds) {
  std::vector<int> slow;
  for (int i = 0; i < slow_clients; ++i) {
    slow.push_back(Connect(port));
    ASSERT_GE(slow.back(), 0);
  }
  std::atomic<bool> done{false};
  std::thread dribble([&] {
    const std::string req = "GET /metrics HTTP/1.1\r\nHost: x\r\n";  // never the blank line
    for (size_t k = 0; !done; k = (k + 1) % req.size()) {
      for (int fd : slow) (void)!send(fd, &req[k], 1, MSG_NOSIGNAL);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });
  for (int i = 0; i < rounds; ++i) {
    EXPECT_EQ(HttpRequest(port, "GET", "/metrics").body, r.Render());
    EXPECT_EQ(HttpRequest(port, "GET", "/healthz").status, 200);
  }
  done = true;
  dribble.join();
  for (int fd : slow) close(fd);
}

// Slow-loris clients, more than the server has workers, each sending its request a byte at a time
// more often than any per-read timeout: /metrics and /healthz still answer meanwhile.
TEST(MetricsHttp, SlowClientsDoNotBlindIt) {
  Registry r;
  Populate(r);
  auto server = MetricsHttpServer::Start(&r, {.host = "127.0.0.1", .port = 0, .num_threads = 2});
  ASSERT_TRUE(server.ok()) << server.status();
  ExpectAnswersDespiteSlowClients(r, (*server)->port(), 8, 5);
}

// A request that does not arrive whole within the deadline is dropped, however steadily it trickles.
TEST(MetricsHttp, ARequestMustArriveWithinTheDeadline) {
  Registry r;
  auto server = MetricsHttpServer::Start(&r, {.host = "127.0.0.1", .port = 0, .request_timeout_seconds = 0.3});
  ASSERT_TRUE(server.ok()) << server.status();
  const int fd = Connect((*server)->port());
  ASSERT_GE(fd, 0);
  const std::string req = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: ";
  char byte = 0;
  ssize_t got = -1;
  // One byte every 20 ms: each read is prompt, but the request would take for ever.
  for (size_t k = 0; k < 100000; ++k) {
    if (send(fd, k < req.size() ? &req[k] : "a", 1, MSG_NOSIGNAL) != 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    got = recv(fd, &byte, 1, MSG_DONTWAIT);
    if (got == 0 || (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) break;
  }
  EXPECT_LE(got, 0) << "the server answered a request it never got whole";
  close(fd);
  // And it still serves.
  EXPECT_EQ(HttpRequest((*server)->port(), "GET", "/healthz").status, 200);
}

// Past max_connections, the oldest connection still sending its request makes room for a new one.
TEST(MetricsHttp, ManyIdleConnectionsDoNotLockItOut) {
  Registry r;
  auto server = MetricsHttpServer::Start(&r, {.host = "127.0.0.1", .port = 0, .request_timeout_seconds = 600,
                                              .max_connections = 4});
  ASSERT_TRUE(server.ok()) << server.status();
  std::vector<int> idle;
  for (int i = 0; i < 16; ++i) idle.push_back(Connect((*server)->port()));
  EXPECT_EQ(HttpRequest((*server)->port(), "GET", "/healthz").status, 200);
  for (int fd : idle) close(fd);
}

// More slow clients than the server may serve at once, with a deadline far away: each new connection
// sheds the oldest still sending, so /metrics and /healthz still answer.
TEST(MetricsHttp, SlowClientsBeyondMaxConnectionsAreShed) {
  Registry r;
  Populate(r);
  auto server = MetricsHttpServer::Start(
      &r, {.host = "127.0.0.1", .port = 0, .num_threads = 1, .request_timeout_seconds = 600, .max_connections = 4});
  ASSERT_TRUE(server.ok()) << server.status();
  ExpectAnswersDespiteSlowClients(r, (*server)->port(), 12, 3);
}

// The routing alone (what the fuzz target drives): paths, methods, queries, HEAD, a bad request line.
TEST(MetricsHttpRouting, AnswersWithoutATransport) {
  Registry r;
  Populate(r);
  bool healthy = true;
  const std::function<bool()> health = [&] { return healthy; };
  const MetricsHttpAnswer m = RouteMetricsRequest(r, health, "GET", "/metrics?name[]=x");
  EXPECT_EQ(m.status, 200);
  EXPECT_EQ(m.content_type, "text/plain; version=0.0.4; charset=utf-8");
  EXPECT_EQ(m.body, r.Render());
  EXPECT_EQ(RouteMetricsRequest(r, health, "HEAD", "/healthz").body, "ok\n");
  healthy = false;
  EXPECT_EQ(RouteMetricsRequest(r, health, "GET", "/healthz").status, 503);
  EXPECT_EQ(RouteMetricsRequest(r, nullptr, "GET", "/healthz").status, 200);
  EXPECT_EQ(RouteMetricsRequest(r, health, "GET", "/metricsfoo").status, 404);
  const MetricsHttpAnswer post = RouteMetricsRequest(r, health, "POST", "/metrics");
  EXPECT_EQ(post.status, 405);
  EXPECT_EQ(post.allow, "GET, HEAD");

  const std::string get = AnswerHttpRequest(r, health, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  const std::string body = r.Render();
  EXPECT_EQ(get.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << get;
  EXPECT_NE(get.find(absl::StrCat("\r\nContent-Length: ", body.size(), "\r\n")), std::string::npos);
  EXPECT_EQ(get.substr(get.size() - body.size()), body);
  const std::string head = AnswerHttpRequest(r, health, "HEAD /metrics HTTP/1.1\r\n\r\n");
  EXPECT_EQ(head.substr(head.size() - 4), "\r\n\r\n") << "no body";
  EXPECT_NE(AnswerHttpRequest(r, health, "DELETE /healthz HTTP/1.1\r\n\r\n").find("\r\nAllow: GET, HEAD\r\n"),
            std::string::npos);
  EXPECT_EQ(AnswerHttpRequest(r, health, "GET\r\n\r\n").rfind("HTTP/1.1 400 Bad Request\r\n", 0), 0u);
  EXPECT_EQ(AnswerHttpRequest(r, health, "").rfind("HTTP/1.1 400 ", 0), 0u);
}

TEST(MetricsHttp, PromtoolAcceptsTheScrape) {
  std::string promtool = FindPromtool();
  if (promtool.empty()) GTEST_SKIP() << "promtool not found (Debian package 'prometheus'); not validated";
  Registry r;
  Populate(r);
  auto server = MetricsHttpServer::Start(&r, {.host = "127.0.0.1", .port = 0});
  ASSERT_TRUE(server.ok()) << server.status();
  HttpResponse m = HttpRequest((*server)->port(), "GET", "/metrics");
  ASSERT_EQ(m.status, 200);

  std::string dir = testing::TempDir();
  std::string in = dir + "/metrics_scrape.txt", out = dir + "/promtool_out.txt";
  { std::ofstream(in) << m.body; }
  std::string cmd = "'" + promtool + "' check metrics < '" + in + "' > '" + out + "' 2>&1";
  int rc = std::system(cmd.c_str());
  std::ifstream f(out);
  std::string report((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  ASSERT_TRUE(WIFEXITED(rc)) << cmd;
  EXPECT_EQ(WEXITSTATUS(rc), 0) << "promtool check metrics said:\n" << report << "\nbody:\n" << m.body;
  EXPECT_EQ(report, "") << "lint findings";
}

}  // namespace
}  // namespace lce::server::metrics
