// Internal: the CUDA engine's scratch. One device allocation (EngineConfig::workspace_bytes at most)
// is carved into the buffers of a row block of R rows (CudaEngine::Carve); host rows stage through
// page-locked host memory.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "lce/device_memory.h"

namespace lce::cuda {

inline int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// What a call's scratch must hold (CudaEngine::PlanCall), which sets its size for R rows.
struct ScratchLayout {
  bool backward = false;
  bool host = false;
  bool host_dw = false;
  bool fast = false;       // fast loss path with d_weight: needs the scaled copy of h
  bool target_dw = false;  // the general path's target term scattered into d_weight (target_order scratch)
  int64_t tile = 0;        // logit tile columns (0: the engine's default, tile_)
  bool epi = false;        // forward through the epilogue-statistics GEMM: no logit tiles
  bool stage = false;      // device rows not 16-byte aligned, copied to s.hidden for the epilogue GEMM's TMA
  bool side = false;       // fast path, device rows: d_hidden's product on aux_ beside dW's (FastGradsBeside)
};

// Scratch of one row block of R rows.
struct Scratch {
  void* cublas_ws = nullptr;
  float* logits[2] = {nullptr, nullptr};  // [R, ldz] fp32 logit tiles (double-buffered)
  float* tile_part = nullptr;      // [R, ntile, 4] epilogue-statistics GEMM's per-tile partials (ScratchLayout::epi)
  void* store = nullptr;           // [R, lds] compact z − m_seg, then dA (backward only)
  float* part = nullptr;           // [R, nseg, 4]
  float* part_global = nullptr;    // [R, nseg_global, 4] (tensor parallel, tp_invariant_)
  float* zy = nullptr;             // [R] target logits gathered over the ranks (likewise)
  float* packed = nullptr;         // [R, 4]
  float* m_local = nullptr;        // [R]
  float* m = nullptr;              // [R]
  float* info = nullptr;           // [R, kRowInfo]
  float* dh = nullptr;             // [R, H] fp32 (backward only; may alias the logit tiles)
  float* dh_parts = nullptr;       // [leaves, dh_slice, H] fp32: d_hidden's leaf partials, after the carved scratch
  int64_t dh_slice = 0;            // rows a slice of them (0: no room, or not on the leaves' path)
  int32_t* dh_fixed = nullptr;  // [dh_slice, H] a group's fixed-point sum in int32 (DhExactGroup), after the partials
  uint8_t* dh_codes = nullptr;  // [dh_slice, H] its elements' scale codes
  // [3]: the first non-finite row; [1] the overflow flag (float bits); [2] the first bad target (device rows)
  unsigned long long* bad = nullptr;
  float* row_c = nullptr;        // [R] fast path: c_row
  void* h_scaled = nullptr;      // [R, H] bf16, fast path with d_weight
  void* target_order = nullptr;  // the target scatter's sort (TargetOrderBytes(R)), fast path with d_weight
  int64_t target_order_bytes = 0;
  void* side_ws = nullptr;  // cuBLAS workspace of d_hidden's product on aux_ (ScratchLayout::side)
  // kHost staging on the device.
  void* hidden = nullptr;                                         // [R, H] head dtype
  int32_t* targets = nullptr;                                     // [R]
  float* up[3] = {nullptr, nullptr, nullptr};                     // grad_loss, grad_logprob, grad_entropy [R]
  float* out[5] = {nullptr, nullptr, nullptr, nullptr, nullptr};  // logprob, entropy, lse, loss, z_loss [R]
  void* d_hidden = nullptr;                                       // [R, H] head dtype
  float* dw_slab = nullptr;                                       // [slab_rows, H] fp32 (kHost with d_weight)
};

// Carves aligned pieces out of one allocation (base null: only counts).
class Carver {
 public:
  explicit Carver(uint8_t* base) : base_(base) {}
  template <typename T>
  T* Take(int64_t count) {
    off_ = RoundUp(off_, 256);
    T* p = reinterpret_cast<T*>(base_ == nullptr ? nullptr : base_ + off_);
    off_ += count * static_cast<int64_t>(sizeof(T));
    return p;
  }
  int64_t used() const { return RoundUp(off_, 256); }

 private:
  uint8_t* base_;
  int64_t off_ = 0;
};

// Host memory for host rows' staging, page-locked (PinHostMemory) so that copies run at the bus's
// speed; grown on demand, never shrunk.
class PinnedStaging {
 public:
  absl::Status Ensure(int64_t bytes, int device);
  uint8_t* get() const { return bytes_.get(); }

 private:
  struct Free {
    void operator()(uint8_t* p) const;
  };
  std::unique_ptr<uint8_t, Free> bytes_;  // declared first: unpinned (pin_) before it is freed
  std::unique_ptr<PinnedHostRange> pin_;
  int64_t size_ = 0;
};

}  // namespace lce::cuda
