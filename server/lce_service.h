// The lce.v1.LceService implementation: translates streamed requests into engine calls on the
// head they name and streams the answers back, chunk by chunk. Validation happens before any math.
#pragma once

#include <atomic>
#include <functional>
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
  // Builds the engine of a new head version (LoadHead, OptimizerStep, UpdateWeights).
  std::function<absl::StatusOr<std::shared_ptr<LceEngine>>(std::shared_ptr<const HeadWeights>)> make_engine;
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
  grpc::Status PolicyLoss(grpc::ServerContext* ctx,
                          grpc::ServerReaderWriter<v1::StreamResponse, v1::StreamRequest>* stream) override;

  // Training RPCs (lce_service_training.cc); admin token.
  grpc::Status LoadHead(grpc::ServerContext* ctx, const v1::LoadHeadRequest* req, v1::HeadDescription* resp) override;
  grpc::Status ZeroGrad(grpc::ServerContext* ctx, const v1::ZeroGradRequest* req, v1::ZeroGradResponse* resp) override;
  grpc::Status GetGrad(grpc::ServerContext* ctx, const v1::GetGradRequest* req,
                       grpc::ServerWriter<v1::TensorChunk>* writer) override;
  grpc::Status OptimizerStep(grpc::ServerContext* ctx, const v1::OptimizerStepRequest* req,
                             v1::OptimizerStepResponse* resp) override;
  grpc::Status UpdateWeights(grpc::ServerContext* ctx, grpc::ServerReader<v1::UpdateWeightsRequest>* reader,
                             v1::HeadDescription* resp) override;
  grpc::Status SaveHead(grpc::ServerContext* ctx, const v1::SaveHeadRequest* req, v1::SaveHeadResponse* resp) override;

 private:
  grpc::Status RunStream(RpcKind rpc, grpc::ServerContext* ctx,
                         grpc::ServerReaderWriter<v1::StreamResponse, v1::StreamRequest>* stream);

  absl::Status Authenticate(grpc::ServerContext* ctx, Access access) const;
  // The head a training RPC names, refusing tensor-parallel groups (not supported yet).
  absl::StatusOr<std::shared_ptr<const ServedHead>> TrainableHead(const std::string& name) const;

  std::shared_ptr<HeadStore> heads_;
  ServiceConfig config_;
  std::atomic<int64_t> streams_in_flight_{0};
};

}  // namespace lce::server
