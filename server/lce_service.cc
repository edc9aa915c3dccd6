#include "lce_service.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "grpc_status.h"

namespace lce::server {
namespace {

v1::DType ToWire(DType d) {
  switch (d) {
    case DType::kFloat32: return v1::DTYPE_FLOAT32;
    case DType::kBFloat16: return v1::DTYPE_BFLOAT16;
    case DType::kFloat16: return v1::DTYPE_FLOAT16;
  }
  return v1::DTYPE_UNSPECIFIED;
}

void Describe(const ServedHead& head, v1::HeadDescription* out) {
  const HeadShape& s = head.engine->shape();
  out->set_name(head.name);
  out->set_vocab_size(s.vocab_size);
  out->set_hidden_size(s.hidden_size);
  out->set_dtype(ToWire(s.dtype));
  out->set_version(head.version);
  out->set_has_bias(s.has_bias);
}

// Points a repeated float field at `n` new zeroed elements and returns their storage.
float* Grow(google::protobuf::RepeatedField<float>* field, int64_t n) {
  field->Resize(static_cast<int>(n), 0.0f);
  return field->mutable_data();
}

// Holds one admission slot for the life of a stream.
class StreamSlot {
 public:
  StreamSlot(std::atomic<int64_t>& counter, int64_t limit) : counter_(counter) {
    admitted_ = counter_.fetch_add(1) < limit || limit <= 0;
  }
  ~StreamSlot() { counter_.fetch_sub(1); }
  bool admitted() const { return admitted_; }

 private:
  std::atomic<int64_t>& counter_;
  bool admitted_;
};

}  // namespace

absl::Status LceService::Authenticate(grpc::ServerContext* ctx, Access access) const {
  if (!config_.auth.enabled()) return absl::OkStatus();
  const auto& md = ctx->client_metadata();
  auto it = md.find("authorization");
  const std::string value = it == md.end() ? std::string() : std::string(it->second.data(), it->second.size());
  return config_.auth.Check(value, access);
}

grpc::Status LceService::GetInfo(grpc::ServerContext* ctx, const v1::GetInfoRequest* req, v1::GetInfoResponse* resp) {
  if (absl::Status s = Authenticate(ctx, Access::kScoring); !s.ok()) return ToGrpcStatus(s);
  absl::StatusOr<std::shared_ptr<const ServedHead>> head = heads_->Get(req->head());
  if (!head.ok()) return ToGrpcStatus(head.status());
  Describe(**head, resp->mutable_head());
  for (const auto& h : heads_->List()) Describe(*h, resp->add_heads());
  resp->set_backend(std::string((*head)->engine->backend()));
  resp->set_tp_size(config_.tp_size);
  resp->set_max_message_bytes(config_.max_message_bytes);
  resp->set_max_rows_per_request(config_.limits.max_rows_per_request);
  resp->set_server_version(LCE_SERVE_VERSION);
  return grpc::Status::OK;
}

grpc::Status LceService::Score(grpc::ServerContext* ctx,
                               grpc::ServerReaderWriter<v1::StreamResponse, v1::StreamRequest>* stream) {
  return RunStream(RpcKind::kScore, ctx, stream);
}
grpc::Status LceService::ForwardBackward(grpc::ServerContext* ctx,
                                         grpc::ServerReaderWriter<v1::StreamResponse, v1::StreamRequest>* stream) {
  return RunStream(RpcKind::kForwardBackward, ctx, stream);
}
grpc::Status LceService::Backward(grpc::ServerContext* ctx,
                                  grpc::ServerReaderWriter<v1::StreamResponse, v1::StreamRequest>* stream) {
  return RunStream(RpcKind::kBackward, ctx, stream);
}

grpc::Status LceService::RunStream(RpcKind rpc, grpc::ServerContext* ctx,
                                   grpc::ServerReaderWriter<v1::StreamResponse, v1::StreamRequest>* stream) {
  if (absl::Status s = Authenticate(ctx, Access::kScoring); !s.ok()) return ToGrpcStatus(s);
  StreamSlot slot(streams_in_flight_, config_.max_concurrent_streams);
  if (!slot.admitted()) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrCat("server is at its limit of ", config_.max_concurrent_streams,
                                     " concurrent streams; retry later"));
  }
  StreamRequestValidator validator(rpc, *heads_, config_.limits);
  v1::StreamRequest msg;
  if (!stream->Read(&msg)) {
    if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "client cancelled");
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "empty request: expected a header message first");
  }
  if (!msg.has_header()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "the first message of a request must be a header");
  }
  absl::StatusOr<RequestPlan> plan = validator.ValidateHeader(msg.header());
  if (!plan.ok()) return ToGrpcStatus(plan.status());
  LceEngine& engine = *plan->head->engine;
  const HeadShape& shape = engine.shape();
  const bool is_fb = rpc == RpcKind::kForwardBackward;
  const bool is_bw = rpc == RpcKind::kBackward;
  const int64_t row_bytes = shape.hidden_size * DTypeSize(shape.dtype);

  int64_t rows_seen = 0, valid_seen = 0, chunk_index = 0, bytes_seen = 0;
  double loss_sum = 0.0;
  std::vector<float> loss_buf, grad_buf;
  v1::StreamResponse resp;
  while (stream->Read(&msg)) {
    if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "client cancelled");
    if (msg.has_header()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("repeated header (message ", chunk_index + 1, "): a request has exactly one"));
    }
    if (!msg.has_chunk()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("message ", chunk_index + 1, " is neither a header nor a chunk"));
    }
    const v1::RowChunk& chunk = msg.chunk();
    absl::StatusOr<int64_t> rows = validator.ValidateChunk(*plan, chunk, chunk_index, rows_seen);
    if (!rows.ok()) return ToGrpcStatus(rows.status());
    const int64_t n = *rows;
    bytes_seen += static_cast<int64_t>(chunk.hidden().size());
    if (config_.max_request_bytes > 0 && bytes_seen > config_.max_request_bytes) {
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          absl::StrCat("chunk ", chunk_index, ": request exceeds ", config_.max_request_bytes,
                                       " bytes of hidden states, the server's limit per request"));
    }
    int64_t valid = 0;
    for (int32_t y : chunk.targets()) valid += y != plan->options.ignore_index ? 1 : 0;

    resp.Clear();
    v1::ChunkResult* out = resp.mutable_chunk();
    out->set_first_row(rows_seen);
    out->set_rows(n);
    RowOutputs row_out;
    if (plan->want_logprobs) row_out.logprob = Grow(out->mutable_logprobs(), n);
    if (plan->want_entropy) row_out.entropy = Grow(out->mutable_entropy(), n);
    if (is_fb) {
      loss_buf.assign(n, 0.0f);
      row_out.loss = loss_buf.data();
    }
    Upstream up;
    GradOutputs grads;
    if (is_fb || is_bw) {
      std::string* dh = out->mutable_d_hidden();
      dh->resize(static_cast<size_t>(n * row_bytes));
      grads.d_hidden = dh->data();
    }
    if (is_fb) {
      up.mode = GradMode::kLoss;
      if (plan->reduction == v1::REDUCTION_NONE) {
        up.grad_loss = chunk.grad_loss_size() > 0 ? chunk.grad_loss().data() : nullptr;
      } else if (plan->reduction == v1::REDUCTION_MEAN) {
        const float g = plan->declared_valid_tokens > 0 ? 1.0f / static_cast<float>(plan->declared_valid_tokens) : 0.0f;
        grad_buf.assign(n, g);
        up.grad_loss = grad_buf.data();
      }
    } else if (is_bw) {
      up.mode = GradMode::kGeneric;
      up.grad_logprob = chunk.grad_logprob_size() > 0 ? chunk.grad_logprob().data() : nullptr;
      up.grad_entropy = chunk.grad_entropy_size() > 0 ? chunk.grad_entropy().data() : nullptr;
    }
    RowsView view{chunk.hidden().data(), chunk.targets().data(), n, MemorySpace::kHost};
    absl::Status s = engine.Compute(view, plan->options, up, row_out, grads);
    if (!s.ok()) {
      return ToGrpcStatus(absl::Status(s.code(), absl::StrCat("chunk ", chunk_index, " (rows ", rows_seen, "..",
                                                              rows_seen + n - 1, "): ", s.message())));
    }
    if (is_fb) {
      for (float l : loss_buf) loss_sum += l;
      if (plan->want_loss) out->mutable_loss()->Add(loss_buf.begin(), loss_buf.end());
    }
    rows_seen += n;
    valid_seen += valid;
    ++chunk_index;
    if (!stream->Write(resp)) return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
  }
  if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "client cancelled");
  if (rows_seen == 0) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "request has a header but no rows");
  }
  if (is_fb) {
    if (plan->reduction == v1::REDUCTION_MEAN && plan->declared_valid_tokens != valid_seen) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("header.num_valid_tokens declared ", plan->declared_valid_tokens,
                                       " but the request has ", valid_seen,
                                       " non-ignored rows; the returned d_hidden is wrong, discard it"));
    }
    resp.Clear();
    v1::RequestSummary* sum = resp.mutable_summary();
    sum->set_rows(rows_seen);
    sum->set_valid_tokens(valid_seen);
    sum->set_loss(plan->reduction == v1::REDUCTION_MEAN ? (valid_seen > 0 ? loss_sum / valid_seen : 0.0) : loss_sum);
    sum->set_head_version(plan->head->version);
    if (!stream->Write(resp)) return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
  }
  return grpc::Status::OK;
}

}  // namespace lce::server
