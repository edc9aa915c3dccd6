#include "request_log.h"

#include <cstdio>
#include <random>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"

namespace lce::server {

std::string AssignRequestId(grpc::ServerContext* ctx) {
  std::string id;
  const auto& md = ctx->client_metadata();
  if (auto it = md.find("x-request-id"); it != md.end()) {
    for (char c : std::string(it->second.data(), std::min<size_t>(it->second.size(), 64))) {
      if (std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.') id.push_back(c);
    }
  }
  if (id.empty()) {
    thread_local std::mt19937_64 rng(std::random_device{}());
    id = absl::StrFormat("%016x", rng());
  }
  ctx->AddInitialMetadata("x-request-id", id);
  return id;
}

namespace {
thread_local RequestWork* current_work = nullptr;
}  // namespace

RequestWork* RequestWork::Current() { return current_work; }
RequestWork::Scope::Scope(RequestWork* work) : prev_(current_work) { current_work = work; }
RequestWork::Scope::~Scope() { current_work = prev_; }

void LogRequest(const std::string& request_id, const char* method, grpc::ServerContext* ctx,
                const grpc::Status& status, double seconds, const RequestWork& work) {
  nlohmann::json line = {
      {"ts", absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone())},
      {"level", status.ok() ? "info" : "warn"},
      {"request_id", request_id},
      {"method", method},
      {"code", absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code()))},
      {"duration_ms", seconds * 1e3},
      {"peer", ctx->peer()},
      // steady_clock, shared by every process of the host: lines up with a client's own timestamps.
      {"start_mono_us", std::chrono::duration_cast<std::chrono::microseconds>(work.start.time_since_epoch()).count()},
  };
  if (work.engine_calls > 0) {
    line["engine_calls"] = work.engine_calls;
    line["engine_ms"] = work.engine_seconds * 1e3;
    line["queue_ms"] = work.queue_seconds * 1e3;
    line["read_wait_ms"] = work.read_wait_seconds * 1e3;
    line["first_chunk_wait_ms"] = work.first_chunk_wait_seconds * 1e3;
    line["staging_ms"] = work.staging_seconds * 1e3;
    line["write_wait_ms"] = work.write_wait_seconds * 1e3;
    line["drain_ms"] = work.drain_seconds * 1e3;
    line["unstage_ms"] = work.unstage_seconds * 1e3;
    if (work.tp_control_seconds > 0) {
      line["tp_control_ms"] = work.tp_control_seconds * 1e3;
      line["tp_inputs_ms"] = work.tp_inputs_seconds * 1e3;
    }
    const auto ms = [](auto d) { return std::chrono::duration<double, std::milli>(d).count(); };
    line["before_first_call_ms"] = ms(work.first_call_start - work.start);
    line["after_last_call_ms"] = seconds * 1e3 - ms(work.last_call_end - work.start);
  }
  if (!status.ok()) line["message"] = status.error_message();
  const std::string text = line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  std::fwrite(text.data(), 1, text.size(), stderr);  // one write per line: lines never interleave
}

}  // namespace lce::server
