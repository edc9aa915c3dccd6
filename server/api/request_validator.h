// Checks every streamed request before any math: the header against the head it names, each chunk
// against the header. Produces the RequestPlan the stream runs on. Errors carry the absl code that
// the server edge maps to the gRPC status (INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION,
// RESOURCE_EXHAUSTED) and a message naming the problem.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "head_store.h"
#include "lce/engine.h"
#include "lce/training.h"
#include "lce/v1/lce.pb.h"

namespace lce::server {

enum class RpcKind { kScore, kForwardBackward, kBackward, kPolicyLoss };
const char* RpcName(RpcKind rpc);

struct RequestLimits {
  int64_t max_rows_per_request = 0;  // 0: no limit
};

struct RequestPlan {
  RpcKind rpc = RpcKind::kScore;
  std::shared_ptr<const ServedHead> head;  // snapshot: the request runs on this version
  LceOptions options;
  bool want_logprobs = false;
  bool want_entropy = false;
  bool want_loss = false;
  bool want_z_loss = false;                      // ForwardBackward
  bool want_argmax = false;                      // options.top_k >= 1 then
  bool want_top_k = false;                       // options.top_k tokens a row
  std::vector<float> class_weights;              // ForwardBackward: empty or [vocab_size]
  v1::Reduction reduction = v1::REDUCTION_MEAN;  // ForwardBackward
  int64_t declared_valid_tokens = -1;            // REDUCTION_MEAN
  bool accumulate_weight_grad = false;           // ForwardBackward, PolicyLoss
  bool defer_weight_grad = false;                // ...kept pending for CommitGrad
  bool partial = false;                          // one part of a request split over streams
  uint64_t split_id = 0;                         // ...whose parts share one dW contribution
  int split_parts = 0;
  bool sends_ahead = false;                      // the client sends without waiting for answers
  // PolicyLoss
  PolicyLossConfig policy;
  AggregationKind aggregation = AggregationKind::kTokenMean;
  std::vector<int64_t> sequence_valid_tokens;  // declared, per sequence
  int64_t total_valid_tokens = 0;              // their sum
};

class StreamRequestValidator {
 public:
  StreamRequestValidator(RpcKind rpc, const HeadStore& heads, RequestLimits limits)
      : rpc_(rpc), heads_(heads), limits_(limits) {}

  absl::StatusOr<RequestPlan> ValidateHeader(const v1::RequestHeader& header) const;

  // Returns the chunk's row count. `chunk_index` and `first_row` only locate errors.
  absl::StatusOr<int64_t> ValidateChunk(const RequestPlan& plan, const v1::RowChunk& chunk,
                                        int64_t chunk_index, int64_t first_row) const;

 private:
  absl::Status ValidateOutputs(const v1::RequestHeader& h, RequestPlan& plan) const;
  absl::Status ValidateClassWeights(const v1::RequestHeader& h, RequestPlan& plan) const;

  RpcKind rpc_;
  const HeadStore& heads_;
  RequestLimits limits_;
};

}  // namespace lce::server
