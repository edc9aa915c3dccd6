// A Call (one message each way) whose hidden states go to gRPC as a slice of the caller's memory.
//
// Set into the request message, a 64-row bf16 Score's 512 KB of hidden states were copied twice
// (into the message, then into gRPC's buffer) in fresh allocations the allocator gave back and
// faulted in again every call: ~0.7 ms of a 3 ms call on a 2-core box. Here the message goes
// without them, and a second `chunk` field holding only `hidden` follows it, its bytes a slice of
// the caller's memory (a parser merges an embedded message that appears twice, so the server reads
// one chunk).
#pragma once

#include <cstdint>
#include <memory>

#include "absl/types/span.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/impl/rpc_method.h"
#include "lce/v1/lce.pb.h"

namespace lce::client {

class HiddenCall {
 public:
  explicit HiddenCall(std::shared_ptr<grpc::Channel> channel);

  // LceService.Call with `request` (whose chunk has no `hidden`) and `hidden` as its chunk's hidden
  // bytes, read in place: they must stay unchanged until this returns, which is after gRPC let go
  // of them.
  grpc::Status Run(grpc::ClientContext* ctx, const v1::CallRequest& request, absl::Span<const uint8_t> hidden,
                   v1::CallResponse* response) const;

 private:
  std::shared_ptr<grpc::Channel> channel_;
  grpc::internal::RpcMethod method_;  // registered once on the channel
};

}  // namespace lce::client
