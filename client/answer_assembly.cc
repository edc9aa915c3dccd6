#include "answer_assembly.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace lce::client {

void PartSummary::Read(const v1::RequestSummary& s) {
  loss = s.loss();
  valid_tokens = s.valid_tokens();
  head_version = s.head_version();
  pending_grads.assign(s.pending_grad_ids().begin(), s.pending_grad_ids().end());
}

AnswerAssembly::AnswerAssembly(int64_t rows, int64_t row_bytes, ForwardBackwardResult* out,
                               absl::Span<uint8_t> d_hidden_out)
    : rows_(rows), row_bytes_(row_bytes), out_(out), d_hidden_out_(d_hidden_out), seen_(static_cast<size_t>(rows), 0) {}

absl::Status AnswerAssembly::Claim(int64_t first, int64_t n) {
  for (int64_t r = first; r < first + n; ++r) {
    if (seen_[static_cast<size_t>(r)]++) return absl::InternalError(absl::StrCat("row ", r, " was answered twice"));
  }
  covered_ += n;
  return absl::OkStatus();
}

float* AnswerAssembly::Floats(std::vector<float>& v) {
  std::lock_guard<std::mutex> lock(mu_);
  if (v.empty()) v.resize(static_cast<size_t>(rows_));
  return v.data();
}

void AnswerAssembly::Place(const google::protobuf::RepeatedField<float>& src, std::vector<float>& dst, int64_t first,
                           std::atomic<int64_t>& count) {
  if (src.empty()) return;  // not selected
  std::copy(src.begin(), src.end(), Floats(dst) + first);
  count += src.size();
}

absl::Status AnswerAssembly::PlaceRowValues(const v1::ChunkResult& c, int64_t first, int64_t n) {
  // Each output an answer carries has a value for each of its rows (an empty one: not selected).
  const std::pair<const google::protobuf::RepeatedField<float>*, const char*> outputs[] = {
      {&c.logprobs(), "logprob"}, {&c.entropy(), "entropy"}, {&c.loss(), "loss"}};
  for (const auto& [src, what] : outputs) {
    if (!src->empty() && src->size() != n) {
      return absl::InternalError(
          absl::StrCat("answer for rows [", first, ", ", first + n, ") has ", src->size(), " ", what, " values"));
    }
  }
  Place(c.logprobs(), out_->logprobs, first, n_logprobs_);
  Place(c.entropy(), out_->entropy, first, n_entropy_);
  Place(c.loss(), out_->loss, first, n_loss_);
  return absl::OkStatus();
}

uint8_t* AnswerAssembly::DHiddenAt(int64_t first) {
  if (!d_hidden_out_.empty()) return d_hidden_out_.data() + first * row_bytes_;
  std::lock_guard<std::mutex> lock(mu_);
  if (out_->d_hidden.empty()) out_->d_hidden.resize(static_cast<size_t>(rows_ * row_bytes_));
  return out_->d_hidden.data() + first * row_bytes_;
}

absl::Status AnswerAssembly::PlaceDHidden(const std::string& bytes, int64_t first, int64_t n) {
  if (bytes.empty()) return absl::OkStatus();
  if (static_cast<int64_t>(bytes.size()) != n * row_bytes_) {
    return absl::InternalError(absl::StrCat("answer for rows [", first, ", ", first + n, ") has ", bytes.size(),
                                            " d_hidden bytes, not ", n * row_bytes_));
  }
  std::copy(bytes.begin(), bytes.end(), DHiddenAt(first));
  n_dhidden_ += n;
  return absl::OkStatus();
}

absl::Status AnswerAssembly::CheckCovered() const {
  if (covered_ != rows_) {
    return absl::InternalError(absl::StrCat("the server answered ", covered_.load(), " of ", rows_, " rows"));
  }
  for (auto [count, what] : {std::pair{n_logprobs_.load(), "logprobs"}, std::pair{n_entropy_.load(), "entropy"},
                             std::pair{n_loss_.load(), "loss"}, std::pair{n_dhidden_.load(), "d_hidden"}}) {
    if (count != 0 && count != rows_) {
      return absl::InternalError(absl::StrCat("the server answered ", what, " for ", count, " of ", rows_, " rows"));
    }
  }
  return absl::OkStatus();
}

absl::Status AnswerAssembly::Finish(const std::vector<PartSummary>& summaries, const v1::RequestHeader& header,
                                    bool split) {
  if (absl::Status s = CheckCovered(); !s.ok()) return s;
  // Parts' losses add up (RequestHeader.partial); so do their valid tokens, which must then match
  // the declared count that every part's mean used.
  out_->reduced_loss = 0;
  out_->valid_tokens = 0;
  out_->head_version = summaries[0].head_version;
  for (const PartSummary& p : summaries) {
    out_->reduced_loss += p.loss;
    out_->valid_tokens += p.valid_tokens;
    out_->pending_grads.insert(out_->pending_grads.end(), p.pending_grads.begin(), p.pending_grads.end());
    if (p.head_version != out_->head_version) {
      return absl::AbortedError(absl::StrCat("the head changed version during the request (", out_->head_version,
                                             " and ", p.head_version, "); retry it"));
    }
  }
  if (split && header.has_num_valid_tokens() && out_->valid_tokens != header.num_valid_tokens()) {
    return absl::InvalidArgumentError(absl::StrCat("header.num_valid_tokens declared ", header.num_valid_tokens(),
                                                   " but the request has ", out_->valid_tokens,
                                                   " non-ignored rows; the returned d_hidden is wrong, discard it"));
  }
  return absl::OkStatus();
}

}  // namespace lce::client
