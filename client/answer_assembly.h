// Where the answers of one request come together: every stream of the request (a part of its rows)
// places its answers here at their rows, and the request's result is checked and completed here
// once all parts are done. A new per-row output of the API is added in this file and its .cc only.
// Private to the client library.
#pragma once

#include <atomic>
#include <cstdint>
#include <future>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "lce/client/lce_client.h"

namespace lce::client {

// What one stream's summary message said (RequestHeader.partial: a part's loss and valid tokens).
struct PartSummary {
  double loss = 0;
  int64_t valid_tokens = 0;
  int64_t head_version = 0;
  std::vector<uint64_t> pending_grads;

  void Read(const v1::RequestSummary& s);
};

// Outputs are sized on first use (under a lock); afterwards the parts write disjoint row ranges
// without it. Thread-safe for parts that answer disjoint rows.
class AnswerAssembly {
 public:
  // `out`: the caller's result; `d_hidden_out`: the caller's destination for d_hidden (empty: the
  // result's d_hidden).
  // `top_k`: the header's (values a row of top_tokens and top_logprobs).
  AnswerAssembly(int64_t rows, int64_t row_bytes, ForwardBackwardResult* out, absl::Span<uint8_t> d_hidden_out,
                 int32_t top_k = 0);

  int64_t rows() const { return rows_; }
  int64_t row_bytes() const { return row_bytes_; }

  // Marks rows [first, first + n) answered: an error if one was answered before.
  absl::Status Claim(int64_t first, int64_t n);
  // Places an answer's per-row values (logprobs, entropy, loss, z_loss, the rankings) at rows [first, first + n).
  absl::Status PlaceRowValues(const v1::ChunkResult& c, int64_t first, int64_t n);
  // Places d_hidden bytes that came in the answer at rows [first, first + n).
  absl::Status PlaceDHidden(const std::string& bytes, int64_t first, int64_t n);
  // A call that returns d_hidden into the result (not into d_hidden_out) sizes it here, before its
  // first answer: a large one on a thread of its own, so that the pages' first touch (the kernel
  // zeroes them: ~40-50 ms for 128 MiB on one core) overlaps the upload and the server's compute
  // instead of holding the first answer while the other streams wait. Finish empties it again if no
  // d_hidden came.
  void SizeDHiddenAhead();
  // Where rows [first, ...) of d_hidden go (a data-plane download writes there), and the count of
  // rows written so.
  uint8_t* DHiddenAt(int64_t first);
  void CountDHidden(int64_t n) { n_dhidden_ += n; }

  // Once every part is done: every row answered exactly once, each output for all rows or none;
  // then the parts' summaries (in part order) into the result. `split`: the request went as
  // several parts, whose valid tokens must add up to the header's declared count.
  absl::Status Finish(const std::vector<PartSummary>& summaries, const v1::RequestHeader& header, bool split);

 private:
  template <typename T>
  absl::Status Check(const google::protobuf::RepeatedField<T>& src, int64_t width, const char* name, int64_t first,
                     int64_t n) const;
  template <typename T>
  void Place(const google::protobuf::RepeatedField<T>& src, int64_t width, std::vector<T>& dst, int64_t first,
             std::atomic<int64_t>& count);
  absl::Status CheckCovered() const;
  void AwaitSizing();  // SizeDHiddenAhead's thread, if one runs: done, its result in out_->d_hidden

  const int64_t rows_, row_bytes_, top_k_;
  ForwardBackwardResult* const out_;
  const absl::Span<uint8_t> d_hidden_out_;
  std::mutex mu_;
  std::future<void> sizing_;   // SizeDHiddenAhead's; waited for under mu_ (and by the destructor)
  std::vector<uint8_t> seen_;  // rows answered; each part touches only its own range
  std::atomic<int64_t> covered_{0}, n_dhidden_{0};
  std::atomic<int64_t> counts_[7] = {};  // rows answered of each output, in PlaceRowValues' order
};

}  // namespace lce::client
