// Training RPCs of LceService: heads by name and version, the fp32 gradient buffer, AdamW steps on
// fp32 master weights, weight updates streamed by a trainer, and saving heads as safetensors.
// Every new weight becomes a new head version; requests in flight keep the version they started on.
#include <cmath>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "grpc_status.h"
#include "head_source.h"
#include "lce/numeric.h"
#include "lce/training.h"
#include "lce_service.h"
#include "nlohmann/json.hpp"
#include "safetensors.h"
#include "wire_types.h"

namespace lce::server {
namespace {

// A new HeadWeights like `base` (shape, bias) with the weight taken from fp32 values.
std::shared_ptr<HeadWeights> WeightsFromFloat(const HeadWeights& base, const std::vector<float>& values) {
  auto w = std::make_shared<HeadWeights>();
  w->shape = base.shape;
  w->bias = base.bias;
  w->weight.resize(base.weight.size());
  ConvertFromFloat(values.data(), static_cast<int64_t>(values.size()), base.shape.dtype, w->weight.data());
  return w;
}

}  // namespace

absl::StatusOr<std::shared_ptr<const ServedHead>> LceService::TrainableHead(const std::string& name) const {
  if (config_.tp_size > 1) {
    return absl::UnimplementedError("training RPCs on a tensor-parallel group are not supported yet");
  }
  if (!config_.make_engine) return absl::FailedPreconditionError("this server cannot build new head versions");
  return heads_->Get(name);
}

grpc::Status LceService::LoadHead(grpc::ServerContext* ctx, const v1::LoadHeadRequest* req, v1::HeadDescription* resp) {
  return Recorded("LoadHead", ctx, [&]() -> grpc::Status {
    if (absl::Status s = Authenticate(ctx, Access::kAdmin); !s.ok()) return ToGrpcStatus(s);
    if (config_.tp_size > 1) return ToGrpcStatus(absl::UnimplementedError("LoadHead on a tensor-parallel group is not supported yet"));
    if (!config_.make_engine) return ToGrpcStatus(absl::FailedPreconditionError("this server cannot build heads"));
    if (req->name().empty()) return ToGrpcStatus(absl::InvalidArgumentError("LoadHead needs a name"));
    std::shared_ptr<const HeadWeights> weights;
    switch (req->source_case()) {
      case v1::LoadHeadRequest::kCloneOf: {
        absl::StatusOr<std::shared_ptr<const ServedHead>> src = heads_->Get(req->clone_of());
        if (!src.ok()) return ToGrpcStatus(src.status());
        weights = (*src)->weights;
        break;
      }
      case v1::LoadHeadRequest::kSafetensorsFile:
      case v1::LoadHeadRequest::kSeeded: {
        HeadSource source;
        if (req->has_seeded()) {
          source.seed_vocab = req->seeded().vocab_size();
          source.seed_hidden = req->seeded().hidden_size();
          source.seed = req->seeded().seed();
          absl::StatusOr<DType> d = FromWire(req->seeded().dtype());
          if (!d.ok()) return ToGrpcStatus(d.status());
          source.dtype = *d;
        } else {
          source.file = req->safetensors_file();
          if (!req->tensor().empty()) source.tensor = req->tensor();
        }
        absl::StatusOr<std::shared_ptr<HeadWeights>> w = lce::server::LoadHead(source, 0, 1);
        if (!w.ok()) return ToGrpcStatus(w.status());
        weights = std::move(*w);
        break;
      }
      default:
        return ToGrpcStatus(absl::InvalidArgumentError("LoadHead needs a source: safetensors_file, clone_of or seeded"));
    }
    absl::StatusOr<std::shared_ptr<LceEngine>> engine = config_.make_engine(weights);
    if (!engine.ok()) return ToGrpcStatus(engine.status());
    absl::StatusOr<std::shared_ptr<const ServedHead>> put = heads_->Put(req->name(), std::move(*engine), weights);
    if (!put.ok()) return ToGrpcStatus(put.status());
    DescribeHead(**put, resp);
    return grpc::Status::OK;
  });
}

grpc::Status LceService::ZeroGrad(grpc::ServerContext* ctx, const v1::ZeroGradRequest* req, v1::ZeroGradResponse*) {
  return Recorded("ZeroGrad", ctx, [&]() -> grpc::Status {
    if (absl::Status s = Authenticate(ctx, Access::kAdmin); !s.ok()) return ToGrpcStatus(s);
    absl::StatusOr<std::shared_ptr<const ServedHead>> head = TrainableHead(req->head());
    if (!head.ok()) return ToGrpcStatus(head.status());
    HeadTrainingState& t = *(*head)->training;
    std::lock_guard<std::mutex> lock(t.mu);
    std::fill(t.grad.begin(), t.grad.end(), 0.0f);
    return grpc::Status::OK;
  });
}

grpc::Status LceService::GetGrad(grpc::ServerContext* ctx, const v1::GetGradRequest* req,
                                 grpc::ServerWriter<v1::TensorChunk>* writer) {
  return Recorded("GetGrad", ctx, [&]() -> grpc::Status {
    if (absl::Status s = Authenticate(ctx, Access::kAdmin); !s.ok()) return ToGrpcStatus(s);
    absl::StatusOr<std::shared_ptr<const ServedHead>> head = TrainableHead(req->head());
    if (!head.ok()) return ToGrpcStatus(head.status());
    const HeadShape& shape = (*head)->engine->shape();
    HeadTrainingState& t = *(*head)->training;
    const int64_t H = shape.hidden_size;
    const int64_t rows_per_chunk = std::max<int64_t>(1, (config_.max_message_bytes / 2) / (H * 4));
    std::vector<float> copy;
    {
      std::lock_guard<std::mutex> lock(t.mu);
      copy = t.grad;
    }
    v1::TensorChunk chunk;
    for (int64_t r0 = 0; r0 < shape.shard_rows; r0 += rows_per_chunk) {
      if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "client cancelled");
      const int64_t n = std::min(rows_per_chunk, shape.shard_rows - r0);
      chunk.set_first_row(shape.vocab_begin + r0);
      chunk.set_rows(n);
      chunk.set_cols(H);
      chunk.set_rows_total(shape.vocab_size);
      chunk.set_dtype(v1::DTYPE_FLOAT32);
      chunk.set_data(reinterpret_cast<const char*>(copy.data() + r0 * H), static_cast<size_t>(n * H * 4));
      if (!writer->Write(chunk)) return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
    }
    return grpc::Status::OK;
  });
}

grpc::Status LceService::OptimizerStep(grpc::ServerContext* ctx, const v1::OptimizerStepRequest* req,
                                       v1::OptimizerStepResponse* resp) {
  return Recorded("OptimizerStep", ctx, [&]() -> grpc::Status {
    if (absl::Status s = Authenticate(ctx, Access::kAdmin); !s.ok()) return ToGrpcStatus(s);
    absl::StatusOr<std::shared_ptr<const ServedHead>> head = TrainableHead(req->head());
    if (!head.ok()) return ToGrpcStatus(head.status());
    AdamWParams p;
    p.lr = req->lr();
    p.beta1 = req->beta1() == 0.0f ? 0.9f : req->beta1();
    p.beta2 = req->beta2() == 0.0f ? 0.999f : req->beta2();
    p.eps = req->eps() == 0.0f ? 1e-8f : req->eps();
    p.weight_decay = req->weight_decay();
    if (!(p.lr >= 0.0f) || !(p.beta1 >= 0.0f && p.beta1 < 1.0f) || !(p.beta2 >= 0.0f && p.beta2 < 1.0f) ||
        !(p.eps > 0.0f) || !(p.weight_decay >= 0.0f) || !(req->max_grad_norm() >= 0.0f)) {
      return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
          "bad AdamW hyper-parameters: lr=", p.lr, " betas=(", p.beta1, ", ", p.beta2, ") eps=", p.eps,
          " weight_decay=", p.weight_decay, " max_grad_norm=", req->max_grad_norm())));
    }
    const ServedHead& h = **head;
    HeadTrainingState& t = *h.training;
    std::shared_ptr<HeadWeights> next;
    double norm = 0;
    {
      std::lock_guard<std::mutex> lock(t.mu);
      const int64_t n = static_cast<int64_t>(t.grad.size());
      if (t.master.empty()) {  // first step: fp32 master weights from the current weight
        t.master.resize(n);
        ConvertToFloat(h.weights->weight.data(), h.weights->shape.dtype, n, t.master.data());
        t.exp_avg.assign(n, 0.0f);
        t.exp_avg_sq.assign(n, 0.0f);
      }
      norm = std::sqrt(SquaredNorm(t.grad.data(), n));
      float scale = 1.0f;
      if (req->max_grad_norm() > 0.0f && norm > req->max_grad_norm()) {
        scale = static_cast<float>(req->max_grad_norm() / (norm + 1e-6));  // as torch's clip_grad_norm_
      }
      ++t.step;
      AdamWStep(t.master.data(), t.exp_avg.data(), t.exp_avg_sq.data(), t.grad.data(), n, p, t.step, scale);
      next = WeightsFromFloat(*h.weights, t.master);
      if (req->zero_grad()) std::fill(t.grad.begin(), t.grad.end(), 0.0f);
      resp->set_step(t.step);
    }
    absl::StatusOr<std::shared_ptr<LceEngine>> engine = config_.make_engine(next);
    if (!engine.ok()) return ToGrpcStatus(engine.status());
    absl::StatusOr<std::shared_ptr<const ServedHead>> put = heads_->Put(h.name, std::move(*engine), next);
    if (!put.ok()) return ToGrpcStatus(put.status());
    resp->set_grad_norm(norm);
    DescribeHead(**put, resp->mutable_head());
    return grpc::Status::OK;
  });
}

grpc::Status LceService::UpdateWeights(grpc::ServerContext* ctx, grpc::ServerReader<v1::UpdateWeightsRequest>* reader,
                                       v1::HeadDescription* resp) {
  return Recorded("UpdateWeights", ctx, [&]() -> grpc::Status {
    if (absl::Status s = Authenticate(ctx, Access::kAdmin); !s.ok()) return ToGrpcStatus(s);
    v1::UpdateWeightsRequest msg;
    if (!reader->Read(&msg) || !msg.has_header()) {
      return ToGrpcStatus(absl::InvalidArgumentError("UpdateWeights starts with a header message"));
    }
    const v1::UpdateWeightsHeader header = msg.header();
    absl::StatusOr<std::shared_ptr<const ServedHead>> head = TrainableHead(header.head());
    if (!head.ok()) return ToGrpcStatus(head.status());
    const ServedHead& h = **head;
    const HeadShape& shape = h.weights->shape;
    const int64_t row_bytes = shape.hidden_size * DTypeSize(shape.dtype);
    auto next = std::make_shared<HeadWeights>();
    next->shape = shape;
    next->bias = h.weights->bias;
    next->weight.reserve(h.weights->weight.size());
    int64_t rows = 0;
    while (reader->Read(&msg)) {
      if (!msg.has_chunk()) return ToGrpcStatus(absl::InvalidArgumentError("UpdateWeights: repeated header"));
      const v1::TensorChunk& c = msg.chunk();
      absl::StatusOr<DType> dtype = FromWire(c.dtype());
      if (!dtype.ok() || *dtype != shape.dtype || c.cols() != shape.hidden_size || c.first_row() != rows ||
          c.rows() <= 0 || rows + c.rows() > shape.vocab_size ||
          static_cast<int64_t>(c.data().size()) != c.rows() * row_bytes) {
        return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
            "UpdateWeights chunk at row ", c.first_row(), ": expected rows from ", rows, " of a [", shape.vocab_size, ", ",
            shape.hidden_size, "] ", DTypeName(shape.dtype), " weight, got ", c.rows(), " rows x ", c.cols(), " cols, ",
            c.data().size(), " bytes")));
      }
      next->weight.insert(next->weight.end(), c.data().begin(), c.data().end());
      rows += c.rows();
    }
    if (rows != shape.vocab_size) {
      return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat("UpdateWeights sent ", rows, " rows of ", shape.vocab_size)));
    }
    absl::StatusOr<std::shared_ptr<LceEngine>> engine = config_.make_engine(next);
    if (!engine.ok()) return ToGrpcStatus(engine.status());
    {
      // The optimizer's master weights follow the new weight; its moments are kept.
      HeadTrainingState& t = *h.training;
      std::lock_guard<std::mutex> lock(t.mu);
      if (!t.master.empty()) ConvertToFloat(next->weight.data(), shape.dtype, static_cast<int64_t>(t.master.size()), t.master.data());
    }
    absl::StatusOr<std::shared_ptr<const ServedHead>> put = heads_->Put(h.name, std::move(*engine), next, header.expected_version());
    if (!put.ok()) return ToGrpcStatus(put.status());
    DescribeHead(**put, resp);
    return grpc::Status::OK;
  });
}

grpc::Status LceService::SaveHead(grpc::ServerContext* ctx, const v1::SaveHeadRequest* req, v1::SaveHeadResponse* resp) {
  return Recorded("SaveHead", ctx, [&]() -> grpc::Status {
    if (absl::Status s = Authenticate(ctx, Access::kAdmin); !s.ok()) return ToGrpcStatus(s);
    absl::StatusOr<std::shared_ptr<const ServedHead>> head = TrainableHead(req->head());
    if (!head.ok()) return ToGrpcStatus(head.status());
    if (req->directory().empty()) return ToGrpcStatus(absl::InvalidArgumentError("SaveHead needs a directory"));
    const ServedHead& h = **head;
    absl::StatusOr<std::vector<std::string>> files = SaveShardedHead(req->directory(), h.name, {h.weights.get()});
    if (!files.ok()) return ToGrpcStatus(files.status());
    for (size_t i = 0; i + 1 < files->size(); ++i) resp->add_files((*files)[i]);
    resp->set_index_file(files->back());
    return grpc::Status::OK;
  });
}

}  // namespace lce::server
