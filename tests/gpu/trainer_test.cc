// The CUDA HeadTrainer against the host AdamW loop (the CPU trainer's math): the same gradient gives
// the same serving weight bits after several clipped steps and an update, for bf16, fp16 and fp32
// heads; the device norm is the float64 sum, in a fixed order that shards of any group size share;
// the engine accumulates dW into the trainer's device buffer. Every test skips (GTEST_SKIP, with a message) where no CUDA device is visible.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "lce/engine.h"
#include "lce/numeric.h"
#include "lce/training.h"

namespace lce {
namespace {

#define SKIP_WITHOUT_GPU() \
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA device visible: CUDA trainer tests skipped"

std::shared_ptr<HeadWeights> RandomHead(int64_t vocab, int64_t hidden, DType dtype, uint64_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  auto w = std::make_shared<HeadWeights>();
  w->shape = {vocab, hidden, dtype, 0, vocab, false};
  std::vector<float> f(static_cast<size_t>(vocab * hidden));
  for (float& x : f) x = normal(rng) / std::sqrt(static_cast<float>(hidden));
  w->weight.resize(f.size() * DTypeSize(dtype));
  ConvertFromFloat(f.data(), static_cast<int64_t>(f.size()), dtype, w->weight.data());
  return w;
}

struct Trained {
  std::shared_ptr<LceEngine> engine;
  std::unique_ptr<HeadTrainer> trainer;
};

Trained CudaTrainer(std::shared_ptr<HeadWeights> w) {
  Trained t;
  absl::StatusOr<std::unique_ptr<LceEngine>> e = CreateEngine(Backend::kCuda, w, EngineConfig{});
  EXPECT_TRUE(e.ok()) << e.status();
  if (!e.ok()) return t;
  t.engine = std::move(*e);
  absl::StatusOr<std::unique_ptr<HeadTrainer>> tr = CreateHeadTrainer(t.engine, w, nullptr);
  EXPECT_TRUE(tr.ok()) << tr.status();
  if (tr.ok()) t.trainer = std::move(*tr);
  return t;
}

// trainer.grad() := a seeded random gradient 0.05·N(0, 1) of n floats, kept in *grad too; landed when it
// returns (a pageable copy may return before it lands, and neither the trainer's nor the engine's stream
// waits for it).
void UploadRandomGrad(HeadTrainer& trainer, int64_t n, uint32_t seed, std::vector<float>* grad) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  grad->resize(static_cast<size_t>(n));
  for (float& g : *grad) g = 0.05f * normal(rng);
  ASSERT_EQ(cudaMemcpy(trainer.grad(), grad->data(), n * 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// Σ g² in float64, in order.
double SquaredNormOf(const std::vector<float>& grad) {
  double sum = 0;
  for (float g : grad) sum += static_cast<double>(g) * g;
  return sum;
}

TEST(CudaTrainer, AdamWKernelGivesTheHostLoopsBits) {
  SKIP_WITHOUT_GPU();
  // An odd element count: the kernel's vector loop and its tail both run.
  const int64_t V = 1001, H = 27, n = V * H;
  for (DType dtype : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    SCOPED_TRACE(DTypeName(dtype));
    std::shared_ptr<HeadWeights> w = RandomHead(V, H, dtype, 11);
    Trained t = CudaTrainer(w);
    ASSERT_NE(t.trainer, nullptr);
    HeadTrainer& trainer = *t.trainer;
    EXPECT_EQ(trainer.grad_space(), MemorySpace::kDevice);
    std::vector<float> grad;
    ASSERT_NO_FATAL_FAILURE(UploadRandomGrad(trainer, n, 12, &grad));
    absl::StatusOr<double> sq = trainer.GradSquaredNorm();
    ASSERT_TRUE(sq.ok()) << sq.status();
    const double want = SquaredNormOf(grad);
    EXPECT_NEAR(*sq, want, 1e-12 * want);
    EXPECT_EQ(*sq, *trainer.GradSquaredNorm()) << "a fixed summation order";
    std::vector<float> slice(3 * H);
    ASSERT_TRUE(trainer.CopyGrad(V - 3, 3, slice.data()).ok());
    EXPECT_EQ(std::memcmp(slice.data(), grad.data() + (V - 3) * H, slice.size() * 4), 0);

    std::vector<float> master(static_cast<size_t>(n)), m(master.size(), 0.0f), v(master.size(), 0.0f);
    ConvertToFloat(w->weight.data(), dtype, n, master.data());
    AdamWParams p;
    p.lr = 3e-3f;
    p.beta2 = 0.95f;
    p.weight_decay = 0.05f;
    for (int step = 1; step <= 4; ++step) {
      if (step == 3) {
        std::shared_ptr<HeadWeights> other = RandomHead(V, H, dtype, 13);
        ASSERT_TRUE(trainer.SetWeight(other).ok());
        ConvertToFloat(other->weight.data(), dtype, n, master.data());
      }
      const float scale = ClipScale(std::sqrt(*sq), 0.5f);
      absl::StatusOr<std::shared_ptr<LceEngine>> e = trainer.Step(p, scale);
      ASSERT_TRUE(e.ok()) << e.status();
      EXPECT_EQ(e->get(), t.engine.get()) << "the CUDA step rewrites the engine's weight in place";
      AdamWStep(master.data(), m.data(), v.data(), grad.data(), n, p, step, scale);
      std::vector<uint8_t> rounded(w->weight.size());
      ConvertFromFloat(master.data(), n, dtype, rounded.data());
      absl::StatusOr<std::shared_ptr<const HeadWeights>> now = trainer.Weights();
      ASSERT_TRUE(now.ok()) << now.status();
      size_t differ = 0;
      for (size_t i = 0; i < rounded.size(); ++i) differ += (*now)->weight[i] != rounded[i];
      EXPECT_EQ(differ, 0u) << "bytes of the serving weight that differ from the host loop's, step " << step;
    }
    ASSERT_TRUE(trainer.ZeroGrad().ok());
    EXPECT_EQ(*trainer.GradSquaredNorm(), 0.0);
  }
}

// A head with a bias (issue 34): dB follows dW in the gradient, counts in its norm, and the step moves the
// bias with the weight, each the host loop's bits; SetWeight changes both. H = 27: dB's part of the
// gradient is not 16-byte aligned.
TEST(CudaTrainer, BiasStepsWithTheWeight) {
  SKIP_WITHOUT_GPU();
  const int64_t V = 1001, H = 27, nw = V * H, n = nw + V;
  for (DType dtype : {DType::kBFloat16, DType::kFloat32}) {
    SCOPED_TRACE(DTypeName(dtype));
    const auto with_bias = [&](uint64_t seed) {
      std::shared_ptr<HeadWeights> w = RandomHead(V, H, dtype, seed);
      w->shape.has_bias = true;
      std::mt19937 rng(seed + 100);
      std::normal_distribution<float> normal;
      w->bias.resize(V);
      for (float& b : w->bias) b = 0.1f * normal(rng);
      return w;
    };
    std::shared_ptr<HeadWeights> w = with_bias(21);
    Trained t = CudaTrainer(w);
    ASSERT_NE(t.trainer, nullptr);
    HeadTrainer& trainer = *t.trainer;
    ASSERT_EQ(trainer.grad_elements(), n);
    std::vector<float> grad;
    ASSERT_NO_FATAL_FAILURE(UploadRandomGrad(trainer, n, 22, &grad));
    absl::StatusOr<double> sq = trainer.GradSquaredNorm();
    ASSERT_TRUE(sq.ok()) << sq.status();
    const double want = SquaredNormOf(grad);
    EXPECT_NEAR(*sq, want, 1e-12 * want) << "‖[dW | dB]‖²";
    std::vector<float> db(V);
    ASSERT_TRUE(trainer.CopyBiasGrad(db.data()).ok());
    EXPECT_EQ(std::memcmp(db.data(), grad.data() + nw, V * 4), 0);

    // The host loop over [master W | bias], as the CPU trainer steps them.
    std::vector<float> master(static_cast<size_t>(n)), m(master.size(), 0.0f), v(master.size(), 0.0f);
    ConvertToFloat(w->weight.data(), dtype, nw, master.data());
    std::copy(w->bias.begin(), w->bias.end(), master.begin() + nw);
    AdamWParams p;
    p.lr = 3e-3f;
    p.weight_decay = 0.05f;
    for (int step = 1; step <= 4; ++step) {
      if (step == 3) {
        std::shared_ptr<HeadWeights> other = with_bias(23);
        ASSERT_TRUE(trainer.SetWeight(other).ok());
        ConvertToFloat(other->weight.data(), dtype, nw, master.data());
        std::copy(other->bias.begin(), other->bias.end(), master.begin() + nw);
      }
      const float scale = ClipScale(std::sqrt(*sq), 0.5f);
      absl::StatusOr<std::shared_ptr<LceEngine>> e = trainer.Step(p, scale);
      ASSERT_TRUE(e.ok()) << e.status();
      AdamWStep(master.data(), m.data(), v.data(), grad.data(), n, p, step, scale);
      std::vector<uint8_t> rounded(w->weight.size());
      ConvertFromFloat(master.data(), nw, dtype, rounded.data());
      absl::StatusOr<std::shared_ptr<const HeadWeights>> now = trainer.Weights();
      ASSERT_TRUE(now.ok()) << now.status();
      EXPECT_EQ(std::memcmp((*now)->weight.data(), rounded.data(), rounded.size()), 0) << "weight, step " << step;
      ASSERT_EQ((*now)->bias.size(), static_cast<size_t>(V));
      EXPECT_EQ(std::memcmp((*now)->bias.data(), master.data() + nw, V * 4), 0) << "bias, step " << step;
    }
  }
}

// The device's tile sums depend on the tile alone: shards of 2, 3 and 5 ranks combine to one rank's
// bits, with float4 loads (H = 64) and without (H = 27).
TEST(CudaTrainer, ShardsTileNormsCombineToOneRanksBits) {
  SKIP_WITHOUT_GPU();
  for (int64_t H : {64, 27}) {
    const int64_t V = 3001;
    std::shared_ptr<HeadWeights> full = RandomHead(V, H, DType::kBFloat16, 31);
    std::mt19937 rng(32);
    std::normal_distribution<float> normal;
    std::vector<float> grad(static_cast<size_t>(V * H));
    for (size_t i = 0; i < grad.size(); ++i) grad[i] = normal(rng) * static_cast<float>(1 + i % 7);
    auto tiles_of = [&](std::shared_ptr<HeadWeights> w) {
      Trained t = CudaTrainer(w);
      const HeadShape& s = w->shape;
      EXPECT_EQ(cudaMemcpy(t.trainer->grad(), grad.data() + s.vocab_begin * H, s.shard_rows * H * 4, cudaMemcpyHostToDevice),
                cudaSuccess);
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the copy landed (see above)
      absl::StatusOr<TileSquaredNorms> n = t.trainer->GradTileSquaredNorms();
      EXPECT_TRUE(n.ok()) << n.status();
      return *n;
    };
    const int64_t tiles = VocabTileCount(V);
    std::vector<float> one(static_cast<size_t>(2 * tiles), 0.0f);
    PackTileSquaredNorms(tiles_of(full), one.data());
    const double want = CombineTileSquaredNorms(one.data(), tiles);
    for (int world : {2, 3, 5}) {
      std::vector<float> exchange(one.size(), 0.0f);
      for (int r = 0; r < world; ++r) {
        const VocabRange range = VocabShard(V, r, world);
        auto shard = std::make_shared<HeadWeights>();
        shard->shape = {V, H, DType::kBFloat16, range.begin, range.end - range.begin, false};
        shard->weight.assign(full->weight.begin() + range.begin * H * 2, full->weight.begin() + range.end * H * 2);
        PackTileSquaredNorms(tiles_of(shard), exchange.data());
      }
      EXPECT_EQ(CombineTileSquaredNorms(exchange.data(), tiles), want) << "H=" << H << ", " << world << " shards";
    }
  }
}

// The engine's dW lands in the trainer's device buffer, as in any device buffer, and a step changes
// what the same engine answers.
TEST(CudaTrainer, EngineAccumulatesIntoTheDeviceGradient) {
  SKIP_WITHOUT_GPU();
  const int64_t V = 5003, H = 256, N = 300;
  std::shared_ptr<HeadWeights> w = RandomHead(V, H, DType::kBFloat16, 21);
  Trained t = CudaTrainer(w);
  ASSERT_NE(t.trainer, nullptr);
  std::mt19937 rng(22);
  std::normal_distribution<float> normal;
  std::vector<uint16_t> hidden(static_cast<size_t>(N * H));
  for (uint16_t& x : hidden) x = FloatToBf16(normal(rng));
  std::vector<int32_t> targets(N);
  for (int64_t i = 0; i < N; ++i) targets[i] = i % 9 == 0 ? -100 : static_cast<int32_t>((i * 131) % V);
  void *d_hidden = nullptr, *d_targets = nullptr, *d_dw = nullptr;
  float* d_lp = nullptr;
  ASSERT_EQ(cudaMalloc(&d_hidden, hidden.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_targets, N * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_dw, V * H * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_lp, N * 4), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_hidden, hidden.data(), hidden.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_targets, targets.data(), N * 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(d_dw, 0, V * H * 4), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the copies and the memset landed (see above)
  const RowsView rows{d_hidden, static_cast<const int32_t*>(d_targets), N, MemorySpace::kDevice};
  const Upstream up{GradMode::kLoss, nullptr, nullptr, nullptr};
  for (int k = 0; k < 2; ++k) {
    ASSERT_TRUE(t.engine->Compute(rows, LceOptions{}, up, {}, {nullptr, t.trainer->grad()}).ok());
    ASSERT_TRUE(t.engine->Compute(rows, LceOptions{}, up, {}, {nullptr, static_cast<float*>(d_dw)}).ok());
  }
  std::vector<float> got(static_cast<size_t>(V * H)), want(got.size());
  ASSERT_TRUE(t.trainer->CopyGrad(0, V, got.data()).ok());
  ASSERT_EQ(cudaMemcpy(want.data(), d_dw, want.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(got, want);
  double norm = 0;
  for (float x : want) norm += static_cast<double>(x) * x;
  EXPECT_GT(norm, 0.0);

  std::vector<float> before(N), after(N);
  ASSERT_TRUE(t.engine->Compute(rows, LceOptions{}, {}, {d_lp, nullptr, nullptr, nullptr}, {}).ok());
  ASSERT_EQ(cudaMemcpy(before.data(), d_lp, N * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  AdamWParams p;
  p.lr = 1e-2f;
  ASSERT_TRUE(t.trainer->Step(p, 1.0f).ok());
  ASSERT_TRUE(t.engine->Compute(rows, LceOptions{}, {}, {d_lp, nullptr, nullptr, nullptr}, {}).ok());
  ASSERT_EQ(cudaMemcpy(after.data(), d_lp, N * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  double mean_gain = 0;
  for (int64_t i = 0; i < N; ++i) mean_gain += targets[i] == -100 ? 0.0 : after[i] - before[i];
  EXPECT_GT(mean_gain, 0.0) << "a descent step on the loss raises the targets' logprobs";
  for (void* ptr : {d_hidden, d_targets, d_dw, static_cast<void*>(d_lp)}) cudaFree(ptr);
}

// Pending contributions on the device: the engine accumulates into a pending buffer, which reaches
// dW only when committed, as dW += fp32(s·P) (the CPU trainer's rounding, elementwise), or as the
// buffer itself scaled in place where dW is zero; a released one leaves dW alone.
TEST(CudaTrainer, PendingContributionsCommitScaled) {
  SKIP_WITHOUT_GPU();
  const int64_t V = 3001, H = 128, N = 64;
  std::shared_ptr<HeadWeights> w = RandomHead(V, H, DType::kBFloat16, 31);
  Trained t = CudaTrainer(w);
  ASSERT_NE(t.trainer, nullptr);
  std::mt19937 rng(32);
  std::normal_distribution<float> normal;
  std::vector<uint16_t> hidden(static_cast<size_t>(N * H));
  for (uint16_t& x : hidden) x = FloatToBf16(normal(rng));
  std::vector<int32_t> targets(N);
  for (int64_t i = 0; i < N; ++i) targets[i] = static_cast<int32_t>((i * 197) % V);
  void *d_hidden = nullptr, *d_targets = nullptr;
  ASSERT_EQ(cudaMalloc(&d_hidden, hidden.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_targets, N * 4), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_hidden, hidden.data(), hidden.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_targets, targets.data(), N * 4, cudaMemcpyHostToDevice), cudaSuccess);
  const RowsView rows{d_hidden, static_cast<const int32_t*>(d_targets), N, MemorySpace::kDevice};
  const Upstream up{GradMode::kLoss, nullptr, nullptr, nullptr};
  const int64_t n = V * H;
  auto dw = [&] {
    std::vector<float> out(static_cast<size_t>(n));
    EXPECT_TRUE(t.trainer->CopyGrad(0, V, out.data()).ok());
    return out;
  };
  auto contribute = [&](uint64_t id) {
    absl::StatusOr<float*> p = t.trainer->AcquirePending(id);
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_TRUE(t.engine->Compute(rows, LceOptions{}, up, {}, {nullptr, *p}).ok());
  };
  ASSERT_TRUE(t.trainer->ZeroGrad().ok());
  contribute(1);
  const std::vector<float> zero = dw();
  for (float x : zero) ASSERT_EQ(x, 0.0f) << "nothing reaches dW before the commit";
  ASSERT_TRUE(t.trainer->CommitPending(1, 1.0f).ok());  // into a zero dW: the buffer itself
  const std::vector<float> p1 = dw();
  contribute(2);
  contribute(3);
  t.trainer->ReleasePending(3);
  ASSERT_TRUE(t.trainer->CommitPending(2, 0.25f).ok());
  const std::vector<float> got = dw();
  double norm = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float want = p1[static_cast<size_t>(i)] + 0.25f * p1[static_cast<size_t>(i)];
    ASSERT_EQ(got[static_cast<size_t>(i)], want) << "element " << i;
    norm += static_cast<double>(want) * want;
  }
  EXPECT_GT(norm, 0.0);
  ASSERT_TRUE(t.trainer->ZeroGrad().ok());
  contribute(4);
  ASSERT_TRUE(t.trainer->CommitPending(4, -3.0f).ok());  // a zero dW scaled in place
  const std::vector<float> scaled = dw();
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(scaled[static_cast<size_t>(i)], -3.0f * p1[static_cast<size_t>(i)]);
  for (void* ptr : {d_hidden, d_targets}) cudaFree(ptr);
}

// GradOutputs::d_weight_fresh on the GPU: over a NaN-filled buffer the call writes dW (beta 0 in the
// first row block's products), as accumulating into zeros does, on the fast loss path with
// and without d_hidden beside it and on the general path (label smoothing), over several row blocks
// (a small workspace).
TEST(CudaTrainer, FreshWeightGradientOverwritesWhatWasThere) {
  SKIP_WITHOUT_GPU();
  const int64_t V = 2053, H = 128, N = 3000;
  std::shared_ptr<HeadWeights> w = RandomHead(V, H, DType::kBFloat16, 41);
  EngineConfig config;
  config.workspace_bytes = int64_t{40} << 20;  // ~34 MB fixed, then row blocks of a few hundred rows
  absl::StatusOr<std::unique_ptr<LceEngine>> e = CreateEngine(Backend::kCuda, w, config);
  ASSERT_TRUE(e.ok()) << e.status();
  std::mt19937 rng(42);
  std::normal_distribution<float> normal;
  std::vector<uint16_t> hidden(static_cast<size_t>(N * H));
  for (uint16_t& x : hidden) x = FloatToBf16(normal(rng));
  std::vector<int32_t> targets(N);
  for (int64_t i = 0; i < N; ++i) targets[i] = i % 11 == 0 ? -100 : static_cast<int32_t>((i * 389) % V);
  void *d_hidden = nullptr, *d_targets = nullptr, *d_dh = nullptr;
  float *zeroed = nullptr, *fresh = nullptr;
  ASSERT_EQ(cudaMalloc(&d_hidden, hidden.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_targets, N * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_dh, N * H * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&zeroed, V * H * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&fresh, V * H * 4), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_hidden, hidden.data(), hidden.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_targets, targets.data(), N * 4, cudaMemcpyHostToDevice), cudaSuccess);
  const RowsView rows{d_hidden, static_cast<const int32_t*>(d_targets), N, MemorySpace::kDevice};
  const Upstream up{GradMode::kLoss, nullptr, nullptr, nullptr};
  LceOptions smoothing;
  smoothing.label_smoothing = 0.1f;
  for (auto [options, dh, what] : {std::tuple{LceOptions{}, false, "fast path"}, std::tuple{LceOptions{}, true, "fast path, d_hidden beside"},
                                   std::tuple{smoothing, true, "general path"}}) {
    ASSERT_EQ(cudaMemset(zeroed, 0, V * H * 4), cudaSuccess);
    ASSERT_EQ(cudaMemset(fresh, 0xff, V * H * 4), cudaSuccess);  // NaN
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    GradOutputs g{dh ? d_dh : nullptr, zeroed};
    absl::Status st = (*e)->Compute(rows, options, up, {}, g);
    ASSERT_TRUE(st.ok()) << what << ": " << st;
    g.d_weight = fresh;
    g.d_weight_fresh = true;
    st = (*e)->Compute(rows, options, up, {}, g);
    ASSERT_TRUE(st.ok()) << what << ", fresh: " << st;
    std::vector<float> a(static_cast<size_t>(V * H)), b(a.size());
    ASSERT_EQ(cudaMemcpy(a.data(), zeroed, a.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(b.data(), fresh, b.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    // The first block's products run with beta 0, which cuBLASLt tunes as a shape of its own: the same
    // sums, maybe another algorithm, so rounding may differ (not NaN, not garbage).
    double scale = 0, err = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      ASSERT_TRUE(std::isfinite(b[i])) << what << ", element " << i << " kept what was there";
      scale = std::max(scale, std::abs(static_cast<double>(a[i])));
      err = std::max(err, std::abs(static_cast<double>(b[i]) - a[i]));
    }
    EXPECT_GT(scale, 0.0);
    EXPECT_LE(err, 1e-5 * scale) << what;
    std::printf("%s: max |fresh - accumulated| %.3g of max |dW| %.3g\n", what, err, scale);
  }
  for (void* ptr : {d_hidden, d_targets, d_dh, static_cast<void*>(zeroed), static_cast<void*>(fresh)}) cudaFree(ptr);
}

}  // namespace
}  // namespace lce
