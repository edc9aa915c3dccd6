// Crash-safe head state (issue 22), end to end: a server group SIGKILLed while it saves leaves the
// previous save loadable, whole; a truncated or corrupt saved file is a clear error at LoadHead, and
// the server goes on serving the head it had.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>

#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "head_source.h"
#include "test_server.h"
#include "tp_processes.h"
#include "training_rpcs.h"

namespace lce::e2e {
namespace {

namespace fs = std::filesystem;

grpc::Status Save(v1::LceService::Stub& stub, const std::string& head, const std::string& dir,
                  v1::SaveHeadResponse* out, double deadline_seconds = 120) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(deadline_seconds * 1000)));
  v1::SaveHeadRequest req;
  req.set_head(head);
  req.set_directory(dir);
  return stub.SaveHead(&ctx, req, out);
}

grpc::Status Load(v1::LceService::Stub& stub, const std::string& name, const std::string& file,
                  v1::HeadDescription* out) {
  grpc::ClientContext ctx;
  v1::LoadHeadRequest req;
  req.set_name(name);
  req.set_safetensors_file(file);
  return stub.LoadHead(&ctx, req, out);
}

std::vector<float> ScoreOn(v1::LceService::Stub& stub, const std::string& head, const Batch& b) {
  v1::RequestHeader h;
  h.set_head(head);
  h.set_hidden_size(kHidden);
  h.set_dtype(b.dtype);
  std::vector<v1::StreamResponse> out;
  grpc::Status s = RunOneChunk(stub, "score", h, b, &out);
  EXPECT_TRUE(s.ok()) << s.error_message();
  if (!s.ok() || out.empty()) return {};
  return {out[0].chunk().logprobs().begin(), out[0].chunk().logprobs().end()};
}

// A saved shard truncated, then with a corrupt header, then a torn index: LoadHead over the served
// head is refused with the file and the problem named; the head keeps its version and its answers.
TEST(SaveCrash, ACorruptSaveIsAClearErrorAndTheOldHeadServes) {
  auto ts = StartTestServer();
  auto stub = RawStub(ts->target);
  const fs::path dir = fs::temp_directory_path() / ("lce_save_corrupt_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  v1::SaveHeadResponse saved;
  grpc::Status st = Save(*stub, "wide", dir.string(), &saved);
  ASSERT_TRUE(st.ok()) << st.error_message();
  const Batch b = MakeBatch(20, v1::DTYPE_FLOAT32, 5);
  const std::vector<float> before = ScoreOn(*stub, "wide", b);
  ASSERT_EQ(before.size(), 20u);
  const int64_t version = ts->heads->Version("wide");
  ASSERT_EQ(saved.files_size(), 1);
  const std::string shard = saved.files(0);  // the file the index names
  const auto size = fs::file_size(shard);

  auto expect_refused = [&](const std::string& file, const std::string& words) {
    v1::HeadDescription d;
    grpc::Status s = Load(*stub, "wide", file, &d);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_NE(s.error_message().find(words), std::string::npos) << "'" << s.error_message() << "' lacks '" << words << "'";
    EXPECT_EQ(ts->heads->Version("wide"), version) << "a refused LoadHead made a version";
    EXPECT_EQ(ScoreOn(*stub, "wide", b), before) << "the head changed";
  };
  fs::resize_file(shard, size - 4);
  expect_refused(saved.index_file(), "truncated?");
  expect_refused(shard, "truncated?");
  fs::resize_file(shard, 6);
  expect_refused(saved.index_file(), "too short for a safetensors file");
  {
    std::ofstream out(shard, std::ios::binary | std::ios::trunc);
    const uint64_t len = 40;
    out.write(reinterpret_cast<const char*>(&len), 8);
    out << "{\"lm_head.weight\": {\"dtype\": \"F32\", \"sh" << std::string(size - 48, '\0');
  }
  expect_refused(saved.index_file(), "header is not a JSON object");
  std::ofstream(saved.index_file()) << "{\"vocab_size\": 3001, \"hidden_si";
  expect_refused(saved.index_file(), "not an lce-serve head index");
  fs::remove_all(dir);
}

// SaveHead over a previous save by a fresh group of two ranks (each at version 1, as after a
// restart, so the committed save names the files this one writes), the front SIGKILLed part-way
// through it at several points of a save's measured duration, the peer a moment later: each time,
// the index loads whole files of one save, the previous one or (killed after the commit) the new
// one; never a mix of the two (the peer's shard written over the committed one's), a torn file or
// nothing.
TEST(SaveCrash, SigkillDuringSaveLeavesThePreviousSaveLoadable) {
  constexpr int64_t kV = 8192, kH = 2048;  // fp32: 64 MiB a save, 32 MiB a rank
  const fs::path dir = fs::temp_directory_path() / ("lce_save_kill_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const std::string save_dir = (dir / "saved").string();
  auto group = [&](uint64_t seed) {
    return std::make_unique<TpGroup>(2, 30.0, "",
                                     std::vector<std::string>{"--seed-head=" + std::to_string(kV) + "x" + std::to_string(kH),
                                                              "--seed=" + std::to_string(seed)});
  };
  auto load = [&]() -> std::shared_ptr<const HeadWeights> {
    server::HeadSource src;
    src.file = save_dir + "/default.index.json";
    auto w = server::LoadHead(src, 0, 1);
    EXPECT_TRUE(w.ok()) << w.status();
    return w.ok() ? *w : nullptr;
  };
  // Which seeded head `w` is, over rows of both ranks' shards (0: neither, a mix or a torn file).
  auto seed_of = [&](const HeadWeights& w, uint64_t a, uint64_t b) -> uint64_t {
    const float* p = reinterpret_cast<const float*>(w.weight.data());
    for (uint64_t seed : {a, b}) {
      bool all = true;
      for (int64_t row : {int64_t{0}, kV / 2 - 1, kV / 2, kV - 1}) {
        for (int64_t c = 0; c < kH && all; ++c) all = p[row * kH + c] == server::SeededHeadValue(seed, row, c, kH);
      }
      if (all) return seed;
    }
    return 0;
  };
  double save_seconds = 0;
  {
    auto first = group(1);
    auto stub = RawStub(first->target());
    v1::SaveHeadResponse r;
    const auto t0 = std::chrono::steady_clock::now();
    grpc::Status st = Save(*stub, "default", save_dir, &r);
    save_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  std::shared_ptr<const HeadWeights> loaded = load();
  ASSERT_TRUE(loaded != nullptr);
  ASSERT_EQ(seed_of(*loaded, 1, 1), 1u);
  uint64_t previous = 1;
  int before_commit = 0;
  const double fractions[] = {0.1, 0.3, 0.5, 0.7, 0.9, 0.05};
  for (int i = 0; i < 6; ++i) {
    const uint64_t seed = 2 + static_cast<uint64_t>(i);
    auto g = group(seed);
    auto stub = RawStub(g->target());
    std::thread saver([&] {
      v1::SaveHeadResponse r;
      (void)Save(*stub, "default", save_dir, &r, 60);  // fails when the group dies under it
    });
    std::this_thread::sleep_for(std::chrono::microseconds(static_cast<int64_t>(fractions[i] * save_seconds * 1e6)));
    // The front dies; the peer lives on a moment (its write, begun, ends), then dies too.
    g->Signal(0, SIGKILL);
    std::this_thread::sleep_for(std::chrono::microseconds(static_cast<int64_t>(save_seconds * 1e6)));
    g->Signal(1, SIGKILL);
    saver.join();
    g.reset();
    loaded = load();
    ASSERT_TRUE(loaded != nullptr) << "after a kill at " << fractions[i] << " of a save, the index no longer loads";
    const uint64_t now = seed_of(*loaded, previous, seed);
    ASSERT_NE(now, 0u) << "after a kill at " << fractions[i] << " of a save, the index loads neither the previous save (seed "
                       << previous << ") nor the new one (seed " << seed << "), whole";
    before_commit += now == previous;
    previous = now;
  }
  // Some kills must have caught a save part-way, or nothing was tested.
  EXPECT_GE(before_commit, 1) << "no kill landed inside a save of " << save_seconds << " s";
  std::printf("SaveHead of %lld MiB by 2 ranks took %.3f s; %d of 6 kills landed before the commit\n",
              static_cast<long long>(kV * kH * 4 >> 20), save_seconds, before_commit);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace lce::e2e
