#include "lce/client/lce_client.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/create_channel.h"

namespace lce::client {
namespace {

absl::Status ToAbsl(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

using BidiStream = grpc::ClientReaderWriter<v1::StreamRequest, v1::StreamResponse>;

}  // namespace

int64_t WireDTypeSize(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_FLOAT32: return 4;
    case v1::DTYPE_BFLOAT16:
    case v1::DTYPE_FLOAT16: return 2;
    default: return 0;
  }
}

std::vector<std::pair<int64_t, int64_t>> PlanChunks(int64_t rows, int64_t row_bytes, int64_t chunk_bytes) {
  const int64_t per = std::max<int64_t>(1, row_bytes > 0 ? chunk_bytes / row_bytes : rows);
  std::vector<std::pair<int64_t, int64_t>> plan;
  for (int64_t r = 0; r < rows; r += per) plan.emplace_back(r, std::min(per, rows - r));
  return plan;
}

LceClient::LceClient(ClientOptions options, std::shared_ptr<grpc::Channel> channel)
    : options_(std::move(options)), channel_(std::move(channel)), stub_(v1::LceService::NewStub(channel_)) {}

absl::StatusOr<std::unique_ptr<LceClient>> LceClient::Create(const ClientOptions& options) {
  if (options.target.empty()) return absl::InvalidArgumentError("ClientOptions.target is empty");
  if (options.chunk_bytes <= 0) return absl::InvalidArgumentError("ClientOptions.chunk_bytes must be > 0");
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(static_cast<int>(std::min<int64_t>(options.max_message_bytes, INT32_MAX)));
  args.SetMaxSendMessageSize(static_cast<int>(std::min<int64_t>(options.max_message_bytes, INT32_MAX)));
  auto creds = options.credentials ? options.credentials : grpc::InsecureChannelCredentials();
  return std::unique_ptr<LceClient>(new LceClient(options, grpc::CreateCustomChannel(options.target, creds, args)));
}

void LceClient::Prepare(grpc::ClientContext* ctx) const {
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
  if (!options_.bearer_token.empty()) ctx->AddMetadata("authorization", "Bearer " + options_.bearer_token);
}

absl::StatusOr<v1::GetInfoResponse> LceClient::GetInfo(const std::string& head) {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  v1::GetInfoRequest req;
  req.set_head(head);
  v1::GetInfoResponse resp;
  grpc::Status s = stub_->GetInfo(&ctx, req, &resp);
  if (!s.ok()) return ToAbsl(s);
  return resp;
}

absl::StatusOr<bool> LceClient::Health(const std::string& service) {
  auto stub = grpc::health::v1::Health::NewStub(channel_);
  grpc::ClientContext ctx;
  Prepare(&ctx);
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  grpc::Status s = stub->Check(&ctx, req, &resp);
  if (!s.ok()) return ToAbsl(s);
  return resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

absl::Status LceClient::Stream(const char* rpc, const HiddenBatch& batch, const v1::RequestHeader& header,
                               absl::Span<const float> grad_loss, absl::Span<const float> grad_logprob,
                               absl::Span<const float> grad_entropy, ForwardBackwardResult* out) {
  const int64_t es = WireDTypeSize(batch.dtype);
  const int64_t row_bytes = batch.hidden_size * es;
  if (es == 0) {
    return absl::InvalidArgumentError(absl::StrCat("batch dtype ", v1::DType_Name(batch.dtype), " is not a wire dtype"));
  }
  if (batch.hidden_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("batch hidden_size must be > 0, got ", batch.hidden_size));
  }
  const bool hidden_in_region = batch.hidden_region.has_value();
  if (batch.hidden_region && batch.d_hidden_region &&
      batch.hidden_region->session_id != batch.d_hidden_region->session_id) {
    return absl::InvalidArgumentError("hidden_region and d_hidden_region must belong to one session");
  }
  if (batch.rows < 0 || (!hidden_in_region && static_cast<int64_t>(batch.hidden.size()) != batch.rows * row_bytes) ||
      static_cast<int64_t>(batch.targets.size()) != batch.rows) {
    return absl::InvalidArgumentError(absl::StrCat("batch of ", batch.rows, " rows x ", batch.hidden_size,
                                                   " needs ", batch.rows * row_bytes, " hidden bytes and ",
                                                   batch.rows, " targets; got ", batch.hidden.size(), " and ",
                                                   batch.targets.size()));
  }
  for (auto [name, span] : {std::pair{"grad_loss", grad_loss}, std::pair{"grad_logprob", grad_logprob},
                            std::pair{"grad_entropy", grad_entropy}}) {
    if (!span.empty() && static_cast<int64_t>(span.size()) != batch.rows) {
      return absl::InvalidArgumentError(absl::StrCat(name, " has ", span.size(), " values for ", batch.rows, " rows"));
    }
  }
  grpc::ClientContext ctx;
  Prepare(&ctx);
  if (batch.hidden_region || batch.d_hidden_region) {
    ctx.AddMetadata("lce-session", batch.hidden_region ? batch.hidden_region->session_id
                                                       : batch.d_hidden_region->session_id);
  }
  std::unique_ptr<BidiStream> stream;
  const std::string which = rpc;
  if (which == "Score") {
    stream = stub_->Score(&ctx);
  } else if (which == "ForwardBackward") {
    stream = stub_->ForwardBackward(&ctx);
  } else {
    stream = stub_->Backward(&ctx);
  }
  const auto plan = PlanChunks(batch.rows, row_bytes, options_.chunk_bytes);
  // Write on a thread of its own: the server answers chunk k while later chunks are in flight,
  // so reading and writing must proceed together or flow control stalls both sides.
  std::thread writer([&] {
    v1::StreamRequest msg;
    *msg.mutable_header() = header;
    msg.mutable_header()->set_hidden_size(batch.hidden_size);
    msg.mutable_header()->set_dtype(batch.dtype);
    if (!stream->Write(msg)) return;
    for (auto [first, n] : plan) {
      msg.Clear();
      v1::RowChunk* c = msg.mutable_chunk();
      if (hidden_in_region) {  // co-located: a slice of the region, no bytes
        v1::RegionSlice* r = c->mutable_hidden_region();
        r->set_region_id(batch.hidden_region->region_id);
        r->set_offset(batch.hidden_region->offset + first * row_bytes);
        r->set_byte_size(n * row_bytes);
      } else {
        c->set_hidden(reinterpret_cast<const char*>(batch.hidden.data()) + first * row_bytes, n * row_bytes);
      }
      if (batch.d_hidden_region) {
        v1::RegionSlice* r = c->mutable_d_hidden_region();
        r->set_region_id(batch.d_hidden_region->region_id);
        r->set_offset(batch.d_hidden_region->offset + first * row_bytes);
        r->set_byte_size(n * row_bytes);
      }
      c->mutable_targets()->Add(batch.targets.begin() + first, batch.targets.begin() + first + n);
      if (!grad_loss.empty()) c->mutable_grad_loss()->Add(grad_loss.begin() + first, grad_loss.begin() + first + n);
      if (!grad_logprob.empty()) {
        c->mutable_grad_logprob()->Add(grad_logprob.begin() + first, grad_logprob.begin() + first + n);
      }
      if (!grad_entropy.empty()) {
        c->mutable_grad_entropy()->Add(grad_entropy.begin() + first, grad_entropy.begin() + first + n);
      }
      if (!stream->Write(msg)) return;  // the server ended the call; Finish says why
    }
    stream->WritesDone();
  });

  // Answers are placed by first_row/rows; together they must cover every row exactly once, and an
  // output present in one answer must be present in all of them.
  std::vector<uint8_t> seen(static_cast<size_t>(batch.rows), 0);
  int64_t covered = 0, n_logprobs = 0, n_entropy = 0, n_loss = 0, n_dhidden = 0;
  absl::Status shape_error;
  v1::StreamResponse resp;
  auto place = [&](const auto& src, std::vector<float>& dst, int64_t first, int64_t n, int64_t& count,
                   const char* what) {
    if (src.empty()) return;
    if (static_cast<int64_t>(src.size()) != n) {
      shape_error = absl::InternalError(absl::StrCat("answer for rows [", first, ", ", first + n, ") has ", src.size(),
                                                     " ", what, " values"));
      return;
    }
    if (dst.empty()) dst.resize(static_cast<size_t>(batch.rows));
    std::copy(src.begin(), src.end(), dst.begin() + first);
    count += n;
  };
  while (shape_error.ok() && stream->Read(&resp)) {
    if (resp.has_summary()) {
      out->reduced_loss = resp.summary().loss();
      out->valid_tokens = resp.summary().valid_tokens();
      out->head_version = resp.summary().head_version();
      continue;
    }
    const v1::ChunkResult& c = resp.chunk();
    const int64_t first = c.first_row(), n = c.rows();
    if (first < 0 || n <= 0 || first > batch.rows - n) {
      shape_error = absl::InternalError(absl::StrCat("answer for rows [", first, ", ", first + n,
                                                     ") is outside the request's ", batch.rows, " rows"));
      break;
    }
    for (int64_t r = first; r < first + n; ++r) {
      if (seen[r]++) {
        shape_error = absl::InternalError(absl::StrCat("row ", r, " was answered twice"));
        break;
      }
    }
    if (!shape_error.ok()) break;
    place(c.logprobs(), out->logprobs, first, n, n_logprobs, "logprob");
    place(c.entropy(), out->entropy, first, n, n_entropy, "entropy");
    place(c.loss(), out->loss, first, n, n_loss, "loss");
    if (!c.d_hidden().empty()) {
      if (static_cast<int64_t>(c.d_hidden().size()) != n * row_bytes) {
        shape_error = absl::InternalError(absl::StrCat("answer for rows [", first, ", ", first + n, ") has ",
                                                       c.d_hidden().size(), " d_hidden bytes, not ", n * row_bytes));
      } else {
        if (out->d_hidden.empty()) out->d_hidden.resize(static_cast<size_t>(batch.rows * row_bytes));
        std::copy(c.d_hidden().begin(), c.d_hidden().end(), out->d_hidden.begin() + first * row_bytes);
        n_dhidden += n;
      }
    }
    covered += n;
  }
  if (!shape_error.ok()) {
    ctx.TryCancel();  // stop the server's work and our writer; the answer is unusable
    while (stream->Read(&resp)) {
    }
  }
  writer.join();
  grpc::Status s = stream->Finish();
  if (!shape_error.ok()) return shape_error;
  if (!s.ok()) return ToAbsl(s);
  if (covered != batch.rows) {
    return absl::InternalError(absl::StrCat("the server answered ", covered, " of ", batch.rows, " rows"));
  }
  for (auto [count, what] : {std::pair{n_logprobs, "logprobs"}, std::pair{n_entropy, "entropy"},
                             std::pair{n_loss, "loss"}, std::pair{n_dhidden, "d_hidden"}}) {
    if (count != 0 && count != batch.rows) {
      return absl::InternalError(absl::StrCat("the server answered ", what, " for ", count, " of ", batch.rows, " rows"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ScoreResult> LceClient::Score(const HiddenBatch& batch, v1::RequestHeader header) {
  ForwardBackwardResult r;
  if (absl::Status s = Stream("Score", batch, header, {}, {}, {}, &r); !s.ok()) return s;
  return ScoreResult{std::move(r.logprobs), std::move(r.entropy)};
}

absl::StatusOr<ForwardBackwardResult> LceClient::ForwardBackward(const HiddenBatch& batch, v1::RequestHeader header,
                                                                 absl::Span<const float> grad_loss) {
  const bool mean = header.reduction() == v1::REDUCTION_MEAN || header.reduction() == v1::REDUCTION_UNSPECIFIED;
  if (mean && !header.has_num_valid_tokens()) {
    const int32_t ignore = header.has_ignore_index() ? header.ignore_index() : -100;
    int64_t valid = 0;
    for (int32_t y : batch.targets) valid += y != ignore ? 1 : 0;
    header.set_num_valid_tokens(valid);
  }
  ForwardBackwardResult r;
  if (absl::Status s = Stream("ForwardBackward", batch, header, grad_loss, {}, {}, &r); !s.ok()) return s;
  return r;
}

absl::StatusOr<BackwardResult> LceClient::Backward(const HiddenBatch& batch, v1::RequestHeader header,
                                                   absl::Span<const float> grad_logprob,
                                                   absl::Span<const float> grad_entropy) {
  ForwardBackwardResult r;
  if (absl::Status s = Stream("Backward", batch, header, {}, grad_logprob, grad_entropy, &r); !s.ok()) return s;
  return BackwardResult{std::move(r.d_hidden)};
}

}  // namespace lce::client

namespace lce::client {

absl::StatusOr<std::unique_ptr<SharedMemorySession>> LceClient::OpenSession() {
  std::unique_ptr<SharedMemorySession> s(new SharedMemorySession());
  // No deadline: a session lives as long as its owner.
  if (!options_.bearer_token.empty()) s->ctx_.AddMetadata("authorization", "Bearer " + options_.bearer_token);
  s->stream_ = stub_->OpenSession(&s->ctx_);
  v1::SessionResponse first;
  if (!s->stream_->Read(&first)) {
    s->broken_ = true;
    return ToAbsl(s->stream_->Finish());
  }
  s->session_id_ = first.session_id();
  if (s->session_id_.empty()) return absl::InternalError("the server's first session message has no session_id");
  return s;
}

absl::StatusOr<v1::SessionResponse> SharedMemorySession::Ask(const v1::SessionRequest& req) {
  std::lock_guard<std::mutex> lock(mu_);
  v1::SessionResponse resp;
  if (broken_ || !stream_->Write(req) || !stream_->Read(&resp)) {
    broken_ = true;
    return absl::UnavailableError("the session stream has ended");
  }
  if (resp.code() != 0) return absl::Status(static_cast<absl::StatusCode>(resp.code()), resp.message());
  return resp;
}

absl::StatusOr<uint64_t> SharedMemorySession::Register(const std::string& shm_name, int64_t offset,
                                                       int64_t byte_size, const std::string& name) {
  v1::SessionRequest req;
  v1::RegisterRegion* r = req.mutable_register_region();
  r->set_name(name.empty() ? shm_name : name);
  r->set_shm_name(shm_name);
  r->set_offset(offset);
  r->set_byte_size(byte_size);
  absl::StatusOr<v1::SessionResponse> resp = Ask(req);
  if (!resp.ok()) return resp.status();
  return resp->region_id();
}

absl::Status SharedMemorySession::Unregister(uint64_t region_id) {
  v1::SessionRequest req;
  req.mutable_unregister_region()->set_region_id(region_id);
  return Ask(req).status();
}

absl::StatusOr<SharedMemorySession::Region> SharedMemorySession::CreateRegion(int64_t bytes, const std::string& name) {
  if (bytes <= 0) return absl::InvalidArgumentError(absl::StrCat("region size must be > 0, got ", bytes));
  static std::atomic<uint64_t> counter{0};
  const std::string shm_name = absl::StrCat("/lce-", getpid(), "-", counter++, "-", std::random_device{}());
  const int fd = shm_open(shm_name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) return absl::InternalError(absl::StrCat("shm_open(", shm_name, "): ", std::strerror(errno)));
  void* addr = MAP_FAILED;
  if (ftruncate(fd, bytes) == 0) addr = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int e = errno;
  close(fd);
  if (addr == MAP_FAILED) {
    shm_unlink(shm_name.c_str());
    return absl::InternalError(absl::StrCat("ftruncate/mmap of ", shm_name, ": ", std::strerror(e)));
  }
  absl::StatusOr<uint64_t> id = Register(shm_name, 0, bytes, name);
  if (!id.ok()) {
    munmap(addr, static_cast<size_t>(bytes));
    shm_unlink(shm_name.c_str());
    return id.status();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    owned_.push_back({*id, shm_name, addr, static_cast<size_t>(bytes)});
  }
  return Region{*id, shm_name, absl::Span<uint8_t>(static_cast<uint8_t*>(addr), static_cast<size_t>(bytes)),
                session_id_};
}

absl::Status SharedMemorySession::ReleaseRegion(uint64_t region_id) {
  Owned o{};
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = std::find_if(owned_.begin(), owned_.end(), [&](const Owned& x) { return x.id == region_id; });
    if (it == owned_.end()) return absl::NotFoundError(absl::StrCat("region ", region_id, " was not created here"));
    o = *it;
    owned_.erase(it);
  }
  absl::Status s = Unregister(region_id);
  munmap(o.addr, o.len);
  shm_unlink(o.shm_name.c_str());
  return s;
}

SharedMemorySession::~SharedMemorySession() {
  if (stream_ != nullptr) {
    if (!broken_) stream_->WritesDone();
    v1::SessionResponse resp;
    while (stream_->Read(&resp)) {
    }
    stream_->Finish();
  }
  for (const Owned& o : owned_) {
    munmap(o.addr, o.len);
    shm_unlink(o.shm_name.c_str());
  }
}

}  // namespace lce::client
