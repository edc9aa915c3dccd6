// A Call (one request message, one response) seen as the stream a StreamedRequest reads and writes:
// the header, then the one chunk, then the end; the chunk's answer and the summary land in the
// response. So a Call runs exactly the stages, checks and math of the streamed RPC it names.
#pragma once

#include <utility>

#include "lce/v1/lce.pb.h"
#include "request_stream.h"

namespace lce::server {

class OneMessageStream final : public RequestStream {
 public:
  // `request` is the Call's (its chunk is moved out, not copied); `response` receives the answers.
  OneMessageStream(v1::CallRequest* request, v1::CallResponse* response) : request_(*request), response_(response) {}

  bool WaitsOnClient() const override { return false; }
  void SendInitialMetadata() override {}
  bool NextMessageSize(uint32_t* size) override {
    *size = next_ == 0 ? static_cast<uint32_t>(request_.header().ByteSizeLong())
                       : static_cast<uint32_t>(request_.chunk().ByteSizeLong());
    return next_ < 2;
  }
  bool Read(v1::StreamRequest* msg) override {
    if (next_ == 0) {
      *msg->mutable_header() = request_.header();
      msg->mutable_header()->set_sends_ahead(false);  // nothing to read ahead: one chunk
    } else if (next_ == 1) {
      msg->mutable_chunk()->Swap(request_.mutable_chunk());
    } else {
      return false;
    }
    ++next_;
    return true;
  }
  bool Write(const v1::StreamResponse& msg, grpc::WriteOptions) override {
    if (msg.has_chunk()) {
      if (response_->has_chunk()) return false;  // one chunk in, one answer out
      *response_->mutable_chunk() = msg.chunk();
    } else if (msg.has_summary()) {
      *response_->mutable_summary() = msg.summary();
    }
    return true;
  }

 private:
  v1::CallRequest& request_;
  v1::CallResponse* response_;
  int next_ = 0;
};

}  // namespace lce::server
