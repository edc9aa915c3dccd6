#include "request_validator.h"

#include "gtest/gtest.h"
#include "head_source.h"

namespace lce::server {
namespace {

class ValidatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    HeadSource src;
    ASSERT_TRUE(ParseSeedShape("50x8", src).ok());
    auto w = LoadHead(src, 0, 1);
    ASSERT_TRUE(w.ok());
    auto e = CreateEngine(Backend::kCpu, *w, EngineConfig{});
    ASSERT_TRUE(e.ok());
    ASSERT_TRUE(heads_.Put("policy", std::move(*e), *w).ok());
  }
  v1::RequestHeader Header() const {
    v1::RequestHeader h;
    h.set_hidden_size(8);
    h.set_dtype(v1::DTYPE_BFLOAT16);
    return h;
  }
  v1::RowChunk Chunk(int rows) const {
    v1::RowChunk c;
    c.mutable_hidden()->resize(rows * 8 * 2);
    for (int i = 0; i < rows; ++i) c.add_targets(i % 50);
    return c;
  }
  HeadStore heads_;
};

void ExpectError(const absl::Status& s, absl::StatusCode code, const std::string& words) {
  EXPECT_EQ(s.code(), code) << s;
  EXPECT_NE(s.message().find(words), std::string::npos) << "message '" << s.message() << "' lacks '" << words << "'";
}

TEST_F(ValidatorTest, HeaderChecks) {
  StreamRequestValidator score(RpcKind::kScore, heads_, {});
  auto plan = score.ValidateHeader(Header());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->want_logprobs && plan->want_entropy);
  EXPECT_FLOAT_EQ(plan->options.temperature, 1.0f);
  EXPECT_EQ(plan->options.ignore_index, -100);

  v1::RequestHeader h = Header();
  h.set_head("nope");
  ExpectError(score.ValidateHeader(h).status(), absl::StatusCode::kNotFound, "unknown head 'nope'");
  h = Header();
  h.set_hidden_size(9);
  ExpectError(score.ValidateHeader(h).status(), absl::StatusCode::kInvalidArgument, "hidden_size is 9");
  h = Header();
  h.set_dtype(v1::DTYPE_FLOAT32);
  ExpectError(score.ValidateHeader(h).status(), absl::StatusCode::kInvalidArgument, "dtype is fp32");
  h = Header();
  h.set_temperature(0.0f);
  ExpectError(score.ValidateHeader(h).status(), absl::StatusCode::kInvalidArgument, "temperature");
  h = Header();
  h.set_head_version(7);
  ExpectError(score.ValidateHeader(h).status(), absl::StatusCode::kFailedPrecondition, "version");
  h = Header();
  h.set_z_loss(0.1f);
  ExpectError(score.ValidateHeader(h).status(), absl::StatusCode::kInvalidArgument, "ForwardBackward only");

  StreamRequestValidator fb(RpcKind::kForwardBackward, heads_, {});
  ExpectError(fb.ValidateHeader(Header()).status(), absl::StatusCode::kInvalidArgument, "num_valid_tokens");
  h = Header();
  h.set_num_valid_tokens(3);
  auto fb_plan = fb.ValidateHeader(h);
  ASSERT_TRUE(fb_plan.ok());
  EXPECT_EQ(fb_plan->reduction, v1::REDUCTION_MEAN);
  EXPECT_TRUE(fb_plan->want_loss);
  h.set_label_smoothing(1.5f);
  ExpectError(fb.ValidateHeader(h).status(), absl::StatusCode::kInvalidArgument, "label_smoothing");
}

TEST_F(ValidatorTest, ChunkChecks) {
  StreamRequestValidator v(RpcKind::kScore, heads_, {.max_rows_per_request = 10});
  auto plan = v.ValidateHeader(Header());
  ASSERT_TRUE(plan.ok());
  auto rows = v.ValidateChunk(*plan, Chunk(4), 0, 0);
  ASSERT_TRUE(rows.ok());
  EXPECT_EQ(*rows, 4);

  v1::RowChunk c = Chunk(4);
  c.mutable_hidden()->resize(63);
  ExpectError(v.ValidateChunk(*plan, c, 2, 0).status(), absl::StatusCode::kInvalidArgument, "chunk 2: hidden holds 63 bytes");
  c = Chunk(4);
  c.set_targets(1, 50);
  ExpectError(v.ValidateChunk(*plan, c, 0, 4).status(), absl::StatusCode::kInvalidArgument, "row 5: target 50");
  c.set_targets(1, -100);
  EXPECT_TRUE(v.ValidateChunk(*plan, c, 0, 0).ok());
  ExpectError(v.ValidateChunk(*plan, Chunk(0), 0, 0).status(), absl::StatusCode::kInvalidArgument, "no rows");
  ExpectError(v.ValidateChunk(*plan, Chunk(4), 3, 8).status(), absl::StatusCode::kResourceExhausted, "10 rows");
  c = Chunk(4);
  c.add_grad_logprob(1.0f);
  ExpectError(v.ValidateChunk(*plan, c, 0, 0).status(), absl::StatusCode::kInvalidArgument, "grad_logprob is not used");

  StreamRequestValidator bw(RpcKind::kBackward, heads_, {});
  auto bplan = bw.ValidateHeader(Header());
  ASSERT_TRUE(bplan.ok());
  c = Chunk(4);
  c.add_grad_entropy(1.0f);
  ExpectError(bw.ValidateChunk(*bplan, c, 0, 0).status(), absl::StatusCode::kInvalidArgument, "grad_entropy has 1 values for 4 rows");
}

}  // namespace
}  // namespace lce::server
