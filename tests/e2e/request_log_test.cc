// Structured request logs: one JSON line per RPC with the client's x-request-id (echoed back in
// the initial metadata), the method, the status code and, for errors, the message.
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "test_server.h"

namespace lce::e2e {
namespace {

TEST(RequestLog, OneJsonLinePerRpcWithTheRequestId) {
  auto ts = StartTestServer(8 << 20, /*log_requests=*/true);
  auto stub = RawStub(ts->target);
  ::testing::internal::CaptureStderr();
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-request-id", "trace-42");
    auto stream = stub->Score(&ctx);
    v1::StreamRequest m;
    m.mutable_header()->set_hidden_size(kHidden);
    m.mutable_header()->set_dtype(v1::DTYPE_BFLOAT16);
    m.mutable_header()->set_temperature(-1.0f);
    stream->Write(m);
    stream->WritesDone();
    v1::StreamResponse r;
    while (stream->Read(&r)) {
    }
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    auto md = ctx.GetServerInitialMetadata();
    auto it = md.find("x-request-id");
    ASSERT_NE(it, md.end());
    EXPECT_EQ(std::string(it->second.data(), it->second.size()), "trace-42");
  }
  ts.reset();  // all handlers done
  const std::string err = ::testing::internal::GetCapturedStderr();
  bool found = false;
  size_t start = 0;
  while (start < err.size()) {
    const size_t end = err.find('\n', start);
    const std::string line = err.substr(start, end == std::string::npos ? std::string::npos : end - start);
    start = end == std::string::npos ? err.size() : end + 1;
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object() || j.value("request_id", "") != "trace-42") continue;
    found = true;
    EXPECT_EQ(j["method"], "Score");
    EXPECT_EQ(j["code"], "INVALID_ARGUMENT");
    EXPECT_EQ(j["level"], "warn");
    EXPECT_NE(j["message"].get<std::string>().find("temperature"), std::string::npos);
    EXPECT_TRUE(j.contains("ts") && j.contains("duration_ms") && j.contains("peer"));
  }
  EXPECT_TRUE(found) << "no log line with request_id trace-42 in:\n" << err;
}

}  // namespace
}  // namespace lce::e2e
