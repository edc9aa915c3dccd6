// The engine's vocab-parallel path: k shards in k threads, joined by an in-process Collectives,
// must give the unsharded engine's answers, the same bits, for every option (docs/MATH.md,
// "Vocab-parallel" and "Order of reductions").
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <thread>

#include "gtest/gtest.h"
#include "lce/engine.h"
#include "lce/head.h"
#include "lce/numeric.h"

namespace lce {
namespace {

// All-reduce among k threads of one process.
class ThreadGroup {
 public:
  explicit ThreadGroup(int k) : k_(k), barrier_(k), slots_(k) {}
  absl::Status AllReduce(int rank, float* data, int64_t n, ReduceOp op) {
    slots_[rank] = data;
    barrier_.arrive_and_wait();
    std::vector<float> out(data, data + n);
    for (int r = 0; r < k_; ++r) {
      if (r == rank) continue;
      for (int64_t i = 0; i < n; ++i) out[i] = op == ReduceOp::kSum ? out[i] + slots_[r][i] : std::max(out[i], slots_[r][i]);
    }
    barrier_.arrive_and_wait();  // everyone has read every slot
    std::copy(out.begin(), out.end(), data);
    barrier_.arrive_and_wait();
    return absl::OkStatus();
  }
  int size() const { return k_; }

 private:
  int k_;
  std::barrier<> barrier_;
  std::vector<float*> slots_;
};

class ThreadCollectives final : public Collectives {
 public:
  ThreadCollectives(ThreadGroup* g, int rank) : g_(g), rank_(rank) {}
  int rank() const override { return rank_; }
  int world_size() const override { return g_->size(); }
  absl::Status AllReduce(float* data, int64_t count, ReduceOp op, bool, void*) override {
    return g_->AllReduce(rank_, data, count, op);
  }

 private:
  ThreadGroup* g_;
  int rank_;
};

struct Answers {
  std::vector<float> logprob, entropy, loss, z_loss, top_logprobs;
  std::vector<int32_t> argmax, top_tokens;
  std::vector<float> d_hidden;  // fp32 head
  std::vector<float> d_weight;  // this engine's shard rows
};

Answers RunEngineOnce(LceEngine& e, const std::vector<float>& h, const std::vector<int32_t>& y, const LceOptions& o,
                      const Upstream& up, const std::vector<float>& class_weight) {
  const int64_t n = static_cast<int64_t>(y.size());
  Answers a;
  a.logprob.assign(n, NAN);
  a.entropy.assign(n, NAN);
  a.loss.assign(n, NAN);
  a.z_loss.assign(n, NAN);
  a.argmax.assign(o.top_k > 0 ? n : 0, -7);
  a.top_tokens.assign(n * o.top_k, -7);
  a.top_logprobs.assign(n * o.top_k, NAN);
  a.d_hidden.assign(h.size(), NAN);
  a.d_weight.assign(e.shape().shard_rows * e.shape().hidden_size, 0.0f);
  RowsView rows{h.data(), y.data(), n, MemorySpace::kHost};
  rows.class_weight = class_weight.empty() ? nullptr : class_weight.data();
  RowOutputs out{a.logprob.data(), a.entropy.data(), nullptr, a.loss.data(), a.z_loss.data()};
  if (o.top_k > 0) {
    out.argmax = a.argmax.data();
    out.top_tokens = a.top_tokens.data();
    out.top_logprobs = a.top_logprobs.data();
  }
  absl::Status s = e.Compute(rows, o, up, out, {a.d_hidden.data(), a.d_weight.data()});
  EXPECT_TRUE(s.ok()) << s;
  return a;
}

void ExpectSameBits(const std::vector<float>& a, const std::vector<float>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(std::memcmp(&a[i], &b[i], sizeof(float)), 0) << what << "[" << i << "]: " << a[i] << " vs " << b[i];
  }
}

// VocabShard: contiguous whole tiles covering the head, none empty while k <= T, within a tile of one another,
// the extra tiles on the last ranks so that the short last tile evens a group out (docs/MATH.md,
// "Vocab-parallel"): the largest shard is never above the ⌈T/k⌉ whole tiles the first ranks took before.
TEST(VocabParallel, ShardsAreWholeTilesWithinATileOfEven) {
  for (int64_t V : {10, 103, 300, 1001, 4097, 32000, 50257, 128256, 151936, 152064, 201088, 256000, 262144}) {
    const int64_t tile = VocabTile(V), tiles = VocabTileCount(V);
    for (int k = 1; k <= 8 && k <= tiles; ++k) {
      const std::string what = "V=" + std::to_string(V) + " k=" + std::to_string(k);
      int64_t end = 0, smallest = V, largest = 0;
      for (int r = 0; r < k; ++r) {
        const VocabRange got = VocabShard(V, r, k);
        EXPECT_EQ(got.begin, end) << what << " rank " << r;
        EXPECT_EQ(got.begin % tile, 0) << what << " rank " << r;
        EXPECT_GT(got.end, got.begin) << what << " rank " << r;
        smallest = std::min(smallest, got.end - got.begin);
        largest = std::max(largest, got.end - got.begin);
        end = got.end;
      }
      EXPECT_EQ(end, V) << what;
      EXPECT_LE(largest - smallest, tile) << what;
      EXPECT_LE(largest, (tiles + k - 1) / k * tile) << what;
      const VocabRange last = VocabShard(V, k - 1, k);  // among the ranks with a tile more
      EXPECT_EQ((last.end - last.begin + tile - 1) / tile, (tiles + k - 1) / k) << what;
    }
  }
  // Two ranks over 99 tiles of 1536 (the last 1408 rows): 49 and 50 tiles, 75264 and 76672 rows.
  EXPECT_EQ(VocabShard(151936, 0, 2).end, 75264);
  EXPECT_EQ(VocabShard(151936, 1, 2).begin, 75264);
  EXPECT_EQ(VocabShard(151936, 1, 2).end, 151936);
  // More ranks than tiles: the first ranks are empty.
  EXPECT_EQ(VocabShard(10, 0, 12).end - VocabShard(10, 0, 12).begin, 0);
  EXPECT_EQ(VocabShard(10, 11, 12).end, 10);
}

TEST(VocabParallel, ShardsGiveTheUnshardedAnswersBitForBit) {
  const int64_t V = 1001, H = 24, N = 150;  // V divisible by neither 2 nor 3; two row blocks
  std::mt19937_64 rng(5);
  std::normal_distribution<float> normal;
  auto full = std::make_shared<HeadWeights>();
  full->shape = {V, H, DType::kFloat32, 0, V, true};
  full->weight.resize(V * H * 4);
  auto* w = reinterpret_cast<float*>(full->weight.data());
  for (int64_t i = 0; i < V * H; ++i) w[i] = normal(rng) / std::sqrt(float(H));
  for (int64_t j = 0; j < V; ++j) full->bias.push_back(0.3f * normal(rng));
  std::vector<float> h(N * H);
  for (auto& x : h) x = 2.0f * normal(rng);
  std::vector<int32_t> y(N);
  for (int64_t i = 0; i < N; ++i) y[i] = i % 9 == 0 ? -100 : static_cast<int32_t>((i * 97) % V);  // every shard hit
  std::vector<float> g(N), u(N), en(N);
  for (int64_t i = 0; i < N; ++i) {
    g[i] = normal(rng);
    u[i] = normal(rng);
    en[i] = normal(rng);
  }
  auto reference = CreateEngine(Backend::kCpu, full, EngineConfig{});
  ASSERT_TRUE(reference.ok());

  for (int k : {2, 3, 5}) {
    for (int opt = 0; opt < 4; ++opt) {
      LceOptions o;
      std::vector<float> cw;  // opt 3: class weights with label smoothing, and the rankings
      if (opt == 1) { o.temperature = 0.7f; o.softcap = 4.0f; }
      if (opt == 2) { o.label_smoothing = 0.1f; o.z_loss = 1e-3f; }
      if (opt == 3) {
        o.label_smoothing = 0.2f;
        o.z_loss = 1e-3f;
        o.top_k = 7;
        for (int64_t j = 0; j < V; ++j) cw.push_back(0.25f + 0.01f * static_cast<float>(j % 150));
      }
      for (GradMode mode : {GradMode::kLoss, GradMode::kGeneric}) {
        Upstream up;
        up.mode = mode;
        up.grad_loss = mode == GradMode::kLoss ? g.data() : nullptr;
        up.grad_logprob = mode == GradMode::kGeneric ? u.data() : nullptr;
        up.grad_entropy = mode == GradMode::kGeneric ? en.data() : nullptr;
        Answers want = RunEngineOnce(**reference, h, y, o, up, cw);
        ThreadGroup group(k);
        std::vector<Answers> got(k);
        std::vector<std::thread> threads;
        for (int r = 0; r < k; ++r) {
          threads.emplace_back([&, r] {
            const VocabRange range = VocabShard(V, r, k);
            auto shard = std::make_shared<HeadWeights>();
            shard->shape = {V, H, DType::kFloat32, range.begin, range.end - range.begin, true};
            shard->weight.assign(full->weight.begin() + range.begin * H * 4, full->weight.begin() + range.end * H * 4);
            shard->bias.assign(full->bias.begin() + range.begin, full->bias.begin() + range.end);
            ThreadCollectives coll(&group, r);
            EngineConfig cfg;
            cfg.collectives = &coll;
            cfg.cpu_threads = 1;
            auto e = CreateEngine(Backend::kCpu, shard, cfg);
            ASSERT_TRUE(e.ok()) << e.status();
            got[r] = RunEngineOnce(**e, h, y, o, up, cw);
          });
        }
        for (auto& t : threads) t.join();
        const std::string tag = "k=" + std::to_string(k) + " opt=" + std::to_string(opt) + " mode=" + std::to_string(int(mode));
        std::vector<float> dw;
        for (int r = 0; r < k; ++r) {
          ExpectSameBits(got[r].logprob, want.logprob, tag + " logprob");
          ExpectSameBits(got[r].entropy, want.entropy, tag + " entropy");
          ExpectSameBits(got[r].loss, want.loss, tag + " loss");
          ExpectSameBits(got[r].z_loss, want.z_loss, tag + " z_loss");
          ExpectSameBits(got[r].top_logprobs, want.top_logprobs, tag + " top_logprobs");
          EXPECT_EQ(got[r].argmax, want.argmax) << tag;
          EXPECT_EQ(got[r].top_tokens, want.top_tokens) << tag;
          ExpectSameBits(got[r].d_hidden, want.d_hidden, tag + " d_hidden");
          dw.insert(dw.end(), got[r].d_weight.begin(), got[r].d_weight.end());
        }
        ExpectSameBits(dw, want.d_weight, tag + " d_weight");
      }
    }
  }
}

}  // namespace
}  // namespace lce
