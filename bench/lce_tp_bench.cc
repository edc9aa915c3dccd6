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
#include <string>
#include <vector>

#include "lce/engine.h"
#include "lce/numeric.h"
#include "metrics.h"
#include "tp_communicator.h"

namespace {

#define CHECK(x)                                                                                 \
  do {                                                                                           \
    auto e_ = (x);                                                                               \
    if (e_ != decltype(e_){}) {                                                                  \
      std::fprintf(stderr, "%s:%d %s failed (%d)\n", __FILE__, __LINE__, #x, static_cast<int>(e_)); \
      std::exit(1);                                                                              \
    }                                                                                            \
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

}  // namespace

int main(int argc, char** argv) {
  using namespace lce;
  const int rank = std::stoi(Flag(argc, argv, "rank", "0"));
  const int world = std::stoi(Flag(argc, argv, "world", "1"));
  const int reps = std::stoi(Flag(argc, argv, "reps", "10"));
  const int warmup = std::stoi(Flag(argc, argv, "warmup", "3"));
  const std::string shapes = Flag(argc, argv, "shapes", "16384x4096x151936");
  server::TpBootstrap b;
  b.rank = rank;
  b.world_size = world;
  b.rendezvous_dir = Flag(argc, argv, "rendezvous", "/tmp/lce_tp_bench");
  b.timeout = absl::Seconds(300);
  server::metrics::Registry registry;
  server::metrics::Counter& comm_seconds = registry.AddCounter("comm_seconds", "").WithLabels({});
  server::metrics::Counter& comm_bytes = registry.AddCounter("comm_bytes", "").WithLabels({});
  auto raw = server::CreateNcclCommunicator(b, rank);
  Ok(raw.status(), "NCCL");
  std::unique_ptr<server::TpCommunicator> comm =
      server::TimeCollectives(std::move(*raw), &comm_seconds, &comm_bytes);
  CHECK(cudaSetDevice(rank));
  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  float* one;
  CHECK(cudaMalloc(&one, 4));
  auto barrier = [&] { Ok(comm->AllReduce(one, 1, ReduceOp::kSum, true, stream), "barrier"); };
  cublasHandle_t blas;
  CHECK(cublasCreate(&blas));
  CHECK(cublasSetStream(blas, stream));

  size_t pos = 0;
  while (pos < shapes.size()) {
    const size_t comma = shapes.find(',', pos);
    const std::string shape = shapes.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    pos = comma == std::string::npos ? shapes.size() : comma + 1;
    int64_t N, H, V;
    if (std::sscanf(shape.c_str(), "%ldx%ldx%ld", &N, &H, &V) != 3) return 2;
    const VocabRange range = VocabShard(V, rank, world);
    const int64_t rows = range.end - range.begin;

    // The shard: rows [begin, end) of the same seeded head on every rank.
    auto weights = std::make_shared<HeadWeights>();
    weights->shape = {V, H, DType::kBFloat16, range.begin, rows, false};
    weights->weight.resize(rows * H * 2);
    NormalBf16(reinterpret_cast<uint16_t*>(weights->weight.data()), rows * H, range.begin * H, 1.0f / std::sqrt(float(H)), 7);
    // The floor: one GEMM over ⌈V/k⌉ rows (an even share; a shard holds whole tiles, rank 0's may be smaller).
    const int64_t floor_rows = (V + world - 1) / world;
    void* wdev;  // a device copy for the floor GEMM
    const int64_t wdev_bytes = std::max(rows, floor_rows) * H * 2;
    CHECK(cudaMalloc(&wdev, wdev_bytes));
    CHECK(cudaMemset(wdev, 0, wdev_bytes));
    CHECK(cudaMemcpy(wdev, weights->weight.data(), rows * H * 2, cudaMemcpyHostToDevice));
    EngineConfig cfg;
    cfg.device = rank;
    cfg.collectives = world > 1 ? comm.get() : nullptr;
    cfg.rank0_outputs = true;  // as lce_server's groups
    auto engine = CreateEngine(Backend::kCuda, weights, cfg);
    Ok(engine.status(), "engine");
    weights.reset();  // the engine keeps what it needs

    void *h, *dh, *floor_out;
    int32_t* t;
    float *g, *lp, *ent, *loss, *dw;
    CHECK(cudaMalloc(&h, N * H * 2));
    CHECK(cudaMalloc(&dh, N * H * 2));
    CHECK(cudaMalloc(&t, N * 4));
    CHECK(cudaMalloc(&g, N * 4));
    CHECK(cudaMalloc(&lp, N * 4));
    CHECK(cudaMalloc(&ent, N * 4));
    CHECK(cudaMalloc(&loss, N * 4));
    CHECK(cudaMalloc(&dw, rows * H * 4));
    CHECK(cudaMalloc(&floor_out, N * floor_rows * 2));
    CHECK(cudaMemset(dw, 0, rows * H * 4));
    {
      std::vector<uint16_t> hh(N * H);
      NormalBf16(hh.data(), N * H, 0, 0.5f, 11);
      CHECK(cudaMemcpy(h, hh.data(), N * H * 2, cudaMemcpyHostToDevice));
      std::vector<int32_t> th(N);
      std::vector<float> gh(N);
      int64_t valid = 0;
      for (int64_t i = 0; i < N; ++i) {
        const uint64_t r = Mix(13 * 0x9e3779b97f4a7c15ULL + static_cast<uint64_t>(i));
        const bool ignored = (r & 0xffff) < 0.05 * 65536;
        th[i] = ignored ? -100 : static_cast<int32_t>((r >> 20) % static_cast<uint64_t>(V));
        valid += ignored ? 0 : 1;
      }
      for (int64_t i = 0; i < N; ++i) gh[i] = th[i] == -100 ? 0.0f : 1.0f / static_cast<float>(valid);
      CHECK(cudaMemcpy(t, th.data(), N * 4, cudaMemcpyHostToDevice));
      CHECK(cudaMemcpy(g, gh.data(), N * 4, cudaMemcpyHostToDevice));
    }

    RowsView view{h, t, N, MemorySpace::kDevice};
    LceOptions opts;
    auto time_ms = [&](auto&& f) {
      for (int i = 0; i < warmup; ++i) f();
      std::vector<double> ms;
      for (int i = 0; i < reps; ++i) {
        barrier();
        CHECK(cudaStreamSynchronize(stream));
        const auto t0 = std::chrono::steady_clock::now();
        f();
        barrier();  // the slowest rank ends the call
        CHECK(cudaStreamSynchronize(stream));
        ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      }
      std::sort(ms.begin(), ms.end());
      return ms[ms.size() / 2];
    };
    const double comm0 = comm_seconds.Value();
    const double train = time_ms([&] {
      Ok((*engine)->Compute(view, opts, {GradMode::kLoss, g, nullptr, nullptr}, {nullptr, nullptr, nullptr, loss}, {dh, dw}),
         "train");
    });
    const double comm_per_train = (comm_seconds.Value() - comm0) * 1e3 / (warmup + reps) ;
    const double score = time_ms([&] {
      Ok((*engine)->Compute(view, opts, {}, {lp, ent, nullptr, nullptr}, {}), "score");
    });
    const float alpha = 1.0f, beta = 0.0f;
    const double gemm = time_ms([&] {
      CHECK(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(floor_rows), static_cast<int>(N),
                         static_cast<int>(H), &alpha, wdev, CUDA_R_16BF, static_cast<int>(H), h, CUDA_R_16BF,
                         static_cast<int>(H), &beta, floor_out, CUDA_R_16BF, static_cast<int>(floor_rows),
                         CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    });
    if (rank == 0) {
      std::printf(
          "k=%d %ldx%ldx%ld  train %8.2f ms (x%.3f of 3 GEMMs of V/k)  score %8.2f ms (x%.3f)  "
          "floor GEMM %7.2f ms (%4.0f TFLOP/s)  in collectives %.2f ms/train (barriers included)\n",
          world, N, H, V, train, train / (3 * gemm), score, score / gemm, gemm, 2.0 * N * H * floor_rows / gemm / 1e9,
          comm_per_train);
      std::fflush(stdout);
    }
    for (void* p : {wdev, h, dh, static_cast<void*>(t),
                    static_cast<void*>(g), static_cast<void*>(lp), static_cast<void*>(ent), static_cast<void*>(loss),
                    static_cast<void*>(dw), static_cast<void*>(floor_out)}) {
      CHECK(cudaFree(p));
    }
  }
  return 0;
}
