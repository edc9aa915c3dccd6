// The lce.v1.LceService implementation: translates streamed requests into engine calls on the
// head they name and streams the answers back, chunk by chunk. Validation happens before any math.
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "head_store.h"
#include "lce/v1/lce.grpc.pb.h"
#include "request_authenticator.h"
#include "request_validator.h"

namespace lce::server {

struct ServiceConfig {
  RequestLimits limits;
  int64_t max_message_bytes = 64 << 20;
  // Admission: streams beyond this many at once get RESOURCE_EXHAUSTED at once (0: no limit).
  int64_t max_concurrent_streams = 0;
  // Largest total hidden bytes of one request (0: no limit).
  int64_t max_request_bytes = 0;
  int tp_size = 1;
  RequestAuthenticator auth;
};

class LceService final : public v1::LceService::Service {
 public:
  LceService(std::shared_ptr<HeadStore> heads, ServiceConfig config)
      : heads_(std::move(heads)), config_(config) {}

  grpc::Status GetInfo(grpc::ServerContext* ctx, const v1::GetInfoRequest* req,
                       v1::GetInfoResponse* resp) override;
  grpc::Status Score(grpc::ServerContext* ctx,
                     grpc::ServerReaderWriter<v1::StreamResponse, v1::StreamRequest>* stream) override;
  grpc::Status ForwardBackward(grpc::ServerContext* ctx,
                               grpc::ServerReaderWriter<v1::StreamResponse, v1::StreamRequest>* stream) override;
  grpc::Status Backward(grpc::ServerContext* ctx,
                        grpc::ServerReaderWriter<v1::StreamResponse, v1::StreamRequest>* stream) override;

 private:
  grpc::Status RunStream(RpcKind rpc, grpc::ServerContext* ctx,
                         grpc::ServerReaderWriter<v1::StreamResponse, v1::StreamRequest>* stream);

  absl::Status Authenticate(grpc::ServerContext* ctx, Access access) const;

  std::shared_ptr<HeadStore> heads_;
  ServiceConfig config_;
  std::atomic<int64_t> streams_in_flight_{0};
};

}  // namespace lce::server
