#include "answer_assembly.h"

#include <algorithm>
#include <new>
#include <system_error>
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
                               absl::Span<uint8_t> d_hidden_out, int32_t top_k)
    : rows_(rows),
      row_bytes_(row_bytes),
      top_k_(top_k),
      out_(out),
      d_hidden_out_(d_hidden_out),
      seen_(static_cast<size_t>(rows), 0) {}

absl::Status AnswerAssembly::Claim(int64_t first, int64_t n) {
  for (int64_t r = first; r < first + n; ++r) {
    if (seen_[static_cast<size_t>(r)]++) return absl::InternalError(absl::StrCat("row ", r, " was answered twice"));
  }
  covered_ += n;
  return absl::OkStatus();
}

template <typename T>
absl::Status AnswerAssembly::Check(const google::protobuf::RepeatedField<T>& src, int64_t width, const char* name,
                                   int64_t first, int64_t n) const {
  if (!src.empty() && src.size() != n * width) {  // empty: not selected
    return absl::InternalError(absl::StrCat("answer for rows [", first, ", ", first + n, ") has ", src.size(), " ",
                                            name, " values, not ", n * width));
  }
  return absl::OkStatus();
}

template <typename T>
void AnswerAssembly::Place(const google::protobuf::RepeatedField<T>& src, int64_t width, std::vector<T>& dst,
                           int64_t first, std::atomic<int64_t>& count) {
  if (src.empty()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);  // sized on first use; parts then write disjoint rows
    if (dst.empty()) dst.resize(static_cast<size_t>(rows_ * width));
  }
  std::copy(src.begin(), src.end(), dst.data() + first * width);
  count += src.size() / width;
}

absl::Status AnswerAssembly::PlaceRowValues(const v1::ChunkResult& c, int64_t first, int64_t n) {
  const int64_t k = std::max<int64_t>(top_k_, 1);
  for (absl::Status s : {Check(c.logprobs(), 1, "logprob", first, n), Check(c.entropy(), 1, "entropy", first, n),
                         Check(c.loss(), 1, "loss", first, n), Check(c.z_loss(), 1, "z_loss", first, n),
                         Check(c.argmax(), 1, "argmax", first, n), Check(c.top_tokens(), k, "top_tokens", first, n),
                         Check(c.top_logprobs(), k, "top_logprobs", first, n)}) {
    if (!s.ok()) return s;
  }
  Rankings& rk = out_->rankings;
  Place(c.logprobs(), 1, out_->logprobs, first, counts_[0]);
  Place(c.entropy(), 1, out_->entropy, first, counts_[1]);
  Place(c.loss(), 1, out_->loss, first, counts_[2]);
  Place(c.z_loss(), 1, out_->z_loss, first, counts_[3]);
  Place(c.argmax(), 1, rk.argmax, first, counts_[4]);
  Place(c.top_tokens(), k, rk.top_tokens, first, counts_[5]);
  Place(c.top_logprobs(), k, rk.top_logprobs, first, counts_[6]);
  return absl::OkStatus();
}

void AnswerAssembly::SizeDHiddenAhead() {
  constexpr int64_t kAheadBytes = 8 << 20;  // smaller: sized at the first answer (a thread costs more)
  if (!d_hidden_out_.empty() || rows_ * row_bytes_ < kAheadBytes) return;
  std::vector<uint8_t>* d_hidden = &out_->d_hidden;
  const size_t bytes = static_cast<size_t>(rows_ * row_bytes_);
  try {
    sizing_ = std::async(std::launch::async, [d_hidden, bytes] {
      try {
        d_hidden->resize(bytes);
      } catch (const std::bad_alloc&) {  // DHiddenAt sizes it again, as without this
      }
    });
  } catch (const std::system_error&) {  // no thread: DHiddenAt sizes it
  }
}

void AnswerAssembly::AwaitSizing() {
  if (sizing_.valid()) sizing_.get();
}

uint8_t* AnswerAssembly::DHiddenAt(int64_t first) {
  if (!d_hidden_out_.empty()) return d_hidden_out_.data() + first * row_bytes_;
  std::lock_guard<std::mutex> lock(mu_);
  AwaitSizing();
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
  const char* names[] = {"logprobs", "entropy", "loss", "z_loss", "argmax", "top_tokens", "top_logprobs"};
  std::vector<std::pair<int64_t, const char*>> counts = {{n_dhidden_.load(), "d_hidden"}};
  for (int i = 0; i < 7; ++i) counts.push_back({counts_[i].load(), names[i]});
  for (auto [count, what] : counts) {
    if (count != 0 && count != rows_) {
      return absl::InternalError(absl::StrCat("the server answered ", what, " for ", count, " of ", rows_, " rows"));
    }
  }
  return absl::OkStatus();
}

absl::Status AnswerAssembly::Finish(const std::vector<PartSummary>& summaries, const v1::RequestHeader& header,
                                    bool split) {
  AwaitSizing();
  if (n_dhidden_ == 0 && d_hidden_out_.empty()) out_->d_hidden = {};  // sized ahead for a d_hidden that did not come
  if (absl::Status s = CheckCovered(); !s.ok()) return s;
  // Parts' losses add up (RequestHeader.partial); so do their valid tokens, which must then match
  // the declared count that every part's mean used.
  out_->reduced_loss = 0;
  out_->valid_tokens = 0;
  out_->head_version = summaries[0].head_version;
  for (const PartSummary& p : summaries) {
    out_->reduced_loss += p.loss;
    out_->valid_tokens += p.valid_tokens;
    // A split request's parts share one contribution (RequestHeader.split_id): its id once.
    for (uint64_t id : p.pending_grads) {
      if (std::find(out_->pending_grads.begin(), out_->pending_grads.end(), id) == out_->pending_grads.end()) {
        out_->pending_grads.push_back(id);
      }
    }
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
