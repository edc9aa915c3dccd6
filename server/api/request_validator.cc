#include "request_validator.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "status_macros.h"
#include "wire_types.h"

namespace lce::server {

const char* RpcName(RpcKind rpc) {
  switch (rpc) {
    case RpcKind::kScore: return "Score";
    case RpcKind::kForwardBackward: return "ForwardBackward";
    case RpcKind::kBackward: return "Backward";
    case RpcKind::kPolicyLoss: return "PolicyLoss";
  }
  return "?";
}

namespace {

// The head a header names, at the version it pins, of its hidden size and dtype.
absl::StatusOr<std::shared_ptr<const ServedHead>> HeadOf(const v1::RequestHeader& h, const HeadStore& heads) {
  absl::StatusOr<std::shared_ptr<const ServedHead>> head = heads.Get(h.head());
  if (!head.ok()) return head.status();
  const ServedHead& served = **head;
  const HeadShape& shape = served.engine->shape();
  if (h.head_version() != 0 && h.head_version() != served.version) {
    return absl::FailedPreconditionError(absl::StrCat("head '", served.name, "' is at version ", served.version,
                                                      ", request pins version ", h.head_version()));
  }
  if (h.hidden_size() != shape.hidden_size) {
    return absl::InvalidArgumentError(absl::StrCat("header.hidden_size is ", h.hidden_size(), " but head '",
                                                   served.name, "' has hidden size ", shape.hidden_size));
  }
  absl::StatusOr<DType> dtype = FromWire(h.dtype());
  if (!dtype.ok()) return absl::InvalidArgumentError(absl::StrCat("header.", dtype.status().message()));
  if (*dtype != shape.dtype) {
    return absl::InvalidArgumentError(absl::StrCat("header.dtype is ", DTypeName(*dtype), " but head '", served.name,
                                                   "' is ", DTypeName(shape.dtype),
                                                   ": send hidden states in the head's dtype"));
  }
  return head;
}

// PolicyLoss's options into the plan: the clip range, the coefficients, the aggregation and the
// sequences' valid-token counts.
absl::Status ReadPolicy(const v1::PolicyLossOptions& p, RequestPlan& plan) {
  if (!(p.clip_low() > 0.0f && p.clip_low() < 1.0f) || !(p.clip_high() > 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.clip_low must be in (0, 1) and clip_high > 0, got ", p.clip_low(), ", ", p.clip_high()));
  }
  if (p.dual_clip() != 0.0f && !(p.dual_clip() > 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("policy.dual_clip must be > 1 (or 0 = off), got ", p.dual_clip()));
  }
  if (p.kl_coef() < 0.0f || p.entropy_coef() < 0.0f) {
    return absl::InvalidArgumentError("policy.kl_coef and policy.entropy_coef must be >= 0");
  }
  if (p.sequence_valid_tokens().empty()) {
    return absl::InvalidArgumentError(
        "policy.sequence_valid_tokens is required: the non-ignored token count of each sequence of the request "
        "(one entry when every row is in sequence 0; the client libraries fill it in)");
  }
  plan.policy = {p.clip_low(),     p.clip_high(), p.dual_clip(),
                 p.entropy_coef(), p.kl_coef(),   p.kl_estimator() == v1::KL_ESTIMATOR_K3 ? KlKind::kK3 : KlKind::kK1};
  switch (p.aggregation()) {
    case v1::AGGREGATION_UNSPECIFIED:
    case v1::AGGREGATION_TOKEN_MEAN: plan.aggregation = AggregationKind::kTokenMean; break;
    case v1::AGGREGATION_SEQ_MEAN_TOKEN_SUM: plan.aggregation = AggregationKind::kSeqMeanTokenSum; break;
    case v1::AGGREGATION_SEQ_MEAN_TOKEN_MEAN: plan.aggregation = AggregationKind::kSeqMeanTokenMean; break;
    default: return absl::InvalidArgumentError(absl::StrCat("unknown aggregation ", p.aggregation()));
  }
  for (int64_t n : p.sequence_valid_tokens()) {
    if (n < 0) return absl::InvalidArgumentError("policy.sequence_valid_tokens must be >= 0");
    // Their sum must be a number (signed overflow is undefined: found by tests/fuzz).
    if (__builtin_add_overflow(plan.total_valid_tokens, n, &plan.total_valid_tokens)) {
      return absl::InvalidArgumentError("policy.sequence_valid_tokens add up to more than 2^63 - 1 tokens");
    }
    plan.sequence_valid_tokens.push_back(n);
  }
  return absl::OkStatus();
}

// A split request's parts (split_id, split_parts): each a partial request accumulating dW.
absl::Status ReadSplit(const v1::RequestHeader& h, RequestPlan& plan) {
  if (h.split_id() != 0 &&
      (!h.partial() || !h.accumulate_weight_grad() || h.split_parts() < 2 || h.split_parts() > 64)) {
    return absl::InvalidArgumentError(
        absl::StrCat("split_id names the parts of a split request that accumulates dW: it "
                     "needs partial, accumulate_weight_grad and split_parts in [2, 64] "
                     "(got ",
                     h.split_parts(), ")"));
  }
  if (h.split_id() == 0 && h.split_parts() != 0) {
    return absl::InvalidArgumentError("split_parts needs split_id");
  }
  plan.split_id = h.split_id();
  plan.split_parts = h.split_parts();
  return absl::OkStatus();
}

// ForwardBackward's reduction (mean by default) and, for the mean, the whole request's valid-token count.
absl::Status ReadReduction(const v1::RequestHeader& h, RequestPlan& plan) {
  plan.reduction = h.reduction() == v1::REDUCTION_UNSPECIFIED ? v1::REDUCTION_MEAN : h.reduction();
  if (!v1::Reduction_IsValid(plan.reduction)) {
    return absl::InvalidArgumentError(absl::StrCat("unknown reduction ", h.reduction()));
  }
  if (plan.reduction == v1::REDUCTION_MEAN) {
    if (!h.has_num_valid_tokens() || h.num_valid_tokens() < 0) {
      return absl::InvalidArgumentError(
          "REDUCTION_MEAN needs header.num_valid_tokens: the number of rows of the whole request whose "
          "target is not ignore_index (the client libraries fill it in)");
    }
    plan.declared_valid_tokens = h.num_valid_tokens();
  } else if (h.has_num_valid_tokens()) {
    return absl::InvalidArgumentError("num_valid_tokens applies to REDUCTION_MEAN only");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<RequestPlan> StreamRequestValidator::ValidateHeader(const v1::RequestHeader& h) const {
  RequestPlan plan;
  plan.rpc = rpc_;
  LCE_ASSIGN_OR_RETURN(plan.head, HeadOf(h, heads_));
  LceOptions& o = plan.options;
  o.temperature = h.has_temperature() ? h.temperature() : 1.0f;
  o.softcap = h.softcap();
  o.ignore_index = h.has_ignore_index() ? h.ignore_index() : -100;
  o.allow_tf32 = h.allow_tf32();
  const bool is_fb = rpc_ == RpcKind::kForwardBackward;
  const bool is_pl = rpc_ == RpcKind::kPolicyLoss;
  if (h.has_policy() && !is_pl) return absl::InvalidArgumentError("header.policy applies to PolicyLoss only");
  if (h.accumulate_weight_grad() && !is_fb && !is_pl && rpc_ != RpcKind::kBackward) {
    return absl::InvalidArgumentError("accumulate_weight_grad applies to ForwardBackward, PolicyLoss and Backward only");
  }
  plan.accumulate_weight_grad = h.accumulate_weight_grad();
  if (h.defer_weight_grad() && !h.accumulate_weight_grad()) {
    return absl::InvalidArgumentError("defer_weight_grad needs accumulate_weight_grad");
  }
  plan.defer_weight_grad = h.defer_weight_grad();
  if (is_pl) {
    LCE_RETURN_IF_ERROR(ReadPolicy(h.policy(), plan));
  }
  if (!is_fb && (h.label_smoothing() != 0.0f || h.z_loss() != 0.0f || h.reduction() != v1::REDUCTION_UNSPECIFIED ||
                 h.has_num_valid_tokens())) {
    return absl::InvalidArgumentError(absl::StrCat("reduction, label_smoothing, z_loss and num_valid_tokens ",
                                                   "apply to ForwardBackward only, not ", RpcName(rpc_)));
  }
  o.label_smoothing = h.label_smoothing();
  o.z_loss = h.z_loss();
  LCE_RETURN_IF_ERROR(ValidateOptions(o));

  plan.partial = h.partial();
  LCE_RETURN_IF_ERROR(ReadSplit(h, plan));
  plan.sends_ahead = h.sends_ahead();
  LCE_RETURN_IF_ERROR(ValidateOutputs(h, plan));
  if (is_fb) LCE_RETURN_IF_ERROR(ReadReduction(h, plan));
  LCE_RETURN_IF_ERROR(ValidateClassWeights(h, plan));
  return plan;
}

// The outputs asked for (the RPC's defaults when none) and the ranking's size.
absl::Status StreamRequestValidator::ValidateOutputs(const v1::RequestHeader& h, RequestPlan& plan) const {
  const bool is_fb = rpc_ == RpcKind::kForwardBackward, is_pl = rpc_ == RpcKind::kPolicyLoss;
  if (h.outputs().empty()) {
    plan.want_logprobs = rpc_ == RpcKind::kScore;
    plan.want_entropy = rpc_ == RpcKind::kScore;
    plan.want_loss = is_fb || is_pl;
  }
  for (int out : h.outputs()) {
    switch (out) {
      case v1::OUTPUT_LOGPROBS: plan.want_logprobs = true; break;
      case v1::OUTPUT_ENTROPY: plan.want_entropy = true; break;
      case v1::OUTPUT_LOSS:
        if (!is_fb && !is_pl) return absl::InvalidArgumentError("OUTPUT_LOSS is a ForwardBackward or PolicyLoss output");
        plan.want_loss = true;
        break;
      case v1::OUTPUT_Z_LOSS:
        if (!is_fb) return absl::InvalidArgumentError("OUTPUT_Z_LOSS is a ForwardBackward output");
        plan.want_z_loss = true;
        break;
      case v1::OUTPUT_ARGMAX: plan.want_argmax = true; break;
      case v1::OUTPUT_TOP_K: plan.want_top_k = true; break;
      default: return absl::InvalidArgumentError(absl::StrCat("unknown output ", out));
    }
  }
  if ((plan.want_argmax || plan.want_top_k) && is_pl) {
    return absl::InvalidArgumentError("OUTPUT_ARGMAX and OUTPUT_TOP_K are Score, ForwardBackward and Backward outputs");
  }
  if (plan.want_top_k != (h.top_k() != 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.top_k (", h.top_k(), ") goes with OUTPUT_TOP_K: set both or neither"));
  }
  if (plan.want_top_k && (h.top_k() < 1 || h.top_k() > kMaxTopK)) {
    return absl::InvalidArgumentError(absl::StrCat("header.top_k must be in [1, ", kMaxTopK, "], got ", h.top_k()));
  }
  plan.options.top_k = plan.want_top_k ? h.top_k() : (plan.want_argmax ? 1 : 0);
  return absl::OkStatus();
}

absl::Status StreamRequestValidator::ValidateClassWeights(const v1::RequestHeader& h, RequestPlan& plan) const {
  if (h.class_weights().empty()) return absl::OkStatus();
  if (rpc_ != RpcKind::kForwardBackward)
    return absl::InvalidArgumentError("class_weights apply to ForwardBackward only");
  if (plan.reduction == v1::REDUCTION_MEAN) {
    return absl::InvalidArgumentError(
        "class_weights with REDUCTION_MEAN: the mean's denominator is the sum of the targets' weights; ask for "
        "REDUCTION_SUM and divide by it (the client libraries do)");
  }
  const int64_t V = plan.head->engine->shape().vocab_size;
  if (h.class_weights_size() != V) {
    return absl::InvalidArgumentError(absl::StrCat("class_weights has ", h.class_weights_size(), " values; head '",
                                                   plan.head->name, "' has ", V, " vocabulary ids"));
  }
  for (int64_t c = 0; c < V; ++c) {
    const float w = h.class_weights(static_cast<int>(c));
    if (!std::isfinite(w)) {
      return absl::InvalidArgumentError(absl::StrCat("class_weights[", c, "] is ", w, "; weights must be finite"));
    }
  }
  plan.class_weights.assign(h.class_weights().begin(), h.class_weights().end());
  return absl::OkStatus();
}

absl::StatusOr<int64_t> StreamRequestValidator::ValidateChunk(const RequestPlan& plan, const v1::RowChunk& c,
                                                              int64_t chunk_index, int64_t first_row) const {
  const HeadShape& shape = plan.head->engine->shape();
  const int64_t rows = c.targets_size();
  const std::string where = absl::StrCat("chunk ", chunk_index, ": ");
  if (rows == 0) return absl::InvalidArgumentError(absl::StrCat(where, "no rows (targets is empty)"));
  const int64_t row_bytes = shape.row_bytes();
  if (c.has_hidden_region()) {
    // Co-located: the hidden states are in a shared-memory region; the service resolves and
    // bounds-checks the slice (RegionRegistry::Resolve).
    if (!c.hidden().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(where, "hidden and hidden_region are both set; send one"));
    }
  } else if (static_cast<int64_t>(c.hidden().size()) != rows * row_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(where, "hidden holds ", c.hidden().size(), " bytes, but ", rows,
                                                   " targets x hidden size ", shape.hidden_size, " x ",
                                                   DTypeSize(shape.dtype), " bytes (", DTypeName(shape.dtype),
                                                   ") = ", rows * row_bytes));
  }
  if (limits_.max_rows_per_request > 0 && first_row + rows > limits_.max_rows_per_request) {
    return absl::ResourceExhaustedError(absl::StrCat(where, "request exceeds ", limits_.max_rows_per_request,
                                                     " rows, the server's limit per request"));
  }
  const int32_t ignore = plan.options.ignore_index;
  for (int64_t i = 0; i < rows; ++i) {
    const int32_t y = c.targets(static_cast<int>(i));
    if (y != ignore && (y < 0 || y >= shape.vocab_size)) {
      return absl::InvalidArgumentError(absl::StrCat(where, "row ", first_row + i, ": target ", y,
                                                     " is outside [0, ", shape.vocab_size,
                                                     ") and is not ignore_index (", ignore, ")"));
    }
  }
  auto check_len = [&](int n, const char* name, bool allowed) -> absl::Status {
    if (n == 0) return absl::OkStatus();
    if (!allowed) {
      return absl::InvalidArgumentError(absl::StrCat(where, name, " is not used by ", RpcName(rpc_),
                                                     (rpc_ == RpcKind::kForwardBackward ? " unless reduction is NONE" : "")));
    }
    if (n != rows) {
      return absl::InvalidArgumentError(absl::StrCat(where, name, " has ", n, " values for ", rows, " rows"));
    }
    return absl::OkStatus();
  };
  const bool is_bw = rpc_ == RpcKind::kBackward;
  LCE_RETURN_IF_ERROR(check_len(c.grad_logprob_size(), "grad_logprob", is_bw));
  LCE_RETURN_IF_ERROR(check_len(c.grad_entropy_size(), "grad_entropy", is_bw));
  const bool loss_grads = rpc_ == RpcKind::kForwardBackward && plan.reduction == v1::REDUCTION_NONE;
  LCE_RETURN_IF_ERROR(check_len(c.grad_loss_size(), "grad_loss", loss_grads));
  const bool is_pl = rpc_ == RpcKind::kPolicyLoss;
  LCE_RETURN_IF_ERROR(check_len(c.old_logprobs_size(), "old_logprobs", is_pl));
  LCE_RETURN_IF_ERROR(check_len(c.advantages_size(), "advantages", is_pl));
  LCE_RETURN_IF_ERROR(check_len(c.ref_logprobs_size(), "ref_logprobs", is_pl));
  LCE_RETURN_IF_ERROR(check_len(c.sequence_ids_size(), "sequence_ids", is_pl));
  if (is_pl) {
    if (c.old_logprobs_size() == 0 || c.advantages_size() == 0) {
      return absl::InvalidArgumentError(absl::StrCat(where, "PolicyLoss needs old_logprobs and advantages for every row"));
    }
    if (plan.policy.kl_coef > 0.0f && c.ref_logprobs_size() == 0) {
      return absl::InvalidArgumentError(absl::StrCat(where, "policy.kl_coef > 0 needs ref_logprobs for every row"));
    }
    const int64_t num_seq = static_cast<int64_t>(plan.sequence_valid_tokens.size());
    for (int64_t i = 0; i < c.sequence_ids_size(); ++i) {
      const int32_t sid = c.sequence_ids(static_cast<int>(i));
      if (sid < 0 || sid >= num_seq) {
        return absl::InvalidArgumentError(absl::StrCat(where, "row ", first_row + i, ": sequence id ", sid,
                                                       " is outside [0, ", num_seq, ")"));
      }
    }
    if (c.sequence_ids_size() == 0 && num_seq != 1) {
      return absl::InvalidArgumentError(absl::StrCat(where, "sequence_ids are required when the request declares ",
                                                     num_seq, " sequences"));
    }
  }
  return rows;
}

}  // namespace lce::server
