// Structured request logs: one JSON line per finished RPC on stderr, carrying the request id the
// client sent in "x-request-id" metadata (or one made up here), which is also returned to the
// client in the initial metadata.
#pragma once

#include <string>

#include "grpcpp/server_context.h"

namespace lce::server {

// The request id of the call (client's x-request-id, sanitised, or a new random one), echoed to
// the client as initial metadata. Call before the first message is written.
std::string AssignRequestId(grpc::ServerContext* ctx);

// {"ts":"2026-11-22T22:19:00.123Z","level":"info","request_id":"...","method":"Score","code":"OK",
//  "duration_ms":12.3,"peer":"ipv4:127.0.0.1:5555","message":"..."} ("warn" for errors).
void LogRequest(const std::string& request_id, const char* method, grpc::ServerContext* ctx,
                const grpc::Status& status, double seconds);

}  // namespace lce::server
