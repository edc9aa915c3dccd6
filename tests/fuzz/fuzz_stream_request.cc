// Fuzz target: a streamed request as the server reads it (lce_service.cc, RunStream): serialized
// StreamRequest messages, the first of which must be a header, through StreamRequestValidator;
// then, for every chunk the validator passes, what the service does with it on the CPU engine
// (forward, the gradient its RPC asks for, PolicyLoss's per-row weights and loss). The validator is
// the only guard before those reads: an input it passes that makes them read out of bounds (a
// target outside the vocabulary, a sequence id outside the declared sequences, a short hidden
// buffer) is caught by ASan or by the checks below; signed overflow in the declared counts by UBSan.
//
// Input: byte 0 picks the RPC (Score, ForwardBackward, Backward, PolicyLoss), byte 1 the row limit;
// then records (fuzz_common.h), each a serialized lce.v1.StreamRequest.
#include <cmath>
#include <memory>

#include "fuzz_common.h"
#include "google/protobuf/stubs/logging.h"
#include "head_source.h"
#include "head_store.h"
#include "lce/engine.h"
#include "lce/training.h"
#include "request_validator.h"

namespace lce::server {
namespace {

constexpr int64_t kVocab = 50, kHidden = 8;

HeadStore& Heads() {
  static HeadStore* heads = [] {
    auto* h = new HeadStore();
    HeadSource src;
    if (!ParseSeedShape("50x8", src).ok()) std::abort();
    auto w = LoadHead(src, 0, 1);
    EngineConfig config;
    config.cpu_threads = 1;
    auto e = CreateEngine(Backend::kCpu, *w, config);
    if (!w.ok() || !e.ok() || !h->Put("policy", std::shared_ptr<LceEngine>(std::move(*e)), *w).ok()) std::abort();
    return h;
  }();
  return *heads;
}

// What RunStream does with a chunk the validator passed, on the host (no regions: a chunk naming
// one is resolved by RegionRegistry::Resolve, fuzzed in fuzz_region_registry).
void RunChunk(const RequestPlan& plan, const v1::RowChunk& chunk, int64_t rows, std::vector<int64_t>& seq_seen) {
  LCE_FUZZ_CHECK(rows == chunk.targets_size(), "rows %lld", static_cast<long long>(rows));
  if (chunk.has_hidden_region()) return;
  const HeadShape& shape = plan.head->engine->shape();
  const int64_t row_bytes = shape.hidden_size * DTypeSize(shape.dtype);
  LCE_FUZZ_CHECK(static_cast<int64_t>(chunk.hidden().size()) == rows * row_bytes, "hidden holds %zu bytes",
                 chunk.hidden().size());
  const int32_t ignore = plan.options.ignore_index;
  for (int i = 0; i < rows; ++i) {
    const int32_t y = chunk.targets(i);
    LCE_FUZZ_CHECK(y == ignore || (y >= 0 && y < shape.vocab_size), "target %d passed", y);
  }
  const RpcKind rpc = plan.rpc;
  const size_t n = static_cast<size_t>(rows);
  std::vector<float> logprob(n), entropy(n), lse(n), loss(n), u(n), e(n), w(n);
  std::vector<uint8_t> d_hidden(static_cast<size_t>(rows * row_bytes));
  RowsView view{chunk.hidden().data(), chunk.targets().data(), rows, MemorySpace::kHost, /*targets_checked=*/true};
  Upstream up;
  RowOutputs out{plan.want_logprobs ? logprob.data() : nullptr, plan.want_entropy ? entropy.data() : nullptr, nullptr,
                 nullptr};
  GradOutputs grads;
  if (rpc == RpcKind::kForwardBackward) {
    up.mode = GradMode::kLoss;
    if (plan.reduction == v1::REDUCTION_NONE && chunk.grad_loss_size() > 0) {
      LCE_FUZZ_CHECK(chunk.grad_loss_size() == rows, "grad_loss %d", chunk.grad_loss_size());
      up.grad_loss = chunk.grad_loss().data();
    }
    out.loss = loss.data();
    grads.d_hidden = d_hidden.data();
  } else if (rpc == RpcKind::kBackward) {
    up.mode = GradMode::kGeneric;
    if (chunk.grad_logprob_size() > 0) {
      LCE_FUZZ_CHECK(chunk.grad_logprob_size() == rows, "grad_logprob %d", chunk.grad_logprob_size());
      up.grad_logprob = chunk.grad_logprob().data();
    }
    if (chunk.grad_entropy_size() > 0) {
      LCE_FUZZ_CHECK(chunk.grad_entropy_size() == rows, "grad_entropy %d", chunk.grad_entropy_size());
      up.grad_entropy = chunk.grad_entropy().data();
    }
    grads.d_hidden = d_hidden.data();
  } else if (rpc == RpcKind::kPolicyLoss) {
    LCE_FUZZ_CHECK(chunk.old_logprobs_size() == rows && chunk.advantages_size() == rows, "policy inputs");
    LCE_FUZZ_CHECK(chunk.ref_logprobs_size() == 0 || chunk.ref_logprobs_size() == rows, "ref_logprobs");
    absl::Status s = plan.head->engine->Compute(view, plan.options, Upstream{}, {logprob.data(), entropy.data(), nullptr, nullptr}, {});
    if (!s.ok()) return;
    const int64_t num_seq = static_cast<int64_t>(plan.sequence_valid_tokens.size());
    std::unique_ptr<bool[]> valid(new bool[n]);
    for (size_t i = 0; i < n; ++i) {
      const int32_t sid = chunk.sequence_ids_size() > 0 ? chunk.sequence_ids(static_cast<int>(i)) : 0;
      // lce_service.cc reads plan.sequence_valid_tokens[sid] and seq_seen[sid] here.
      LCE_FUZZ_CHECK(sid >= 0 && sid < num_seq, "sequence id %d of %lld sequences passed", sid,
                     static_cast<long long>(num_seq));
      valid[i] = chunk.targets(static_cast<int>(i)) != ignore;
      if (!valid[i]) continue;
      ++seq_seen[static_cast<size_t>(sid)];
      w[i] = AggregationWeight(plan.aggregation, plan.sequence_valid_tokens[static_cast<size_t>(sid)],
                               plan.total_valid_tokens, num_seq);
    }
    PolicyLossSums sums;
    PolicyLossRows(rows, plan.policy, logprob.data(), entropy.data(), chunk.old_logprobs().data(),
                   chunk.advantages().data(), chunk.ref_logprobs_size() > 0 ? chunk.ref_logprobs().data() : nullptr,
                   w.data(), valid.get(), loss.data(), u.data(), e.data(), &sums);
    up = Upstream{GradMode::kGeneric, nullptr, u.data(), e.data()};
    out = RowOutputs{};
    grads.d_hidden = d_hidden.data();
  }
  (void)plan.head->engine->Compute(view, plan.options, up, out, grads);
}

void Run(const uint8_t* data, size_t size) {
  if (size < 2) return;
  const RpcKind rpc = static_cast<RpcKind>(data[0] % 4);
  RequestLimits limits;
  limits.max_rows_per_request = data[1] % 4 == 0 ? 0 : data[1] % 32;
  StreamRequestValidator validator(rpc, Heads(), limits);
  fuzz::Records records(data + 2, size - 2);
  std::string_view bytes;
  if (!records.Next(&bytes)) return;
  v1::StreamRequest msg;
  if (!msg.ParseFromArray(bytes.data(), static_cast<int>(bytes.size())) || !msg.has_header()) return;
  absl::StatusOr<RequestPlan> plan = validator.ValidateHeader(msg.header());
  if (!plan.ok()) {
    LCE_FUZZ_CHECK(!plan.status().message().empty(), "an error without a message");
    return;
  }
  if (plan->rpc == RpcKind::kPolicyLoss) {
    int64_t sum = 0;
    for (int64_t t : plan->sequence_valid_tokens) {
      LCE_FUZZ_CHECK(t >= 0, "a negative sequence count passed");
      sum += t;  // UBSan: the validator must have refused a sum that overflows
    }
    LCE_FUZZ_CHECK(sum == plan->total_valid_tokens, "total_valid_tokens");
  }
  std::vector<int64_t> seq_seen(plan->sequence_valid_tokens.size(), 0);
  int64_t rows_seen = 0;
  for (int64_t chunk_index = 0; chunk_index < 16 && records.Next(&bytes); ++chunk_index) {
    if (!msg.ParseFromArray(bytes.data(), static_cast<int>(bytes.size())) || !msg.has_chunk()) return;
    absl::StatusOr<int64_t> rows = validator.ValidateChunk(*plan, msg.chunk(), chunk_index, rows_seen);
    if (!rows.ok()) {
      LCE_FUZZ_CHECK(!rows.status().message().empty(), "an error without a message");
      return;
    }
    LCE_FUZZ_CHECK(limits.max_rows_per_request == 0 || rows_seen + *rows <= limits.max_rows_per_request,
                   "%lld rows passed a limit of %lld", static_cast<long long>(rows_seen + *rows),
                   static_cast<long long>(limits.max_rows_per_request));
    RunChunk(*plan, msg.chunk(), *rows, seq_seen);
    rows_seen += *rows;
  }
}

// Seeds: a valid request of each RPC, and a few near misses.
void WriteSeeds(const std::string& dir) {
  auto header = [](RpcKind rpc) {
    v1::StreamRequest m;
    v1::RequestHeader* h = m.mutable_header();
    h->set_hidden_size(kHidden);
    h->set_dtype(v1::DTYPE_BFLOAT16);
    if (rpc == RpcKind::kForwardBackward) h->set_num_valid_tokens(3);
    if (rpc == RpcKind::kPolicyLoss) {
      v1::PolicyLossOptions* p = h->mutable_policy();
      p->set_clip_low(0.2f);
      p->set_clip_high(0.28f);
      p->set_kl_coef(0.01f);
      p->set_aggregation(v1::AGGREGATION_SEQ_MEAN_TOKEN_MEAN);
      p->add_sequence_valid_tokens(2);
      p->add_sequence_valid_tokens(1);
    }
    return m;
  };
  auto chunk = [](RpcKind rpc, int rows) {
    v1::StreamRequest m;
    v1::RowChunk* c = m.mutable_chunk();
    std::string hidden(static_cast<size_t>(rows * kHidden * 2), '\0');
    for (size_t i = 0; i < hidden.size(); i += 2) hidden[i + 1] = static_cast<char>(0x3f);  // bf16 ~0.5
    c->set_hidden(hidden);
    for (int i = 0; i < rows; ++i) c->add_targets(i * 7 % kVocab);
    for (int i = 0; i < rows; ++i) {
      if (rpc == RpcKind::kBackward) {
        c->add_grad_logprob(1.0f);
        c->add_grad_entropy(-0.5f);
      }
      if (rpc == RpcKind::kPolicyLoss) {
        c->add_old_logprobs(-3.0f);
        c->add_advantages(i % 2 ? 1.0f : -1.0f);
        c->add_ref_logprobs(-3.5f);
        c->add_sequence_ids(i < 2 ? 0 : 1);
      }
    }
    return m;
  };
  const char* names[] = {"score", "forward_backward", "backward", "policy_loss"};
  for (int k = 0; k < 4; ++k) {
    const RpcKind rpc = static_cast<RpcKind>(k);
    std::string in = {static_cast<char>(k), static_cast<char>(1 + 4 * 2)};  // row limit 9
    fuzz::AppendRecord(in, header(rpc).SerializeAsString());
    fuzz::AppendRecord(in, chunk(rpc, 3).SerializeAsString());
    fuzz::WriteSeed(dir, std::string(names[k]) + "_ok", in);
    // Two chunks, the second crossing the row limit; and one with a region slice.
    std::string two = in;
    fuzz::AppendRecord(two, chunk(rpc, 7).SerializeAsString());
    fuzz::WriteSeed(dir, std::string(names[k]) + "_limit", two);
    v1::StreamRequest region = chunk(rpc, 2);
    region.mutable_chunk()->clear_hidden();
    region.mutable_chunk()->mutable_hidden_region()->set_region_id(1);
    region.mutable_chunk()->mutable_hidden_region()->set_byte_size(2 * kHidden * 2);
    std::string r = {static_cast<char>(k), 0};
    fuzz::AppendRecord(r, header(rpc).SerializeAsString());
    fuzz::AppendRecord(r, region.SerializeAsString());
    fuzz::WriteSeed(dir, std::string(names[k]) + "_region", r);
  }
  // ForwardBackward with REDUCTION_NONE and per-row loss gradients; a Score header with every option.
  v1::StreamRequest fb = header(RpcKind::kForwardBackward);
  fb.mutable_header()->set_reduction(v1::REDUCTION_NONE);
  fb.mutable_header()->clear_num_valid_tokens();
  fb.mutable_header()->set_label_smoothing(0.1f);
  fb.mutable_header()->set_z_loss(1e-4f);
  v1::StreamRequest fbc = chunk(RpcKind::kForwardBackward, 2);
  fbc.mutable_chunk()->add_grad_loss(1.0f);
  fbc.mutable_chunk()->add_grad_loss(0.5f);
  std::string in = {1, 0};
  fuzz::AppendRecord(in, fb.SerializeAsString());
  fuzz::AppendRecord(in, fbc.SerializeAsString());
  fuzz::WriteSeed(dir, "forward_backward_none", in);
  v1::StreamRequest sc = header(RpcKind::kScore);
  sc.mutable_header()->set_temperature(0.7f);
  sc.mutable_header()->set_softcap(30.0f);
  sc.mutable_header()->set_ignore_index(3);
  sc.mutable_header()->add_outputs(v1::OUTPUT_LOGPROBS);
  in = {0, 0};
  fuzz::AppendRecord(in, sc.SerializeAsString());
  fuzz::AppendRecord(in, chunk(RpcKind::kScore, 4).SerializeAsString());
  fuzz::WriteSeed(dir, "score_options", in);
  // Declared sequence counts whose sum overflows int64 (the validator summed them unchecked: UBSan).
  v1::StreamRequest big = header(RpcKind::kPolicyLoss);
  big.mutable_header()->mutable_policy()->add_sequence_valid_tokens(INT64_MAX);
  big.mutable_header()->mutable_policy()->add_sequence_valid_tokens(INT64_MAX);
  in = {3, 0};
  fuzz::AppendRecord(in, big.SerializeAsString());
  fuzz::AppendRecord(in, chunk(RpcKind::kPolicyLoss, 3).SerializeAsString());
  fuzz::WriteSeed(dir, "regress_policy_count_overflow", in);
}

}  // namespace
}  // namespace lce::server

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);  // invalid UTF-8 in string fields is logged, and fuzzed often
  lce::fuzz::MaybeWriteSeeds(lce::server::WriteSeeds);
  lce::server::Heads();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  lce::server::Run(data, size);
  return 0;
}
