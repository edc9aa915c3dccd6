// A failed or cancelled training request leaves the weights and the accumulated gradient exactly as
// before it (issue 22): a ForwardBackward or PolicyLoss that accumulates dW and fails at a later
// chunk, at its end (declared counts) or is cancelled part-way; an UpdateWeights cut short; an
// OptimizerStep refused. Afterwards the head trains on as if they never came: its gradient and
// weights have the bits of a server that never saw them.
#include <cmath>
#include <cstring>

#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "test_server.h"
#include "training_rpcs.h"

namespace lce::e2e {
namespace {

v1::RowChunk ChunkOf(const Batch& b, int64_t begin, int64_t end) {
  v1::RowChunk c;
  const size_t row_bytes = b.hidden.size() / static_cast<size_t>(b.rows);
  c.set_hidden(b.hidden.data() + begin * row_bytes, (end - begin) * row_bytes);
  for (int64_t i = begin; i < end; ++i) c.add_targets(b.targets[i]);
  return c;
}

v1::RequestHeader Accumulating(v1::Reduction reduction = v1::REDUCTION_SUM) {
  v1::RequestHeader h;
  h.set_head("wide");
  h.set_hidden_size(kHidden);
  h.set_dtype(v1::DTYPE_FLOAT32);
  h.set_reduction(reduction);
  h.set_accumulate_weight_grad(true);
  return h;
}

// A streamed ForwardBackward ("fb") or PolicyLoss ("pl"): the header, then the chunks; with
// `cancel_after_first`, the client cancels once the first chunk's answer is in.
grpc::Status Stream(v1::LceService::Stub& stub, const std::string& rpc, const v1::RequestHeader& header,
                    const std::vector<v1::RowChunk>& chunks, bool cancel_after_first = false) {
  grpc::ClientContext ctx;
  auto s = rpc == "pl" ? stub.PolicyLoss(&ctx) : stub.ForwardBackward(&ctx);
  v1::StreamRequest m;
  *m.mutable_header() = header;
  s->Write(m);
  v1::StreamResponse r;
  for (size_t i = 0; i < chunks.size(); ++i) {
    m.Clear();
    *m.mutable_chunk() = chunks[i];
    if (!s->Write(m)) break;
    if (cancel_after_first && i == 0) {
      EXPECT_TRUE(s->Read(&r)) << "no answer to the first chunk";
      ctx.TryCancel();
      break;
    }
  }
  s->WritesDone();
  while (s->Read(&r)) {
  }
  return s->Finish();
}

// The head's served weight, its version and its accumulated dW, as bytes.
struct TrainingState {
  int64_t version = 0;
  std::vector<uint8_t> weight;
  std::vector<float> grad;
};

TrainingState StateOf(TestServer& ts, v1::LceService::Stub& stub) {
  const server::ServedHead& h = **ts.heads->Get("wide");
  return {h.version, h.weights->weight, GradOf(stub, "wide")};
}

void ExpectSameBits(const TrainingState& got, const TrainingState& want, const std::string& after) {
  EXPECT_EQ(got.version, want.version) << after;
  EXPECT_TRUE(got.weight == want.weight) << after << ": the weight changed";
  ASSERT_EQ(got.grad.size(), want.grad.size());
  EXPECT_EQ(std::memcmp(got.grad.data(), want.grad.data(), got.grad.size() * 4), 0)
      << after << ": the accumulated gradient changed";
}

TEST(TrainingFailure, AFailedOrCancelledRequestLeavesWeightsAndGradientExactlyAsBefore) {
  auto ts = StartTestServer();
  auto stub = RawStub(ts->target);
  const Batch a = MakeBatch(48, v1::DTYPE_FLOAT32, 71), b = MakeBatch(48, v1::DTYPE_FLOAT32, 72);
  ASSERT_EQ(Stream(*stub, "fb", Accumulating(), {ChunkOf(a, 0, 48)}).error_code(), grpc::StatusCode::OK);
  const TrainingState before = StateOf(*ts, *stub);
  ASSERT_TRUE(std::any_of(before.grad.begin(), before.grad.end(), [](float g) { return g != 0.0f; }));

  // A later chunk refused by the validator, after the first accumulated.
  v1::RowChunk bad = ChunkOf(b, 24, 48);
  bad.set_targets(3, static_cast<int32_t>(kVocab));
  grpc::Status st = Stream(*stub, "fb", Accumulating(), {ChunkOf(b, 0, 24), bad});
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  ExpectSameBits(StateOf(*ts, *stub), before, "a refused second chunk");

  // Every chunk computed, then the declared count is wrong (REDUCTION_MEAN).
  int64_t valid = 0;
  for (int32_t y : b.targets) valid += y != -100;
  v1::RequestHeader mean = Accumulating(v1::REDUCTION_MEAN);
  mean.set_num_valid_tokens(valid + 5);
  st = Stream(*stub, "fb", mean, {ChunkOf(b, 0, 24), ChunkOf(b, 24, 48)});
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  ExpectSameBits(StateOf(*ts, *stub), before, "a wrong num_valid_tokens");

  // Cancelled by the client after the first chunk's answer.
  st = Stream(*stub, "fb", Accumulating(), {ChunkOf(b, 0, 24), ChunkOf(b, 24, 48)}, /*cancel_after_first=*/true);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::CANCELLED) << st.error_message();
  ExpectSameBits(StateOf(*ts, *stub), before, "a cancelled request");

  // PolicyLoss whose declared sequence length is not what came.
  v1::RequestHeader pl = Accumulating(v1::REDUCTION_UNSPECIFIED);
  pl.clear_reduction();
  pl.mutable_policy()->set_clip_low(0.2f);
  pl.mutable_policy()->set_clip_high(0.28f);
  pl.mutable_policy()->add_sequence_valid_tokens(valid + 1);
  std::vector<v1::RowChunk> pl_chunks = {ChunkOf(b, 0, 24), ChunkOf(b, 24, 48)};
  for (v1::RowChunk& c : pl_chunks) {
    for (int i = 0; i < c.targets_size(); ++i) {
      c.add_old_logprobs(-8.0f);
      c.add_advantages(i % 2 ? 1.0f : -0.5f);
    }
  }
  st = Stream(*stub, "pl", pl, pl_chunks);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  ExpectSameBits(StateOf(*ts, *stub), before, "a PolicyLoss with a wrong sequence length");

  // An UpdateWeights cut short, and an OptimizerStep with a learning rate that is no number.
  {
    grpc::ClientContext ctx;
    v1::HeadDescription out;
    auto writer = stub->UpdateWeights(&ctx, &out);
    v1::UpdateWeightsRequest m;
    m.mutable_header()->set_head("wide");
    writer->Write(m);
    m.Clear();
    v1::TensorChunk* c = m.mutable_chunk();
    c->set_first_row(0);
    c->set_rows(10);
    c->set_cols(kHidden);
    c->set_rows_total(kVocab);
    c->set_dtype(v1::DTYPE_FLOAT32);
    c->set_data(std::string(10 * kHidden * 4, '\0'));
    writer->Write(m);
    writer->WritesDone();
    EXPECT_FALSE(writer->Finish().ok());
  }
  ExpectSameBits(StateOf(*ts, *stub), before, "an UpdateWeights cut short");
  {
    grpc::ClientContext ctx;
    v1::OptimizerStepRequest req;
    req.set_head("wide");
    req.set_lr(std::nanf(""));
    v1::OptimizerStepResponse resp;
    EXPECT_FALSE(stub->OptimizerStep(&ctx, req, &resp).ok());
  }
  ExpectSameBits(StateOf(*ts, *stub), before, "a refused OptimizerStep");

  // The head trains on with the bits of a server that only saw the requests that succeeded.
  auto ref = StartTestServer();
  auto ref_stub = RawStub(ref->target);
  for (TestServer* server : {ts.get(), ref.get()}) {
    auto& s = server == ts.get() ? *stub : *ref_stub;
    if (server == ref.get()) ASSERT_TRUE(Stream(s, "fb", Accumulating(), {ChunkOf(a, 0, 48)}).ok());
    ASSERT_TRUE(Stream(s, "fb", Accumulating(), {ChunkOf(b, 0, 24), ChunkOf(b, 24, 48)}).ok());
    grpc::ClientContext ctx;
    v1::OptimizerStepRequest req;
    req.set_head("wide");
    req.set_lr(1e-2f);
    v1::OptimizerStepResponse resp;
    ASSERT_TRUE(s.OptimizerStep(&ctx, req, &resp).ok());
  }
  ExpectSameBits(StateOf(*ts, *stub), StateOf(*ref, *ref_stub), "training on");
}

}  // namespace
}  // namespace lce::e2e
