// Structured request logs: one JSON line per finished RPC on stderr, carrying the request id the
// client sent in "x-request-id" metadata (or one made up here), which is also returned to the
// client in the initial metadata.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "grpcpp/server_context.h"

namespace lce::server {

// The request id of the call (client's x-request-id, sanitised, or a new random one), echoed to
// the client as initial metadata. Call before the first message is written.
std::string AssignRequestId(grpc::ServerContext* ctx);

// Engine work of one request, gathered while it runs (RequestWork::Current on the handler's thread).
struct RequestWork {
  int64_t engine_calls = 0;
  double engine_seconds = 0;  // inside LceEngine::Compute
  double queue_seconds = 0;   // waiting for the engine (other requests' calls)
  // Streams: waiting for the client's messages (the header too), for room in the answer queue, and
  // for the last answers to be written at the end.
  double read_wait_seconds = 0, write_wait_seconds = 0, drain_seconds = 0;
  // Of read_wait_seconds, the wait for the header and the first chunk (the pipeline's fill).
  double first_chunk_wait_seconds = 0;
  // GPU engines: a chunk's copies to and from the device staging (buffers, copies, waits), outside
  // the engine.
  double staging_seconds = 0;
  // Of staging_seconds, bringing outputs back after the calls (the rest: inputs up, before them).
  double unstage_seconds = 0;
  // Of engine_seconds, a tensor-parallel group's front sharing each call with its peers before its own part:
  // the control block (its round trip), then the call's inputs (rows, targets, upstream gradients).
  double tp_control_seconds = 0, tp_inputs_seconds = 0;
  // When the request began, its first engine call began, and its last one ended: the request's
  // head (reading the header and first chunk, staging it) and tail (outputs back, the last answer
  // written) are what a one-call engine-only run does not pay.
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point first_call_start{}, last_call_end{};
  // The request the calling thread is serving now (null outside one).
  static RequestWork* Current();
  // Makes `work` the calling thread's current request for the scope's life.
  class Scope {
   public:
    explicit Scope(RequestWork* work);
    ~Scope();

   private:
    RequestWork* prev_;
  };
};

// {"ts":"2026-11-22T22:19:00.123Z","level":"info","request_id":"...","method":"Score","code":"OK",
//  "duration_ms":12.3,"peer":"ipv4:127.0.0.1:5555","message":"..."} ("warn" for errors), and for
// requests that ran the engine "engine_calls", "engine_ms" and "queue_ms".
void LogRequest(const std::string& request_id, const char* method, grpc::ServerContext* ctx,
                const grpc::Status& status, double seconds, const RequestWork& work = {});

}  // namespace lce::server
