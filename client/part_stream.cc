#include "part_stream.h"

#include <algorithm>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "replica.h"

namespace lce::client {
namespace {

// A region-backed chunk carries no hidden bytes: one chunk (of at most kRegionChunkRows rows) lets
// the server run the part as one engine call. Over the data plane the bytes still travel, and are
// chunked as on the wire so that transfer and compute overlap.
constexpr int64_t kRegionChunkRows = 1 << 16;

StreamTrace::Time Now() { return std::chrono::steady_clock::now(); }

// Socket i's share [offset, offset + length) of a transfer of `bytes` over k sockets: equal shares
// (whole 4 KiB pages where possible); below 64 KiB all of it on socket 0.
std::pair<int64_t, int64_t> SocketShare(int64_t bytes, int64_t k, int64_t i) {
  if (k == 1 || bytes < (int64_t{1} << 16)) return {0, i == 0 ? bytes : 0};
  const int64_t lo = bytes * i / k / 4096 * 4096, hi = i + 1 == k ? bytes : bytes * (i + 1) / k / 4096 * 4096;
  return {lo, hi - lo};
}

v1::CallMethod CallMethodOf(const std::string& rpc) {
  return rpc == "Score" ? v1::CALL_SCORE : rpc == "ForwardBackward" ? v1::CALL_FORWARD_BACKWARD : v1::CALL_BACKWARD;
}

// A header for `batch`: the caller's, with the batch's shape.
v1::RequestHeader HeaderFor(const v1::RequestHeader& header, const HiddenBatch& batch) {
  v1::RequestHeader h = header;
  h.set_hidden_size(batch.hidden_size);
  h.set_dtype(batch.dtype);
  return h;
}

void SetSlice(v1::RegionSlice* r, const RegionRef& region, int64_t offset, int64_t bytes) {
  r->set_region_id(region.region_id);
  r->set_offset(region.offset + offset);
  r->set_byte_size(bytes);
}

void AddRows(google::protobuf::RepeatedField<float>* to, absl::Span<const float> values, int64_t first, int64_t n) {
  if (!values.empty()) to->Add(values.begin() + first, values.begin() + first + n);
}

}  // namespace

// Kept threads, not made each chunk: this runs once a chunk.
absl::Status SplitTransfer(const std::vector<DataPlaneConnection*>& sockets, int64_t bytes, WorkerPool& workers,
                           const std::function<absl::Status(DataPlaneConnection&, int64_t, int64_t)>& move) {
  const int64_t k = static_cast<int64_t>(sockets.size());
  if (SocketShare(bytes, k, 0).second == bytes) return move(*sockets[0], 0, bytes);  // one share: no threads
  std::vector<absl::Status> results(static_cast<size_t>(k));
  auto part = [&](int64_t i) {
    const auto [lo, len] = SocketShare(bytes, k, i);
    results[static_cast<size_t>(i)] = move(*sockets[static_cast<size_t>(i)], lo, len);
  };
  TaskLatch others_done(k - 1);
  for (int64_t i = 1; i < k; ++i) {
    workers.Run([&, i] {
      part(i);
      others_done.Done();
    });
  }
  part(0);
  others_done.Wait();
  for (const absl::Status& s : results) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

PartStream::PartStream(const StreamEnv& env, const PartRequest& request, std::pair<int64_t, int64_t> rows,
                       const DataPlaneLane* lane)
    : env_(env),
      request_(request),
      batch_(request.batch),
      part_first_(rows.first),
      part_rows_(rows.second),
      row_bytes_(request.assembly.row_bytes()),
      lane_(lane),
      hidden_in_region_(request.batch.hidden_region.has_value()),
      tracing_(static_cast<bool>(env.options.stream_trace)),
      plan_(PlanChunks()),
      shares_done_(lane == nullptr ? 0 : plan_.size(), 0),
      uploaders_(lane == nullptr ? 0 : static_cast<int>(lane->up.size())),
      tasks_done_(uploaders_ + 1) {}

std::vector<std::pair<int64_t, int64_t>> PartStream::PlanChunks() const {
  // The smaller last chunk only where d_hidden comes back: a score's last answer is a few floats and
  // its tail the last chunk's compute, which a smaller chunk does not shorten (it adds an engine call).
  const ClientOptions& o = env_.options;
  const int64_t last_chunk_bytes = std::string(request_.rpc) == "Score" ? 0 : o.last_chunk_bytes;
  auto plan = hidden_in_region_ && lane_ == nullptr
                  ? client::PlanChunks(part_rows_, row_bytes_, kRegionChunkRows * row_bytes_)
                  : client::PlanChunks(part_rows_, row_bytes_, o.chunk_bytes, o.first_chunk_bytes, last_chunk_bytes,
                                       o.grow_chunks);
  for (auto& [first, n] : plan) first += part_first_;
  return plan;
}

absl::Status PartStream::Run(v1::LceService::Stub& stub, const HiddenCall* hidden_call, grpc::ClientContext& ctx,
                             PartSummary* summary) {
  summary_ = summary;
  Mark(trace_.start);
  env_.prepare(&ctx);
  if (FitsOneCall()) {
    if (std::optional<absl::Status> s = RunAsCall(stub, hidden_call)) return *s;
    env_.no_call = true;  // an older server: stream from now on (if it refuses that too, it says why)
  }
  return RunAsStream(stub, ctx);
}

// A whole request of one chunk, without the data plane: one Call, one message each way (no stream
// to set up, no round trip a message), unless the server has no Call.
bool PartStream::FitsOneCall() const {
  return lane_ == nullptr && plan_.size() == 1 && part_rows_ == request_.assembly.rows() &&
         env_.options.single_message_calls && !env_.no_call.load();
}

std::optional<absl::Status> PartStream::RunAsCall(v1::LceService::Stub& stub, const HiddenCall* hidden_call) {
  v1::CallRequest req;
  req.set_method(CallMethodOf(request_.rpc));
  *req.mutable_header() = HeaderFor(request_.header, batch_);
  const bool hidden_apart = hidden_call != nullptr && !hidden_in_region_;
  v1::StreamRequest msg;
  ChunkMessage(0, msg, /*with_hidden=*/!hidden_apart);
  *req.mutable_chunk() = std::move(*msg.mutable_chunk());
  grpc::ClientContext call_ctx;
  env_.prepare(&call_ctx);
  v1::CallResponse answer;
  if (tracing_) trace_.opened = trace_.first_chunk_sent = trace_.last_chunk_sent = Now();
  const auto [first, n] = plan_[0];
  const grpc::Status s =
      hidden_apart
          ? hidden_call->Run(&call_ctx, req, batch_.hidden.subspan(first * row_bytes_, n * row_bytes_), &answer)
          : stub.Call(&call_ctx, req, &answer);
  if (tracing_) trace_.first_answer = trace_.last_answer = Now();
  ReportTrace();
  if (s.error_code() == grpc::StatusCode::UNIMPLEMENTED) return std::nullopt;
  if (!s.ok()) return ToAbsl(s);
  if (absl::Status placed = Place(answer.chunk()); !placed.ok()) return placed;
  if (answer.has_summary()) summary_->Read(answer.summary());
  return absl::OkStatus();
}

// The call is created first (at once: its initial metadata waits for the header), then the
// uploaders start on the client's kept threads, and the header goes. An upload that fails cancels
// the call.
absl::Status PartStream::RunAsStream(v1::LceService::Stub& stub, grpc::ClientContext& ctx) {
  std::unique_ptr<BidiStream> stream = Open(stub, ctx);
  Mark(trace_.opened);
  StartUploaders(ctx);
  WriteRequest(*stream);
  ReadAnswers(*stream, ctx);
  StopAll();
  tasks_done_.Wait();
  const grpc::Status s = stream->Finish();
  ReportTrace();
  if (!upload_error_.ok()) return upload_error_;
  if (!answer_error_.ok()) return answer_error_;
  return ToAbsl(s);
}

std::unique_ptr<PartStream::BidiStream> PartStream::Open(v1::LceService::Stub& stub, grpc::ClientContext& ctx) {
  ctx.set_initial_metadata_corked(true);
  const std::string rpc = request_.rpc;
  if (rpc == "Score") return stub.Score(&ctx);
  if (rpc == "ForwardBackward") return stub.ForwardBackward(&ctx);
  return stub.Backward(&ctx);
}

void PartStream::ChunkMessage(size_t k, v1::StreamRequest& msg, bool with_hidden) const {
  const auto [first, n] = plan_[k];
  msg.Clear();
  v1::RowChunk* c = msg.mutable_chunk();
  if (hidden_in_region_) {  // a slice of the region, no bytes
    SetSlice(c->mutable_hidden_region(), *batch_.hidden_region, first * row_bytes_, n * row_bytes_);
  } else if (with_hidden) {
    c->set_hidden(reinterpret_cast<const char*>(batch_.hidden.data()) + first * row_bytes_, n * row_bytes_);
  }
  if (batch_.d_hidden_region) {
    SetSlice(c->mutable_d_hidden_region(), *batch_.d_hidden_region, first * row_bytes_, n * row_bytes_);
  }
  c->mutable_targets()->Add(batch_.targets.begin() + first, batch_.targets.begin() + first + n);
  AddRows(c->mutable_grad_loss(), request_.grads.loss, first, n);
  AddRows(c->mutable_grad_logprob(), request_.grads.logprob, first, n);
  AddRows(c->mutable_grad_entropy(), request_.grads.entropy, first, n);
}

// One uploader per socket, each moving its share of every chunk in turn without waiting for the
// others (no barrier a chunk: a slow socket delays only the chunks it has not finished).
void PartStream::StartUploaders(grpc::ClientContext& ctx) {
  for (int i = 0; i < uploaders_; ++i) {
    env_.workers.Run([this, &ctx, i] {
      absl::Cleanup done = [this] { tasks_done_.Done(); };
      Upload(i, ctx);
    });
  }
}

void PartStream::Upload(int socket, grpc::ClientContext& ctx) {
  const RegionRef& to = *batch_.hidden_region;
  for (size_t c = 0; c < plan_.size(); ++c) {
    const auto [first, n] = plan_[c];
    const auto [off, len] = SocketShare(n * row_bytes_, uploaders_, socket);
    absl::Status s;
    if (len > 0) {
      s = lane_->up[static_cast<size_t>(socket)]->Write(to.session_id, to.region_id,
                                                        to.offset + first * row_bytes_ + off,
                                                        batch_.hidden.subspan(first * row_bytes_ + off, len));
    }
    std::lock_guard<std::mutex> l(mu_);
    if (!s.ok()) {
      if (upload_error_.ok()) upload_error_ = s;
      stop_ = true;
      cv_.notify_all();
      ctx.TryCancel();
      return;
    }
    if (stop_) return;
    ++shares_done_[c];
    while (uploaded_ < plan_.size() && shares_done_[uploaded_] == uploaders_) ++uploaded_;
    cv_.notify_all();
  }
}

// The header, with the call's initial metadata, from this thread (a woken worker starts later), and
// the first chunk too where its bytes need no upload; the rest from a worker, each as its bytes are in.
void PartStream::WriteRequest(BidiStream& stream) {
  bool more = false;
  const size_t next = WriteHeader(stream, &more);
  if (!more) {
    tasks_done_.Done();
    return;
  }
  env_.workers.Run([this, &stream, next] {
    absl::Cleanup done = [this] { tasks_done_.Done(); };
    WriteChunks(stream, next);
  });
}

// Writes the header (and the first chunk where it needs no upload); returns the next chunk to
// write, `*more` false once nothing is left for the writer (all written, or the server ended the
// call: a failed write, which Finish explains).
size_t PartStream::WriteHeader(BidiStream& stream, bool* more) {
  v1::StreamRequest msg;
  *msg.mutable_header() = HeaderFor(request_.header, batch_);
  // Every chunk goes without waiting for answers: the server may then compute one chunk while it
  // reads and stages the next (RequestHeader.sends_ahead).
  msg.mutable_header()->set_sends_ahead(true);
  *more = stream.Write(msg);
  size_t next = 0;
  if (*more && lane_ == nullptr && !plan_.empty()) {
    ChunkMessage(0, msg);
    *more = stream.Write(msg);
    next = 1;
    Mark(trace_.first_chunk_sent);
  }
  if (*more && next == plan_.size()) {
    Mark(trace_.last_chunk_sent);
    stream.WritesDone();
    *more = false;
  }
  return next;
}

void PartStream::WriteChunks(BidiStream& stream, size_t first) {
  v1::StreamRequest msg;
  for (size_t next = first; next < plan_.size(); ++next) {
    if (lane_ != nullptr) {
      std::unique_lock<std::mutex> l(mu_);
      cv_.wait(l, [&] { return stop_ || uploaded_ > next; });
      if (stop_) return;
    }
    ChunkMessage(next, msg);
    if (!stream.Write(msg)) return;  // the server ended the call; Finish says why
    if (next == 0) Mark(trace_.first_chunk_sent);
    if (next + 1 == plan_.size()) Mark(trace_.last_chunk_sent);
  }
  stream.WritesDone();
}

void PartStream::StopAll() {
  std::lock_guard<std::mutex> l(mu_);
  stop_ = true;
  cv_.notify_all();
}

void PartStream::ReadAnswers(BidiStream& stream, grpc::ClientContext& ctx) {
  v1::StreamResponse resp;
  while (stream.Read(&resp) && Handle(resp)) {
  }
  if (!answer_error_.ok()) {
    ctx.TryCancel();  // stop the server's work and our writer; the answer is unusable
    while (stream.Read(&resp)) {
    }
  }
}

// One answer; false once the answers are unusable.
bool PartStream::Handle(const v1::StreamResponse& resp) {
  if (tracing_) {
    trace_.last_answer = Now();
    if (trace_.first_answer == StreamTrace::Time{}) trace_.first_answer = trace_.last_answer;
  }
  if (resp.has_summary()) {
    summary_->Read(resp.summary());
    return true;
  }
  answer_error_ = Place(resp.chunk());
  return answer_error_.ok();
}

absl::Status PartStream::Place(const v1::ChunkResult& c) {
  const int64_t n = c.rows(), first = part_first_ + c.first_row();
  if (c.first_row() < 0 || n <= 0 || c.first_row() > part_rows_ - n) {
    return absl::InternalError(absl::StrCat("answer for rows [", first, ", ", first + n,
                                            ") is outside the stream's rows [", part_first_, ", ",
                                            part_first_ + part_rows_, ")"));
  }
  AnswerAssembly& assembly = request_.assembly;
  if (absl::Status s = assembly.Claim(first, n); !s.ok()) return s;
  if (absl::Status s = assembly.PlaceRowValues(c, first, n); !s.ok()) return s;
  // Over the data plane the server wrote d_hidden into its memory before answering.
  if (lane_ != nullptr && batch_.d_hidden_region) return DownloadDHidden(first, n);
  return assembly.PlaceDHidden(c.d_hidden(), first, n);
}

absl::Status PartStream::DownloadDHidden(int64_t first, int64_t n) {
  const RegionRef& from = *batch_.d_hidden_region;
  uint8_t* dst = request_.assembly.DHiddenAt(first);
  auto read = [&](DataPlaneConnection& c, int64_t off, int64_t len) {
    return c.Read(from.session_id, from.region_id, from.offset + first * row_bytes_ + off,
                  absl::MakeSpan(dst + off, len));
  };
  if (absl::Status s = SplitTransfer(lane_->down, n * row_bytes_, env_.workers, read); !s.ok()) return s;
  request_.assembly.CountDHidden(n);
  return absl::OkStatus();
}

void PartStream::Mark(StreamTrace::Time& t) const {
  if (tracing_) t = Now();
}

void PartStream::ReportTrace() {
  if (!tracing_) return;
  trace_.ended = Now();
  env_.options.stream_trace(trace_);
}

}  // namespace lce::client
