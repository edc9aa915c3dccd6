// The stream a StreamedRequest reads its messages from and writes its answers to.
//
// gRPC's typed Read returns false both at the client's half-close and when a message does not parse,
// so a stream whose third message is garbage would look like a two-message request and be answered
// OK. The four streamed computations therefore take their messages as bytes (ParsingStream) and
// parse them here: a message that is no StreamRequest is the request's error (ReadError), not its end.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/sync_stream.h"
#include "lce/v1/lce.pb.h"

namespace lce::server {

class RequestStream : public grpc::ServerReaderWriterInterface<v1::StreamResponse, v1::StreamRequest> {
 public:
  // Why the last Read returned false if it was not the stream's end (OK otherwise).
  virtual absl::Status ReadError() const { return absl::OkStatus(); }
  // False where the messages are already in memory and the answers go to memory (a Call): no Read
  // or Write waits on the client, so none needs a watchdog or a cancellation check after it.
  virtual bool WaitsOnClient() const { return true; }
};

class ParsingStream final : public RequestStream {
 public:
  using Raw = grpc::ServerReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>;
  explicit ParsingStream(Raw* raw) : raw_(raw) {}

  void SendInitialMetadata() override { raw_->SendInitialMetadata(); }
  bool NextMessageSize(uint32_t* size) override { return raw_->NextMessageSize(size); }
  bool Read(v1::StreamRequest* msg) override {
    grpc::ByteBuffer bytes;
    if (!raw_->Read(&bytes)) return false;
    ++messages_;
    const size_t size = bytes.Length();  // Deserialize consumes the buffer
    const grpc::Status parsed = grpc::SerializationTraits<v1::StreamRequest>::Deserialize(&bytes, msg);
    if (parsed.ok()) return true;
    read_error_ = absl::InvalidArgumentError(
        absl::StrCat("message ", messages_, " of the stream (", size,
                     " bytes) is not a StreamRequest: it does not parse as protobuf"));
    return false;
  }
  bool Write(const v1::StreamResponse& msg, grpc::WriteOptions options) override {
    grpc::ByteBuffer bytes;
    bool own_buffer = false;
    if (!grpc::SerializationTraits<v1::StreamResponse>::Serialize(msg, &bytes, &own_buffer).ok()) return false;
    return raw_->Write(bytes, options);
  }
  absl::Status ReadError() const override { return read_error_; }

 private:
  Raw* raw_;
  int64_t messages_ = 0;
  absl::Status read_error_;
};

}  // namespace lce::server
