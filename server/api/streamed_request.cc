#include "streamed_request.h"

#include <algorithm>
#include <chrono>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "grpc_status.h"
#include "lce/training.h"
#include "status_macros.h"
#include "wire_types.h"

namespace lce::server {
namespace {

// Points a repeated float field at `n` new zeroed elements and returns their storage.
template <typename T>
T* Grow(google::protobuf::RepeatedField<T>* field, int64_t n) {
  field->Resize(static_cast<int>(n), T{});
  return field->mutable_data();
}

}  // namespace

StreamedRequest::StreamedRequest(LceService& service, RpcKind rpc, grpc::ServerContext* ctx, Stream* stream,
                                 bool one_message)
    : service_(service),
      config_(service.config_),
      rpc_(rpc),
      ctx_(ctx),
      stream_(stream),
      work_(RequestWork::Current()),
      one_message_(one_message),
      is_fb_(rpc == RpcKind::kForwardBackward),
      is_bw_(rpc == RpcKind::kBackward),
      is_pl_(rpc == RpcKind::kPolicyLoss),
      method_(RpcName(rpc)),
      op_(is_fb_ ? "forward_backward" : is_bw_ ? "backward" : is_pl_ ? "policy_loss" : "score") {}

StreamedRequest::~StreamedRequest() {
  pipeline_.reset();
  // A client that stops reading must not hold the handler (and its slot) in the last writes.
  if (writer_.has_value()) {
    bool drained = false;
    (void)service_.WithinLimit(ctx_, *stream_, service_.IdleWait("the client to read the last answers"),
                               [&] { return writer_->Finish(); }, &drained);
  }
}

template <typename F>
auto StreamedRequest::Timed(double RequestWork::*acc, F&& f) {
  if (work_ == nullptr) return f();
  const auto t0 = std::chrono::steady_clock::now();
  auto r = f();
  work_->*acc += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

absl::Status StreamedRequest::Run() {
  absl::Status g = Stages();
  // A request that failed adds nothing to dW: its pending contribution goes (after the pipeline's
  // last call into it has ended).
  if (contribution_.id != 0) {
    pipeline_.reset();
    service_.EndContribution(*plan_->head, contribution_.id, /*ok=*/false, /*defer=*/false).IgnoreError();
  }
  return g;
}

absl::Status StreamedRequest::Stages() {
  LCE_RETURN_IF_ERROR(Admit());
  for (;;) {
    bool more = false;
    LCE_RETURN_IF_ERROR(Receive(&more));
    if (!more) break;
    // A chunk that will open a group takes the place of one two groups back: done first.
    if (pipelined_ && group_.chunks.empty()) LCE_RETURN_IF_ERROR(WaitForSlot());
    InFlightChunk& c = ChunkAt(chunk_index_);
    c.msg.Swap(&msg_);
    LCE_RETURN_IF_ERROR(Accept(c));
    LCE_RETURN_IF_ERROR(Prepare(c));
    LCE_RETURN_IF_ERROR(pipelined_ ? Group(c) : Compute(c));
  }
  return Finish();
}

// The header, the head's version, then the slot: a client that opens streams and sends nothing
// holds none (and is dropped at the header timeout).
absl::Status StreamedRequest::Admit() {
  LCE_RETURN_IF_ERROR(service_.ReadHeader(rpc_, ctx_, stream_, &plan_, &head_use_));
  LCE_RETURN_IF_ERROR(TakeSlot());
  validator_.emplace(rpc_, *service_.heads_, config_.limits);
  const HeadShape& shape = plan_->head->engine->shape();
  row_bytes_ = shape.row_bytes();
  num_seq_ = static_cast<int64_t>(plan_->sequence_valid_tokens.size());
  seq_seen_.assign(static_cast<size_t>(num_seq_), 0);
  // Pipelined streams: calls and answers on threads of their own, on GPU engines (one GPU, or a
  // tensor-parallel group's front, whose merged chunks are staged in host memory) where the client
  // sends ahead (a client waiting for an answer before it sends more would wait for ever on a server
  // reading ahead), except PolicyLoss's (host work between its two calls).
  const bool gpu = config_.cuda_device >= 0 || plan_->head->engine->backend() == "cuda";
  pipelined_ = (gpu ? config_.pipeline_chunks : config_.pipeline_chunks_on_cpu) && plan_->sends_ahead && !is_pl_;
  // Its threads start now, while the first chunk is on its way. Where they cannot (a task limit),
  // the stream is served serially on this thread: slower, never an abort (issue 35, item 4).
  if (pipelined_) {
    absl::StatusOr<std::unique_ptr<EngineCallPipeline>> p = EngineCallPipeline::Start(work_);
    if (p.ok()) pipeline_ = *std::move(p);
    pipelined_ = p.ok();
  }
  merging_ = pipelined_ && config_.merge_chunk_rows > 1;
  // Answers leave from their own thread while the next chunk computes (two in flight at most; on
  // this thread where it cannot start); a pipelined stream's finish thread writes them itself, a
  // Call's handler into its response.
  writer_.emplace(stream_, 2, /*own_thread=*/!pipelined_ && !one_message_);
  return absl::OkStatus();
}

absl::Status StreamedRequest::TakeSlot() {
  slot_.emplace(service_.streams_in_flight_, config_.max_concurrent_streams);
  auto refuse = [&](const char* reason, std::string message) {
    if (config_.metrics != nullptr) config_.metrics->rejections.WithLabels({reason}).Increment();
    return absl::ResourceExhaustedError(std::move(message));
  };
  if (!slot_->admitted()) {
    return refuse("concurrent_streams", absl::StrCat("server is at its limit of ", config_.max_concurrent_streams,
                                                     " concurrent streams; retry later"));
  }
  // A Call holds its slot only while it computes: only streams, which may hold theirs for as long as
  // their client trickles chunks, count against the client's share.
  const int64_t cap = service_.StreamsPerClient();
  if (one_message_ || cap <= 0 ||
      slot_->TakeClientShare(service_.client_streams_, ctx_->peer(), service_.ClientToken(ctx_), cap)) {
    return absl::OkStatus();
  }
  return refuse("streams_per_client",
                absl::StrCat("client ", slot_->client(), " already holds ", cap, " of the server's ",
                             config_.max_concurrent_streams, " concurrent streams, the most one client may ",
                             "(--max-streams-per-client); retry later"));
}

// The client's next message, within the idle timeout; `*more` is false at the stream's end.
absl::Status StreamedRequest::Receive(bool* more) {
  // A Call's messages are in memory: no wait to bound, so no timeout message to build either.
  LceService::ClientWait limit{0.0, "", ""};
  if (stream_->WaitsOnClient()) {
    limit = service_.IdleWait(chunk_index_ == 0 ? std::string("the first chunk")
                                                : absl::StrCat("the message after chunk ", chunk_index_ - 1));
  }
  absl::Status g = service_.WithinLimit(
      ctx_, *stream_, limit,
      [&] { return Timed(&RequestWork::read_wait_seconds, [&] { return stream_->Read(&msg_); }); }, more);
  if (!g.ok()) return g;
  if (!*more) return stream_->ReadError();  // the end, or a message that did not parse
  if (stream_->WaitsOnClient() && ctx_->IsCancelled()) {
    return absl::CancelledError("client cancelled");
  }
  if (msg_.has_header()) {
    return absl::InvalidArgumentError(
        absl::StrCat("repeated header (message ", chunk_index_ + 1, "): a request has exactly one"));
  }
  if (!msg_.has_chunk()) {
    return absl::InvalidArgumentError(absl::StrCat("message ", chunk_index_ + 1, " is neither a header nor a chunk"));
  }
  if (chunk_index_ == 0 && work_ != nullptr) work_->first_chunk_wait_seconds = work_->read_wait_seconds;
  return absl::OkStatus();
}

// The chunk checked against the plan, its regions resolved, the request's byte budget.
absl::Status StreamedRequest::Accept(InFlightChunk& c) {
  const v1::RowChunk& chunk = c.msg.chunk();
  absl::StatusOr<int64_t> rows = validator_->ValidateChunk(*plan_, chunk, chunk_index_, rows_seen_);
  if (!rows.ok()) {
    if (rows.status().code() == absl::StatusCode::kResourceExhausted && config_.metrics != nullptr) {
      config_.metrics->rejections.WithLabels({"request_rows"}).Increment();
    }
    return rows.status();
  }
  c.index = chunk_index_;
  c.first_row = rows_seen_;
  c.rows = *rows;
  c.message_bytes = static_cast<int64_t>(c.msg.ByteSizeLong());
  LCE_RETURN_IF_ERROR(ResolveRegions(c));
  bytes_seen_ += c.rows * row_bytes_;
  if (config_.max_request_bytes > 0 && bytes_seen_ > config_.max_request_bytes) {
    if (config_.metrics != nullptr) config_.metrics->rejections.WithLabels({"request_bytes"}).Increment();
    return absl::ResourceExhaustedError(absl::StrCat("chunk ", chunk_index_, ": request exceeds ",
                                                     config_.max_request_bytes,
                                                     " bytes of hidden states, the server's limit per request"));
  }
  return absl::OkStatus();
}

// Co-located clients: hidden states read from, and d_hidden written to, shared-memory regions of
// the request's session (checked: owner, bounds, size). The slices stay mapped until the chunk is
// done.
absl::Status StreamedRequest::ResolveRegions(InFlightChunk& c) {
  const v1::RowChunk& chunk = c.msg.chunk();
  c.hidden = chunk.hidden().data();
  c.hidden_slice = {};
  c.dh_slice = {};
  if (!chunk.has_hidden_region() && !chunk.has_d_hidden_region()) return absl::OkStatus();
  // The session's id and its secret (issue 35, item 12: the id alone once opened its regions).
  const auto& md = ctx_->client_metadata();
  auto value = [&md](const char* key) {
    auto it = md.find(key);
    return it == md.end() ? std::string() : std::string(it->second.data(), it->second.size());
  };
  const std::string session = value("lce-session"), secret = value("lce-session-secret");
  auto fail = [&](const absl::Status& e) {
    return absl::Status(e.code(), absl::StrCat("chunk ", chunk_index_, ": ", e.message()));
  };
  const int64_t bytes = c.rows * row_bytes_;
  RegionRegistry& regions = service_.regions_;
  if (chunk.has_hidden_region()) {
    absl::StatusOr<RegionRegistry::Slice> r = regions.Resolve(session, secret, chunk.hidden_region(), bytes, "hidden_region");
    if (!r.ok()) return fail(r.status());
    c.hidden_slice = *std::move(r);
    c.hidden = reinterpret_cast<const char*>(c.hidden_slice.bytes.data());
  }
  if (!chunk.has_d_hidden_region()) return absl::OkStatus();
  if (!(is_fb_ || is_bw_ || is_pl_)) return fail(absl::InvalidArgumentError("d_hidden_region: Score returns no d_hidden"));
  absl::StatusOr<RegionRegistry::Slice> r = regions.Resolve(session, secret, chunk.d_hidden_region(), bytes, "d_hidden_region");
  if (!r.ok()) return fail(r.status());
  c.dh_slice = *std::move(r);
  if (c.dh_slice.device && !c.hidden_slice.device) {
    return fail(absl::InvalidArgumentError(
        "d_hidden_region is device memory (CUDA IPC) but the hidden states are not: put both on the GPU"));
  }
  // The engine reads hidden after it starts writing d_hidden: the two must not share bytes.
  const auto* hp = reinterpret_cast<const uint8_t*>(c.hidden);
  const uint8_t* dp = c.dh_slice.bytes.data();
  if (c.dh_slice.device == c.hidden_slice.device && hp < dp + bytes && dp < hp + bytes) {
    return fail(absl::InvalidArgumentError("d_hidden_region overlaps the chunk's hidden states"));
  }
  return absl::OkStatus();
}

// Where the chunk's outputs go, its upstream gradients, and (GPU engines) the stream's staging.
absl::Status StreamedRequest::Prepare(InFlightChunk& c) {
  const v1::RowChunk& chunk = c.msg.chunk();
  const int64_t n = c.rows;
  int64_t valid = 0;
  for (int32_t y : chunk.targets()) valid += y != plan_->options.ignore_index ? 1 : 0;
  PlaceRowOutputs(c);
  if (absl::Status s = PlaceGradients(c); !s.ok()) return s;
  // ValidateChunk checked every target: the engine need not check them again.
  c.view = RowsView{c.hidden, chunk.targets().data(), n, MemorySpace::kHost, /*targets_checked=*/true};
  c.view.class_weight = plan_->class_weights.empty() ? nullptr : plan_->class_weights.data();
  // A GPU engine of one rank gets every chunk in device memory, copied on this stream's thread
  // (outside the engine's lock); its dW lives on the device too. Merged chunks are staged side by
  // side, in host memory for a CPU engine.
  c.device_path = c.hidden_slice.device || config_.cuda_device >= 0;
  rows_seen_ += n;
  valid_seen_ += valid;
  ++chunk_index_;
  if (Staged(c)) {
    for (int k = 0; k < (pipelined_ ? 2 : 1); ++k) {
      if (staging_.held[k] != nullptr) continue;
      absl::StatusOr<std::unique_ptr<ChunkStaging>> st = service_.TakeStaging();
      if (!st.ok()) return st.status();
      staging_.held[k] = *std::move(st);
    }
  }
  SetUpstream(c);
  return absl::OkStatus();
}

// The answer's per-row arrays the engine writes into (and a forward-backward's per-row loss).
void StreamedRequest::PlaceRowOutputs(InFlightChunk& c) {
  const int64_t n = c.rows;
  c.resp.Clear();
  v1::ChunkResult* out = c.resp.mutable_chunk();
  out->set_first_row(rows_seen_);
  out->set_rows(n);
  c.outs = RowOutputs{};
  if (plan_->want_logprobs) c.outs.logprob = Grow(out->mutable_logprobs(), n);
  if (plan_->want_entropy) c.outs.entropy = Grow(out->mutable_entropy(), n);
  if (plan_->want_z_loss) c.outs.z_loss = Grow(out->mutable_z_loss(), n);
  if (plan_->want_argmax) c.outs.argmax = Grow(out->mutable_argmax(), n);
  if (plan_->want_top_k) {
    c.outs.top_tokens = Grow(out->mutable_top_tokens(), n * plan_->options.top_k);
    c.outs.top_logprobs = Grow(out->mutable_top_logprobs(), n * plan_->options.top_k);
  }
  c.loss.clear();
  if (is_fb_) {
    c.loss.assign(n, 0.0f);
    c.outs.loss = c.loss.data();
  }
}

// d_hidden (the client's region, else the answer) and the head's gradients (the request's contribution).
absl::Status StreamedRequest::PlaceGradients(InFlightChunk& c) {
  c.grads = GradOutputs{};
  if (c.dh_slice.hold != nullptr) {
    c.grads.d_hidden = c.dh_slice.bytes.data();
  } else if (is_fb_ || is_bw_ || is_pl_) {
    std::string* dh = c.resp.mutable_chunk()->mutable_d_hidden();
    dh->resize(static_cast<size_t>(c.rows * row_bytes_));
    c.grads.d_hidden = dh->data();
  }
  if (!plan_->accumulate_weight_grad) return absl::OkStatus();
  // dW goes into the request's own pending buffer (its split request's), taken at its first chunk,
  // whose engine call writes it (the buffer comes unzeroed; engine calls run in chunk order,
  // pipelined or not); a split request's comes zeroed, and its parts' calls add to it in any order.
  const bool first = contribution_.id == 0;
  if (first) {
    absl::StatusOr<LceService::Contribution> made =
        service_.BeginContribution(*plan_->head, plan_->split_id, plan_->split_parts);
    if (!made.ok()) return ChunkError(c, made.status());
    contribution_ = *made;
  }
  c.grads.d_weight = contribution_.d_weight;
  c.grads.d_bias = contribution_.d_bias;
  c.grads.d_weight_pending = contribution_.id;
  c.grads.d_weight_fresh = first && !contribution_.zeroed;
  return absl::OkStatus();
}

// The upstream gradients: the loss's (its reduction's weights, or the client's per row), or logprob's and entropy's.
void StreamedRequest::SetUpstream(InFlightChunk& c) {
  const v1::RowChunk& chunk = c.msg.chunk();
  c.up = Upstream{};
  if (is_fb_) {
    c.up.mode = GradMode::kLoss;
    if (plan_->reduction == v1::REDUCTION_NONE) {
      c.up.grad_loss = chunk.grad_loss_size() > 0 ? chunk.grad_loss().data() : nullptr;
    } else if (plan_->reduction == v1::REDUCTION_MEAN) {
      const float g = plan_->declared_valid_tokens > 0 ? 1.0f / static_cast<float>(plan_->declared_valid_tokens) : 0.0f;
      c.grad.assign(static_cast<size_t>(c.rows), g);
      c.up.grad_loss = c.grad.data();
    }
  } else if (is_bw_) {
    c.up.mode = GradMode::kGeneric;
    c.up.grad_logprob = chunk.grad_logprob_size() > 0 ? chunk.grad_logprob().data() : nullptr;
    c.up.grad_entropy = chunk.grad_entropy_size() > 0 ? chunk.grad_entropy().data() : nullptr;
  }
}

absl::Status StreamedRequest::ChunkError(const InFlightChunk& c, const absl::Status& s) const {
  return absl::Status(s.code(), absl::StrCat("chunk ", c.index, " (rows ", c.first_row, "..", c.first_row + c.rows - 1,
                                             "): ", s.message()));
}

// Waits for the oldest pipelined chunk to be computed and answered (its error names it already).
absl::Status StreamedRequest::WaitOldest() {
  submitted_.pop_front();
  return pipeline_->WaitOldest();
}

absl::Status StreamedRequest::CallEngine(InFlightChunk& c, const char* what, const Upstream& up,
                                         const RowOutputs& outs, const GradOutputs& grads) {
  LceEngine& engine = *plan_->head->engine;
  return c.device_path ? service_.RunEngineOnDevice(method_, what, engine, *staging_.held[0], c.view,
                                                    c.hidden_slice.device, plan_->options, up, outs, grads,
                                                    c.dh_slice.device)
                       : service_.RunEngine(method_, what, engine, c.view, plan_->options, up, outs, grads);
}

// Unpipelined: the engine call here (into the request's pending dW when it accumulates), then the
// answer.
absl::Status StreamedRequest::Compute(InFlightChunk& c) {
  absl::Status s;
  if (is_pl_) s = PolicyForward(c);
  if (s.ok()) {
    const RowOutputs second = is_pl_ ? RowOutputs{} : c.outs;
    if (Batchable(c)) {
      s = ComputeBatched(c);
    } else {
      s = CallEngine(c, op_, c.up, second, c.grads);
    }
  }
  if (!s.ok()) return ChunkError(c, s);
  return Answer(c);
}

// A Call of a few rows whose hidden states came in its message, without side effects on the head,
// on an engine that gives each of its outputs the same bits in any batch: the batcher may merge it.
bool StreamedRequest::Batchable(const InFlightChunk& c) const {
  const DynamicBatcher& batcher = service_.batcher_;
  if (!batcher.enabled() || !one_message_ || is_pl_ || plan_->accumulate_weight_grad) return false;
  // The batcher merges the four classic outputs and d_hidden; a call with more is made alone.
  if (plan_->options.top_k > 0 || plan_->want_z_loss || !plan_->class_weights.empty()) return false;
  if (c.rows > batcher.options().max_rows || c.hidden_slice.hold != nullptr || c.dh_slice.hold != nullptr) {
    return false;
  }
  const std::vector<std::string> invariant = plan_->head->engine->invariance().across_batches;
  auto is_invariant = [&](const char* output) {
    return std::find(invariant.begin(), invariant.end(), output) != invariant.end();
  };
  return (c.outs.logprob == nullptr || is_invariant("logprob")) &&
         (c.outs.entropy == nullptr || is_invariant("entropy")) && (c.outs.loss == nullptr || is_invariant("loss")) &&
         (c.grads.d_hidden == nullptr || is_invariant("d_hidden"));
}

// The chunk's engine call through the dynamic batcher: merged with other requests' rows, or (when
// this request leads) the merged call made here with this request's staging.
absl::Status StreamedRequest::ComputeBatched(InFlightChunk& c) {
  const BatchRows rows{c.view.hidden, c.view.targets, c.rows, c.up.grad_loss, c.up.grad_logprob,
                       c.up.grad_entropy, c.outs.logprob, c.outs.entropy, c.outs.loss, c.grads.d_hidden};
  const BatchKey key{plan_->head.get(), plan_->options, c.up.mode, row_bytes_, PresentArrays(rows)};
  auto run = [this, &c](const BatchRows& r) {
    // The merged call is every batched request's: no one request's log accounts it (see below).
    RequestWork::Scope unaccounted(nullptr);
    const RowsView view{r.hidden, r.targets, r.rows, MemorySpace::kHost, /*targets_checked=*/true};
    const Upstream up{c.up.mode, r.grad_loss, r.grad_logprob, r.grad_entropy};
    const RowOutputs outs{r.logprob, r.entropy, nullptr, r.loss};
    const GradOutputs grads{r.d_hidden, nullptr};
    LceEngine& engine = *plan_->head->engine;
    return c.device_path ? service_.RunEngineOnDevice(method_, op_, engine, *staging_.held[0], view, false,
                                                      plan_->options, up, outs, grads, false)
                         : service_.RunEngine(method_, op_, engine, view, plan_->options, up, outs, grads);
  };
  DynamicBatcher::Timing t;
  absl::Status s = service_.batcher_.Run(key, rows, run, [this] { return ctx_->IsCancelled(); }, op_, &t);
  if (work_ != nullptr && t.launched != std::chrono::steady_clock::time_point{}) {
    // This request's share of the log: its wait for the batch as queue time, the batch's call.
    if (work_->engine_calls == 0) work_->first_call_start = t.launched;
    work_->last_call_end = t.ended;
    ++work_->engine_calls;
    work_->queue_seconds += std::chrono::duration<double>(t.launched - t.enqueued).count();
    work_->engine_seconds += std::chrono::duration<double>(t.ended - t.launched).count();
  }
  return s;
}

// PolicyLoss: the forward for logprob and entropy, the policy loss and its upstream gradients on
// the host; the generic backward (which recomputes the logits tile by tile) follows in Compute.
absl::Status StreamedRequest::PolicyForward(InFlightChunk& c) {
  const v1::RowChunk& chunk = c.msg.chunk();
  const int64_t n = c.rows;
  lp_buf_.assign(n, 0.0f);
  ent_buf_.assign(n, 0.0f);
  if (absl::Status s = CallEngine(c, "policy_forward", Upstream{}, {lp_buf_.data(), ent_buf_.data(), nullptr, nullptr},
                                  {});
      !s.ok()) {
    return s;
  }
  w_buf_.assign(n, 0.0f);
  valid_buf_.reset(new bool[n]);
  for (int64_t i = 0; i < n; ++i) {
    const int32_t sid = chunk.sequence_ids_size() > 0 ? chunk.sequence_ids(static_cast<int>(i)) : 0;
    valid_buf_[i] = chunk.targets(static_cast<int>(i)) != plan_->options.ignore_index;
    if (!valid_buf_[i]) continue;
    ++seq_seen_[sid];
    w_buf_[i] = AggregationWeight(plan_->aggregation, plan_->sequence_valid_tokens[sid], plan_->total_valid_tokens,
                                  num_seq_);
  }
  c.loss.assign(n, 0.0f);
  u_buf_.assign(n, 0.0f);
  e_buf_.assign(n, 0.0f);
  PolicyLossRows(n, plan_->policy, lp_buf_.data(), ent_buf_.data(), chunk.old_logprobs().data(),
                 chunk.advantages().data(), chunk.ref_logprobs_size() > 0 ? chunk.ref_logprobs().data() : nullptr,
                 w_buf_.data(), valid_buf_.get(), c.loss.data(), u_buf_.data(), e_buf_.data(), &policy_sums_);
  if (plan_->want_logprobs) std::copy(lp_buf_.begin(), lp_buf_.end(), c.outs.logprob);
  if (plan_->want_entropy) std::copy(ent_buf_.begin(), ent_buf_.end(), c.outs.entropy);
  c.up = Upstream{GradMode::kGeneric, nullptr, u_buf_.data(), e_buf_.data()};
  return absl::OkStatus();
}

// After its engine call: sums, metrics, and the answer on its way.
absl::Status StreamedRequest::Answer(InFlightChunk& c) {
  v1::ChunkResult* out = c.resp.mutable_chunk();
  if (is_fb_ || is_pl_) {
    for (float l : c.loss) loss_sum_ += l;
    if (plan_->want_loss) out->mutable_loss()->Add(c.loss.begin(), c.loss.end());
  }
  if (config_.metrics != nullptr) {
    config_.metrics->tokens.WithLabels({op_}).Increment(static_cast<double>(c.rows));
    config_.metrics->bytes_received.Increment(static_cast<double>(c.message_bytes));
    config_.metrics->bytes_sent.Increment(static_cast<double>(c.resp.ByteSizeLong()));
  }
  // A client that shrank its shm object meanwhile had the server compute on zeros: no answer.
  for (const auto& [slice, what] : {std::pair{&c.hidden_slice, "hidden_region"}, {&c.dh_slice, "d_hidden_region"}}) {
    if (absl::Status s = RegionRegistry::CheckIntact(*slice, what); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("chunk ", c.index, ": ", s.message()));
    }
  }
  c.hidden_slice = {};
  c.dh_slice = {};
  const bool last = !SummaryFollows() && c.index == last_chunk_.load();
  bool written = false;
  absl::Status g = service_.WithinLimit(
      ctx_, *stream_, service_.IdleWait("the client to read an answer"),
      [&] {
        return Timed(&RequestWork::write_wait_seconds,
                     [&] { return last ? writer_->PushLast(std::move(c.resp)) : writer_->Push(std::move(c.resp)); });
      },
      &written);
  if (!g.ok()) return g;
  if (!written) return absl::CancelledError("client went away");
  c.resp = v1::StreamResponse();
  return absl::OkStatus();
}

// The stream's end: the pipeline drained, the declared counts, the summary, the last answers out.
absl::Status StreamedRequest::Finish() {
  last_chunk_.store(chunk_index_ - 1);
  if (pipeline_ != nullptr) pipeline_->Close();  // its threads end with the last chunk
  while (pipeline_ != nullptr && pipeline_->outstanding() > 0) {
    LCE_RETURN_IF_ERROR(WaitOldest());
  }
  // A Call's client that left is seen when its answer is sent.
  if (stream_->WaitsOnClient() && ctx_->IsCancelled()) {
    return absl::CancelledError("client cancelled");
  }
  if (rows_seen_ == 0) return absl::InvalidArgumentError("request has a header but no rows");
  LCE_RETURN_IF_ERROR(CheckDeclaredCounts());
  LCE_RETURN_IF_ERROR(EndContribution());
  LCE_RETURN_IF_ERROR(SendSummary());
  bool drained = false;
  absl::Status g = service_.WithinLimit(
      ctx_, *stream_, service_.IdleWait("the client to read the last answers"),
      [&] { return Timed(&RequestWork::drain_seconds, [&] { return writer_->Finish(); }); }, &drained);
  if (!g.ok()) return g;
  if (!drained) return absl::CancelledError("client went away");
  return absl::OkStatus();
}

// A part of a split request (header.partial) carries the whole request's counts: the client checks
// that its parts add up.
absl::Status StreamedRequest::CheckDeclaredCounts() const {
  if (plan_->partial) return absl::OkStatus();
  if (is_fb_ && plan_->reduction == v1::REDUCTION_MEAN && plan_->declared_valid_tokens != valid_seen_) {
    return absl::InvalidArgumentError(absl::StrCat("header.num_valid_tokens declared ", plan_->declared_valid_tokens,
                                                   " but the request has ", valid_seen_,
                                                   " non-ignored rows; the returned d_hidden is wrong, discard it"));
  }
  if (!is_pl_) return absl::OkStatus();
  for (int64_t q = 0; q < num_seq_; ++q) {
    if (seq_seen_[q] != plan_->sequence_valid_tokens[q]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "policy.sequence_valid_tokens[", q, "] declared ", plan_->sequence_valid_tokens[q], " but the request has ",
          seq_seen_[q], " non-ignored rows in that sequence; discard the returned d_hidden"));
    }
  }
  return absl::OkStatus();
}

// Every row computed and checked: the request's dW is added now, before its summary leaves (so a
// client that reads the summary finds it in dW), or, deferred, waits for CommitGrad under the id
// the summary carries. A failure after this adds nothing more and takes nothing back.
absl::Status StreamedRequest::EndContribution() {
  if (contribution_.id == 0) return absl::OkStatus();
  const uint64_t id = contribution_.id;
  contribution_ = {};
  absl::StatusOr<bool> completed = service_.EndContribution(*plan_->head, id, /*ok=*/true, plan_->defer_weight_grad);
  if (!completed.ok()) return completed.status();
  // A split request's id is reported once, by the part that completed it.
  if (plan_->defer_weight_grad && *completed) deferred_id_ = id;
  return absl::OkStatus();
}

absl::Status StreamedRequest::SendSummary() {
  // A Backward's summary carries its weight gradient's outcome (and its pending id, deferred).
  if (!SummaryFollows()) return absl::OkStatus();
  v1::StreamResponse resp;
  v1::RequestSummary* sum = resp.mutable_summary();
  sum->set_rows(rows_seen_);
  sum->set_valid_tokens(valid_seen_);
  sum->set_head_version(plan_->head->version);
  if (deferred_id_ != 0) sum->add_pending_grad_ids(deferred_id_);
  if (is_fb_) {
    // The mean's denominator is the declared count; for a whole request it equals valid_seen.
    const int64_t denom = plan_->partial ? plan_->declared_valid_tokens : valid_seen_;
    sum->set_loss(plan_->reduction == v1::REDUCTION_MEAN ? (denom > 0 ? loss_sum_ / denom : 0.0) : loss_sum_);
  } else if (is_pl_) {
    const double t = std::max<int64_t>(policy_sums_.tokens, 1);
    sum->set_loss(policy_sums_.loss);
    sum->set_clip_fraction(policy_sums_.clipped / t);
    sum->set_approx_kl(policy_sums_.approx_kl / t);
    sum->set_mean_entropy(policy_sums_.entropy / t);
    sum->set_mean_ratio(policy_sums_.ratio / t);
    sum->set_mean_kl(policy_sums_.kl / t);
  }
  bool written = false;
  absl::Status g = service_.WithinLimit(
      ctx_, *stream_, service_.IdleWait("the client to read an answer"),
      [&] { return writer_->PushLast(std::move(resp)); }, &written);
  if (!g.ok()) return g;
  if (!written) return absl::CancelledError("client went away");
  return absl::OkStatus();
}

}  // namespace lce::server
