// The one place where absl::Status becomes grpc::Status (the numeric codes agree).
#pragma once

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace lce::server {

inline grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

}  // namespace lce::server
