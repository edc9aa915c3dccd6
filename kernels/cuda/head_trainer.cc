// The CUDA HeadTrainer: every buffer on the engine's GPU, every call ordered on the trainer's own
// stream and complete (synchronised) when it returns, so that the engine's calls, on its stream, see
// its results and it sees theirs (an engine call is complete when it returns too).
#include "cuda/head_trainer.h"

#include <cuda_runtime.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_engine.h"
#include "cuda/kernels.h"
#include "lce/device_memory.h"

namespace lce::cuda {
namespace {

class CudaHeadTrainer final : public HeadTrainer {
 public:
  CudaHeadTrainer(std::shared_ptr<LceEngine> engine, std::shared_ptr<const HeadWeights> weights, EngineWeightOnDevice w)
      : HeadTrainer(weights->shape), engine_(std::move(engine)), weights_(std::move(weights)), serving_(w) {}
  ~CudaHeadTrainer() override {
    if (stream_ != nullptr) {
      cudaSetDevice(serving_.device);
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
  }

  absl::Status Init() {
    LCE_CUDA_CHECK(cudaSetDevice(serving_.device));
    LCE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    absl::StatusOr<std::unique_ptr<GradBuffer>> g = NewGradBuffer();
    if (!g.ok()) return g.status();
    grad_ = std::move(*g);
    const ShardTiles tiles = TilesOf(shape_);
    norm_shape_ = {shape_.hidden_size, tiles.first_tile, tiles.count, tiles.tile_rows, tiles.vocab_begin, tiles.shard_rows};
    absl::StatusOr<std::unique_ptr<DeviceBuffer>> s =
        AllocateDeviceBuffer(std::max<int64_t>(1, tiles.count * (kTileChunks + 1)) * 8, serving_.device);
    if (!s.ok()) return s.status();
    norm_scratch_ = std::move(*s);
    return ZeroGrad();
  }

  std::string_view backend() const override { return "cuda"; }
  MemorySpace grad_space() const override { return MemorySpace::kDevice; }
  void* stream() override { return stream_; }

  absl::StatusOr<TileSquaredNorms> GradTileSquaredNorms() override {
    LCE_CUDA_CHECK(cudaSetDevice(serving_.device));
    double* scratch = reinterpret_cast<double*>(norm_scratch_->data());
    double* sums = scratch + norm_shape_.tiles * kTileChunks;
    LCE_CUDA_CHECK(LaunchTileSquaredNorms(grad_data(), norm_shape_, scratch, sums, stream_));
    TileSquaredNorms out{norm_shape_.first_tile, std::vector<double>(static_cast<size_t>(norm_shape_.tiles))};
    LCE_CUDA_CHECK(cudaMemcpyAsync(out.sums.data(), sums, out.sums.size() * 8, cudaMemcpyDeviceToHost, stream_));
    std::vector<float> d_bias(shape_.has_bias ? shape_.shard_rows : 0);
    if (shape_.has_bias) {
      LCE_CUDA_CHECK(
          cudaMemcpyAsync(d_bias.data(), BiasPart(grad_data()), d_bias.size() * 4, cudaMemcpyDeviceToHost, stream_));
    }
    LCE_CUDA_CHECK(Sync());
    // A tile's rows of dW, then of dB (in float64 on the host: a few floats a row), as the CPU trainer.
    const ShardTiles tiles = TilesOf(shape_);
    for (int64_t i = 0; shape_.has_bias && i < tiles.count; ++i) {
      out.sums[i] += SquaredNorm(d_bias.data() + tiles.RowBegin(i), tiles.RowEnd(i) - tiles.RowBegin(i));
    }
    return out;
  }

  absl::Status PrepareStep() override {
    if (master_ != nullptr) return absl::OkStatus();
    LCE_CUDA_CHECK(cudaSetDevice(serving_.device));
    return MakeMasters();
  }

  absl::StatusOr<std::shared_ptr<LceEngine>> Step(const AdamWParams& p, float grad_scale) override {
    LCE_CUDA_CHECK(PrepareStep());
    const AdamWCoefficients c = AdamWCoefficientsAt(p, steps_ + 1);
    AdamWKernelArgs a;
    a.grad_scale = grad_scale;
    a.decay = c.decay;
    a.beta1 = p.beta1;
    a.one_minus_beta1 = 1.0f - p.beta1;
    a.beta2 = p.beta2;
    a.one_minus_beta2 = 1.0f - p.beta2;
    a.bc2_sqrt = c.bc2_sqrt;
    a.eps = p.eps;
    a.step_size = c.step_size;
    LCE_CUDA_CHECK(LaunchAdamW(Master(), Master() + Stride(), Master() + 2 * Stride(), grad_data(), shape_.dtype,
                               serving_.weight, weight_elements(), a, stream_));
    if (shape_.has_bias) {
      // dB follows dW in the gradient buffer, not 16-byte aligned in general: the kernel reads an aligned copy.
      float* db = reinterpret_cast<float*>(bias_grad_->data());
      const int64_t b0 = BiasOffset(), n = shape_.shard_rows;
      LCE_CUDA_CHECK(cudaMemcpyAsync(db, BiasPart(grad_data()), n * 4, cudaMemcpyDeviceToDevice, stream_));
      LCE_CUDA_CHECK(LaunchAdamW(Master() + b0, Master() + Stride() + b0, Master() + 2 * Stride() + b0, db,
                                 DType::kFloat32, serving_.bias, n, a, stream_));
    }
    LCE_CUDA_CHECK(Sync());
    ++steps_;
    host_current_ = false;
    return engine_;
  }

  absl::StatusOr<std::shared_ptr<LceEngine>> SetWeight(std::shared_ptr<const HeadWeights> w) override {
    if (w->weight.size() != weights_->weight.size()) return absl::InvalidArgumentError("new weight has another shape");
    if (w->bias.size() != weights_->bias.size()) return absl::InvalidArgumentError("new bias has another shape");
    LCE_CUDA_CHECK(cudaSetDevice(serving_.device));
    LCE_CUDA_CHECK(cudaMemcpyAsync(serving_.weight, w->weight.data(), w->weight.size(), cudaMemcpyHostToDevice, stream_));
    if (shape_.has_bias) {
      LCE_CUDA_CHECK(
          cudaMemcpyAsync(serving_.bias, w->bias.data(), w->bias.size() * 4, cudaMemcpyHostToDevice, stream_));
    }
    if (master_ != nullptr) LCE_CUDA_CHECK(MastersFromServing(Master()));
    LCE_CUDA_CHECK(Sync());
    weights_ = std::move(w);
    host_current_ = true;
    return engine_;
  }

  absl::StatusOr<std::shared_ptr<const HeadWeights>> Weights() override {
    if (host_current_) return weights_;
    auto w = std::make_shared<HeadWeights>();
    w->shape = shape_;
    w->bias.resize(weights_->bias.size());
    w->weight.resize(weights_->weight.size());
    LCE_CUDA_CHECK(cudaSetDevice(serving_.device));
    LCE_CUDA_CHECK(cudaMemcpyAsync(w->weight.data(), serving_.weight, w->weight.size(), cudaMemcpyDeviceToHost, stream_));
    if (shape_.has_bias) {
      LCE_CUDA_CHECK(
          cudaMemcpyAsync(w->bias.data(), serving_.bias, w->bias.size() * 4, cudaMemcpyDeviceToHost, stream_));
    }
    LCE_CUDA_CHECK(Sync());
    weights_ = std::move(w);
    host_current_ = true;
    return weights_;
  }

 protected:
  absl::StatusOr<std::unique_ptr<GradBuffer>> NewGradBuffer() override {
    absl::StatusOr<std::unique_ptr<DeviceBuffer>> b = AllocateDeviceBuffer(grad_elements() * 4, serving_.device);
    if (!b.ok()) return b.status();
    return std::unique_ptr<GradBuffer>(new DeviceGradBuffer(std::move(*b)));
  }
  absl::Status Zero(float* x) override {
    LCE_CUDA_CHECK(cudaSetDevice(serving_.device));
    LCE_CUDA_CHECK(cudaMemsetAsync(x, 0, static_cast<size_t>(grad_elements()) * 4, stream_));
    return Sync();
  }
  absl::Status Scale(float* x, float s) override {
    LCE_CUDA_CHECK(cudaSetDevice(serving_.device));
    LCE_CUDA_CHECK(LaunchScaleAdd(x, nullptr, s, grad_elements(), stream_));
    return Sync();
  }
  absl::Status AddScaled(float* y, const float* x, float s) override {
    LCE_CUDA_CHECK(cudaSetDevice(serving_.device));
    LCE_CUDA_CHECK(LaunchScaleAdd(y, x, s, grad_elements(), stream_));
    return Sync();
  }
  absl::Status CopyRows(const float* buffer, int64_t first_row, int64_t rows, float* host) override {
    return CopyElements(buffer, first_row * shape_.hidden_size, rows * shape_.hidden_size, host);
  }
  absl::Status CopyElements(const float* buffer, int64_t first, int64_t n, float* host) override {
    LCE_CUDA_CHECK(cudaSetDevice(serving_.device));
    LCE_CUDA_CHECK(cudaMemcpyAsync(host, buffer + first, static_cast<size_t>(n) * 4, cudaMemcpyDeviceToHost, stream_));
    return Sync();
  }

 private:
  class DeviceGradBuffer final : public GradBuffer {
   public:
    explicit DeviceGradBuffer(std::unique_ptr<DeviceBuffer> b) : b_(std::move(b)) {}
    float* data() override { return reinterpret_cast<float*>(b_->data()); }

   private:
    std::unique_ptr<DeviceBuffer> b_;
  };

  absl::Status Sync() {
    LCE_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }
  // master, exp_avg and exp_avg_sq: one allocation of three fp32 shards, each Stride() floats apart
  // (a multiple of 64, for the kernel's 16-byte vectors); a bias's part of each from BiasOffset().
  float* Master() { return reinterpret_cast<float*>(master_->data()); }
  int64_t BiasOffset() const { return (weight_elements() + 63) / 64 * 64; }
  int64_t Stride() const { return (BiasOffset() + (shape_.has_bias ? shape_.shard_rows : 0) + 63) / 64 * 64; }
  // master [Stride()] := the serving weight in fp32, then its bias (on stream_).
  absl::Status MastersFromServing(float* master) {
    LCE_CUDA_CHECK(LaunchDTypeToFloat(serving_.weight, shape_.dtype, master, weight_elements(), stream_));
    if (shape_.has_bias) {
      LCE_CUDA_CHECK(cudaMemcpyAsync(master + BiasOffset(), serving_.bias, shape_.shard_rows * 4,
                                     cudaMemcpyDeviceToDevice, stream_));
    }
    return absl::OkStatus();
  }
  // At the first step: masters from the serving weight, zero moments.
  absl::Status MakeMasters() {
    absl::StatusOr<std::unique_ptr<DeviceBuffer>> m = AllocateDeviceBuffer(3 * Stride() * 4, serving_.device);
    if (!m.ok()) return m.status();
    float* master = reinterpret_cast<float*>((*m)->data());
    if (shape_.has_bias) {
      absl::StatusOr<std::unique_ptr<DeviceBuffer>> db = AllocateDeviceBuffer(shape_.shard_rows * 4, serving_.device);
      if (!db.ok()) return db.status();
      bias_grad_ = std::move(*db);
    }
    LCE_CUDA_CHECK(MastersFromServing(master));
    LCE_CUDA_CHECK(cudaMemsetAsync(master + Stride(), 0, static_cast<size_t>(2 * Stride()) * 4, stream_));
    LCE_CUDA_CHECK(Sync());
    master_ = std::move(*m);  // only once complete: a failure leaves no half-made state
    return absl::OkStatus();
  }

  std::shared_ptr<LceEngine> engine_;
  std::shared_ptr<const HeadWeights> weights_;  // host copy: current while host_current_
  bool host_current_ = true;
  EngineWeightOnDevice serving_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<DeviceBuffer> norm_scratch_, master_;
  std::unique_ptr<DeviceBuffer> bias_grad_;  // Step's aligned copy of dB (a head with a bias)
  TileNormShape norm_shape_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<HeadTrainer>> CreateCudaHeadTrainer(std::shared_ptr<LceEngine> engine,
                                                                   std::shared_ptr<const HeadWeights> weights) {
  absl::StatusOr<EngineWeightOnDevice> w = WeightOnDevice(*engine);
  if (!w.ok()) return w.status();
  auto t = std::make_unique<CudaHeadTrainer>(std::move(engine), std::move(weights), *w);
  if (absl::Status s = t->Init(); !s.ok()) return s;
  return std::unique_ptr<HeadTrainer>(std::move(t));
}

}  // namespace lce::cuda
