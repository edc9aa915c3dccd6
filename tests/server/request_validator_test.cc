#include "request_validator.h"

#include <cmath>
#include <cstdint>

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

// The row limit is inclusive: exactly the limit passes, one row more does not (a `>=` would refuse
// the first and a `>` turned into `>=` must fail here).
TEST_F(ValidatorTest, RowLimitIsInclusive) {
  StreamRequestValidator v(RpcKind::kScore, heads_, {.max_rows_per_request = 10});
  auto plan = v.ValidateHeader(Header());
  ASSERT_TRUE(plan.ok());
  auto at = v.ValidateChunk(*plan, Chunk(4), 2, 6);
  ASSERT_TRUE(at.ok()) << at.status();
  EXPECT_EQ(*at, 4);
  EXPECT_TRUE(v.ValidateChunk(*plan, Chunk(10), 0, 0).ok());
  ExpectError(v.ValidateChunk(*plan, Chunk(5), 2, 6).status(), absl::StatusCode::kResourceExhausted, "10 rows");
  ExpectError(v.ValidateChunk(*plan, Chunk(11), 0, 0).status(), absl::StatusCode::kResourceExhausted, "10 rows");
}

// Targets lie in [0, vocab_size): the last token passes, vocab_size itself and -1 do not, on every kind
// of request, and whatever the ignore_index. Guards against the bound `y > vocab_size`.
TEST_F(ValidatorTest, TargetBoundIsVocabSizeExclusive) {
  for (RpcKind kind : {RpcKind::kScore, RpcKind::kForwardBackward, RpcKind::kBackward}) {
    StreamRequestValidator v(kind, heads_, {});
    v1::RequestHeader h = Header();
    if (kind == RpcKind::kForwardBackward) h.set_num_valid_tokens(4);
    for (int32_t ignore : {-100, 7}) {
      h.set_ignore_index(ignore);
      auto plan = v.ValidateHeader(h);
      ASSERT_TRUE(plan.ok()) << plan.status();
      v1::RowChunk c = Chunk(4);
      if (kind == RpcKind::kBackward) {
        for (int i = 0; i < 4; ++i) c.add_grad_logprob(1.0f);
      }
      c.set_targets(3, 49);
      EXPECT_TRUE(v.ValidateChunk(*plan, c, 0, 0).ok()) << "the last token";
      c.set_targets(3, 50);
      ExpectError(v.ValidateChunk(*plan, c, 0, 0).status(), absl::StatusCode::kInvalidArgument, "row 3: target 50");
      c.set_targets(3, -1);
      ExpectError(v.ValidateChunk(*plan, c, 0, 0).status(), absl::StatusCode::kInvalidArgument, "row 3: target -1");
    }
  }
}

v1::RequestHeader PolicyHeader(v1::RequestHeader h, std::vector<int64_t> sequence_valid_tokens) {
  v1::PolicyLossOptions* p = h.mutable_policy();
  p->set_clip_low(0.2f);
  p->set_clip_high(0.28f);
  for (int64_t n : sequence_valid_tokens) p->add_sequence_valid_tokens(n);
  return h;
}

v1::RowChunk PolicyChunk(v1::RowChunk c, const std::vector<int32_t>& sequence_ids) {
  for (int i = 0; i < c.targets_size(); ++i) {
    c.add_old_logprobs(-1.0f);
    c.add_advantages(0.5f);
  }
  for (int32_t id : sequence_ids) c.add_sequence_ids(id);
  return c;
}

// PolicyLoss's options and rows: every sequence id must index sequence_valid_tokens (the server reads
// that array by id), and the per-row fields must cover every row.
TEST_F(ValidatorTest, PolicyLossChecks) {
  StreamRequestValidator pl(RpcKind::kPolicyLoss, heads_, {});
  auto plan = pl.ValidateHeader(PolicyHeader(Header(), {3, 1}));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->total_valid_tokens, 4);
  EXPECT_EQ(plan->aggregation, AggregationKind::kTokenMean);

  EXPECT_TRUE(pl.ValidateChunk(*plan, PolicyChunk(Chunk(4), {0, 0, 1, 1}), 0, 0).ok());
  // The last valid id passes; the first past the end does not; nor does a negative one.
  ExpectError(pl.ValidateChunk(*plan, PolicyChunk(Chunk(4), {0, 0, 1, 2}), 0, 7).status(),
              absl::StatusCode::kInvalidArgument, "row 10: sequence id 2 is outside [0, 2)");
  ExpectError(pl.ValidateChunk(*plan, PolicyChunk(Chunk(4), {0, -1, 1, 1}), 0, 0).status(),
              absl::StatusCode::kInvalidArgument, "sequence id -1");
  ExpectError(pl.ValidateChunk(*plan, PolicyChunk(Chunk(4), {}), 0, 0).status(), absl::StatusCode::kInvalidArgument,
              "sequence_ids are required when the request declares 2 sequences");
  ExpectError(pl.ValidateChunk(*plan, PolicyChunk(Chunk(4), {0, 0, 1}), 0, 0).status(),
              absl::StatusCode::kInvalidArgument, "sequence_ids has 3 values for 4 rows");
  ExpectError(pl.ValidateChunk(*plan, Chunk(4), 0, 0).status(), absl::StatusCode::kInvalidArgument,
              "PolicyLoss needs old_logprobs and advantages");

  // One sequence: ids may be left out.
  auto one = pl.ValidateHeader(PolicyHeader(Header(), {4}));
  ASSERT_TRUE(one.ok());
  EXPECT_TRUE(pl.ValidateChunk(*one, PolicyChunk(Chunk(4), {}), 0, 0).ok());

  // The options.
  v1::RequestHeader h = PolicyHeader(Header(), {4});
  h.mutable_policy()->set_kl_coef(0.1f);
  auto kl = pl.ValidateHeader(h);
  ASSERT_TRUE(kl.ok());
  ExpectError(pl.ValidateChunk(*kl, PolicyChunk(Chunk(4), {}), 0, 0).status(), absl::StatusCode::kInvalidArgument,
              "kl_coef > 0 needs ref_logprobs");
  h = PolicyHeader(Header(), {4});
  h.mutable_policy()->set_clip_low(1.0f);
  ExpectError(pl.ValidateHeader(h).status(), absl::StatusCode::kInvalidArgument, "clip_low must be in (0, 1)");
  h = PolicyHeader(Header(), {4});
  h.mutable_policy()->set_dual_clip(1.0f);
  ExpectError(pl.ValidateHeader(h).status(), absl::StatusCode::kInvalidArgument, "dual_clip must be > 1");
  h = PolicyHeader(Header(), {4});
  h.mutable_policy()->set_entropy_coef(-0.1f);
  ExpectError(pl.ValidateHeader(h).status(), absl::StatusCode::kInvalidArgument, "must be >= 0");
  h = PolicyHeader(Header(), {4, -1});
  ExpectError(pl.ValidateHeader(h).status(), absl::StatusCode::kInvalidArgument, "sequence_valid_tokens must be >= 0");
  ExpectError(pl.ValidateHeader(PolicyHeader(Header(), {})).status(), absl::StatusCode::kInvalidArgument,
              "sequence_valid_tokens is required");
  h = PolicyHeader(Header(), {4});
  h.mutable_policy()->set_aggregation(v1::AGGREGATION_SEQ_MEAN_TOKEN_SUM);
  auto agg = pl.ValidateHeader(h);
  ASSERT_TRUE(agg.ok());
  EXPECT_EQ(agg->aggregation, AggregationKind::kSeqMeanTokenSum);
  StreamRequestValidator score(RpcKind::kScore, heads_, {});
  ExpectError(score.ValidateHeader(PolicyHeader(Header(), {4})).status(), absl::StatusCode::kInvalidArgument,
              "header.policy applies to PolicyLoss only");
}

// PolicyLoss's options at and just past their bounds (each `<` against `<=` of the validator's
// checks fails here), and declared counts whose sum is not a number.
TEST_F(ValidatorTest, PolicyLossOptionBounds) {
  StreamRequestValidator pl(RpcKind::kPolicyLoss, heads_, {});
  auto with = [&](auto set) {
    v1::RequestHeader h = PolicyHeader(Header(), {2, 1});
    set(*h.mutable_policy());
    return pl.ValidateHeader(h).status();
  };
  using P = v1::PolicyLossOptions;
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_TRUE(with([](P& p) { p.set_clip_low(0.999f); }).ok());
  EXPECT_TRUE(with([](P& p) { p.set_clip_low(1e-6f); }).ok());
  ExpectError(with([](P& p) { p.set_clip_low(0.0f); }), kInvalid, "policy.clip_low must be in (0, 1) and clip_high > 0, got 0, 0.28");
  ExpectError(with([](P& p) { p.set_clip_low(std::nanf("")); }), kInvalid, "policy.clip_low must be in (0, 1)");
  EXPECT_TRUE(with([](P& p) { p.set_clip_high(5.0f); }).ok());
  ExpectError(with([](P& p) { p.set_clip_high(0.0f); }), kInvalid, "clip_high > 0, got 0.2, 0");
  EXPECT_TRUE(with([](P& p) { p.set_dual_clip(0.0f); }).ok());  // off
  EXPECT_TRUE(with([](P& p) { p.set_dual_clip(1.0001f); }).ok());
  ExpectError(with([](P& p) { p.set_dual_clip(-3.0f); }), kInvalid, "policy.dual_clip must be > 1");
  EXPECT_TRUE(with([](P& p) { p.set_kl_coef(0.0f); p.set_entropy_coef(0.0f); }).ok());
  ExpectError(with([](P& p) { p.set_kl_coef(-1e-6f); }), kInvalid, "policy.kl_coef and policy.entropy_coef must be >= 0");
  EXPECT_TRUE(with([](P& p) { p.add_sequence_valid_tokens(0); }).ok());  // an empty sequence
  ExpectError(with([](P& p) { p.set_aggregation(static_cast<v1::Aggregation>(99)); }), kInvalid, "unknown aggregation 99");
  // Declared counts whose sum overflows int64 (summed unchecked before: UBSan in tests/fuzz).
  ExpectError(with([](P& p) {
                p.add_sequence_valid_tokens(INT64_MAX);
                p.add_sequence_valid_tokens(INT64_MAX);
              }),
              kInvalid, "policy.sequence_valid_tokens add up to more than 2^63 - 1 tokens");
}

}  // namespace
}  // namespace lce::server
