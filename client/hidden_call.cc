#include "hidden_call.h"

#include <string>

#include "absl/synchronization/notification.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "grpcpp/impl/client_unary_call.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "grpcpp/support/byte_buffer.h"

namespace lce::client {
namespace {

// `chunk { hidden: <n bytes> }` up to the bytes themselves, both fields length-delimited (wire type 2).
std::string ChunkHiddenPrefix(size_t n) {
  using google::protobuf::io::CodedOutputStream;
  const uint32_t hidden_tag = (static_cast<uint32_t>(v1::RowChunk::kHiddenFieldNumber) << 3) | 2;
  const uint32_t chunk_tag = (static_cast<uint32_t>(v1::CallRequest::kChunkFieldNumber) << 3) | 2;
  const size_t chunk_size = CodedOutputStream::VarintSize32(hidden_tag) + CodedOutputStream::VarintSize64(n) + n;
  std::string out;
  {
    google::protobuf::io::StringOutputStream sink(&out);
    CodedOutputStream coded(&sink);
    coded.WriteVarint32(chunk_tag);
    coded.WriteVarint64(chunk_size);
    coded.WriteVarint32(hidden_tag);
    coded.WriteVarint64(n);
  }  // flushed into `out`
  return out;
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
