// The edges where absl::Status and grpc::Status meet (the numeric codes agree). Inside server/ a
// status is absl::Status; LceService::Recorded, which every RPC leaves through, makes the gRPC one,
// and the answers of other data-parallel fronts come in through FromGrpcStatus (DpJob::CallFront).
#pragma once

#include <string>

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace lce::server {

inline grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}
inline grpc::Status ToGrpcStatus(grpc::Status s) { return s; }  // made at the edge already

inline absl::Status FromGrpcStatus(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

}  // namespace lce::server
