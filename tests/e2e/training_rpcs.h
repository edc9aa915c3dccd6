// Raw-stub calls of the training RPCs, and a CPU reference, that the training tests share (one
// server: training_test.cc; tensor-parallel groups: tp_test.cc). Heads are fp32 [kVocab, kHidden].
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "grpcpp/client_context.h"

#include "lce/v1/lce.grpc.pb.h"
#include "test_server.h"

namespace lce::e2e {

// A Score (rpc "score"), Backward ("bw": the upstream gradient of each target's logprob -1, which is
// the summed cross-entropy's) or ForwardBackward (any other) of `b` in one chunk; answers into `out`.
grpc::Status RunOneChunk(v1::LceService::Stub& stub, const std::string& rpc, const v1::RequestHeader& header,
                         const Batch& b, std::vector<v1::StreamResponse>* out);

// UpdateWeights of `head` with `weight`, in blocks of 700 rows, and `bias` unless empty.
grpc::Status UpdateWeightsRpc(v1::LceService::Stub& stub, const std::string& head, const std::vector<float>& weight,
                              int64_t expected_version, v1::HeadDescription* out, const std::vector<float>& bias = {});

// `head`'s whole dW from GetGrad (NaN where no row came), or its pending contribution `pending`, or
// with `bias` its dB [kVocab]; the rows must come in order.
std::vector<float> GradOf(v1::LceService::Stub& stub, const std::string& head, uint64_t pending = 0, bool bias = false);

// Logprobs of `b` from a CPU engine over `weight`.
std::vector<float> CpuEngineLogprobs(const std::vector<float>& weight, const Batch& b);

// A Score stream of `b` (fp32) on `head`, held open: its first chunk is sent and answered when made;
// Again() sends the same chunk and returns its answer; Finish() ends the request.
class OpenScore {
 public:
  OpenScore(v1::LceService::Stub& stub, const std::string& head, const Batch& b);
  std::vector<float> first() const { return first_; }
  std::vector<float> Again();
  grpc::Status Finish();

 private:
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::StreamRequest, v1::StreamResponse>> stream_;
  v1::StreamRequest chunk_;
  std::vector<float> first_;
};

}  // namespace lce::e2e
