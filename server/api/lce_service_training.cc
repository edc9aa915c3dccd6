// Training RPCs of LceService: heads by name and version, the fp32 gradient dW, AdamW steps on fp32
// master weights, weight updates streamed by a trainer, and saving heads as safetensors. Each rank's
// share of the work is its shard's HeadTrainer (lce/training.h: host memory on CPUs, device memory
// on GPUs); under tensor parallelism the group (tp_group.h) does the same on every rank. A new weight
// is a new head version; it is made only while no request runs on the head (head_store.h).
#include <cmath>
#include <cstring>
#include <filesystem>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "dp_job.h"
#include "grpc_status.h"
#include "head_source.h"
#include "lce/numeric.h"
#include "lce/training.h"
#include "lce_service.h"
#include "status_macros.h"
#include "wire_types.h"

namespace lce::server {
namespace {

absl::StatusOr<AdamWParams> AdamWFrom(const v1::OptimizerStepRequest& req) {
  AdamWParams p;
  p.lr = req.lr();
  p.beta1 = req.beta1() == 0.0f ? 0.9f : req.beta1();
  p.beta2 = req.beta2() == 0.0f ? 0.999f : req.beta2();
  p.eps = req.eps() == 0.0f ? 1e-8f : req.eps();
  p.weight_decay = req.weight_decay();
  if (!(p.lr >= 0.0f) || !(p.beta1 >= 0.0f && p.beta1 < 1.0f) || !(p.beta2 >= 0.0f && p.beta2 < 1.0f) ||
      !(p.eps > 0.0f) || !(p.weight_decay >= 0.0f) || !(req.max_grad_norm() >= 0.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("bad AdamW hyper-parameters: lr=", p.lr, " betas=(", p.beta1, ", ",
                                                   p.beta2, ") eps=", p.eps, " weight_decay=", p.weight_decay,
                                                   " max_grad_norm=", req.max_grad_norm()));
  }
  return p;
}

absl::StatusOr<TpHeadSource> SourceFrom(const v1::LoadHeadRequest& req) {
  TpHeadSource out;
  switch (req.source_case()) {
    case v1::LoadHeadRequest::kCloneOf:
      out.clone_of = req.clone_of();
      return out;
    case v1::LoadHeadRequest::kSeeded: {
      out.source.seed_vocab = req.seeded().vocab_size();
      out.source.seed_hidden = req.seeded().hidden_size();
      out.source.seed = req.seeded().seed();
      out.source.seed_bias = req.seeded().bias();
      absl::StatusOr<DType> d = FromWire(req.seeded().dtype());
      if (!d.ok()) return d.status();
      out.source.dtype = *d;
      return out;
    }
    case v1::LoadHeadRequest::kSafetensorsFile:
      out.source.file = req.safetensors_file();
      if (!req.tensor().empty()) out.source.tensor = req.tensor();
      return out;
    default:
      return absl::InvalidArgumentError("LoadHead needs a source: safetensors_file, clone_of or seeded");
  }
}

// Rows [begin, end) of a [V, H] weight, as a shard of `base`'s shape and bias.
std::shared_ptr<HeadWeights> ShardOf(const HeadWeights& full, const HeadWeights& base) {
  auto w = std::make_shared<HeadWeights>();
  w->shape = base.shape;
  w->bias = base.bias;  // a bias the update does not set stays
  if (!full.bias.empty()) {
    w->bias.assign(full.bias.begin() + base.shape.vocab_begin, full.bias.begin() + base.shape.vocab_end());
  }
  const int64_t row_bytes = base.shape.row_bytes();
  const auto first = full.weight.begin() + base.shape.vocab_begin * row_bytes;
  w->weight.assign(first, first + base.shape.shard_rows * row_bytes);
  return w;
}

// UpdateWeightsHeader.bias for a head of `shape`: empty (the bias stays), or the new one, checked.
// (On a tensor-parallel group, the whole bias: TpGroup::Update gives each rank its rows.)
absl::StatusOr<std::vector<float>> NewBias(const v1::UpdateWeightsHeader& header, const HeadShape& shape) {
  if (header.bias().empty()) return std::vector<float>();
  if (!shape.has_bias) return absl::InvalidArgumentError("UpdateWeights: header.bias given, but the head has no bias");
  if (header.bias_size() != shape.vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("UpdateWeights: header.bias has ", header.bias_size(), " values for ", shape.vocab_size, " rows"));
  }
  for (int i = 0; i < header.bias_size(); ++i) {
    if (!std::isfinite(header.bias(i))) {
      return absl::InvalidArgumentError(
          absl::StrCat("UpdateWeights: header.bias[", i, "] is not finite; nothing changed"));
    }
  }
  return std::vector<float>(header.bias().begin(), header.bias().end());
}

// UpdateWeights' client stream as LceService::WithinLimit sees it: one whose reads wait on the
// client (the messages themselves come from the gRPC reader, not from this).
class ClientStreamMark final : public RequestStream {
 public:
  void SendInitialMetadata() override {}
  bool NextMessageSize(uint32_t*) override { return false; }
  bool Read(v1::StreamRequest*) override { return false; }
  bool Write(const v1::StreamResponse&, grpc::WriteOptions) override { return false; }
};
const ClientStreamMark kClientStream;

// The first row of a chunk (`cols` wide) holding a NaN or an infinity, or -1. One such weight makes
// every later Score of the head fail, so none is taken.
int64_t FirstNonFiniteRow(const std::string& data, DType dtype, int64_t cols) {
  const int64_t es = DTypeSize(dtype), n = static_cast<int64_t>(data.size()) / es;
  for (int64_t i = 0; i < n; ++i) {
    float v;
    uint16_t h;
    std::memcpy(dtype == DType::kFloat32 ? static_cast<void*>(&v) : &h, data.data() + i * es, es);
    if (dtype == DType::kBFloat16) v = Bf16ToFloat(h);
    if (dtype == DType::kFloat16) v = Fp16ToFloat(h);
    if (!std::isfinite(v)) return i / cols;
  }
  return -1;
}

// The rest of an UpdateWeights stream, each message from `next` (false at the end): the whole
// [vocab, hidden] weight of a head of `shape`, in row blocks in order, every value finite.
absl::StatusOr<HeadWeights> ReadWholeWeight(const UpdateReader& next, const HeadShape& shape) {
  HeadWeights full;
  full.shape = shape;
  full.shape.vocab_begin = 0;
  full.shape.shard_rows = shape.vocab_size;
  const int64_t row_bytes = shape.row_bytes();
  full.weight.reserve(static_cast<size_t>(shape.vocab_size * row_bytes));
  int64_t rows = 0;
  v1::UpdateWeightsRequest msg;
  for (;;) {
    absl::StatusOr<bool> more = next(&msg);
    if (!more.ok()) return more.status();
    if (!*more) break;
    if (!msg.has_chunk()) return absl::InvalidArgumentError("UpdateWeights: repeated header");
    const v1::TensorChunk& c = msg.chunk();
    absl::StatusOr<DType> dtype = FromWire(c.dtype());
    if (!dtype.ok() || *dtype != shape.dtype || c.cols() != shape.hidden_size || c.first_row() != rows ||
        c.rows() <= 0 || rows + c.rows() > shape.vocab_size || static_cast<int64_t>(c.data().size()) != c.rows() * row_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "UpdateWeights chunk at row ", c.first_row(), ": expected rows from ", rows, " of a [", shape.vocab_size, ", ",
          shape.hidden_size, "] ", DTypeName(shape.dtype), " weight, got ", c.rows(), " rows x ", c.cols(), " cols, ",
          c.data().size(), " bytes"));
    }
    if (const int64_t bad = FirstNonFiniteRow(c.data(), shape.dtype, shape.hidden_size); bad >= 0) {
      return absl::InvalidArgumentError(absl::StrCat("UpdateWeights: row ", c.first_row() + bad,
                                                     " of the weight holds a NaN or an infinity; nothing changed"));
    }
    full.weight.insert(full.weight.end(), c.data().begin(), c.data().end());
    rows += c.rows();
  }
  if (rows != shape.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat("UpdateWeights sent ", rows, " rows of ", shape.vocab_size));
  }
  return full;
}

}  // namespace

absl::StatusOr<RequestPlan> LceService::ValidateAndUse(const StreamRequestValidator& validator,
                                                       const v1::RequestHeader& header,
                                                       std::optional<HeadStore::Use>& use) {
  for (;;) {
    absl::StatusOr<RequestPlan> plan = validator.ValidateHeader(header);
    if (!plan.ok()) return plan;
    absl::StatusOr<HeadStore::Use> held = heads_->Enter(plan->head);
    if (held.ok()) {
      use.emplace(*std::move(held));
      return plan;
    }
    if (held.status().code() != absl::StatusCode::kAborted) return held.status();
    // The head changed while the request waited: validate against the new version.
  }
}

absl::StatusOr<std::shared_ptr<const HeadWeights>> LceService::CloneWeight(const TpHeadSource& source) {
  if (source.clone_of.empty()) return std::shared_ptr<const HeadWeights>();
  absl::StatusOr<std::shared_ptr<const ServedHead>> h = heads_->Get(source.clone_of);
  if (!h.ok()) return h.status();
  std::lock_guard<std::mutex> lock((*h)->training->mu);
  return CurrentWeights((*h)->training->trainer.get(), (*h)->weights);
}

absl::Status LceService::LoadOwnShard(const TpHeadSource& source, std::shared_ptr<const HeadWeights> clone,
                                      std::shared_ptr<const HeadWeights>* weights, std::shared_ptr<LceEngine>* engine) {
  absl::StatusOr<std::shared_ptr<const HeadWeights>> w =
      LoadShard(source, 0, config_.tp_size, [&](const std::string&) { return clone; }, config_.max_head_bytes);
  if (!w.ok()) return w.status();
  absl::StatusOr<std::shared_ptr<LceEngine>> e = config_.make_engine(*w);
  if (!e.ok()) return e.status();
  *weights = *std::move(w);
  *engine = *std::move(e);
  return absl::OkStatus();
}

absl::StatusOr<HeadTrainer*> LceService::TrainerOf(const ServedHead& head) const {
  return TrainerFor(head.training->trainer, head.shard_engine, head.weights, config_.make_engine);
}

absl::StatusOr<HeadStore::Change> LceService::BeginWeightChange(grpc::ServerContext* ctx, const std::string& name) {
  // Gives up a little before the client's deadline, so that the client hears why.
  const auto left = ctx->deadline() - std::chrono::system_clock::now();  // huge when the client set no deadline
  const absl::Duration wait = left < absl::ToChronoNanoseconds(config_.weight_change_wait)
                                  ? absl::FromChrono(left) * 0.9
                                  : config_.weight_change_wait;
  return heads_->BeginChange(name, absl::Now() + wait);
}

HeadVersion LceService::Serve(const std::string& name, int64_t version, std::shared_ptr<LceEngine> shard_engine,
                              std::shared_ptr<const HeadWeights> weights, std::shared_ptr<HeadTraining> training) const {
  std::shared_ptr<LceEngine> served = shard_engine;
  if (config_.tp_group != nullptr) served = std::make_shared<TpFrontEngine>(config_.tp_group, name, version, shard_engine);
  return HeadVersion{std::move(served), std::move(shard_engine), std::move(weights), std::move(training)};
}

grpc::Status LceService::LoadHead(grpc::ServerContext* ctx, const v1::LoadHeadRequest* req, v1::HeadDescription* resp) {
  return Recorded("LoadHead", ctx, [&]() -> absl::Status {
    LCE_RETURN_IF_ERROR(Authenticate(ctx, Access::kAdmin));
    DpCall dp = DpCall::Route(config_.dp_job.get(), ctx, &v1::LceService::Stub::LoadHead, *req, resp);
    if (dp.answered()) return dp.answer();  // data-parallel replicas: every replica loads it
    if (!config_.make_engine) return absl::FailedPreconditionError("this server cannot build heads");
    if (req->name().empty()) return absl::InvalidArgumentError("LoadHead needs a name");
    LCE_ASSIGN_OR_RETURN(const TpHeadSource source, SourceFrom(*req));
    absl::StatusOr<HeadStore::Change> change = BeginWeightChange(ctx, req->name());
    const int64_t current = heads_->Version(req->name());
    std::shared_ptr<const HeadWeights> weights;
    std::shared_ptr<LceEngine> engine;
    // A clone's weight is taken before the group's lock (the order every request takes the locks in).
    absl::StatusOr<std::shared_ptr<const HeadWeights>> clone = CloneWeight(source);
    if (!clone.ok()) change = clone.status();
    auto load_own = [&] { return LoadOwnShard(source, clone.ok() ? *clone : nullptr, &weights, &engine); };
    // Data-parallel replicas agree on the outcome: a server without tensor-parallel peers loads its
    // head before they meet, so a replica that cannot load it keeps the others from serving it alone.
    // (A group's peers keep what they load: there the replicas meet first.)
    const bool load_first = config_.tp_group == nullptr;
    absl::Status loaded = change.ok() && load_first ? load_own() : change.status();
    LCE_RETURN_IF_ERROR(dp.Ready(loaded));
    if (!load_first) {
      LCE_RETURN_IF_ERROR(config_.tp_group->Load(req->name(), current + 1, source, load_own));
    }
    // A new head: no gradient, no optimizer state.
    absl::StatusOr<std::shared_ptr<const ServedHead>> put =
        heads_->Put(req->name(), Serve(req->name(), current + 1, engine, weights, nullptr), current);
    if (!put.ok()) return put.status();
    DescribeHead(**put, resp);
    return absl::OkStatus();
  });
}

grpc::Status LceService::ZeroGrad(grpc::ServerContext* ctx, const v1::ZeroGradRequest* req, v1::ZeroGradResponse* resp) {
  return Recorded("ZeroGrad", ctx, [&]() -> absl::Status {
    LCE_RETURN_IF_ERROR(Authenticate(ctx, Access::kAdmin));
    DpCall dp = DpCall::Route(config_.dp_job.get(), ctx, &v1::LceService::Stub::ZeroGrad, *req, resp);
    if (dp.answered()) return dp.answer();  // data-parallel replicas: every replica zeroes its dW
    absl::StatusOr<std::shared_ptr<const ServedHead>> head = heads_->Get(req->head());
    if (!head.ok()) return head.status();
    HeadTraining& t = *(*head)->training;
    std::lock_guard<std::mutex> lock(t.mu);
    if (t.trainer != nullptr) {  // none yet: nothing accumulated
      LCE_RETURN_IF_ERROR(t.trainer->ZeroGrad());
    }
    if (config_.tp_group != nullptr) return config_.tp_group->ZeroGrad((*head)->name);
    return absl::OkStatus();
  });
}

namespace {

// GetGrad(bias) asks for dB [vocab, 1]: of a head with a bias, not of a pending contribution.
absl::Status CheckBiasGrad(const HeadShape& shape, uint64_t pending) {
  if (!shape.has_bias) return absl::FailedPreconditionError("GetGrad(bias): the head has no bias");
  if (pending != 0) return absl::InvalidArgumentError("GetGrad: bias and pending_grad_id go separately");
  return absl::OkStatus();
}

// This shard's rows [r0, r0 + n) of dW (of pending contribution `pending` when non-zero), or with
// `bias` all of its dB (r0 = 0, n = shard_rows), into `out`.
absl::Status CopyShardGrad(HeadTrainer& trainer, uint64_t pending, bool bias, int64_t r0, int64_t n,
                           std::vector<float>& out) {
  out.resize(static_cast<size_t>(n * (bias ? 1 : trainer.shape().hidden_size)));
  if (bias) return trainer.CopyBiasGrad(out.data());
  return pending != 0 ? trainer.CopyPending(pending, r0, n, out.data()) : trainer.CopyGrad(r0, n, out.data());
}

}  // namespace

grpc::Status LceService::GetGrad(grpc::ServerContext* ctx, const v1::GetGradRequest* req,
                                 grpc::ServerWriter<v1::TensorChunk>* writer) {
  return Recorded("GetGrad", ctx, [&]() -> absl::Status {
    // A pending contribution is its client's (who alone knows its id); dW is the head's.
    const uint64_t pending = req->pending_grad_id();
    LCE_RETURN_IF_ERROR(Authenticate(ctx, pending != 0 ? Access::kScoring : Access::kAdmin));
    absl::StatusOr<std::shared_ptr<const ServedHead>> head = heads_->Get(req->head());
    if (!head.ok()) return head.status();
    const HeadShape& shape = (*head)->shard_engine->shape();
    const bool bias = req->bias();
    if (bias) LCE_RETURN_IF_ERROR(CheckBiasGrad(shape, pending));
    const int64_t cols = bias ? 1 : shape.hidden_size;  // dB: [vocab, 1]
    // Messages within any gRPC client's default receive limit (4 MiB) as well as the server's.
    const int64_t chunk_bytes = std::min<int64_t>(config_.max_message_bytes / 2, int64_t{2} << 20);
    const int64_t rows_per_chunk = std::max<int64_t>(1, chunk_bytes / (cols * 4));
    std::lock_guard<std::mutex> lock((*head)->training->mu);
    absl::StatusOr<HeadTrainer*> trainer = TrainerOf(**head);
    if (!trainer.ok()) return trainer.status();
    if (pending != 0) {
      const PendingGrads::Entry* e = (*head)->training->pending.Find(pending);
      if (e == nullptr || !e->complete()) {
        return absl::NotFoundError(
            absl::StrCat("no finished pending weight gradient ", pending, " on head '", (*head)->name, "'"));
      }
    }
    v1::TensorChunk chunk;
    chunk.set_cols(cols);
    chunk.set_rows_total(shape.vocab_size);
    chunk.set_dtype(v1::DTYPE_FLOAT32);
    // Rows [first, first + rows) of dW (dB), in messages of rows_per_chunk rows.
    auto send = [&](int64_t first, int64_t rows, const float* data) -> absl::Status {
      for (int64_t r0 = 0; r0 < rows; r0 += rows_per_chunk) {
        if (ctx->IsCancelled()) return absl::CancelledError("client cancelled");
        const int64_t n = std::min(rows_per_chunk, rows - r0);
        chunk.set_first_row(first + r0);
        chunk.set_rows(n);
        chunk.set_data(reinterpret_cast<const char*>(data + r0 * cols), static_cast<size_t>(n * cols * 4));
        if (!writer->Write(chunk)) return absl::CancelledError("client went away");
      }
      return absl::OkStatus();
    };
    // This rank's shard first (dB whole: one float a row), then the peers' shards, in rank order.
    const int64_t copy_rows = bias ? shape.shard_rows : rows_per_chunk;
    std::vector<float> piece;
    for (int64_t r0 = 0; r0 < shape.shard_rows; r0 += copy_rows) {
      const int64_t n = std::min(copy_rows, shape.shard_rows - r0);
      LCE_RETURN_IF_ERROR(CopyShardGrad(**trainer, pending, bias, r0, n, piece));
      LCE_RETURN_IF_ERROR(send(shape.vocab_begin + r0, n, piece.data()));
    }
    if (config_.tp_group == nullptr) return absl::OkStatus();
    return config_.tp_group->GatherPeerGrads((*head)->name, shape, send, pending, bias);
  });
}

grpc::Status LceService::OptimizerStep(grpc::ServerContext* ctx, const v1::OptimizerStepRequest* req,
                                       v1::OptimizerStepResponse* resp) {
  return Recorded("OptimizerStep", ctx, [&]() -> absl::Status {
    LCE_RETURN_IF_ERROR(Authenticate(ctx, Access::kAdmin));
    DpCall dp = DpCall::Route(config_.dp_job.get(), ctx, &v1::LceService::Stub::OptimizerStep, *req, resp);
    if (dp.answered()) return dp.answer();  // data-parallel replicas: every replica steps on the summed dW
    LCE_ASSIGN_OR_RETURN(const AdamWParams adamw, AdamWFrom(*req));
    absl::StatusOr<std::shared_ptr<const ServedHead>> named = heads_->Get(req->head());
    if (!named.ok()) return named.status();
    absl::StatusOr<HeadStore::Change> change = BeginWeightChange(ctx, (*named)->name);
    LCE_RETURN_IF_ERROR(dp.Ready(change.status()));
    absl::StatusOr<std::shared_ptr<const ServedHead>> head = heads_->Get((*named)->name);  // current, now fixed
    if (!head.ok()) return head.status();
    const ServedHead& h = **head;
    std::lock_guard<std::mutex> lock(h.training->mu);
    absl::StatusOr<HeadTrainer*> trainer = TrainerOf(h);
    const int64_t vocab = h.shard_engine->shape().vocab_size;
    absl::StatusOr<ShardStep> step =
        config_.tp_group != nullptr
            ? config_.tp_group->Step(h.name, h.version + 1, vocab, trainer, adamw, req->max_grad_norm(), dp.reducer())
            : StepShard(trainer, vocab, nullptr, nullptr, adamw, req->max_grad_norm(), dp.reducer());
    if (!step.ok()) return step.status();
    if (req->zero_grad() || dp.ZeroesGradAfterStep()) {
      LCE_RETURN_IF_ERROR((*trainer)->ZeroGrad());
      if (config_.tp_group != nullptr) {
        LCE_RETURN_IF_ERROR(config_.tp_group->ZeroGrad(h.name));
      }
    }
    absl::StatusOr<std::shared_ptr<const ServedHead>> put =
        heads_->Put(h.name, Serve(h.name, h.version + 1, step->engine, h.weights, h.training), h.version);
    if (!put.ok()) return put.status();
    // Contributions made on the old weight can no longer be committed (autograd: a backward after
    // the step that changed its weight).
    ReleaseContributions(h, h.training->pending.TakeAll(PendingGrads::Drop::kStale));
    resp->set_step((*trainer)->steps());
    resp->set_grad_norm(step->grad_norm);
    DescribeHead(**put, resp->mutable_head());
    return absl::OkStatus();
  });
}

grpc::Status LceService::UpdateWeights(grpc::ServerContext* ctx, grpc::ServerReader<v1::UpdateWeightsRequest>* reader,
                                       v1::HeadDescription* resp) {
  return Recorded("UpdateWeights", ctx, [&]() -> absl::Status {
    LCE_RETURN_IF_ERROR(Authenticate(ctx, Access::kAdmin));
    // Read as a streamed request is: the header within the header timeout, each next message within
    // the idle timeout, and an admission slot from the header on (issue 35, item 14).
    bool slot = false;
    absl::Cleanup release = [&] {
      if (slot) streams_in_flight_.fetch_sub(1);
    };
    int64_t read = 0;
    const UpdateReader next = [&](v1::UpdateWeightsRequest* m) -> absl::StatusOr<bool> {
      bool got = false;
      const ClientWait wait = read == 0 ? HeaderWait() : IdleWait(absl::StrCat("UpdateWeights' message ", read + 1));
      if (absl::Status g = WithinLimit(
              ctx, kClientStream, wait, [&] { return reader->Read(m); }, &got);
          !g.ok()) {
        return absl::DeadlineExceededError(g.message());
      }
      if (!got || read++ > 0) return got;
      slot = true;
      const int64_t limit = config_.max_concurrent_streams;
      if (streams_in_flight_.fetch_add(1) < limit || limit <= 0) return true;
      if (config_.metrics != nullptr) config_.metrics->rejections.WithLabels({"concurrent_streams"}).Increment();
      return absl::ResourceExhaustedError(
          absl::StrCat("server is at its limit of ", limit, " concurrent streams; retry later"));
    };
    DpCall dp = DpCall::RouteUpdate(config_.dp_job.get(), ctx, next, resp);
    if (dp.answered()) return dp.answer();  // data-parallel replicas: every replica serves it
    v1::UpdateWeightsRequest msg;
    absl::StatusOr<bool> first = next(&msg);
    if (!first.ok()) return first.status();
    if (!*first || !msg.has_header()) {
      return absl::InvalidArgumentError("UpdateWeights starts with a header message");
    }
    const v1::UpdateWeightsHeader header = msg.header();
    absl::StatusOr<std::shared_ptr<const ServedHead>> named = heads_->Get(header.head());
    if (!named.ok()) return named.status();
    // The whole weight first (no request waits for the client's upload), then the change.
    const HeadShape& named_shape = (*named)->shard_engine->shape();
    LCE_ASSIGN_OR_RETURN(std::vector<float> bias, NewBias(header, named_shape));
    LCE_ASSIGN_OR_RETURN(HeadWeights full, ReadWholeWeight(next, named_shape));
    full.bias = std::move(bias);
    absl::StatusOr<HeadStore::Change> change = BeginWeightChange(ctx, (*named)->name);
    LCE_RETURN_IF_ERROR(dp.Ready(change.status()));
    absl::StatusOr<std::shared_ptr<const ServedHead>> head = heads_->Get((*named)->name);
    if (!head.ok()) return head.status();
    const ServedHead& h = **head;
    if (header.expected_version() != 0 && header.expected_version() != h.version) {
      return absl::FailedPreconditionError(absl::StrCat("head '", h.name, "' is at version ", h.version,
                                                        ", the update expected version ", header.expected_version()));
    }
    const HeadShape& now = h.weights->shape;
    if (now.vocab_size != full.shape.vocab_size || now.hidden_size != full.shape.hidden_size ||
        now.dtype != full.shape.dtype) {
      return absl::FailedPreconditionError(
          absl::StrCat("head '", h.name, "' was replaced by another shape while the update was sent"));
    }
    std::lock_guard<std::mutex> lock(h.training->mu);
    std::shared_ptr<const HeadWeights> shard = ShardOf(full, *h.weights);
    std::shared_ptr<LceEngine> engine;
    auto serve_own = [&]() -> absl::Status {  // through the trainer, whose masters follow; moments stay
      absl::StatusOr<std::shared_ptr<LceEngine>> e = ReplaceWeight(h.training->trainer.get(), shard, config_.make_engine);
      if (e.ok()) engine = *std::move(e);
      return e.status();
    };
    absl::Status s =
        config_.tp_group != nullptr ? config_.tp_group->Update(h.name, h.version + 1, full, serve_own) : serve_own();
    if (!s.ok()) return s;
    absl::StatusOr<std::shared_ptr<const ServedHead>> put =
        heads_->Put(h.name, Serve(h.name, h.version + 1, engine, shard, h.training), h.version);
    if (!put.ok()) return put.status();
    ReleaseContributions(h, h.training->pending.TakeAll(PendingGrads::Drop::kStale));
    DescribeHead(**put, resp);
    return absl::OkStatus();
  });
}

grpc::Status LceService::SaveHead(grpc::ServerContext* ctx, const v1::SaveHeadRequest* req, v1::SaveHeadResponse* resp) {
  return Recorded("SaveHead", ctx, [&]() -> absl::Status {
    LCE_RETURN_IF_ERROR(Authenticate(ctx, Access::kAdmin));
    DpCall dp = DpCall::Route(config_.dp_job.get(), ctx, &v1::LceService::Stub::SaveHead, *req, resp);
    if (dp.answered()) return dp.answer();  // data-parallel replicas: this front's replica writes, in the job's order
    absl::StatusOr<std::shared_ptr<const ServedHead>> head = heads_->Get(req->head());
    if (!head.ok()) return head.status();
    if (req->directory().empty()) return absl::InvalidArgumentError("SaveHead needs a directory");
    const ServedHead& h = **head;
    const int world = config_.tp_size;
    std::lock_guard<std::mutex> lock(h.training->mu);  // no step rewrites the weight meanwhile
    // Before any rank writes: a committed save of this very version (another run's) moves aside.
    LCE_RETURN_IF_ERROR(ProtectCommittedSave(req->directory(), h.name, h.version, world));
    absl::StatusOr<std::string> shard;
    auto write_own = [&]() -> absl::Status {
      absl::StatusOr<std::shared_ptr<const HeadWeights>> w = CurrentWeights(h.training->trainer.get(), h.weights);
      if (!w.ok()) return w.status();
      shard = WriteHeadShard(req->directory(), h.name, h.version, **w, 0, world);
      return shard.status();
    };
    absl::Status s = config_.tp_group != nullptr ? config_.tp_group->Save(h.name, h.version, req->directory(), write_own)
                                                 : write_own();
    if (!s.ok()) return s;
    // Last: the index's rename commits the save (head_source.h).
    LCE_ASSIGN_OR_RETURN(const std::string index,
                         WriteHeadIndex(req->directory(), h.name, h.version, h.shard_engine->shape(), world));
    resp->add_files(*shard);
    for (int r = 1; r < world; ++r) {
      resp->add_files((std::filesystem::path(req->directory()) / ShardFileName(h.name, h.version, r, world)).string());
    }
    resp->set_index_file(index);
    return absl::OkStatus();
  });
}

}  // namespace lce::server
