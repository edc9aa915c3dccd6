// Tensor parallelism across processes (Gloo over loopback): k = 2 and 3 lce_server ranks give the
// answers of one unsharded engine and train like one rank (dW, global norm, weights; LoadHead,
// UpdateWeights, versions that no request straddles); a peer that dies or hangs mid-request ends the
// request with UNAVAILABLE naming the rank, within the watchdog timeout, and the front exits for a
// restart. LCE_TEST_TP_BACKEND=cuda runs the same on GPUs.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

#include "grpcpp/client_context.h"

#include "gtest/gtest.h"
#include "head_source.h"
#include "httplib.h"
#include "lce/client/lce_client.h"
#include "nlohmann/json.hpp"
#include "test_server.h"
#include "tp_processes.h"
#include "training_rpcs.h"

namespace lce::e2e {
namespace {

namespace fs = std::filesystem;

// LCE_TEST_TP_SIZES=1,2 picks the group sizes compared with one unsharded engine (default 2,3).
std::vector<int> GroupSizes() {
  const char* env = std::getenv("LCE_TEST_TP_SIZES");
  std::vector<int> sizes;
  for (const char* p = env != nullptr && *env != 0 ? env : "2,3"; *p != 0;) {
    sizes.push_back(std::atoi(p));
    while (*p != 0 && *p != ',') ++p;
    if (*p == ',') ++p;
  }
  return sizes;
}

std::unique_ptr<client::LceClient> Connect(const std::string& target, int64_t chunk_bytes) {
  return ConnectClient(target, chunk_bytes, [](client::ClientOptions& o) { o.timeout = absl::Seconds(60); });
}

std::shared_ptr<LceEngine> FullEngine() {
  server::HeadSource src;
  src.seed_vocab = kVocab;
  src.seed_hidden = kHidden;
  src.seed = 7;
  src.dtype = DType::kFloat32;
  auto w = server::LoadHead(src, 0, 1);
  EXPECT_TRUE(w.ok());
  auto e = CreateEngine(Backend::kCpu, *w, EngineConfig{});
  EXPECT_TRUE(e.ok());
  return std::move(*e);
}

double RelErr(const float* got, const float* want, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    num += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    den += double(want[i]) * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// With the default flags, a row's logprob, entropy, loss and d_hidden are the same bits on a group as on
// one server, and GetInfo says so (issues 17, 36): the CPU engine for any group size; the CUDA engine for
// groups of 2 and 4 (d_hidden's leaves; a group of 3 the forward's outputs), the vocabulary >= 98304
// (segments at global offsets).
TEST(TensorParallel, InvariantGroupsGiveOneServersBits) {
  const bool cuda = TpBackend() == "cuda";
  const int64_t vocab = cuda ? 140001 : 5003, hidden = 2 * kHidden, rows = 96;
  const std::vector<std::string> extra = {"--seed-head=" + std::to_string(vocab) + "x" + std::to_string(hidden),
                                          "--head-dtype=bf16"};
  Batch b = MakeBatch(2 * rows, v1::DTYPE_BFLOAT16, 41);  // 2·rows rows of kHidden = rows rows of `hidden`
  b.targets.resize(rows);
  for (int64_t i = 0; i < 16; ++i) b.targets[i] = static_cast<int32_t>(i * (vocab / 16));  // every shard
  client::HiddenBatch view{b.dtype, rows, hidden, absl::MakeConstSpan(b.hidden), absl::MakeConstSpan(b.targets)};
  struct Answers {
    std::vector<float> logprobs, entropy, loss;
    std::string d_hidden;
  };
  std::vector<int> sizes = {1};
  for (int k : GroupSizes()) {
    if (k != 1) sizes.push_back(k);
  }
  std::vector<Answers> got;
  for (int k : sizes) {
    TpGroup group(k, 30.0, "", extra);
    auto c = Connect(group.target(), 1 << 20);
    auto info = c->GetInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    ASSERT_EQ(info->tp_size(), k);
    const auto& listed = info->invariance().across_tp_sizes();
    const bool dh_listed = std::find(listed.begin(), listed.end(), "d_hidden") != listed.end();
    EXPECT_EQ(dh_listed, !cuda || k != 3) << "k=" << k;
    EXPECT_NE(std::find(listed.begin(), listed.end(), "logprob"), listed.end()) << "k=" << k;
    auto score = c->Score(view, v1::RequestHeader());
    ASSERT_TRUE(score.ok()) << "k=" << k << ": " << score.status();
    v1::RequestHeader h;
    h.set_reduction(v1::REDUCTION_SUM);
    auto fb = c->ForwardBackward(view, h);
    ASSERT_TRUE(fb.ok()) << "k=" << k << ": " << fb.status();
    got.push_back({score->logprobs, score->entropy, fb->loss,
                   std::string(fb->d_hidden.begin(), fb->d_hidden.end())});
  }
  for (size_t i = 1; i < got.size(); ++i) {
    const std::string tag = "k=" + std::to_string(sizes[i]) + " vs one server";
    EXPECT_EQ(got[i].logprobs, got[0].logprobs) << tag;
    EXPECT_EQ(got[i].entropy, got[0].entropy) << tag;
    EXPECT_EQ(got[i].loss, got[0].loss) << tag;
    if (!cuda || sizes[i] != 3) EXPECT_TRUE(got[i].d_hidden == got[0].d_hidden) << tag << ": d_hidden differs";
  }
}

TEST(TensorParallel, GroupsOfTwoAndThreeMatchOneEngine) {
  auto engine = FullEngine();
  Batch b = MakeBatch(400, v1::DTYPE_FLOAT32, 31);
  for (int i = 0; i < 12; ++i) b.targets[i] = static_cast<int32_t>(i * (kVocab / 12));  // targets in every shard
  client::HiddenBatch view{b.dtype, b.rows, kHidden, absl::MakeConstSpan(b.hidden), absl::MakeConstSpan(b.targets)};
  std::vector<float> g(b.rows), u(b.rows), en(b.rows);
  for (int64_t i = 0; i < b.rows; ++i) {
    g[i] = 0.5f + std::sin(0.2f * i);
    u[i] = std::cos(0.1f * i);
    en[i] = std::sin(0.37f * i);
  }
  for (int k : GroupSizes()) {
    TpGroup group(k, 30.0);  // a collective waits long on a loaded 2-core machine
    auto c = Connect(group.target(), 4 * kHidden * 37);
    auto info = c->GetInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->tp_size(), k);
    EXPECT_EQ(info->head().vocab_size(), kVocab);
    for (int opt = 0; opt < 3; ++opt) {
      v1::RequestHeader h;
      LceOptions o;
      if (opt == 1) { h.set_temperature(0.7f); h.set_softcap(5.0f); o.temperature = 0.7f; o.softcap = 5.0f; }
      if (opt == 2) { h.set_label_smoothing(0.1f); h.set_z_loss(1e-3f); o.label_smoothing = 0.1f; o.z_loss = 1e-3f; }
      const std::string tag = "k=" + std::to_string(k) + " opt=" + std::to_string(opt);
      std::vector<float> lp(b.rows), ent(b.rows), loss(b.rows), dh(b.rows * kHidden), dh2(b.rows * kHidden);
      RowsView rows{b.hidden.data(), b.targets.data(), b.rows, MemorySpace::kHost};
      Upstream up{GradMode::kLoss, g.data(), nullptr, nullptr};
      ASSERT_TRUE(engine->Compute(rows, o, up, {lp.data(), ent.data(), nullptr, loss.data()}, {dh.data(), nullptr}).ok());
      if (opt != 2) {
        v1::RequestHeader sh = h;
        auto score = c->Score(view, sh);
        ASSERT_TRUE(score.ok()) << tag << " " << score.status();
        EXPECT_LE(RelErr(score->logprobs.data(), lp.data(), lp.size()), 1e-5) << tag;
        EXPECT_LE(RelErr(score->entropy.data(), ent.data(), ent.size()), 1e-5) << tag;
        Upstream gen{GradMode::kGeneric, nullptr, u.data(), en.data()};
        ASSERT_TRUE(engine->Compute(rows, o, gen, {}, {dh2.data(), nullptr}).ok());
        auto bw = c->Backward(view, sh, u, en);
        ASSERT_TRUE(bw.ok()) << tag << " " << bw.status();
        EXPECT_LE(RelErr(reinterpret_cast<const float*>(bw->d_hidden.data()), dh2.data(), dh2.size()), 1e-5) << tag;
      }
      h.set_reduction(v1::REDUCTION_NONE);
      auto fb = c->ForwardBackward(view, h, g);
      ASSERT_TRUE(fb.ok()) << tag << " " << fb.status();
      EXPECT_LE(RelErr(fb->loss.data(), loss.data(), loss.size()), 1e-5) << tag;
      EXPECT_LE(RelErr(reinterpret_cast<const float*>(fb->d_hidden.data()), dh.data(), dh.size()), 1e-5) << tag;
      if (opt == 0) {  // the same over the data plane (the front's server memory, two sockets a direction)
        auto dp = ConnectClient(group.target(), 4 * kHidden * 37, [](client::ClientOptions& o) {
          o.timeout = absl::Seconds(60);
          o.data_plane = true;
          o.data_plane_sockets = 2;
        });
        auto fb_dp = dp->ForwardBackward(view, h, g);
        ASSERT_TRUE(fb_dp.ok()) << tag << " data plane: " << fb_dp.status();
        EXPECT_LE(RelErr(fb_dp->loss.data(), loss.data(), loss.size()), 1e-5) << tag << " data plane";
        EXPECT_LE(RelErr(reinterpret_cast<const float*>(fb_dp->d_hidden.data()), dh.data(), dh.size()), 1e-5)
            << tag << " data plane";
      }
    }
  }
}

// ---- training on a group ----

// A ForwardBackward of `b` (sum reduction) on `head`, accumulating dW.
grpc::Status Accumulate(const std::string& target, const Batch& b, const std::string& head = "") {
  v1::RequestHeader h;
  h.set_head(head);
  h.set_hidden_size(kHidden);
  h.set_dtype(b.dtype);
  h.set_reduction(v1::REDUCTION_SUM);
  h.set_accumulate_weight_grad(true);
  std::vector<v1::StreamResponse> answers;
  return RunOneChunk(*RawStub(target), "fb", h, b, &answers);
}

std::vector<float> GatheredGrad(const std::string& target, const std::string& head = "") {
  return GradOf(*RawStub(target), head);
}

v1::OptimizerStepResponse Step(const std::string& target, const std::string& head = "") {
  auto stub = RawStub(target);
  grpc::ClientContext ctx;
  v1::OptimizerStepRequest req;
  req.set_head(head);
  req.set_lr(1e-2f);
  req.set_weight_decay(0.01f);
  req.set_max_grad_norm(0.5f);
  req.set_zero_grad(true);
  v1::OptimizerStepResponse resp;
  grpc::Status s = stub->OptimizerStep(&ctx, req, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return resp;
}

// Logprobs of `b` on `head` (pinned to `version` unless 0); empty on failure, with its status in `st`.
std::vector<float> Logprobs(const std::string& target, const Batch& b, const std::string& head = "", int64_t version = 0,
                            grpc::Status* st = nullptr) {
  auto c = Connect(target, 1 << 20);
  v1::RequestHeader h;
  h.set_head(head);
  h.set_head_version(version);
  auto r = c->Score({b.dtype, b.rows, kHidden, absl::MakeConstSpan(b.hidden), absl::MakeConstSpan(b.targets)}, h);
  if (st != nullptr) *st = r.ok() ? grpc::Status::OK : grpc::Status(static_cast<grpc::StatusCode>(r.status().code()), std::string(r.status().message()));
  if (st == nullptr) EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? r->logprobs : std::vector<float>();
}

// The fp32 seeded head the groups start with (--seed=7), or another seed's.
std::vector<float> SeededWeight(uint64_t seed = 7) {
  server::HeadSource src;
  src.seed_vocab = kVocab;
  src.seed_hidden = kHidden;
  src.seed = seed;
  src.dtype = DType::kFloat32;
  auto w = server::LoadHead(src, 0, 1);
  EXPECT_TRUE(w.ok());
  const float* p = reinterpret_cast<const float*>((*w)->weight.data());
  return {p, p + kVocab * kHidden};
}

// `head`'s current weight (and bias), through SaveHead (every rank writes its shard) and the index it wrote.
std::shared_ptr<HeadWeights> SavedHead(const std::string& target, const std::string& head = "") {
  const fs::path dir = fs::temp_directory_path() / ("lce_tp_saved_" + std::to_string(::getpid()));
  auto stub = RawStub(target);
  grpc::ClientContext ctx;
  v1::SaveHeadRequest save;
  save.set_head(head);
  save.set_directory(dir.string());
  v1::SaveHeadResponse saved;
  grpc::Status st = stub->SaveHead(&ctx, save, &saved);
  EXPECT_TRUE(st.ok()) << st.error_message();
  server::HeadSource src;
  src.file = saved.index_file();
  auto w = server::LoadHead(src, 0, 1);
  fs::remove_all(dir);
  EXPECT_TRUE(w.ok()) << w.status();
  return w.ok() ? *std::move(w) : nullptr;
}

std::vector<float> SavedWeight(const std::string& target, const std::string& head = "") {
  std::shared_ptr<HeadWeights> w = SavedHead(target, head);
  if (w == nullptr) return {};
  const float* p = reinterpret_cast<const float*>(w->weight.data());
  return {p, p + kVocab * kHidden};
}

grpc::Status UpdateWeight(const std::string& target, const std::vector<float>& w, int64_t expected,
                          v1::HeadDescription* out) {
  return UpdateWeightsRpc(*RawStub(target), "default", w, expected, out);
}

grpc::Status LoadHeadRpc(const std::string& target, const v1::LoadHeadRequest& req, v1::HeadDescription* out) {
  auto stub = RawStub(target);
  grpc::ClientContext ctx;
  return stub->LoadHead(&ctx, req, out);
}

// A batch whose first rows target every shard of every group size.
Batch TrainingBatch(uint64_t seed) {
  Batch b = MakeBatch(300, v1::DTYPE_FLOAT32, seed);
  for (int i = 0; i < 12; ++i) b.targets[i] = static_cast<int32_t>(i * (kVocab / 12));
  return b;
}

// Equal bits (bits), or within `tol` relative error.
void ExpectSame(const std::vector<float>& got, const std::vector<float>& want, bool bits, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  if (bits) {
    EXPECT_EQ(got, want) << what;
  } else {
    EXPECT_LE(RelErr(got.data(), want.data(), want.size()), tol) << what;
  }
}

// The front's request log splits, out of each request's engine time, what sharing its calls with the peers
// took: the control blocks (tp_control_ms) and the inputs (tp_inputs_ms) — where a group's time goes
// besides its shards' compute (bench/NOTES.md e30).
TEST(TensorParallel, TheFrontsRequestLogTimesSharingWithThePeers) {
  TpGroup group(2, 30.0, "", {"--log-requests=true"});
  auto c = Connect(group.target(), 4 * kHidden * 37);  // several chunks, so several engine calls
  const Batch b = MakeBatch(300, v1::DTYPE_FLOAT32, 5);
  auto score = c->Score(View(b), v1::RequestHeader());
  ASSERT_TRUE(score.ok()) << score.status();
  v1::RequestHeader h;
  h.set_reduction(v1::REDUCTION_NONE);
  auto fb = c->ForwardBackward(View(b), h, std::vector<float>(b.rows, 1.0f));
  ASSERT_TRUE(fb.ok()) << fb.status();
  std::vector<nlohmann::json> lines;  // the two requests' lines (written as each RPC ends)
  for (int tries = 0; tries < 100 && lines.size() < 2; ++tries) {
    lines.clear();
    std::istringstream err(group.Stderr(0));
    for (std::string line; std::getline(err, line);) {
      nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_object() && (j.value("method", "") == "Score" || j.value("method", "") == "ForwardBackward")) {
        lines.push_back(j);
      }
    }
    if (lines.size() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_EQ(lines.size(), 2u) << group.Stderr(0);
  for (const nlohmann::json& j : lines) {
    const std::string tag = j.dump();
    EXPECT_EQ(j.value("code", ""), "OK") << tag;
    EXPECT_GT(j.value("engine_calls", 0), 1) << tag;
    const double control = j.value("tp_control_ms", -1.0), inputs = j.value("tp_inputs_ms", -1.0);
    EXPECT_GT(control, 0.0) << tag;
    EXPECT_GT(inputs, 0.0) << tag;
    EXPECT_LE(control + inputs, j.value("engine_ms", 0.0)) << tag;
  }
}

// Training a sharded head: the same requests on a group of k (2 and 3) and a group of 1 accumulate
// the same dW (GetGrad gathers the shards), each optimizer step sees the same global gradient norm
// and leaves the same weights (SaveHead, every rank's shard), three steps running: the same bits on
// CPUs (the engine's dW and the tile-ordered norm do not depend on the group size), within rounding
// on GPUs (cuBLAS picks algorithms by shape). A head saved by a group of 3 loads into a group of 2.
TEST(TensorParallel, TrainingTheShardedHeadMatchesOneRank) {
  const bool bits = TpBackend() == "cpu";
  for (int k : GroupSizes()) {
    if (k == 1) continue;
    TpGroup one(1, 10.0), group(k, 10.0);
    for (int it = 0; it < 3; ++it) {
      const std::string tag = "k=" + std::to_string(k) + " step " + std::to_string(it + 1) + ": ";
      const Batch b = TrainingBatch(51 + it);
      ASSERT_TRUE(Accumulate(one.target(), b).ok());
      grpc::Status st = Accumulate(group.target(), b);
      ASSERT_TRUE(st.ok()) << tag << st.error_message();
      ExpectSame(GatheredGrad(group.target()), GatheredGrad(one.target()), bits, 1e-5, tag + "dW");
      const v1::OptimizerStepResponse s1 = Step(one.target()), sk = Step(group.target());
      if (bits) EXPECT_EQ(sk.grad_norm(), s1.grad_norm()) << tag << "the global norm over all shards";
      EXPECT_NEAR(sk.grad_norm(), s1.grad_norm(), 1e-5 * s1.grad_norm()) << tag << "the global norm over all shards";
      EXPECT_GT(s1.grad_norm(), 0.5) << "clipping must be exercised";
      EXPECT_EQ(sk.head().version(), 2 + it);
      EXPECT_EQ(sk.step(), 1 + it);
      ExpectSame(SavedWeight(group.target()), SavedWeight(one.target()), bits, 1e-5, tag + "weights");
      ExpectSame(Logprobs(group.target(), b), Logprobs(one.target(), b), bits, 1e-5, tag + "answers");
    }
    for (float x : GatheredGrad(group.target())) ASSERT_EQ(x, 0.0f) << "k=" << k << ": zero_grad reaches every shard";
    if (k != 3) continue;
    const std::string dir = (fs::temp_directory_path() / ("lce_tp_save_" + std::to_string(::getpid()))).string();
    auto stub = RawStub(group.target());
    grpc::ClientContext ctx;
    v1::SaveHeadRequest save;
    save.set_directory(dir);
    v1::SaveHeadResponse saved;
    grpc::Status st = stub->SaveHead(&ctx, save, &saved);
    ASSERT_TRUE(st.ok()) << st.error_message();
    EXPECT_EQ(saved.files_size(), 3);
    TpGroup two(2, 10.0, saved.index_file());
    const Batch b = TrainingBatch(60);
    const std::vector<float> before = Logprobs(group.target(), b), after = Logprobs(two.target(), b);
    ASSERT_EQ(before.size(), after.size());
    EXPECT_LE(RelErr(after.data(), before.data(), before.size()), 1e-5) << "saved by 3 ranks, loaded by 2";
    fs::remove_all(dir);
  }
}

// A head with a bias on a group (issue 34): LoadHead seeded{bias}, UpdateWeights with a bias (each rank
// its rows), then three accumulations and clipped steps give one rank's bits: dW, dB (GetGrad(bias)
// gathers the shards), the norm over [dW | dB], the stepped weight and bias, the answers. CPU engine
// only: the CUDA engine trains a bias, but its groups' dW and dB bits depend on the group size.
TEST(TensorParallel, ABiasedHeadTrainsToOneRanksBits) {
  if (TpBackend() != "cpu") GTEST_SKIP() << "one rank's bits for any group size: the CPU engine's (CUDA: not dW, dB)";
  std::vector<float> bias(kVocab);
  for (int64_t i = 0; i < kVocab; ++i) bias[i] = 3.0f * std::sin(0.37f * static_cast<float>(i));
  v1::LoadHeadRequest seeded;
  seeded.set_name("biased");
  seeded.mutable_seeded()->set_vocab_size(kVocab);
  seeded.mutable_seeded()->set_hidden_size(kHidden);
  seeded.mutable_seeded()->set_seed(9);
  seeded.mutable_seeded()->set_dtype(v1::DTYPE_FLOAT32);
  seeded.mutable_seeded()->set_bias(true);
  for (int k : GroupSizes()) {
    if (k == 1) continue;
    TpGroup one(1, 10.0), group(k, 10.0);
    for (const std::string& target : {one.target(), group.target()}) {
      v1::HeadDescription d;
      grpc::Status st = LoadHeadRpc(target, seeded, &d);
      ASSERT_TRUE(st.ok()) << st.error_message();
      EXPECT_TRUE(d.has_bias());
      st = UpdateWeightsRpc(*RawStub(target), "biased", SeededWeight(9), 1, &d, bias);
      ASSERT_TRUE(st.ok()) << st.error_message();
    }
    EXPECT_EQ(SavedHead(group.target(), "biased")->bias, bias) << "k=" << k << ": each rank holds its rows";
    for (int it = 0; it < 3; ++it) {
      const std::string tag = "k=" + std::to_string(k) + " step " + std::to_string(it + 1) + ": ";
      const Batch b = TrainingBatch(81 + it);
      ASSERT_TRUE(Accumulate(one.target(), b, "biased").ok());
      grpc::Status st = Accumulate(group.target(), b, "biased");
      ASSERT_TRUE(st.ok()) << tag << st.error_message();
      EXPECT_EQ(GradOf(*RawStub(group.target()), "biased"), GradOf(*RawStub(one.target()), "biased")) << tag << "dW";
      const std::vector<float> db = GradOf(*RawStub(one.target()), "biased", 0, true);
      EXPECT_EQ(GradOf(*RawStub(group.target()), "biased", 0, true), db) << tag << "dB";
      EXPECT_GT(*std::max_element(db.begin(), db.end()), 0.1f) << "dB is not negligible";
      const v1::OptimizerStepResponse s1 = Step(one.target(), "biased"), sk = Step(group.target(), "biased");
      EXPECT_EQ(sk.grad_norm(), s1.grad_norm()) << tag << "the norm over every shard's dW and dB";
      const std::shared_ptr<HeadWeights> w1 = SavedHead(one.target(), "biased"),
                                         wk = SavedHead(group.target(), "biased");
      ASSERT_TRUE(w1 != nullptr && wk != nullptr);
      EXPECT_EQ(wk->weight, w1->weight) << tag << "weights";
      EXPECT_EQ(wk->bias, w1->bias) << tag << "bias";
      EXPECT_NE(w1->bias, bias) << tag << "the step moved the bias";
      EXPECT_EQ(Logprobs(group.target(), b, "biased"), Logprobs(one.target(), b, "biased")) << tag << "answers";
    }
    for (float x : GradOf(*RawStub(group.target()), "biased", 0, true)) ASSERT_EQ(x, 0.0f) << "zero_grad reaches dB";
  }
}

// The head-gradient contract on a group: a deferred request's dW reaches no shard until CommitGrad,
// which adds it, scaled, on every rank (GetGrad gathers them); a discarded one adds nothing anywhere.
TEST(TensorParallel, DeferredWeightGradientsCommitOnEveryRank) {
  const bool bits = TpBackend() == "cpu";
  const int k = GroupSizes().back();
  TpGroup one(1, 10.0), group(k, 10.0);
  const Batch b = TrainingBatch(71);
  ASSERT_TRUE(Accumulate(one.target(), b).ok());
  const std::vector<float> plain = GatheredGrad(one.target());
  auto deferred = [&](const std::string& target) {
    v1::RequestHeader h;
    h.set_hidden_size(kHidden);
    h.set_dtype(b.dtype);
    h.set_reduction(v1::REDUCTION_SUM);
    h.set_accumulate_weight_grad(true);
    h.set_defer_weight_grad(true);
    std::vector<v1::StreamResponse> answers;
    grpc::Status st = RunOneChunk(*RawStub(target), "fb", h, b, &answers);
    EXPECT_TRUE(st.ok()) << st.error_message();
    EXPECT_EQ(answers.back().summary().pending_grad_ids_size(), 1);
    return answers.back().summary().pending_grad_ids(0);
  };
  auto commit = [&](uint64_t id, float scale, bool discard) {
    grpc::ClientContext ctx;
    v1::CommitGradRequest req;
    req.set_pending_grad_id(id);
    req.set_scale(scale);
    req.set_discard(discard);
    v1::CommitGradResponse resp;
    return RawStub(group.target())->CommitGrad(&ctx, req, &resp);
  };
  const uint64_t dropped = deferred(group.target());
  for (float x : GatheredGrad(group.target())) ASSERT_EQ(x, 0.0f) << "k=" << k << ": nothing before the commit";
  ASSERT_TRUE(commit(dropped, 1.0f, /*discard=*/true).ok());
  const uint64_t id = deferred(group.target());
  grpc::Status st = commit(id, -0.5f, false);
  ASSERT_TRUE(st.ok()) << st.error_message();
  std::vector<float> want(plain.size());
  for (size_t i = 0; i < plain.size(); ++i) want[i] = -0.5f * plain[i];
  ExpectSame(GatheredGrad(group.target()), want, bits, 1e-5, "k=" + std::to_string(k) + ": dW of the commit");
  EXPECT_EQ(commit(id, 1.0f, false).error_code(), grpc::StatusCode::NOT_FOUND) << "an id commits once";
}

// DESIGN: "dW never leaves its rank". A training call and an optimizer step move per-row
// statistics and d_hidden between the ranks (and the gradient norm), never a weight-gradient shard:
// the front's collective bytes (lce_collective_bytes_total, the same on every rank) over each stay
// far below one rank's dW shard.
TEST(TensorParallel, WeightGradientsNeverLeaveTheirRank) {
  constexpr int k = 2;
  constexpr int64_t vocab = 65536;  // a dW shard of 4 MiB, far above a call's fixed control traffic
  TpGroup group(k, 10.0, "",
                {"--metrics-port=0", "--metrics-host=127.0.0.1", "--seed-head=" + std::to_string(vocab) + "x32"});
  const int port = group.FrontMetricsPort();
  ASSERT_GT(port, 0) << "the front printed no metrics port";
  auto collective_bytes = [port] {
    httplib::Client http("127.0.0.1", port);
    const httplib::Result r = http.Get("/metrics");
    EXPECT_TRUE(r && r->status == 200);
    if (!r) return -1.0;
    const std::string name = "lce_collective_bytes_total{rank=\"0\"} ";
    const size_t at = r->body.find(name);
    EXPECT_NE(at, std::string::npos) << r->body;
    return at == std::string::npos ? -1.0 : std::atof(r->body.c_str() + at + name.size());
  };
  static_assert(kHidden == 32);
  const double shard = static_cast<double>(vocab / k) * kHidden * sizeof(float);
  const double start = collective_bytes();
  const Batch b = MakeBatch(8, v1::DTYPE_FLOAT32, 90);
  ASSERT_TRUE(Accumulate(group.target(), b).ok());
  const double after_call = collective_bytes();
  const v1::OptimizerStepResponse step = Step(group.target());
  EXPECT_GT(step.grad_norm(), 0.0);
  const double after_step = collective_bytes();
  EXPECT_GT(after_call, start) << "the call's statistics and d_hidden cross the ranks";
  EXPECT_LT(after_call - start, shard / 8) << "a training call moved " << after_call - start
                                           << " bytes; a dW shard is " << shard;
  EXPECT_LT(after_step - after_call, shard / 8) << "an optimizer step moved " << after_step - after_call
                                                << " bytes; a dW shard is " << shard;
  std::cout << "collective bytes: training call " << after_call - start << ", optimizer step "
            << after_step - after_call << ", one dW shard " << shard << std::endl;
}

// LoadHead on a group: each rank reads its rows of a seeded head, of a file, or clones its shard of
// another head; UpdateWeights splits the new weight over the shards; both make versions as on one
// server, and a source no rank can read changes nothing.
TEST(TensorParallel, LoadHeadAndUpdateWeightsOnAGroup) {
  const int k = GroupSizes().back();
  TpGroup group(k, 30.0);
  const Batch b = TrainingBatch(71);
  const std::vector<float> w7 = SeededWeight(7), w9 = SeededWeight(9);

  v1::LoadHeadRequest seeded;
  seeded.set_name("seeded");
  seeded.mutable_seeded()->set_vocab_size(kVocab);
  seeded.mutable_seeded()->set_hidden_size(kHidden);
  seeded.mutable_seeded()->set_seed(9);
  seeded.mutable_seeded()->set_dtype(v1::DTYPE_FLOAT32);
  v1::HeadDescription d;
  grpc::Status st = LoadHeadRpc(group.target(), seeded, &d);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(d.version(), 1);
  EXPECT_EQ(d.vocab_size(), kVocab);
  const std::vector<float> lp9 = Logprobs(group.target(), b, "seeded");
  EXPECT_LE(RelErr(lp9.data(), CpuEngineLogprobs(w9, b).data(), lp9.size()), 1e-5) << "a seeded head";

  v1::LoadHeadRequest clone;
  clone.set_name("ref");
  clone.set_clone_of("default");
  ASSERT_TRUE(LoadHeadRpc(group.target(), clone, &d).ok());
  const std::vector<float> lp7 = Logprobs(group.target(), b, "default");
  // (Another engine over the same weight: on a GPU its GEMMs may pick other algorithms, so not bits.)
  const std::vector<float> lp_ref = Logprobs(group.target(), b, "ref");
  EXPECT_LE(RelErr(lp_ref.data(), lp7.data(), lp7.size()), 1e-6) << "a clone";

  const std::string dir = (fs::temp_directory_path() / ("lce_tp_load_" + std::to_string(::getpid()))).string();
  {
    auto stub = RawStub(group.target());
    grpc::ClientContext ctx;
    v1::SaveHeadRequest save;
    save.set_head("seeded");
    save.set_directory(dir);
    v1::SaveHeadResponse saved;
    ASSERT_TRUE(stub->SaveHead(&ctx, save, &saved).ok());
    v1::LoadHeadRequest file;
    file.set_name("from_file");
    file.set_safetensors_file(saved.index_file());
    st = LoadHeadRpc(group.target(), file, &d);
    ASSERT_TRUE(st.ok()) << st.error_message();
    const std::vector<float> lp_file = Logprobs(group.target(), b, "from_file");
    EXPECT_LE(RelErr(lp_file.data(), lp9.data(), lp9.size()), 1e-6) << "a head read back from the shards it saved";
  }
  fs::remove_all(dir);

  v1::LoadHeadRequest missing;
  missing.set_name("missing");
  missing.set_safetensors_file(dir + "/no-such-file.safetensors");
  st = LoadHeadRpc(group.target(), missing, &d);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
  grpc::Status unknown;
  Logprobs(group.target(), b, "missing", 0, &unknown);
  EXPECT_EQ(unknown.error_code(), grpc::StatusCode::NOT_FOUND) << "no rank keeps a head that one rank could not load";

  std::vector<float> negated = w7;
  for (float& x : negated) x = -x;
  EXPECT_EQ(UpdateWeight(group.target(), negated, 5, &d).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  st = UpdateWeight(group.target(), negated, 1, &d);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(d.version(), 2);
  const std::vector<float> lp_neg = Logprobs(group.target(), b, "default");
  EXPECT_LE(RelErr(lp_neg.data(), CpuEngineLogprobs(negated, b).data(), lp_neg.size()), 1e-5) << "the update reached every shard";
  EXPECT_EQ(Logprobs(group.target(), b, "ref"), lp_ref) << "the clone is a copy";
  EXPECT_LE(RelErr(SavedWeight(group.target()).data(), negated.data(), negated.size()), 0.0);

  // The updated head trains on: the masters follow the update.
  ASSERT_TRUE(Accumulate(group.target(), b).ok());
  const v1::OptimizerStepResponse s = Step(group.target());
  EXPECT_EQ(s.head().version(), 3);
  EXPECT_LE(RelErr(SavedWeight(group.target()).data(), negated.data(), negated.size()), 0.2)
      << "one step from the updated weight, not from the loaded one";
  EXPECT_GT(RelErr(SavedWeight(group.target()).data(), w7.data(), w7.size()), 1.0);

  auto c = Connect(group.target(), 1 << 20);
  auto info = c->GetInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->heads_size(), 4);  // default, seeded, ref, from_file
  EXPECT_EQ(info->head().version(), 3);
}

// A weight change while a request is in flight on a group (the first of LCE_TEST_TP_SIZES, default 2):
// the request's later chunks get the answers of the version it started on, on every rank (each rank's
// shard enters every logprob); the change waits for it, then takes effect, and the old version,
// pinned, is gone.
TEST(TensorParallel, AVersionChangeDuringARequestDoesNotChangeItsAnswers) {
  TpGroup group(GroupSizes().front(), 30.0);
  const Batch b = TrainingBatch(81);
  auto stub = RawStub(group.target());
  OpenScore request(*stub, "", b);

  std::vector<float> negated = SeededWeight(7);
  for (float& x : negated) x = -x;
  grpc::Status update;
  v1::HeadDescription d;
  std::thread updater([&] { update = UpdateWeight(group.target(), negated, 0, &d); });
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the update arrives and waits
  auto c = Connect(group.target(), 1 << 20);
  auto info = c->GetInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->head().version(), 1) << "no new version while the request runs";

  EXPECT_EQ(request.Again(), request.first()) << "the request's second chunk ran on the version it started on";
  ASSERT_TRUE(request.Finish().ok());
  updater.join();
  ASSERT_TRUE(update.ok()) << update.error_message();
  EXPECT_EQ(d.version(), 2);
  const std::vector<float> now = Logprobs(group.target(), b);
  EXPECT_LE(RelErr(now.data(), CpuEngineLogprobs(negated, b).data(), now.size()), 1e-5) << "the change took effect";
  grpc::Status pinned;
  Logprobs(group.target(), b, "", 1, &pinned);
  EXPECT_EQ(pinned.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << pinned.error_message();
}

// A request that keeps the group busy for a while: many small chunks.
absl::Status LongRequest(const std::string& target) {
  auto c = Connect(target, kHidden * 4 * 16);
  Batch b = MakeBatch(200000, v1::DTYPE_FLOAT32, 1);
  v1::RequestHeader h;
  h.set_reduction(v1::REDUCTION_SUM);
  return c->ForwardBackward({b.dtype, b.rows, kHidden, absl::MakeConstSpan(b.hidden), absl::MakeConstSpan(b.targets)}, h).status();
}

// The group the fault tests break: LCE_TEST_TP_FAULT_SIZE ranks (default 3); the last one fails.
int FaultGroupSize() {
  const char* env = std::getenv("LCE_TEST_TP_FAULT_SIZE");
  return env != nullptr && *env != 0 ? std::atoi(env) : 3;
}

void ExpectPeerFailureHandled(int signal, double timeout_seconds) {
  const int k = FaultGroupSize();
  const int victim = k - 1;
  TpGroup group(k, timeout_seconds);
  absl::Status result;
  // Requests one after another until one fails: a fast group (CUDA, chunks merged into few calls) may
  // finish a request before the fault.
  std::thread request([&] {
    const auto start = std::chrono::steady_clock::now();
    do {
      result = LongRequest(group.target());
    } while (result.ok() && std::chrono::steady_clock::now() - start < std::chrono::seconds(60));
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  auto hit = std::chrono::steady_clock::now();
  group.Signal(victim, signal);
  request.join();
  const double after = std::chrono::duration<double>(std::chrono::steady_clock::now() - hit).count();
  EXPECT_EQ(result.code(), absl::StatusCode::kUnavailable) << result;
  EXPECT_LE(after, timeout_seconds + 5.0) << "the front took too long to give up";
  if (signal == SIGKILL) {
    EXPECT_NE(result.message().find("rank " + std::to_string(victim)), std::string::npos) << result;
  }
  EXPECT_EQ(group.WaitExit(0, timeout_seconds + 10), 3) << "the front must exit 3 for a group restart";
  if (signal == SIGSTOP) group.Signal(victim, SIGKILL);
}

TEST(TensorParallel, KilledPeerGivesUnavailable) { ExpectPeerFailureHandled(SIGKILL, 5.0); }

TEST(TensorParallel, HungPeerGivesUnavailableWithinTheTimeout) { ExpectPeerFailureHandled(SIGSTOP, 3.0); }

}  // namespace
}  // namespace lce::e2e
