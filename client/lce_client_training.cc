// The C++ client's training RPCs: LoadHead, ZeroGrad, GetGrad, OptimizerStep, UpdateWeights,
// SaveHead. They all go to the front (ClientOptions.target's first server) with the admin token.
#include <cstring>

#include "absl/strings/str_cat.h"
#include "lce/client/lce_client.h"
#include "replica.h"

namespace lce::client {
namespace {

// Checks one GetGrad block against the gradient's shape so far (set by the first block).
absl::Status CheckGradBlock(const v1::TensorChunk& c, const Gradient& g) {
  if (c.dtype() != v1::DTYPE_FLOAT32) {
    return absl::InternalError(absl::StrCat("GetGrad sent a block of ", v1::DType_Name(c.dtype()), ", not fp32"));
  }
  if (c.cols() != g.cols || c.rows_total() != g.rows || c.first_row() < 0 || c.rows() < 0 ||
      c.first_row() > g.rows - c.rows() || static_cast<int64_t>(c.data().size()) != c.rows() * c.cols() * 4) {
    return absl::InternalError(absl::StrCat("GetGrad block of rows [", c.first_row(), ", ", c.first_row() + c.rows(),
                                            ") x ", c.cols(), " with ", c.data().size(),
                                            " bytes does not fit a gradient of ", g.rows, " x ", g.cols));
  }
  return absl::OkStatus();
}

// A unary call of `stub`: its response, or its status.
template <typename Request, typename Response>
absl::StatusOr<Response> Unary(grpc::Status (v1::LceService::Stub::*rpc)(grpc::ClientContext*, const Request&, Response*),
                               v1::LceService::Stub& stub, grpc::ClientContext& ctx, const Request& request) {
  Response response;
  if (grpc::Status s = (stub.*rpc)(&ctx, request, &response); !s.ok()) return ToAbsl(s);
  return response;
}

}  // namespace

absl::StatusOr<v1::HeadDescription> LceClient::LoadHead(const v1::LoadHeadRequest& request) {
  grpc::ClientContext ctx;
  Prepare(&ctx, /*admin=*/true);
  return Unary(&v1::LceService::Stub::LoadHead, *front_->stub, ctx, request);
}

absl::Status LceClient::ZeroGrad(const std::string& head) {
  grpc::ClientContext ctx;
  Prepare(&ctx, /*admin=*/true);
  v1::ZeroGradRequest req;
  req.set_head(head);
  return Unary(&v1::LceService::Stub::ZeroGrad, *front_->stub, ctx, req).status();
}

absl::Status LceClient::CommitGrad(const std::string& head, uint64_t pending_grad, float scale, bool discard) {
  grpc::ClientContext ctx;
  Prepare(&ctx, /*admin=*/false);  // the scoring token, as the request that made it
  v1::CommitGradRequest req;
  req.set_head(head);
  req.set_pending_grad_id(pending_grad);
  req.set_discard(discard);
  if (!discard) req.set_scale(scale);
  return Unary(&v1::LceService::Stub::CommitGrad, *front_->stub, ctx, req).status();
}

absl::StatusOr<Gradient> LceClient::GetGrad(const std::string& head, bool bias) {
  grpc::ClientContext ctx;
  Prepare(&ctx, /*admin=*/true);
  v1::GetGradRequest req;
  req.set_head(head);
  req.set_bias(bias);
  std::unique_ptr<grpc::ClientReader<v1::TensorChunk>> reader = front_->stub->GetGrad(&ctx, req);
  Gradient g;
  int64_t covered = 0;
  bool first = true;
  absl::Status shape_error;
  v1::TensorChunk c;
  while (shape_error.ok() && reader->Read(&c)) {
    if (first) {
      g.rows = c.rows_total();
      g.cols = c.cols();
      g.values.assign(static_cast<size_t>(g.rows * g.cols), 0.0f);
      first = false;
    }
    shape_error = CheckGradBlock(c, g);
    if (!shape_error.ok()) break;
    std::memcpy(g.values.data() + c.first_row() * g.cols, c.data().data(), c.data().size());
    covered += c.rows();
  }
  if (!shape_error.ok()) {
    ctx.TryCancel();
    while (reader->Read(&c)) {
    }
  }
  grpc::Status s = reader->Finish();
  if (!shape_error.ok()) return shape_error;
  if (!s.ok()) return ToAbsl(s);
  if (covered != g.rows) {
    return absl::InternalError(absl::StrCat("GetGrad sent ", covered, " of the gradient's ", g.rows, " rows"));
  }
  return g;
}

absl::StatusOr<v1::OptimizerStepResponse> LceClient::OptimizerStep(const v1::OptimizerStepRequest& request) {
  grpc::ClientContext ctx;
  Prepare(&ctx, /*admin=*/true);
  return Unary(&v1::LceService::Stub::OptimizerStep, *front_->stub, ctx, request);
}

absl::StatusOr<v1::HeadDescription> LceClient::UpdateWeights(const std::string& head, const WeightTensor& weight,
                                                             int64_t expected_version) {
  const int64_t row_bytes = weight.cols * WireDTypeSize(weight.dtype);
  if (row_bytes <= 0 || weight.rows <= 0 || static_cast<int64_t>(weight.bytes.size()) != weight.rows * row_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("a weight of ", weight.rows, " x ", weight.cols, " ",
                                                   v1::DType_Name(weight.dtype), " needs ", weight.rows * row_bytes,
                                                   " bytes; got ", weight.bytes.size()));
  }
  grpc::ClientContext ctx;
  Prepare(&ctx, /*admin=*/true);
  v1::HeadDescription resp;
  std::unique_ptr<grpc::ClientWriter<v1::UpdateWeightsRequest>> writer = front_->stub->UpdateWeights(&ctx, &resp);
  v1::UpdateWeightsRequest msg;
  msg.mutable_header()->set_head(head);
  msg.mutable_header()->set_expected_version(expected_version);
  msg.mutable_header()->mutable_bias()->Add(weight.bias.begin(), weight.bias.end());
  bool open = writer->Write(msg);
  const int64_t step = std::max<int64_t>(1, options_.chunk_bytes / row_bytes);
  for (int64_t r = 0; open && r < weight.rows; r += step) {
    const int64_t n = std::min(step, weight.rows - r);
    msg.Clear();
    v1::TensorChunk* c = msg.mutable_chunk();
    c->set_first_row(r);
    c->set_rows(n);
    c->set_cols(weight.cols);
    c->set_rows_total(weight.rows);
    c->set_dtype(weight.dtype);
    c->set_data(reinterpret_cast<const char*>(weight.bytes.data()) + r * row_bytes, static_cast<size_t>(n * row_bytes));
    open = writer->Write(msg);  // false: the server ended the call; Finish says why
  }
  if (open) writer->WritesDone();
  if (grpc::Status s = writer->Finish(); !s.ok()) return ToAbsl(s);
  return resp;
}

absl::StatusOr<v1::SaveHeadResponse> LceClient::SaveHead(const std::string& head, const std::string& directory) {
  grpc::ClientContext ctx;
  Prepare(&ctx, /*admin=*/true);
  v1::SaveHeadRequest req;
  req.set_head(head);
  req.set_directory(directory);
  return Unary(&v1::LceService::Stub::SaveHead, *front_->stub, ctx, req);
}

}  // namespace lce::client
