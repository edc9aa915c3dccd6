#include "hidden_call.h"

#include <string>

#include "absl/synchronization/notification.h"
#include "grpcpp/impl/client_unary_call.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "grpcpp/support/byte_buffer.h"

namespace lce::client {
namespace {

void AppendVarint(uint64_t v, std::string* out) {
  for (; v >= 0x80; v >>= 7) out->push_back(static_cast<char>((v & 0x7f) | 0x80));
  out->push_back(static_cast<char>(v));
}

// The tag of a length-delimited field.
void AppendTag(int field, std::string* out) { AppendVarint((static_cast<uint64_t>(field) << 3) | 2, out); }

// `chunk { hidden: <n bytes> }` up to the bytes themselves.
std::string ChunkHiddenPrefix(size_t n) {
  std::string inner;
  AppendTag(v1::RowChunk::kHiddenFieldNumber, &inner);
  AppendVarint(n, &inner);
  std::string out;
  AppendTag(v1::CallRequest::kChunkFieldNumber, &out);
  AppendVarint(inner.size() + n, &out);
  return out + inner;
}

}  // namespace

HiddenCall::HiddenCall(std::shared_ptr<grpc::Channel> channel)
    : channel_(std::move(channel)),
      method_("/lce.v1.LceService/Call", grpc::internal::RpcMethod::NORMAL_RPC, channel_) {}

grpc::Status HiddenCall::Run(grpc::ClientContext* ctx, const v1::CallRequest& request,
                             absl::Span<const uint8_t> hidden, v1::CallResponse* response) const {
  absl::Notification released;  // gRPC dropped its last reference to the hidden states
  grpc::Status status;
  {
    const grpc::Slice slices[] = {
        grpc::Slice(request.SerializeAsString()), grpc::Slice(ChunkHiddenPrefix(hidden.size())),
        grpc::Slice(const_cast<uint8_t*>(hidden.data()), hidden.size(),
                    [](void* done) { static_cast<absl::Notification*>(done)->Notify(); }, &released)};
    const grpc::ByteBuffer wire(slices, 3);
    status = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, v1::CallResponse>(channel_.get(), method_, ctx, wire,
                                                                                    response);
  }
  // A status can come while a write is still under way (the server refused the call early): the
  // caller's memory may go only once gRPC is done with it.
  released.WaitForNotification();
  return status;
}

}  // namespace lce::client
