#include "tp_group.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"

namespace lce::server {
namespace {

constexpr uint32_t kMagic = 0x4c434531;  // "LCE1"
enum class TpOp : uint32_t { kCompute = 1, kStop = 2 };
enum Flags : uint32_t { kGradLoss = 1, kGradLogprob = 2, kGradEntropy = 4, kWantDWeight = 8 };

// Fixed-size control block broadcast before each call's data.
struct TpControl {
  uint32_t magic = kMagic;
  TpOp op = TpOp::kCompute;
  int64_t rows = 0;
  uint32_t mode = 0;
  uint32_t flags = 0;
  float temperature = 1, softcap = 0, label_smoothing = 0, z_loss = 0;
  int32_t ignore_index = -100;
  uint32_t allow_tf32 = 0;
};

absl::Status BroadcastControl(TpCommunicator& comm, TpControl& c) {
  return comm.Broadcast(&c, sizeof(c), false, nullptr);
}

}  // namespace

absl::Status TpFrontEngine::Fail(absl::Status s) {
  if (!failed_) {
    failed_ = true;
    comm_->Abort();
    if (on_failure_) on_failure_(s);
  }
  return s;
}

absl::Status TpFrontEngine::Compute(const RowsView& rows, const LceOptions& o, const Upstream& up,
                                    const RowOutputs& outputs, const GradOutputs& grads) {
  if (rows.space != MemorySpace::kHost) return absl::InvalidArgumentError("tensor-parallel front takes host rows");
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_) return absl::UnavailableError("tensor-parallel group is down; it is being restarted");
  TpControl c;
  c.rows = rows.rows;
  c.mode = static_cast<uint32_t>(up.mode);
  c.flags = (up.grad_loss ? kGradLoss : 0) | (up.grad_logprob ? kGradLogprob : 0) |
            (up.grad_entropy ? kGradEntropy : 0) | (grads.d_weight ? kWantDWeight : 0);
  c.temperature = o.temperature;
  c.softcap = o.softcap;
  c.label_smoothing = o.label_smoothing;
  c.z_loss = o.z_loss;
  c.ignore_index = o.ignore_index;
  c.allow_tf32 = o.allow_tf32 ? 1 : 0;
  const HeadShape& s = shape();
  const int64_t row_bytes = s.hidden_size * DTypeSize(s.dtype);
  absl::Status st = BroadcastControl(*comm_, c);
  // The comm API is in place; the front's inputs are const, so copy through a staging buffer.
  auto send = [&](const void* p, int64_t bytes) -> absl::Status {
    if (!st.ok() || p == nullptr) return st;
    staging_.resize(static_cast<size_t>(bytes));
    std::memcpy(staging_.data(), p, static_cast<size_t>(bytes));
    return comm_->Broadcast(staging_.data(), bytes, false, nullptr);
  };
  st = send(rows.hidden, rows.rows * row_bytes);
  st = send(rows.targets, rows.rows * 4);
  st = send(up.grad_loss, rows.rows * 4);
  st = send(up.grad_logprob, rows.rows * 4);
  st = send(up.grad_entropy, rows.rows * 4);
  if (!st.ok()) return Fail(st);
  st = local_->Compute(rows, o, up, outputs, grads);
  if (st.code() == absl::StatusCode::kUnavailable) return Fail(st);
  return st;
}

absl::Status TpFrontEngine::StopPeers() {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_) return absl::OkStatus();
  TpControl c;
  c.op = TpOp::kStop;
  return BroadcastControl(*comm_, c);
}

absl::Status RunTpPeer(LceEngine& engine, TpCommunicator& comm) {
  const HeadShape& s = engine.shape();
  const int64_t row_bytes = s.hidden_size * DTypeSize(s.dtype);
  std::vector<uint8_t> hidden, d_hidden;
  std::vector<int32_t> targets;
  std::vector<float> gl, gu, ge, scratch;
  std::vector<float> d_weight;
  for (;;) {
    TpControl c;
    if (absl::Status st = BroadcastControl(comm, c); !st.ok()) return st;
    if (c.magic != kMagic) return absl::DataLossError("tensor-parallel control block is corrupt");
    if (c.op == TpOp::kStop) return absl::OkStatus();
    const int64_t n = c.rows;
    hidden.resize(static_cast<size_t>(n * row_bytes));
    targets.resize(static_cast<size_t>(n));
    if (absl::Status st = comm.Broadcast(hidden.data(), n * row_bytes, false, nullptr); !st.ok()) return st;
    if (absl::Status st = comm.Broadcast(targets.data(), n * 4, false, nullptr); !st.ok()) return st;
    Upstream up;
    up.mode = static_cast<GradMode>(c.mode);
    auto recv = [&](uint32_t flag, std::vector<float>& buf, const float** dst) -> absl::Status {
      if (!(c.flags & flag)) return absl::OkStatus();
      buf.resize(static_cast<size_t>(n));
      *dst = buf.data();
      return comm.Broadcast(buf.data(), n * 4, false, nullptr);
    };
    if (absl::Status st = recv(kGradLoss, gl, &up.grad_loss); !st.ok()) return st;
    if (absl::Status st = recv(kGradLogprob, gu, &up.grad_logprob); !st.ok()) return st;
    if (absl::Status st = recv(kGradEntropy, ge, &up.grad_entropy); !st.ok()) return st;
    LceOptions o;
    o.temperature = c.temperature;
    o.softcap = c.softcap;
    o.label_smoothing = c.label_smoothing;
    o.z_loss = c.z_loss;
    o.ignore_index = c.ignore_index;
    o.allow_tf32 = c.allow_tf32 != 0;
    GradOutputs grads;
    if (up.mode != GradMode::kNone) {
      d_hidden.resize(static_cast<size_t>(n * row_bytes));
      grads.d_hidden = d_hidden.data();  // the all-reduce inside needs every rank; the front keeps the result
    }
    if (c.flags & kWantDWeight) {
      d_weight.resize(static_cast<size_t>(s.shard_rows * s.hidden_size), 0.0f);  // this rank's dW shard
      grads.d_weight = d_weight.data();
    }
    RowsView rows{hidden.data(), targets.data(), n, MemorySpace::kHost};
    absl::Status st = engine.Compute(rows, o, up, RowOutputs{}, grads);
    if (st.code() == absl::StatusCode::kUnavailable) return st;
    // Other errors (bad rows) are deterministic: the front got the same one and answered the client.
  }
}

}  // namespace lce::server
