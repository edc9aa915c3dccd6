// CPU engine against the float64 reference (tests/kernels/reference.h) on fresh random inputs.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <set>
#include <tuple>

#include "gtest/gtest.h"
#include "lce/engine.h"
#include "lce/numeric.h"
#include "reference.h"

namespace lce {
namespace {

using testing::RefProblem;
using testing::RefResult;
using testing::Decode;
using testing::Encode;
using testing::RelErr;

// RelErr holds every row to the tolerance, not only the whole (an L2 ratio over N rows dilutes one
// bad row by ~1/sqrt(N): a 1% error in one row of 1000 read as 3e-4 and passed 1e-3).
TEST(Reference, RelErrSeesOneBadRow) {
  std::vector<double> want(1000);
  for (size_t i = 0; i < want.size(); ++i) want[i] = -3.0 - static_cast<double>(i % 7);
  std::vector<float> got(want.begin(), want.end());
  EXPECT_LE(RelErr(got, want), 1e-7);
  got[617] = static_cast<float>(want[617] * 1.01);
  EXPECT_GT(RelErr(got, want), 5e-3);
  // Rows of 16 values (d_hidden): one row off by 1% of its norm, the others exact.
  std::vector<double> dh(64 * 16);
  for (size_t i = 0; i < dh.size(); ++i) dh[i] = std::sin(0.37 * static_cast<double>(i));
  std::vector<float> dh_got(dh.begin(), dh.end());
  for (size_t c = 0; c < 16; ++c) dh_got[40 * 16 + c] = static_cast<float>(dh[40 * 16 + c] * 1.01);
  EXPECT_GT(RelErr(dh_got, dh, 16), 5e-3);
  // A row near zero is held to a typical row's norm, not its own: rounding there is not an error.
  std::vector<double> small = {1.0, -2.0, 1e-12, 3.0};
  std::vector<float> small_got = {1.0f, -2.0f, 1e-9f, 3.0f};
  EXPECT_LE(RelErr(small_got, small), 1e-8);
  EXPECT_EQ(RelErr(std::vector<float>(3), small), std::numeric_limits<double>::infinity());
}

struct Case {
  RefProblem ref;
  std::shared_ptr<HeadWeights> head;
  std::vector<uint8_t> hidden;
  std::vector<float> class_weight;  // empty or [vocab] (ref.class_weight holds the same values)
};

// Random problem: hidden ~ N(0, hidden_scale²), W ~ N(0, 1/H), targets uniform, a fraction ignored.
Case MakeCase(int64_t rows, int64_t H, int64_t V, DType dtype, uint64_t seed, double hidden_scale = 1.0,
              double ignore_fraction = 0.1, bool bias = false) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  std::uniform_real_distribution<double> unif;
  Case c;
  c.ref.rows = rows;
  c.ref.hidden = H;
  c.ref.vocab = V;
  c.head = std::make_shared<HeadWeights>();
  c.head->shape = {V, H, dtype, 0, V, bias};
  for (int64_t i = 0; i < V * H; ++i) {
    c.ref.w.push_back(Encode(normal(rng) / std::sqrt(static_cast<double>(H)), dtype, c.head->weight));
  }
  if (bias) {
    for (int64_t j = 0; j < V; ++j) {
      c.head->bias.push_back(static_cast<float>(normal(rng) * 0.5));
      c.ref.bias.push_back(c.head->bias.back());
    }
  }
  for (int64_t i = 0; i < rows * H; ++i) c.ref.h.push_back(Encode(normal(rng) * hidden_scale, dtype, c.hidden));
  std::uniform_int_distribution<int32_t> tgt(0, static_cast<int32_t>(V - 1));
  for (int64_t i = 0; i < rows; ++i) c.ref.targets.push_back(unif(rng) < ignore_fraction ? -100 : tgt(rng));
  return c;
}

std::unique_ptr<LceEngine> Engine(const Case& c) {
  absl::StatusOr<std::unique_ptr<LceEngine>> e = CreateEngine(Backend::kCpu, c.head, EngineConfig{});
  EXPECT_TRUE(e.ok()) << e.status();
  return std::move(*e);
}

struct EngineRun {
  std::vector<float> lse, logprob, entropy, loss, z_loss, dw, db;
  std::vector<uint8_t> dh;
  absl::Status status;
};

constexpr float kPoison = std::numeric_limits<float>::quiet_NaN();

EngineRun RunEngine(LceEngine& e, const Case& c, const std::vector<float>& g = {},
                    const std::vector<float>& u = {}, const std::vector<float>& en = {}) {
  const RefProblem& p = c.ref;
  EngineRun r;
  // Poisoned outputs: an element the engine forgets to write fails the comparison.
  r.lse.assign(p.rows, kPoison);
  r.logprob.assign(p.rows, kPoison);
  r.entropy.assign(p.rows, kPoison);
  r.loss.assign(p.rows, kPoison);
  r.z_loss.assign(p.rows, kPoison);
  Upstream up;
  up.mode = p.mode;
  up.grad_loss = g.empty() ? nullptr : g.data();
  up.grad_logprob = u.empty() ? nullptr : u.data();
  up.grad_entropy = en.empty() ? nullptr : en.data();
  GradOutputs grads;
  if (p.mode != GradMode::kNone) {
    r.dh.assign(p.rows * p.hidden * DTypeSize(c.head->shape.dtype), 0xff);  // NaN in every dtype
    r.dw.assign(p.vocab * p.hidden, 0.0f);
    grads.d_hidden = r.dh.data();
    grads.d_weight = r.dw.data();
    if (c.head->shape.has_bias) {
      r.db.assign(p.vocab, 0.0f);
      grads.d_bias = r.db.data();
    }
  }
  RowsView rows{c.hidden.data(), p.targets.data(), p.rows, MemorySpace::kHost};
  rows.class_weight = c.class_weight.empty() ? nullptr : c.class_weight.data();
  r.status = e.Compute(rows, p.options, up,
                       {r.logprob.data(), r.entropy.data(), r.lse.data(), r.loss.data(), r.z_loss.data()}, grads);
  return r;
}

std::vector<float> ToFloat(const std::vector<double>& v) { return {v.begin(), v.end()}; }

class ForwardShapes : public ::testing::TestWithParam<std::tuple<int64_t, int64_t, int64_t, DType>> {};

TEST_P(ForwardShapes, MatchesFloat64Reference) {
  const auto [rows, H, V, dtype] = GetParam();
  Case c = MakeCase(rows, H, V, dtype, 1000 + rows * 7 + V);
  auto e = Engine(c);
  EngineRun r = RunEngine(*e, c);
  ASSERT_TRUE(r.status.ok()) << r.status;
  RefResult ref = testing::ReferenceLce(c.ref);
  EXPECT_LE(RelErr(r.lse, ref.lse), 1e-5);
  EXPECT_LE(RelErr(r.logprob, ref.logprob), 1e-5);
  EXPECT_LE(RelErr(r.loss, ref.loss), 1e-5);
  EXPECT_LE(RelErr(r.entropy, ref.entropy), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, ForwardShapes,
    ::testing::Values(std::make_tuple(1, 16, 7, DType::kFloat32), std::make_tuple(3, 8, 1, DType::kFloat32),
                      std::make_tuple(17, 32, 2048, DType::kFloat32), std::make_tuple(130, 24, 5003, DType::kFloat32),
                      std::make_tuple(129, 40, 4097, DType::kBFloat16), std::make_tuple(64, 64, 3001, DType::kFloat16),
                      std::make_tuple(257, 16, 2049, DType::kBFloat16)));

// Every option, forward and both gradient modes, all three dtypes.
class Options : public ::testing::TestWithParam<std::tuple<DType, int>> {};

LceOptions OptionSet(int k) {
  LceOptions o;
  switch (k) {
    case 0: break;
    case 1: o.temperature = 0.7f; break;
    case 2: o.softcap = 3.0f; o.temperature = 1.3f; break;
    case 3: o.label_smoothing = 0.1f; break;
    case 4: o.z_loss = 1e-2f; break;
    case 5: o.temperature = 0.9f; o.softcap = 5.0f; o.label_smoothing = 0.05f; o.z_loss = 1e-3f; o.ignore_index = 3; break;
    case 6:
      o.label_smoothing = 0.1f;
      o.z_loss = 1e-2f;
      o.softcap = 4.0f;
      break;        // with class weights
    case 7: break;  // with class weights
  }
  return o;
}

// Class weights in [0, 2) with some zeros: PyTorch's CrossEntropyLoss(weight=...) (docs/MATH.md).
void AddClassWeights(Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> unif(0.0, 2.0);
  for (int64_t j = 0; j < c.ref.vocab; ++j) {
    const float w = j % 17 == 0 ? 0.0f : static_cast<float>(unif(rng));
    c.class_weight.push_back(w);
    c.ref.class_weight.push_back(w);
  }
}

TEST_P(Options, ValuesAndGradientsMatchReference) {
  const auto [dtype, k] = GetParam();
  for (GradMode mode : {GradMode::kLoss, GradMode::kGeneric}) {
    Case c = MakeCase(150, 24, 2500, dtype, 77 + k * 13 + static_cast<int>(mode), 2.0, 0.1, /*bias=*/k == 5);
    c.ref.options = OptionSet(k);
    if (k >= 6) AddClassWeights(c, 1000 + k);
    if (c.ref.options.ignore_index != -100) {
      for (auto& y : c.ref.targets) if (y == -100) y = c.ref.options.ignore_index;
    }
    c.ref.mode = mode;
    std::mt19937 rng(k);
    std::normal_distribution<double> n;
    std::vector<float> g, u, en;
    if (mode == GradMode::kLoss) {
      for (int64_t i = 0; i < c.ref.rows; ++i) g.push_back(static_cast<float>(n(rng)));
      c.ref.grad_loss.assign(g.begin(), g.end());
    } else {
      for (int64_t i = 0; i < c.ref.rows; ++i) u.push_back(static_cast<float>(n(rng)));
      for (int64_t i = 0; i < c.ref.rows; ++i) en.push_back(static_cast<float>(n(rng)));
      c.ref.grad_logprob.assign(u.begin(), u.end());
      c.ref.grad_entropy.assign(en.begin(), en.end());
    }
    auto e = Engine(c);
    EngineRun r = RunEngine(*e, c, g, u, en);
    ASSERT_TRUE(r.status.ok()) << r.status;
    RefResult ref = testing::ReferenceLce(c.ref);
    EXPECT_LE(RelErr(r.logprob, ref.logprob), 1e-5) << "option set " << k;
    EXPECT_LE(RelErr(r.loss, ref.loss), 1e-5) << "option set " << k;
    EXPECT_LE(RelErr(r.z_loss, ref.z_loss), 1e-5) << "option set " << k;
    EXPECT_LE(RelErr(r.entropy, ref.entropy), 1e-5) << "option set " << k;
    const double dh_tol = dtype == DType::kFloat32 ? 1e-5 : 1e-2;
    EXPECT_LE(RelErr(Decode(r.dh, dtype), ref.d_hidden), dh_tol) << "option set " << k << " mode " << int(mode);
    EXPECT_LE(RelErr(r.dw, ref.d_weight), 1e-5) << "option set " << k << " mode " << int(mode);
    if (k == 5) EXPECT_LE(RelErr(r.db, ref.d_bias), 1e-5) << "d_bias, mode " << int(mode);
  }
}

INSTANTIATE_TEST_SUITE_P(All, Options,
                         ::testing::Combine(::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                                            ::testing::Range(0, 8)));

TEST(CpuEngine, ExtremeLogits) {
  // Hidden scaled so logits reach ~1e4: softmax is nearly one-hot; nothing may overflow.
  Case c = MakeCase(40, 32, 3000, DType::kFloat32, 5, 2e3);
  c.ref.mode = GradMode::kLoss;
  auto e = Engine(c);
  EngineRun r = RunEngine(*e, c);
  ASSERT_TRUE(r.status.ok()) << r.status;
  RefResult ref = testing::ReferenceLce(c.ref);
  double max_abs_lse = 0;
  for (double v : ref.lse) max_abs_lse = std::max(max_abs_lse, std::abs(v));
  EXPECT_GT(max_abs_lse, 1e3);
  EXPECT_LE(RelErr(r.logprob, ref.logprob), 1e-5);
  EXPECT_LE(RelErr(r.lse, ref.lse), 1e-5);
  for (int64_t i = 0; i < c.ref.rows; ++i) EXPECT_NEAR(r.entropy[i], ref.entropy[i], 1e-2) << "row " << i;
  EXPECT_LE(RelErr(Decode(r.dh, DType::kFloat32), ref.d_hidden), 1e-4);
}

TEST(CpuEngine, LargeLogitOffsetKeepsDHiddenPrecise) {
  // Every logit near 2700 (a bias offset), the softmax spread over many columns: p must come from
  // exp((z − max) − log S), not exp(z − lse) with lse rounded at 2700 (an ulp of 2.4e-4): that form put
  // 4.1e-5 of relative error into d_hidden here, this one 6.9e-6.
  Case c = MakeCase(64, 64, 5000, DType::kFloat32, 77, 1.0, 0.0, /*bias=*/true);
  for (size_t j = 0; j < c.head->bias.size(); ++j) c.ref.bias[j] = c.head->bias[j] += 2700.0f;
  c.ref.mode = GradMode::kLoss;
  auto e = Engine(c);
  EngineRun r = RunEngine(*e, c);
  ASSERT_TRUE(r.status.ok()) << r.status;
  RefResult ref = testing::ReferenceLce(c.ref);
  EXPECT_GT(ref.lse[0], 2700);
  EXPECT_LE(RelErr(Decode(r.dh, DType::kFloat32), ref.d_hidden), 2e-5);
}

TEST(CpuEngine, AllRowsIgnored) {
  Case c = MakeCase(20, 16, 999, DType::kBFloat16, 9, 1.0, /*ignore_fraction=*/1.0);
  c.ref.mode = GradMode::kLoss;
  auto e = Engine(c);
  EngineRun r = RunEngine(*e, c);
  ASSERT_TRUE(r.status.ok()) << r.status;
  RefResult ref = testing::ReferenceLce(c.ref);
  for (int64_t i = 0; i < c.ref.rows; ++i) {
    EXPECT_EQ(r.loss[i], 0.0f);
    EXPECT_EQ(r.logprob[i], 0.0f);
  }
  EXPECT_LE(RelErr(r.entropy, ref.entropy), 1e-5);
  for (float v : Decode(r.dh, DType::kBFloat16)) ASSERT_EQ(v, 0.0f);
  for (float v : r.dw) ASSERT_EQ(v, 0.0f);
}

TEST(CpuEngine, FiniteDifferenceGradients) {
  // Tiny fp32 head; the engine's d_hidden and dW against central differences of the float64
  // objective (independent of the analytic formulas both implement).
  for (GradMode mode : {GradMode::kLoss, GradMode::kGeneric}) {
    Case c = MakeCase(4, 6, 11, DType::kFloat32, 31, 1.0, 0.0, /*bias=*/true);
    c.ref.targets[2] = -100;
    c.ref.options.temperature = 0.8f;
    c.ref.options.softcap = 2.5f;
    c.ref.options.label_smoothing = 0.1f;
    c.ref.options.z_loss = 0.05f;
    c.ref.mode = mode;
    std::vector<float> g = {0.5f, -1.0f, 2.0f, 1.5f}, u = {1.0f, 0.3f, -0.7f, 2.0f}, en = {-0.4f, 1.1f, 0.6f, 0.2f};
    if (mode == GradMode::kLoss) {
      c.ref.grad_loss.assign(g.begin(), g.end());
      u.clear();
      en.clear();
    } else {
      c.ref.grad_logprob.assign(u.begin(), u.end());
      c.ref.grad_entropy.assign(en.begin(), en.end());
      g.clear();
    }
    auto e = Engine(c);
    EngineRun r = RunEngine(*e, c, g, u, en);
    ASSERT_TRUE(r.status.ok()) << r.status;
    const std::vector<float> dh = Decode(r.dh, DType::kFloat32);
    const double step = 1e-5;
    for (size_t k = 0; k < c.ref.h.size(); ++k) {
      RefProblem plus = c.ref, minus = c.ref;
      plus.h[k] += step;
      minus.h[k] -= step;
      const double fd = (testing::ReferenceObjective(plus) - testing::ReferenceObjective(minus)) / (2 * step);
      EXPECT_NEAR(dh[k], fd, 1e-4 * std::max(1.0, std::abs(fd))) << "d_hidden[" << k << "] mode " << int(mode);
    }
    for (size_t k = 0; k < c.ref.w.size(); ++k) {
      RefProblem plus = c.ref, minus = c.ref;
      plus.w[k] += step;
      minus.w[k] -= step;
      const double fd = (testing::ReferenceObjective(plus) - testing::ReferenceObjective(minus)) / (2 * step);
      EXPECT_NEAR(r.dw[k], fd, 1e-4 * std::max(1.0, std::abs(fd))) << "d_weight[" << k << "] mode " << int(mode);
    }
  }
}

// Runs rows [r0, r0 + n) of `c` as one call into the matching slices of `into` (dW accumulated).
void RunSlice(LceEngine& e, const Case& c, int64_t r0, int64_t n, EngineRun& into) {
  const int64_t row_bytes = c.ref.hidden * DTypeSize(c.head->shape.dtype);
  RowsView rows{c.hidden.data() + r0 * row_bytes, c.ref.targets.data() + r0, n, MemorySpace::kHost};
  Upstream up;
  up.mode = c.ref.mode;
  const absl::Status s = e.Compute(
      rows, c.ref.options, up,
      {into.logprob.data() + r0, into.entropy.data() + r0, into.lse.data() + r0, into.loss.data() + r0},
      {into.dh.data() + r0 * row_bytes, into.dw.data()});
  ASSERT_TRUE(s.ok()) << s;
}

EngineRun EmptyRun(const Case& c) {
  EngineRun r;
  for (auto* v : {&r.logprob, &r.entropy, &r.lse, &r.loss}) v->assign(c.ref.rows, kPoison);
  r.dh.assign(c.ref.rows * c.ref.hidden * DTypeSize(c.head->shape.dtype), 0xff);
  r.dw.assign(c.ref.vocab * c.ref.hidden, 0.0f);
  return r;
}

// Bitwise: the same bits, not close values (DESIGN.md, "Guarantees": invariance).
void ExpectSameBits(const EngineRun& a, const EngineRun& b, int64_t r0, int64_t n, int64_t row_bytes,
                    const char* what) {
  for (int64_t i = r0; i < r0 + n; ++i) {
    EXPECT_EQ(std::memcmp(&a.logprob[i], &b.logprob[i], 4), 0) << what << " logprob row " << i;
    EXPECT_EQ(std::memcmp(&a.entropy[i], &b.entropy[i], 4), 0) << what << " entropy row " << i;
    EXPECT_EQ(std::memcmp(&a.lse[i], &b.lse[i], 4), 0) << what << " lse row " << i;
    EXPECT_EQ(std::memcmp(&a.loss[i], &b.loss[i], 4), 0) << what << " loss row " << i;
    EXPECT_EQ(std::memcmp(a.dh.data() + i * row_bytes, b.dh.data() + i * row_bytes, row_bytes), 0)
        << what << " d_hidden row " << i;
  }
}

TEST(CpuEngine, ChunkingInvariance) {
  // The same rows cut into differently sized calls give the same bits, dW (accumulated in row
  // order over the calls) included.
  Case c = MakeCase(301, 32, 2100, DType::kBFloat16, 11);
  c.ref.mode = GradMode::kLoss;
  auto e = Engine(c);
  EngineRun whole = EmptyRun(c), chunked = EmptyRun(c);
  RunSlice(*e, c, 0, c.ref.rows, whole);
  for (int64_t r0 = 0, step = 1; r0 < c.ref.rows; r0 += step, step = step * 3 + 1) {
    RunSlice(*e, c, r0, std::min(step, c.ref.rows - r0), chunked);
  }
  ExpectSameBits(chunked, whole, 0, c.ref.rows, 32 * 2, "chunked");
  EXPECT_EQ(std::memcmp(chunked.dw.data(), whole.dw.data(), whole.dw.size() * 4), 0);
}

TEST(CpuEngine, BatchInvariance) {
  // A row's results are the same bits alone, in a batch of 7 and in one of 300, with every option
  // that changes the arithmetic (bias, softcap, temperature, label smoothing, z-loss), an fp32 and
  // a bf16 head, and a hidden size that is no multiple of the GEMM tile.
  for (const DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    Case c = MakeCase(300, 72, 2500, dtype, 21, 1.0, 0.1, /*bias=*/true);
    c.ref.mode = GradMode::kLoss;
    c.ref.options.softcap = 20.0f;
    c.ref.options.temperature = 0.7f;
    c.ref.options.label_smoothing = 0.1f;
    c.ref.options.z_loss = 1e-3f;
    auto e = Engine(c);
    const int64_t row_bytes = 72 * DTypeSize(dtype);
    EngineRun batch300 = EmptyRun(c);
    RunSlice(*e, c, 0, 300, batch300);
    for (const int64_t row : {0, 5, 127, 128, 299}) {
      EngineRun alone = EmptyRun(c), batch7 = EmptyRun(c);
      RunSlice(*e, c, row, 1, alone);
      const int64_t b0 = std::min<int64_t>(row, 300 - 7);
      RunSlice(*e, c, b0, 7, batch7);
      ExpectSameBits(alone, batch300, row, 1, row_bytes, "alone vs 300");
      ExpectSameBits(batch7, batch300, row, 1, row_bytes, "in 7 vs 300");
    }
  }
}

TEST(CpuEngine, NonFiniteHiddenIsAnError) {
  Case c = MakeCase(10, 16, 100, DType::kFloat32, 3);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  auto e = Engine(c);
  for (float bad : {nan, inf}) {
    Case d = c;
    std::memcpy(d.hidden.data() + (7 * 16 + 5) * 4, &bad, 4);
    EngineRun r = RunEngine(*e, d);
    EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status.message().find("row 7"), std::string::npos) << r.status;
  }
}

TEST(CpuEngine, BadTargetsAndOptionsAreErrors) {
  Case c = MakeCase(5, 8, 50, DType::kFloat32, 4);
  auto e = Engine(c);
  c.ref.targets[3] = 50;
  EngineRun r = RunEngine(*e, c);
  EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status.message().find("row 3: target 50"), std::string::npos) << r.status;
  c.ref.targets[3] = 1;
  c.ref.options.temperature = 0.0f;
  r = RunEngine(*e, c);
  EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status.message().find("temperature"), std::string::npos) << r.status;
}

TEST(Numeric, HalfConversionsRoundToNearestEven) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBf16(Bf16ToFloat(0x3f80) + std::ldexp(1.0f, -8)), 0x3f80);  // tie -> even
  EXPECT_EQ(FloatToBf16(Bf16ToFloat(0x3f81) + std::ldexp(1.0f, -8)), 0x3f82);  // tie -> even
  EXPECT_EQ(FloatToFp16(1.0f), 0x3c00);
  EXPECT_EQ(FloatToFp16(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToFp16(65520.0f), 0x7c00);
  EXPECT_EQ(FloatToFp16(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(FloatToFp16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie -> even
  for (uint32_t b = 0; b < 0x10000; ++b) {  // every finite half survives the round trip
    const uint16_t h = static_cast<uint16_t>(b);
    if ((h & 0x7c00) == 0x7c00) continue;
    ASSERT_EQ(FloatToFp16(Fp16ToFloat(h)), h) << std::hex << b;
    ASSERT_EQ(FloatToBf16(Bf16ToFloat(h)), h) << std::hex << b;
  }
}

// GradOutputs::d_weight_fresh: a call over a buffer of garbage (NaN) writes dW there, the same bits as
// accumulating into zeros, over several row blocks (the first writes, the rest add); a call without
// rows or a backward zeroes it.
TEST(CpuEngine, FreshWeightGradientOverwritesWhatWasThere) {
  Case c = MakeCase(300, 16, 257, DType::kBFloat16, 21);
  c.ref.mode = GradMode::kLoss;
  auto e = Engine(c);
  const RowsView rows{c.hidden.data(), c.ref.targets.data(), c.ref.rows, MemorySpace::kHost};
  const Upstream up{GradMode::kLoss, nullptr, nullptr, nullptr};
  std::vector<float> zeroed(257 * 16, 0.0f), fresh(257 * 16, kPoison);
  ASSERT_TRUE(e->Compute(rows, LceOptions{}, up, {}, {nullptr, zeroed.data()}).ok());
  GradOutputs g{nullptr, fresh.data()};
  g.d_weight_fresh = true;
  ASSERT_TRUE(e->Compute(rows, LceOptions{}, up, {}, g).ok());
  EXPECT_EQ(std::memcmp(fresh.data(), zeroed.data(), zeroed.size() * 4), 0);
  std::fill(fresh.begin(), fresh.end(), kPoison);
  ASSERT_TRUE(e->Compute(rows, LceOptions{}, Upstream{}, {}, g).ok());
  for (float v : fresh) ASSERT_EQ(v, 0.0f) << "a forward-only call still writes a fresh dW";
}

// Rankings (argmax, top-k) against a float64 sort: the engine's j-th logprob is the j-th largest,
// and the token it names has that logprob (near-equal logits may swap places between fp32 and
// float64, so tokens are checked through their values).
void ExpectRankings(const Case& c, int k, const std::vector<int32_t>& argmax, const std::vector<int32_t>& tokens,
                    const std::vector<float>& logprobs, const RefResult& ref) {
  const int64_t V = c.ref.vocab;
  for (int64_t i = 0; i < c.ref.rows; ++i) {
    std::vector<double> row(ref.all_logprob.begin() + i * V, ref.all_logprob.begin() + (i + 1) * V);
    std::vector<double> sorted = row;
    std::sort(sorted.begin(), sorted.end(), std::greater<double>());
    std::set<int32_t> seen;
    for (int j = 0; j < k; ++j) {
      const int32_t t = tokens[i * k + j];
      ASSERT_TRUE(t >= 0 && t < V) << "row " << i << " rank " << j;
      EXPECT_TRUE(seen.insert(t).second) << "row " << i << ": token " << t << " twice";
      EXPECT_NEAR(logprobs[i * k + j], sorted[j], 1e-5 * (1 + std::abs(sorted[j]))) << "row " << i << " rank " << j;
      EXPECT_NEAR(row[t], sorted[j], 1e-5 * (1 + std::abs(sorted[j]))) << "row " << i << " rank " << j;
    }
    EXPECT_EQ(argmax[i], tokens[i * k]) << "row " << i;
  }
}

TEST(CpuEngine, RankingsMatchFloat64Sort) {
  for (int k : {1, 20, 64}) {
    Case c = MakeCase(37, 24, 700, DType::kBFloat16, 300 + k, 2.0);
    c.ref.options.top_k = k;
    c.ref.options.temperature = 0.8f;
    c.ref.options.softcap = 6.0f;
    auto e = Engine(c);
    std::vector<int32_t> argmax(c.ref.rows, -7), tokens(c.ref.rows * k, -7);
    std::vector<float> logprobs(c.ref.rows * k, kPoison), lse(c.ref.rows, kPoison);
    RowOutputs out;
    out.lse = lse.data();
    out.argmax = argmax.data();
    out.top_tokens = tokens.data();
    out.top_logprobs = logprobs.data();
    RowsView rows{c.hidden.data(), c.ref.targets.data(), c.ref.rows, MemorySpace::kHost};
    ASSERT_TRUE(e->Compute(rows, c.ref.options, Upstream{}, out, GradOutputs{}).ok());
    ExpectRankings(c, k, argmax, tokens, logprobs, testing::ReferenceLce(c.ref));
  }
}

// Equal logits rank by id (lower first), whatever tile they sit in; rows of a ranking ask for nothing
// else and still get every slot.
TEST(CpuEngine, EqualLogitsRankLowerIdFirst) {
  const int64_t H = 8, V = 200;
  auto head = std::make_shared<HeadWeights>();
  head->shape = {V, H, DType::kFloat32, 0, V, false};
  std::vector<float> w(V * H, 0.0f);
  w[3 * H] = 1.0f;    // logit 1
  w[150 * H] = 1.0f;  // logit 1, in a later tile
  w[77 * H] = 0.5f;   // logit 0.5; every other logit is 0
  head->weight.assign(reinterpret_cast<uint8_t*>(w.data()), reinterpret_cast<uint8_t*>(w.data() + w.size()));
  auto e = CreateEngine(Backend::kCpu, head, EngineConfig{});
  ASSERT_TRUE(e.ok());
  std::vector<float> h(H, 0.0f);
  h[0] = 1.0f;
  const int32_t y = 5;
  LceOptions o;
  o.top_k = 5;
  std::vector<int32_t> argmax(1), tokens(5);
  RowOutputs out;
  out.argmax = argmax.data();
  out.top_tokens = tokens.data();
  RowsView rows{h.data(), &y, 1, MemorySpace::kHost};
  ASSERT_TRUE((*e)->Compute(rows, o, Upstream{}, out, GradOutputs{}).ok());
  EXPECT_EQ(tokens, (std::vector<int32_t>{3, 150, 77, 0, 1}));
  EXPECT_EQ(argmax[0], 3);
  o.top_k = 0;
  EXPECT_EQ((*e)->Compute(rows, o, Upstream{}, out, GradOutputs{}).code(), absl::StatusCode::kInvalidArgument);
  o.top_k = kMaxTopK + 1;
  EXPECT_EQ((*e)->Compute(rows, o, Upstream{}, RowOutputs{}, GradOutputs{}).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace lce
