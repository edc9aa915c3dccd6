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
  if (config_.tp_size > 1 && (config_.tp_front == nullptr || !config_.tp_front->trainable())) {
    return absl::UnimplementedError("training RPCs on a GPU tensor-parallel group are not supported yet");
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
        absl::StatusOr<std::shared_ptr<HeadWeights>> w = lce::server::LoadHead(source, 0, 1, config_.max_head_bytes);
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
    if (config_.tp_front != nullptr) return ToGrpcStatus(config_.tp_front->ZeroGradPeers());
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
    if (config_.tp_front != nullptr) {  // the other shards, in rank order
      absl::Status s = config_.tp_front->FetchPeerGrads([&](int64_t first, int64_t rows, const float* data) {
        for (int64_t r0 = 0; r0 < rows; r0 += rows_per_chunk) {
          const int64_t n = std::min(rows_per_chunk, rows - r0);
          chunk.set_first_row(first + r0);
          chunk.set_rows(n);
          chunk.set_data(reinterpret_cast<const char*>(data + r0 * H), static_cast<size_t>(n * H * 4));
          if (!writer->Write(chunk)) return absl::CancelledError("client went away");
        }
        return absl::OkStatus();
      });
      if (!s.ok()) return ToGrpcStatus(s);
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
    std::lock_guard<std::mutex> lock(t.mu);
    const int64_t n = static_cast<int64_t>(t.grad.size());
    if (t.master.empty()) {  // first step: fp32 master weights from the current weight
      t.master.resize(n);
      ConvertToFloat(h.weights->weight.data(), h.weights->shape.dtype, n, t.master.data());
      t.exp_avg.assign(n, 0.0f);
      t.exp_avg_sq.assign(n, 0.0f);
    }
    // Steps this rank's shard with the (global) clipping scale and builds its new engine.
    auto step_local = [&](float scale) -> absl::StatusOr<std::shared_ptr<LceEngine>> {
      ++t.step;
      AdamWStep(t.master.data(), t.exp_avg.data(), t.exp_avg_sq.data(), t.grad.data(), n, p, t.step, scale);
      next = WeightsFromFloat(*h.weights, t.master);
      return config_.make_engine(next);
    };
    const double local_sq = SquaredNorm(t.grad.data(), n);
    double norm = 0;
    std::shared_ptr<LceEngine> served;
    if (config_.tp_front != nullptr) {
      // Every rank steps its shard with the scale of the global norm; the front's engine object
      // stays (its local shard engine is replaced inside the group lock).
      absl::StatusOr<double> global = config_.tp_front->Step(p, req->max_grad_norm(), local_sq, step_local);
      if (!global.ok()) return ToGrpcStatus(global.status());
      norm = *global;
      served = h.engine;
    } else {
      norm = std::sqrt(local_sq);
      const float scale = req->max_grad_norm() > 0.0f && norm > req->max_grad_norm()
                              ? static_cast<float>(req->max_grad_norm() / (norm + 1e-6))  // as torch's clip_grad_norm_
                              : 1.0f;
      absl::StatusOr<std::shared_ptr<LceEngine>> engine = step_local(scale);
      if (!engine.ok()) return ToGrpcStatus(engine.status());
      served = std::move(*engine);
    }
    if (req->zero_grad()) {
      std::fill(t.grad.begin(), t.grad.end(), 0.0f);
      if (config_.tp_front != nullptr) {
        if (absl::Status s = config_.tp_front->ZeroGradPeers(); !s.ok()) return ToGrpcStatus(s);
      }
    }
    resp->set_step(t.step);
    absl::StatusOr<std::shared_ptr<const ServedHead>> put = heads_->Put(h.name, std::move(served), next);
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
    if (config_.tp_size > 1) {
      return ToGrpcStatus(absl::UnimplementedError("UpdateWeights on a tensor-parallel group is not supported yet"));
    }
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
    const int world = config_.tp_size;
    absl::StatusOr<std::string> shard = WriteHeadShard(req->directory(), h.name, *h.weights, 0, world);
    if (!shard.ok()) return ToGrpcStatus(shard.status());
    if (config_.tp_front != nullptr) {  // every peer writes its own shard
      if (absl::Status s = config_.tp_front->SaveShards(req->directory(), h.name); !s.ok()) return ToGrpcStatus(s);
    }
    absl::StatusOr<std::string> index = WriteHeadIndex(req->directory(), h.name, h.weights->shape, world);
    if (!index.ok()) return ToGrpcStatus(index.status());
    resp->add_files(*shard);
    for (int r = 1; r < world; ++r) {
      resp->add_files((std::filesystem::path(req->directory()) / ShardFileName(h.name, r, world)).string());
    }
    resp->set_index_file(*index);
    return grpc::Status::OK;
  });
}

}  // namespace lce::server
