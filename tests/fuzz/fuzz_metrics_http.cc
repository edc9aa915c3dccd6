// Fuzz target: the /metrics server's answer to a request (metrics_http.h, AnswerHttpRequest): the
// request line's parse (method, path, query) and the routing, over the bytes a connection sent
// (the server hands over at most 16 KiB, up to the blank line). The answer must be a whole HTTP/1.1
// response whose Content-Length is its body's (none for HEAD). The registry's series carry label
// values from the input, so that the exposition's escaping is fuzzed along.
#include <string>

#include "fuzz_common.h"
#include "metrics.h"
#include "metrics_http.h"

namespace lce::server::metrics {
namespace {

void Run(const uint8_t* data, size_t size) {
  static Registry* registry = [] {
    auto* r = new Registry();
    r->AddCounter("lce_requests", "Requests.", {"method", "code"}).WithLabels({"Score", "OK"}).Increment();
    r->AddGauge("lce_up", "Up.");
    r->AddHistogram("lce_seconds", "Latency.", {"op"}).WithLabels({"score"}).Observe(0.02);
    return r;
  }();
  static Family<Counter>& fuzzed = registry->AddCounter("lce_fuzzed", "Label values from the input.\n\\", {"value"});
  if (size == 0) return;
  const bool healthy = data[0] & 1;
  const std::string request(reinterpret_cast<const char*>(data) + 1, size - 1);
  const std::string label = request.substr(0, 24);
  fuzzed.WithLabels({label}).Increment();
  const std::string answer = AnswerHttpRequest(*registry, [healthy] { return healthy; }, request);
  fuzzed.Remove({label});
  LCE_FUZZ_CHECK(answer.rfind("HTTP/1.1 ", 0) == 0, "answer starts '%.20s'", answer.c_str());
  const size_t end = answer.find("\r\n\r\n");
  LCE_FUZZ_CHECK(end != std::string::npos, "no end of headers");
  const size_t cl = answer.find("Content-Length: ");
  LCE_FUZZ_CHECK(cl != std::string::npos && cl < end, "no Content-Length");
  const size_t declared = std::stoul(answer.substr(cl + 16));
  const size_t body = answer.size() - end - 4;
  const bool head = request.rfind("HEAD ", 0) == 0;
  LCE_FUZZ_CHECK(body == declared || (head && body == 0), "Content-Length %zu, body %zu", declared, body);
}

void WriteSeeds(const std::string& dir) {
  const char* seeds[][2] = {
      {"get_metrics", "\x01GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"},
      {"head_healthz", "\x00HEAD /healthz HTTP/1.1\r\n\r\n"},
      {"query", "\x01GET /metrics?name[]=lce_up HTTP/1.0\r\n\r\n"},
      {"post", "\x01POST /healthz HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc"},
      {"not_found", "\x01GET /../etc/passwd HTTP/1.1\r\n\r\n"},
      {"bad", "\x01GET\r\n\r\n"},
  };
  for (const auto& s : seeds) {
    const std::string text = s[1][0] == '\0' ? std::string(1, '\0') + (s[1] + 1) : std::string(s[1]);
    fuzz::WriteSeed(dir, s[0], text);
  }
}

}  // namespace
}  // namespace lce::server::metrics

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  lce::fuzz::MaybeWriteSeeds(lce::server::metrics::WriteSeeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  lce::server::metrics::Run(data, size);
  return 0;
}
