// Tensor-parallel benchmark: one process per GPU (rank), the CUDA engine over a vocabulary shard,
// NCCL collectives through the server's communicator (the same code lce_server runs). Every rank
// gets the same hidden states and targets in device memory; the time of a call is the slowest
// rank's, measured between two NCCL barriers.
//
//   train  Compute(kLoss, mean over valid rows): d_hidden (bf16, all-reduced) and dW (fp32) of the shard
//   score  Compute(kNone): logprob + entropy
//   floor  one bf16 [N,H]x[H,⌈V/k⌉] cuBLAS GEMM on rank 0 (train's per-rank floor is three, score's one)
//   comm   time inside collectives per train call (all-reduces of partials and of d_hidden)
//
// Usage (see `bench/device.sh tp`): lce_tp_bench --rank=R --world=K --rendezvous=DIR
//          [--shapes=16384x4096x151936,...] [--reps=10] [--warmup=3]
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "lce/engine.h"
#include "lce/numeric.h"
#include "metrics.h"
#include "tp_communicator.h"

namespace {

#define CHECK(x)                                                                                    \
  do {                                                                                              \
    auto e_ = (x);                                                                                  \
    if (e_ != decltype(e_){}) {                                                                     \
      std::fprintf(stderr, "%s:%d %s failed (%d)\n", __FILE__, __LINE__, #x, static_cast<int>(e_)); \
      std::exit(1);                                                                                 \
    }                                                                                               \
  } while (0)

void Ok(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, std::string(s.message()).c_str());
    std::exit(1);
  }
}

uint64_t Mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  return x ^ (x >> 33);
}

// N(0, scale²) in bf16 (bits); element i of a tensor drawn with `seed` is the same on every rank.
void NormalBf16(uint16_t* out, int64_t n, int64_t offset, float scale, uint64_t seed) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t r = Mix(seed * 0x9e3779b97f4a7c15ULL + static_cast<uint64_t>(i + offset));
    const float u1 = ((r >> 40) + 1) * (1.0f / 16777217.0f);
    const float u2 = ((r >> 16) & 0xffffff) * (1.0f / 16777216.0f);
    out[i] = lce::FloatToBf16(scale * std::sqrt(-2.0f * std::log(u1)) * std::cos(6.283185307f * u2));
  }
}

std::string Flag(int argc, char** argv, const std::string& name, const std::string& def) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--" + name + "=", 0) == 0) return a.substr(name.size() + 3);
  }
  return def;
}

// What every shape's run shares: this rank, the group and the timing's stream, barrier and counters.
struct TpBench {
  int rank = 0, world = 1, reps = 10, warmup = 3;
  std::unique_ptr<lce::server::TpCommunicator> comm;
  lce::server::metrics::Counter* comm_seconds = nullptr;
  cudaStream_t stream = nullptr;
  float* one = nullptr;  // the barrier's all-reduced value
  cublasHandle_t blas = nullptr;

  void Barrier() { Ok(comm->AllReduce(one, 1, lce::ReduceOp::kSum, true, stream), "barrier"); }
  // Median of reps calls of f after warmup, each between two barriers: the slowest rank ends the call.
  template <typename F>
  double TimeMs(F&& f) {
    for (int i = 0; i < warmup; ++i) f();
    std::vector<double> ms;
    for (int i = 0; i < reps; ++i) {
      Barrier();
      CHECK(cudaStreamSynchronize(stream));
      const auto t0 = std::chrono::steady_clock::now();
      f();
      Barrier();
      CHECK(cudaStreamSynchronize(stream));
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  }
};

// This rank's shard: rows [begin, end) of the same seeded head on every rank.
std::shared_ptr<lce::HeadWeights> SeededShard(const lce::VocabRange& range, int64_t H, int64_t V) {
  const int64_t rows = range.end - range.begin;
  auto weights = std::make_shared<lce::HeadWeights>();
  weights->shape = {V, H, lce::DType::kBFloat16, range.begin, rows, false};
  weights->weight.resize(rows * H * 2);
  NormalBf16(reinterpret_cast<uint16_t*>(weights->weight.data()), rows * H, range.begin * H, 1.0f / std::sqrt(float(H)),
             7);
  return weights;
}

// Every rank's same rows in device memory: hidden states, targets (5% ignored) and the mean's upstream gradient.
struct RankRows {
  void* h = nullptr;
  int32_t* t = nullptr;
  float* g = nullptr;
};

RankRows MakeRows(int64_t N, int64_t H, int64_t V) {
  RankRows r;
  CHECK(cudaMalloc(&r.h, N * H * 2));
  CHECK(cudaMalloc(&r.t, N * 4));
  CHECK(cudaMalloc(&r.g, N * 4));
  std::vector<uint16_t> hh(N * H);
  NormalBf16(hh.data(), N * H, 0, 0.5f, 11);
  CHECK(cudaMemcpy(r.h, hh.data(), N * H * 2, cudaMemcpyHostToDevice));
  std::vector<int32_t> th(N);
  std::vector<float> gh(N);
  int64_t valid = 0;
  for (int64_t i = 0; i < N; ++i) {
    const uint64_t x = Mix(13 * 0x9e3779b97f4a7c15ULL + static_cast<uint64_t>(i));
    const bool ignored = (x & 0xffff) < 0.05 * 65536;
    th[i] = ignored ? -100 : static_cast<int32_t>((x >> 20) % static_cast<uint64_t>(V));
    valid += ignored ? 0 : 1;
  }
  for (int64_t i = 0; i < N; ++i) gh[i] = th[i] == -100 ? 0.0f : 1.0f / static_cast<float>(valid);
  CHECK(cudaMemcpy(r.t, th.data(), N * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(r.g, gh.data(), N * 4, cudaMemcpyHostToDevice));
  return r;
}

// The floor: one GEMM over ceil(V/k) rows (an even share; a shard holds whole tiles, rank 0's may be smaller),
// on a device copy of this rank's shard padded with zeros to that share.
double TimeFloor(TpBench& b, const lce::HeadWeights& shard, const RankRows& in, int64_t N, int64_t floor_rows) {
  const int64_t H = shard.shape.hidden_size, rows = shard.shape.shard_rows;
  void *wdev, *floor_out;
  const int64_t wdev_bytes = std::max(rows, floor_rows) * H * 2;
  CHECK(cudaMalloc(&wdev, wdev_bytes));
  CHECK(cudaMemset(wdev, 0, wdev_bytes));
  CHECK(cudaMemcpy(wdev, shard.weight.data(), rows * H * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&floor_out, N * floor_rows * 2));
  const float alpha = 1.0f, beta = 0.0f;
  const double ms = b.TimeMs([&] {
    CHECK(cublasGemmEx(b.blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(floor_rows), static_cast<int>(N),
                       static_cast<int>(H), &alpha, wdev, CUDA_R_16BF, static_cast<int>(H), in.h, CUDA_R_16BF,
                       static_cast<int>(H), &beta, floor_out, CUDA_R_16BF, static_cast<int>(floor_rows),
                       CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  });
  for (void* p : {wdev, floor_out}) CHECK(cudaFree(p));
  return ms;
}

// One shape: the group's train and score, then rank 0's floor; rank 0 prints the line.
void BenchShape(TpBench& b, int64_t N, int64_t H, int64_t V) {
  using namespace lce;
  const VocabRange range = VocabShard(V, b.rank, b.world);
  const int64_t rows = range.end - range.begin;
  std::shared_ptr<HeadWeights> shard = SeededShard(range, H, V);
  EngineConfig cfg;
  cfg.device = b.rank;
  cfg.collectives = b.world > 1 ? b.comm.get() : nullptr;
  cfg.rank0_outputs = true;  // as lce_server's groups
  auto engine = CreateEngine(Backend::kCuda, shard, cfg);
  Ok(engine.status(), "engine");
  const RankRows in = MakeRows(N, H, V);
  void* dh;
  float *lp, *ent, *loss, *dw;
  CHECK(cudaMalloc(&dh, N * H * 2));
  CHECK(cudaMalloc(&lp, N * 4));
  CHECK(cudaMalloc(&ent, N * 4));
  CHECK(cudaMalloc(&loss, N * 4));
  CHECK(cudaMalloc(&dw, rows * H * 4));
  CHECK(cudaMemset(dw, 0, rows * H * 4));
  RowsView view{in.h, in.t, N, MemorySpace::kDevice};
  LceOptions opts;
  const double comm0 = b.comm_seconds->Value();
  const double train = b.TimeMs([&] {
    Ok((*engine)->Compute(view, opts, {GradMode::kLoss, in.g, nullptr, nullptr}, {nullptr, nullptr, nullptr, loss},
                          {dh, dw}),
       "train");
  });
  const double comm_per_train = (b.comm_seconds->Value() - comm0) * 1e3 / (b.warmup + b.reps);
  const double score = b.TimeMs([&] {
    Ok((*engine)->Compute(view, opts, {}, {lp, ent, nullptr, nullptr}, {}), "score");
  });
  const int64_t floor_rows = (V + b.world - 1) / b.world;
  const double gemm = TimeFloor(b, *shard, in, N, floor_rows);
  if (b.rank == 0) {
    std::printf(
        "k=%d %ldx%ldx%ld  train %8.2f ms (x%.3f of 3 GEMMs of V/k)  score %8.2f ms (x%.3f)  "
        "floor GEMM %7.2f ms (%4.0f TFLOP/s)  in collectives %.2f ms/train (barriers included)\n",
        b.world, N, H, V, train, train / (3 * gemm), score, score / gemm, gemm, 2.0 * N * H * floor_rows / gemm / 1e9,
        comm_per_train);
    std::fflush(stdout);
  }
  for (void* p : {in.h, dh, static_cast<void*>(in.t), static_cast<void*>(in.g), static_cast<void*>(lp),
                  static_cast<void*>(ent), static_cast<void*>(loss), static_cast<void*>(dw)}) {
    CHECK(cudaFree(p));
  }
}

}  // namespace

int main(int argc, char** argv) {
  using namespace lce;
  TpBench b;
  b.rank = std::stoi(Flag(argc, argv, "rank", "0"));
  b.world = std::stoi(Flag(argc, argv, "world", "1"));
  b.reps = std::stoi(Flag(argc, argv, "reps", "10"));
  b.warmup = std::stoi(Flag(argc, argv, "warmup", "3"));
  const std::string shapes = Flag(argc, argv, "shapes", "16384x4096x151936");
  server::TpBootstrap boot;
  boot.rank = b.rank;
  boot.world_size = b.world;
  boot.rendezvous_dir = Flag(argc, argv, "rendezvous", "/tmp/lce_tp_bench");
  boot.timeout = absl::Seconds(300);
  server::metrics::Registry registry;
  b.comm_seconds = &registry.AddCounter("comm_seconds", "").WithLabels({});
  server::metrics::Counter& comm_bytes = registry.AddCounter("comm_bytes", "").WithLabels({});
  auto raw = server::CreateNcclCommunicator(boot, b.rank);
  Ok(raw.status(), "NCCL");
  b.comm = server::TimeCollectives(std::move(*raw), b.comm_seconds, &comm_bytes);
  CHECK(cudaSetDevice(b.rank));
  CHECK(cudaStreamCreate(&b.stream));
  CHECK(cudaMalloc(&b.one, 4));
  CHECK(cublasCreate(&b.blas));
  CHECK(cublasSetStream(b.blas, b.stream));
  size_t pos = 0;
  while (pos < shapes.size()) {
    const size_t comma = shapes.find(',', pos);
    const std::string shape = shapes.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    pos = comma == std::string::npos ? shapes.size() : comma + 1;
    int64_t N, H, V;
    if (std::sscanf(shape.c_str(), "%ldx%ldx%ld", &N, &H, &V) != 3) return 2;
    BenchShape(b, N, H, V);
  }
  return 0;
}
