// The CUDA engine's scratch (workspace.h): the layout of a row block's buffers in the workspace, the
// block size the budget allows, and host rows' pinned staging.
#include "cuda/workspace.h"

#include <algorithm>
#include <cstdlib>

#include "cuda/cuda_check.h"
#include "cuda/cuda_engine_impl.h"

namespace lce::cuda {

int64_t CudaEngine::Carve(const ScratchLayout& l, int64_t R, uint8_t* base, Scratch* s) const {
  const int64_t H = shape_.hidden_size;
  const int64_t esz = DTypeSize(shape_.dtype);
  Carver c(base);
  s->cublas_ws = c.Take<uint8_t>(kCublasWorkspace);
  const int64_t ldz = Ldz(l);
  if (l.epi) {
    s->tile_part = c.Take<float>(R * EpiTiles() * 4);
  } else {
    s->logits[0] = c.Take<float>(2 * R * ldz);
    s->logits[1] = s->logits[0] == nullptr ? nullptr : s->logits[0] + R * ldz;
  }
  s->part = c.Take<float>(R * nseg_ * 4);
  if (tp_invariant_) {
    s->part_global = c.Take<float>(R * nseg_global_ * 4);
    s->zy = c.Take<float>(R);
  }
  s->packed = c.Take<float>(R * kPacked);
  s->m_local = c.Take<float>(R);
  s->m = c.Take<float>(R);
  s->info = c.Take<float>(R * kRowInfo);
  s->bad = c.Take<unsigned long long>(3);
  s->row_c = c.Take<float>(R);
  if (l.fast) s->h_scaled = c.Take<uint8_t>(R * H * 2);
  if (l.fast || l.target_dw) {
    s->target_order_bytes = TargetOrderBytes(R);
    s->target_order = c.Take<uint8_t>(s->target_order_bytes);
  }
  if (l.side) s->side_ws = c.Take<uint8_t>(kCublasWorkspace);
  if (l.backward) {
    s->store = c.Take<uint8_t>(R * lds_ * (shape_.dtype == DType::kFloat32 ? 4 : 2));
    // d_hidden's fp32 accumulator reuses the logit tiles (free by then) where it fits.
    s->dh = !l.epi && H <= 2 * ldz ? s->logits[0] : c.Take<float>(R * H);
  }
  if (l.host || l.stage) s->hidden = c.Take<uint8_t>(R * H * esz);
  if (l.host) {
    s->targets = c.Take<int32_t>(R);
    for (float*& p : s->up) p = c.Take<float>(R);
    for (float*& p : s->out) p = c.Take<float>(R);
    if (l.backward) s->d_hidden = c.Take<uint8_t>(R * H * esz);
  }
  if (l.host_dw) s->dw_slab = c.Take<float>(DwSlabRows() * H);
  return c.used();
}

int64_t CudaEngine::WideTile(int64_t R) const {
  const int64_t fits = kWideLogitBytes / (2 * static_cast<int64_t>(sizeof(float)) * R) / kSegment * kSegment;
  return std::min(RoundUp(shape_.shard_rows, kSegment), std::max(tile_, fits));
}

int64_t CudaEngine::Bytes(const ScratchLayout& l, int64_t R) const {
  Scratch s;
  return Carve(l, R, nullptr, &s);
}

absl::Status CudaEngine::GrowDeviceBuffer(std::unique_ptr<DeviceBuffer>& buf, int64_t bytes) {
  if (buf != nullptr && buf->size() >= bytes) return absl::OkStatus();
  LCE_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the stream may still use the old one
  if (buf != nullptr) scratch_bytes_ -= buf->size();
  buf.reset();  // freed before the larger one is taken
  absl::StatusOr<std::unique_ptr<DeviceBuffer>> grown = AllocateDeviceBuffer(bytes, config_.device);
  if (!grown.ok()) return grown.status();
  buf = std::move(*grown);
  scratch_bytes_ += buf->size();
  return absl::OkStatus();
}

int64_t CudaEngine::RowsPerBlock(const ScratchLayout& l, int64_t want, int64_t budget) const {
  int64_t lo = 1, hi = std::min<int64_t>(want, kMaxRowsPerBlock);
  if (const int64_t cap = tuning_.max_rows; cap > 0) hi = std::min(hi, cap);
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (Bytes(l, mid) <= budget)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

void PinnedStaging::Free::operator()(uint8_t* p) const { std::free(p); }

absl::Status PinnedStaging::Ensure(int64_t bytes, int device) {
  if (bytes <= size_) return absl::OkStatus();
  pin_.reset();
  bytes_.reset();
  size_ = 0;
  constexpr int64_t kPage = 4096;
  const int64_t size = RoundUp(bytes, kPage);
  bytes_.reset(static_cast<uint8_t*>(std::aligned_alloc(kPage, static_cast<size_t>(size))));
  if (bytes_ == nullptr) return absl::ResourceExhaustedError("no host memory for the pinned staging");
  absl::StatusOr<std::unique_ptr<PinnedHostRange>> pin = PinHostMemory(bytes_.get(), size, device);
  if (!pin.ok()) {
    bytes_.reset();
    return pin.status();
  }
  pin_ = std::move(*pin);
  size_ = size;
  return absl::OkStatus();
}

}  // namespace lce::cuda
