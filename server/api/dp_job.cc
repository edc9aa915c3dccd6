#include "dp_job.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "grpc_server.h"
#include "grpc_status.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "request_authenticator.h"
#include "status_macros.h"
#include "tp_group.h"

namespace lce::server {
namespace {

namespace fs = std::filesystem;

// Metadata of the calls between fronts. kSecret: the job's secret (relays and forwards); kSequence:
// the sequencer's forward, to apply as this call; kOrigin: a relay, from this replica's front.
constexpr char kSecret[] = "lce-dp-job";
constexpr char kSequence[] = "lce-dp-seq";
constexpr char kOrigin[] = "lce-dp-origin";
// Trailing metadata of an answer that a front's handler (not the transport) gave.
constexpr char kReached[] = "lce-dp-reached";
// A meeting's slot of a front whose data-parallel links are down (other slots: a status code).
constexpr float kLinksDown = 100.0f;

// An integer as a float that all-reduces exactly (below 2^24).
float Exact(int64_t v) { return static_cast<float>(v % (int64_t{1} << 24)); }

fs::path AddressFile(const DpOptions& o, int replica) {
  return fs::path(o.rendezvous) / "fronts" / absl::StrCat("front-", replica, ".addr");
}

// The meeting's verdict from every front's slot (v[0, n)) and the call's number (v[n], -v[n + 1]).
absl::Status Judge(const std::vector<float>& v, int n, const absl::Status& mine) {
  for (int d = 0; d < n; ++d) {
    if (v[d] == kLinksDown) {
      return absl::UnavailableError(absl::StrCat("replica ", d, "'s data-parallel links are down since an earlier ",
                                                 "failure; the job's training is down until it restarts"));
    }
  }
  if (!mine.ok()) return mine;
  for (int d = 0; d < n; ++d) {
    if (v[d] != 0.0f) {
      return absl::Status(static_cast<absl::StatusCode>(static_cast<int>(v[d])),
                          absl::StrCat("replica ", d, " could not get ready for this change (its answer says why); ",
                                       "no replica changed"));
    }
  }
  return absl::OkStatus();
}

std::chrono::system_clock::time_point ForwardDeadline(grpc::ServerContext* ctx, absl::Duration cap) {
  const auto capped = std::chrono::system_clock::now() +
                      std::chrono::duration_cast<std::chrono::system_clock::duration>(absl::ToChronoNanoseconds(cap));
  return std::min(ctx->deadline(), capped);
}

// Hex HMAC-SHA256 of replica `replica`'s address under the job's secret.
std::string AddressMac(int replica, const std::string& address, const std::string& secret) {
  const std::string text = absl::StrCat("lce-dp front ", replica, " ", address);
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()), reinterpret_cast<const unsigned char*>(text.data()),
       text.size(), mac, &n);
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(mac), n));
}

}  // namespace

absl::Status PublishFrontAddress(const DpOptions& dp, int replica, const std::string& address, const std::string& secret) {
  const fs::path file = AddressFile(dp, replica);
  const fs::path tmp = file.string() + ".tmp";
  std::ofstream(tmp) << address << "\n" << AddressMac(replica, address, secret) << "\n";
  std::error_code ec;
  fs::rename(tmp, file, ec);  // readers never see a half-written address
  if (ec) return absl::InternalError(absl::StrCat("cannot publish this front's address in ", file.string(), ": ", ec.message()));
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadFrontAddress(const DpOptions& dp, int replica, const std::string& secret) {
  const fs::path file = AddressFile(dp, replica);
  std::string address, mac;
  if (!(std::ifstream(file) >> address >> mac)) {
    return absl::NotFoundError(absl::StrCat("replica ", replica, "'s front published no address in ", file.string()));
  }
  if (!ConstantTimeEquals(mac, AddressMac(replica, address, secret))) {
    return absl::PermissionDeniedError(
        absl::StrCat(file.string(), " is not signed by this data-parallel job: its address is not used"));
  }
  return address;
}

absl::StatusOr<std::shared_ptr<DpJob>> DpJob::Join(const DpJobOptions& o, DpRank* front_rank, const HeadShape& shape,
                                                   int tp_size) {
  TpBootstrap b = DpBootstrap(o.dp, "fronts", "data-parallel control link");
  b.timeout = o.change_wait + o.dp.timeout;  // the slowest front's drain, then the call itself
  absl::StatusOr<std::unique_ptr<TpCommunicator>> control = CreateGlooCommunicator(b);
  if (!control.ok()) return control.status();
  std::shared_ptr<DpJob> job(new DpJob(o, front_rank, *std::move(control)));
  LCE_RETURN_IF_ERROR(job->CheckShapes(shape, tp_size));
  LCE_RETURN_IF_ERROR(job->ShareSecret());
  if (o.dp.replica == 0) {
    LCE_RETURN_IF_ERROR(MarkDpJobFormed(o.dp));
  }
  return job;
}

absl::Status DpJob::CheckShapes(const HeadShape& shape, int tp_size) {
  const float mine[4] = {Exact(shape.vocab_size), Exact(shape.hidden_size), static_cast<float>(shape.dtype),
                         static_cast<float>(tp_size)};
  float v[8];
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = mine[i];
    v[2 * i + 1] = -mine[i];
  }
  LCE_RETURN_IF_ERROR(AllReduceFloats(*control_, *control_staging_, v, 8, ReduceOp::kMax));
  for (int i = 0; i < 8; i += 2) {
    if (v[i] != -v[i + 1]) {
      return absl::FailedPreconditionError(
          "the data-parallel replicas start with different heads or tensor-parallel sizes: every replica needs the "
          "same head (shape and dtype) and the same --tp-size");
    }
  }
  return absl::OkStatus();
}

absl::Status DpJob::ShareSecret() {
  char hex[33] = {};
  if (replica() == 0) {
    std::random_device random;
    for (int i = 0; i < 32; ++i) hex[i] = "0123456789abcdef"[random() % 16];
  }
  LCE_RETURN_IF_ERROR(control_->Broadcast(hex, 32, false, nullptr, 0));
  secret_.assign(hex, 32);
  return absl::OkStatus();
}

absl::Status DpJob::Publish(int port) {
  return PublishFrontAddress(options_.dp, replica(), absl::StrCat(options_.dp.host, ":", port), secret_);
}

bool DpJob::Marked(grpc::ServerContext* ctx, const char* key, std::string* value) const {
  const auto& md = ctx->client_metadata();
  auto it = md.find(key);
  if (it == md.end()) return false;
  value->assign(it->second.data(), it->second.size());
  return true;
}

std::optional<absl::Status> DpJob::Route(grpc::ServerContext* ctx, DpCallKind kind, const FrontCall& call,
                                         const std::function<void(int)>& take, int64_t* seq) {
  std::string secret, text;
  const bool marked = Marked(ctx, kSecret, &secret);
  if (marked && !ConstantTimeEquals(secret, secret_)) {
    return absl::PermissionDeniedError("the call carries another data-parallel job's mark");
  }
  if (marked && Marked(ctx, kSequence, &text)) {  // the sequencer's forward: this replica's part
    if (!absl::SimpleAtoi(text, seq)) return absl::InvalidArgumentError("bad call number");
    ctx->AddTrailingMetadata(kReached, "1");
    return std::nullopt;
  }
  if (replica() != 0) {
    absl::Status s = Relay(ctx, call);
    if (s.ok()) take(0);
    return s;
  }
  int origin = 0;
  if (marked && Marked(ctx, kOrigin, &text) && (!absl::SimpleAtoi(text, &origin) || origin < 0 || origin >= size())) {
    origin = 0;
  }
  ctx->AddTrailingMetadata(kReached, "1");
  absl::Status s = Sequence(ctx, kind, origin, call);
  if (s.ok()) take(origin);
  return s;
}

absl::StatusOr<v1::LceService::Stub*> DpJob::Front(int replica) {
  std::lock_guard<std::mutex> lock(fronts_mu_);
  if (auto it = fronts_.find(replica); it != fronts_.end()) return it->second.get();
  absl::StatusOr<std::string> address = ReadFrontAddress(options_.dp, replica, secret_);
  for (int i = 0; i < 100 && !address.ok(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // it may still be starting to serve
    address = ReadFrontAddress(options_.dp, replica, secret_);
  }
  if (!address.ok()) return absl::UnavailableError(address.status().message());
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (!options_.tls_cert.empty()) {
    grpc::SslCredentialsOptions ssl;
    absl::StatusOr<std::string> ca = ReadPem(options_.tls_ca);
    if (!ca.ok()) return absl::FailedPreconditionError(absl::StrCat("--dp-tls-ca: ", ca.status().message()));
    ssl.pem_root_certs = *ca;
    if (!options_.tls_client_ca.empty()) {  // the fronts want client certificates: present ours
      absl::StatusOr<std::string> cert = ReadPem(options_.tls_cert), key = ReadPem(options_.tls_key);
      if (!cert.ok() || !key.ok()) return cert.ok() ? key.status() : cert.status();
      ssl.pem_cert_chain = *cert;
      ssl.pem_private_key = *key;
    }
    creds = grpc::SslCredentials(ssl);
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  auto stub = v1::LceService::NewStub(grpc::CreateCustomChannel(*address, creds, args));
  return (fronts_[replica] = std::move(stub)).get();
}

DpJob::Answer DpJob::CallFront(int replica, grpc::ServerContext* ctx, const Marks& marks, const FrontCall& call,
                               grpc::ClientContext& c) {
  absl::StatusOr<v1::LceService::Stub*> stub = Front(replica);
  if (!stub.ok()) return {stub.status(), false};
  // Long enough for a front's drain, the meeting and the call; a client's deadline comes first.
  c.set_deadline(ForwardDeadline(ctx, 2 * (options_.change_wait + options_.dp.timeout) + absl::Seconds(30)));
  const auto& md = ctx->client_metadata();
  if (auto auth = md.find("authorization"); auth != md.end()) {
    c.AddMetadata("authorization", std::string(auth->second.data(), auth->second.size()));
  }
  for (const auto& [key, value] : marks) c.AddMetadata(key, value);
  const grpc::Status s = call(replica, **stub, c);
  return {FromGrpcStatus(s), c.GetServerTrailingMetadata().count(kReached) > 0};  // the one conversion of an answer
}

absl::Status DpJob::Relay(grpc::ServerContext* ctx, const FrontCall& call) {
  grpc::ClientContext c;
  const Answer a = CallFront(0, ctx, {{kSecret, secret_}, {kOrigin, absl::StrCat(replica())}}, call, c);
  if (a.reached) return a.status;
  return absl::UnavailableError(absl::StrCat("data-parallel replica 0 (the job's sequencer) did not answer (",
                                             a.status.message(), "); the job's training is down until it restarts, ",
                                             "every replica keeps scoring"));
}

absl::Status DpJob::Sequence(grpc::ServerContext* ctx, DpCallKind kind, int origin, const FrontCall& call) {
  std::lock_guard<std::mutex> lock(sequence_mu_);
  if (!down_.ok()) return down_;
  const Marks marks = {{kSecret, secret_}, {kSequence, absl::StrCat(++sequence_)}};
  std::vector<int> replicas;
  for (int d = 0; d < size(); ++d) {
    if (kind.everywhere || d == origin) replicas.push_back(d);
  }
  std::vector<Answer> answers(replicas.size());
  std::vector<grpc::ClientContext> contexts(replicas.size());
  std::atomic<bool> dropping{false};
  std::vector<std::thread> calls;
  for (size_t i = 0; i < replicas.size(); ++i) {
    calls.emplace_back([&, i] {
      answers[i] = CallFront(replicas[i], ctx, marks, call, contexts[i]);
      answers[i].dropped = dropping && !answers[i].reached && answers[i].status.code() == absl::StatusCode::kCancelled;
      // A lost replica fails the call: the others are not waited for (a hung one would hold the
      // answer until its deadline). Their handlers run on, and change nothing without the lost one.
      if (answers[i].lost() && !dropping.exchange(true)) {
        for (grpc::ClientContext& other : contexts) other.TryCancel();
      }
    });
  }
  for (std::thread& t : calls) t.join();
  return Combine(kind, replicas, answers);
}

std::vector<std::string> DpJob::LostReplicas(const std::vector<int>& replicas, const std::vector<Answer>& answers) {
  std::vector<std::string> lost, silent;
  bool unreachable = false;
  for (size_t i = 0; i < answers.size(); ++i) {
    const Answer& a = answers[i];
    if (a.dropped) silent.push_back(absl::StrCat("replica ", replicas[i], " did not answer in time"));
    if (!a.lost()) continue;
    unreachable = unreachable || !a.reached;
    lost.push_back(a.reached ? absl::StrCat("replica ", replicas[i], ": ", a.status.message())
                             : absl::StrCat("replica ", replicas[i], " did not answer (", a.status.message(), ")"));
  }
  // A replica that timed out waiting (its links say only that a peer was silent) was waiting for the
  // ones still silent when the sequencer gave up: they are named first. Where a front could not be
  // reached at all, the silent ones are merely the calls the sequencer cut short.
  if (!lost.empty() && !unreachable) lost.insert(lost.begin(), silent.begin(), silent.end());
  if (lost.empty() && !front_rank_->health().ok()) lost.push_back(std::string(front_rank_->health().message()));
  return lost;
}

absl::Status DpJob::Combine(DpCallKind kind, const std::vector<int>& replicas, const std::vector<Answer>& answers) {
  const std::vector<std::string> lost = LostReplicas(replicas, answers);
  if (!lost.empty()) {
    down_ = absl::UnavailableError(absl::StrCat("the data-parallel job's training is down until it restarts (every ",
                                                "replica keeps scoring): ", absl::StrJoin(lost, "; ")));
    return down_;
  }
  std::vector<std::string> failed, applied;
  absl::StatusCode code = absl::StatusCode::kOk;
  for (size_t i = 0; i < answers.size(); ++i) {
    const absl::Status& s = answers[i].status;
    if (s.ok()) {
      applied.push_back(absl::StrCat("replica ", replicas[i]));
    } else if (!answers[i].dropped) {
      failed.push_back(absl::StrCat("replica ", replicas[i], ": ", s.message()));
      if (code == absl::StatusCode::kOk) code = s.code();
    }
  }
  if (failed.empty()) return absl::OkStatus();
  if (kind.meets && !applied.empty()) {
    failed.push_back(absl::StrCat(absl::StrJoin(applied, ", "), " did apply it: the replicas differ until it is applied again"));
  }
  return absl::Status(code, absl::StrJoin(failed, "; "));
}

absl::Status DpJob::LoseControl(const absl::Status& why) {
  control_->Abort();
  control_health_ = absl::UnavailableError(absl::StrCat("the data-parallel fronts lost each other: ", why.message()));
  return control_health_;
}

absl::Status DpJob::Meet(int64_t seq, const absl::Status& mine) {
  std::lock_guard<std::mutex> lock(meet_mu_);
  if (!control_health_.ok()) return control_health_;
  const int n = size();
  std::vector<float> v(static_cast<size_t>(n) + 2, 0.0f);
  v[replica()] = !front_rank_->health().ok() ? kLinksDown : mine.ok() ? 0.0f : static_cast<float>(mine.code());
  v[n] = Exact(seq);
  v[n + 1] = -Exact(seq);
  if (absl::Status s = AllReduceFloats(*control_, *control_staging_, v.data(), n + 2, ReduceOp::kMax); !s.ok()) {
    return LoseControl(s);
  }
  if (v[n] != -v[n + 1]) return LoseControl(absl::InternalError("the fronts met at different calls"));
  return Judge(v, n, mine);
}

// ---- DpCall ----

DpCall::DpCall(DpJob* job, grpc::ServerContext* ctx, DpCallKind kind, const FrontCall& call,
               const std::function<void(int)>& take)
    : job_(job) {
  answer_ = job->Route(ctx, kind, call, take, &seq_);
  must_meet_ = !answer_.has_value() && kind.meets;
}

DpCall& DpCall::operator=(DpCall&& other) noexcept {
  job_ = std::exchange(other.job_, nullptr);
  answer_ = std::move(other.answer_);
  seq_ = other.seq_;
  must_meet_ = std::exchange(other.must_meet_, false);
  return *this;
}

DpCall::~DpCall() {
  if (must_meet_) {
    job_->Meet(seq_, absl::AbortedError(absl::StrCat("replica ", job_->replica(), " answered before getting ready")))
        .IgnoreError();
  }
}

absl::Status DpCall::Ready(const absl::Status& mine) {
  if (!must_meet_) return mine;
  must_meet_ = false;
  return job_->Meet(seq_, mine);
}

bool DpJob::IsForward(grpc::ServerContext* ctx) const {
  std::string mark;
  return Marked(ctx, kSecret, &mark) && Marked(ctx, kSequence, &mark);
}

DpCall DpCall::RouteUpdate(DpJob* job, grpc::ServerContext* ctx, const UpdateReader& next, v1::HeadDescription* resp) {
  if (job == nullptr) return DpCall();
  // A client's stream is read once, whole, before any front is called (a client that stalls or is
  // refused costs the job nothing); a forward is read by the RPC itself.
  std::vector<v1::UpdateWeightsRequest> stream;
  if (!job->IsForward(ctx)) {
    for (v1::UpdateWeightsRequest msg;;) {
      absl::StatusOr<bool> more = next(&msg);
      if (!more.ok()) {
        DpCall refused;
        refused.answer_ = more.status();
        return refused;
      }
      if (!*more) break;
      stream.push_back(std::move(msg));
    }
  }
  std::vector<v1::HeadDescription> answers(static_cast<size_t>(job->size()));
  auto call = [&](int replica, v1::LceService::Stub& stub, grpc::ClientContext& c) -> grpc::Status {
    std::unique_ptr<grpc::ClientWriter<v1::UpdateWeightsRequest>> writer = stub.UpdateWeights(&c, &answers[replica]);
    for (const v1::UpdateWeightsRequest& msg : stream) {
      if (!writer->Write(msg)) break;
    }
    writer->WritesDone();
    return writer->Finish();
  };
  return DpCall(job, ctx, DpCallKind{true, true}, call, [&](int replica) { *resp = std::move(answers[replica]); });
}

}  // namespace lce::server
