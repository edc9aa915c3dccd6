// A pipelined stream's chunks in groups: consecutive chunks staged side by side (row offsets in the
// stream's staging slot), each submitted as it comes; the pipeline's caller runs the chunks of a group
// that queued up while the engine was busy as one engine call, and each chunk is then unstaged and
// answered on its own (hidden states and d_hidden in GPU memory, which are used where they are, where
// they are contiguous). A chunk never waits for a later one. The clients' 4 MiB chunks are 512 rows at
// H = 4096; an engine call per chunk re-reads and re-writes the request's fp32 dW each time
// (bench/RESULTS.md, "Chunks merged on the server").
#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

#include "status_macros.h"
#include "streamed_request.h"

namespace lce::server {

// Chunk `index`'s place in the ring: two groups' worth, so the chunk it replaces is in a group two back.
StreamedRequest::InFlightChunk& StreamedRequest::ChunkAt(int64_t index) {
  if (ring_.empty()) ring_.resize(merging_ ? 2 * kMaxGroupChunks : 2);
  std::unique_ptr<InFlightChunk>& c = ring_[static_cast<size_t>(index) % ring_.size()];
  if (c == nullptr) c = std::make_unique<InFlightChunk>();
  return *c;
}

// The group that opens next takes the staging slot (and its chunks the places in the ring) of the group
// two back: every chunk of that one must be done.
absl::Status StreamedRequest::WaitForSlot() {
  while (!submitted_.empty() && submitted_.front() + 2 <= groups_ + 1) LCE_RETURN_IF_ERROR(WaitOldest());
  return absl::OkStatus();
}

// Hidden states or d_hidden in GPU memory (the data plane's server memory on the GPU, the client's
// CUDA IPC memory) are used where they are: a chunk's join the group's call only where they follow the
// group's rows in the same region (the data plane's chunks do, in one stream's order).
bool StreamedRequest::FollowsOnDevice(const InFlightChunk& c, const InFlightChunk& f) const {
  const int64_t offset = group_.rows * row_bytes_;
  auto follows = [offset](const RegionRegistry::Slice& next, const RegionRegistry::Slice& first) {
    if (next.device != first.device) return false;
    return !next.device || (next.region == first.region && next.bytes.data() == first.bytes.data() + offset);
  };
  return follows(c.hidden_slice, f.hidden_slice) && follows(c.dh_slice, f.dh_slice);
}

// The open group takes the chunk when it fits and gives its call the same arrays (a chunk may leave
// out grad_loss or the entropy's upstream: then it cannot share the others' call).
bool StreamedRequest::JoinsGroup(const InFlightChunk& c) const {
  if (group_.chunks.empty()) return false;
  const InFlightChunk& f = *group_.chunks.front();
  if (!merging_ || !Fits(c.rows) || !FollowsOnDevice(c, f)) return false;
  auto same = [](const void* a, const void* b) { return (a == nullptr) == (b == nullptr); };
  return same(c.up.grad_loss, f.up.grad_loss) && same(c.up.grad_logprob, f.up.grad_logprob) &&
         same(c.up.grad_entropy, f.up.grad_entropy) && same(c.grads.d_hidden, f.grads.d_hidden);
}

// Stages the chunk after the open group's rows (a new group in the other slot when it does not join) and
// submits it at once.
absl::Status StreamedRequest::Group(InFlightChunk& c) {
  if (!group_.chunks.empty() && !JoinsGroup(c)) {
    group_ = ChunkGroup{};
    LCE_RETURN_IF_ERROR(WaitForSlot());
  }
  if (group_.chunks.empty()) {
    ++groups_;
    group_.slot = static_cast<int>(groups_ % 2);
    group_.capacity = merging_ ? std::max(config_.merge_chunk_rows, c.rows) : c.rows;
  }
  if (Staged(c)) {
    absl::StatusOr<LceService::StagedCall> staged = service_.StageOnDevice(
        *staging_.held[group_.slot], c.view, c.hidden_slice.device, row_bytes_, plan_->head->engine->shape().vocab_size,
        plan_->options.top_k, c.up, c.outs, c.grads, c.dh_slice.device, {group_.rows, group_.capacity});
    if (!staged.ok()) return ChunkError(c, staged.status());
    c.staged = *staged;
  } else {
    c.staged = LceService::StagedCall{c.view, c.up, c.outs, c.grads};
  }
  group_.chunks.push_back(&c);
  group_.rows += c.rows;
  ChunkStaging* st = Staged(c) ? staging_.held[group_.slot].get() : nullptr;
  // Closed once a chunk of this size would not fit: the next chunk then waits for its slot before it
  // takes a place in the ring.
  if (!merging_ || !Fits(c.rows)) group_ = ChunkGroup{};
  return SubmitChunk(c, merging_ ? groups_ : 0, st);
}

// The chunk's call (with the chunks of its group queued behind it: its views over all their rows, dW fresh
// where its own is), then its outputs back and its answer, on the pipeline's threads.
absl::Status StreamedRequest::SubmitChunk(InFlightChunk& c, int64_t group, ChunkStaging* st) {
  submitted_.push_back(groups_);
  pipeline_->SubmitMergeable(
      group, c.rows,
      [this, call = c.staged, first = c.index](int64_t rows, int64_t jobs) -> absl::Status {
        LceService::StagedCall merged = call;
        merged.rows.rows = rows;
        absl::Status s = service_.RunEngine(method_, op_, *plan_->head->engine, merged.rows, plan_->options, merged.up,
                                            merged.outs, merged.grads);
        return s.ok() ? s : CallError(first, jobs, s);
      },
      [this, st, &c]() -> absl::Status {
        absl::Status s = st != nullptr ? service_.UnstageFromDevice(*st, c.staged) : absl::OkStatus();
        if (s.ok()) s = Answer(c);
        return s.ok() ? s : ChunkError(c, s);
      });
  return absl::OkStatus();
}

// A call's error as its chunk's own: an engine's "row N: ..." (N from the call's first row) names the
// chunk that holds row N and the row within it, as a call of that chunk alone would; other errors name
// the call's first chunk, and the chunks after it that shared the call.
absl::Status StreamedRequest::CallError(int64_t first, int64_t jobs, const absl::Status& s) {
  int64_t row = -1;
  const absl::string_view m = s.message();
  const size_t colon = m.find(": ");
  if (absl::StartsWith(m, "row ") && colon != absl::string_view::npos &&
      !absl::SimpleAtoi(m.substr(4, colon - 4), &row)) {
    row = -1;
  }
  for (int64_t k = 0, seen = 0; k < jobs; ++k) {
    const InFlightChunk& c = ChunkAt(first + k);
    if (row >= seen && row < seen + c.rows) {
      return ChunkError(c, absl::Status(s.code(), absl::StrCat("row ", row - seen, m.substr(colon))));
    }
    seen += c.rows;
  }
  const absl::Status named = ChunkError(ChunkAt(first), s);
  if (jobs == 1) return named;
  return absl::Status(s.code(), absl::StrCat(named.message(), " (chunks ", first + 1, "..", first + jobs - 1,
                                             " shared its engine call)"));
}

}  // namespace lce::server
