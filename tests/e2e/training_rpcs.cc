#include "training_rpcs.h"

#include <cmath>
#include <cstring>

#include "grpcpp/client_context.h"
#include "gtest/gtest.h"

namespace lce::e2e {

grpc::Status RunOneChunk(v1::LceService::Stub& stub, const std::string& rpc, const v1::RequestHeader& header,
                         const Batch& b, std::vector<v1::StreamResponse>* out) {
  grpc::ClientContext ctx;
  auto s = rpc == "score" ? stub.Score(&ctx) : rpc == "bw" ? stub.Backward(&ctx) : stub.ForwardBackward(&ctx);
  v1::StreamRequest m;
  *m.mutable_header() = header;
  s->Write(m);
  m.Clear();
  m.mutable_chunk()->set_hidden(b.hidden.data(), b.hidden.size());
  for (int32_t y : b.targets) m.mutable_chunk()->add_targets(y);
  // A Backward's upstream gradient of logprob_i: -1 for a target, so that dW and d_hidden are those of
  // the sum of the cross-entropy losses, as a ForwardBackward of REDUCTION_SUM.
  if (rpc == "bw") {
    const int32_t ignore = header.has_ignore_index() ? header.ignore_index() : -100;
    for (int32_t y : b.targets) m.mutable_chunk()->add_grad_logprob(y == ignore ? 0.0f : -1.0f);
  }
  s->Write(m);
  s->WritesDone();
  v1::StreamResponse r;
  while (s->Read(&r)) out->push_back(r);
  return s->Finish();
}

grpc::Status UpdateWeightsRpc(v1::LceService::Stub& stub, const std::string& head, const std::vector<float>& weight,
                              int64_t expected_version, v1::HeadDescription* out, const std::vector<float>& bias) {
  grpc::ClientContext ctx;
  auto writer = stub.UpdateWeights(&ctx, out);
  v1::UpdateWeightsRequest m;
  m.mutable_header()->set_head(head);
  m.mutable_header()->set_expected_version(expected_version);
  m.mutable_header()->mutable_bias()->Assign(bias.begin(), bias.end());
  writer->Write(m);
  for (int64_t r0 = 0; r0 < kVocab; r0 += 700) {
    const int64_t n = std::min<int64_t>(700, kVocab - r0);
    m.Clear();
    v1::TensorChunk* c = m.mutable_chunk();
    c->set_first_row(r0);
    c->set_rows(n);
    c->set_cols(kHidden);
    c->set_rows_total(kVocab);
    c->set_dtype(v1::DTYPE_FLOAT32);
    c->set_data(reinterpret_cast<const char*>(weight.data() + r0 * kHidden), n * kHidden * 4);
    writer->Write(m);
  }
  writer->WritesDone();
  return writer->Finish();
}

std::vector<float> GradOf(v1::LceService::Stub& stub, const std::string& head, uint64_t pending, bool bias) {
  grpc::ClientContext ctx;
  v1::GetGradRequest req;
  req.set_head(head);
  req.set_pending_grad_id(pending);
  req.set_bias(bias);
  auto reader = stub.GetGrad(&ctx, req);
  const int64_t cols = bias ? 1 : kHidden;
  std::vector<float> g(kVocab * cols, std::nanf(""));
  int64_t next = 0;
  v1::TensorChunk c;
  while (reader->Read(&c)) {
    EXPECT_EQ(c.first_row(), next) << "GetGrad sends the rows in order";
    EXPECT_EQ(c.cols(), cols);
    EXPECT_EQ(static_cast<int64_t>(c.data().size()), c.rows() * cols * 4);
    if (c.cols() != cols || c.first_row() + c.rows() > kVocab || c.data().size() != size_t(c.rows() * cols * 4))
      continue;
    next = c.first_row() + c.rows();
    std::memcpy(g.data() + c.first_row() * cols, c.data().data(), c.data().size());
  }
  grpc::Status st = reader->Finish();
  EXPECT_TRUE(st.ok()) << st.error_message();
  return g;
}

std::vector<float> CpuEngineLogprobs(const std::vector<float>& weight, const Batch& b) {
  auto w = std::make_shared<HeadWeights>();
  w->shape = {kVocab, kHidden, DType::kFloat32, 0, kVocab, false};
  w->weight.resize(weight.size() * 4);
  std::memcpy(w->weight.data(), weight.data(), w->weight.size());
  auto e = CreateEngine(Backend::kCpu, w, EngineConfig{});
  EXPECT_TRUE(e.ok());
  std::vector<float> lp(b.rows);
  RowsView rows{b.hidden.data(), b.targets.data(), b.rows, MemorySpace::kHost};
  EXPECT_TRUE((*e)->Compute(rows, LceOptions{}, {}, {lp.data(), nullptr, nullptr, nullptr}, {}).ok());
  return lp;
}

OpenScore::OpenScore(v1::LceService::Stub& stub, const std::string& head, const Batch& b) {
  stream_ = stub.Score(&ctx_);
  v1::StreamRequest m;
  m.mutable_header()->set_head(head);
  m.mutable_header()->set_hidden_size(kHidden);
  m.mutable_header()->set_dtype(v1::DTYPE_FLOAT32);
  EXPECT_TRUE(stream_->Write(m));
  chunk_.mutable_chunk()->set_hidden(b.hidden.data(), b.hidden.size());
  for (int32_t y : b.targets) chunk_.mutable_chunk()->add_targets(y);
  first_ = Again();
}

std::vector<float> OpenScore::Again() {
  v1::StreamResponse r;
  EXPECT_TRUE(stream_->Write(chunk_));
  EXPECT_TRUE(stream_->Read(&r));
  return {r.chunk().logprobs().begin(), r.chunk().logprobs().end()};
}

grpc::Status OpenScore::Finish() {
  stream_->WritesDone();
  v1::StreamResponse rest;
  while (stream_->Read(&rest)) {
  }
  return stream_->Finish();
}

}  // namespace lce::e2e
