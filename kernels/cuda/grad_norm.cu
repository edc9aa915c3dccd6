// Σ x² over each vocabulary tile of a gradient shard (global-norm clipping), in double and in a fixed
// order that depends on the tile alone: each tile is cut into kTileChunks interleaved chunks, one block
// each, every thread a fixed strided set of the tile's elements counted from the tile's first element,
// tree reductions of fixed shape, then the chunks of each tile summed in order. The same bits for the
// same tile on any GPU, wherever the tile sits in its shard and whatever else runs.
#include "cuda/cuda_check.h"
#include "cuda/kernels.h"

namespace lce::cuda {
namespace {

constexpr int kThreads = 256;

// Sum over the block's threads of v, in a fixed tree order; the result in thread 0.
__device__ double BlockSum(double v) {
  __shared__ double lanes[kThreads];
  lanes[threadIdx.x] = v;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) lanes[threadIdx.x] += lanes[threadIdx.x + half];
    __syncthreads();
  }
  return lanes[0];
}

// Block (c, t): chunk c of tile t. vec4: every tile starts 16-byte aligned (hidden % 4 == 0).
__global__ void __launch_bounds__(kThreads)
TileChunkSums(const float* __restrict__ x, TileNormShape shape, bool vec4, double* __restrict__ partials) {
  const int64_t t = blockIdx.y;
  const int64_t tile = shape.first_tile + t;
  const int64_t r0 = max(int64_t{0}, tile * shape.tile_rows - shape.vocab_begin);
  const int64_t r1 = min(shape.shard_rows, (tile + 1) * shape.tile_rows - shape.vocab_begin);
  const float* base = x + r0 * shape.hidden;
  const int64_t n = (r1 - r0) * shape.hidden;
  const int64_t stride = int64_t{kTileChunks} * kThreads;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  double s = 0;
  const int64_t vec_n = vec4 ? n / 4 : 0;
  for (int64_t i = first; i < vec_n; i += stride) {
    const float4 f = reinterpret_cast<const float4*>(base)[i];
    s += static_cast<double>(f.x) * f.x + static_cast<double>(f.y) * f.y + static_cast<double>(f.z) * f.z +
         static_cast<double>(f.w) * f.w;
  }
  for (int64_t i = vec_n * 4 + first; i < n; i += stride) s += static_cast<double>(base[i]) * base[i];
  const double block = BlockSum(s);
  if (threadIdx.x == 0) partials[t * kTileChunks + blockIdx.x] = block;
}

__global__ void SumChunks(const double* __restrict__ partials, int64_t tiles, double* __restrict__ out) {
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < tiles;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    double s = 0;
    for (int c = 0; c < kTileChunks; ++c) s += partials[t * kTileChunks + c];
    out[t] = s;
  }
}

}  // namespace

absl::Status LaunchTileSquaredNorms(const float* x, const TileNormShape& shape, double* scratch, double* out,
                                    cudaStream_t stream) {
  if (shape.tiles <= 0) return absl::OkStatus();
  if (shape.tiles > 65535) return absl::InvalidArgumentError("more than 65535 vocabulary tiles in a shard");
  const bool vec4 = shape.hidden % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  TileChunkSums<<<dim3(kTileChunks, static_cast<unsigned>(shape.tiles)), kThreads, 0, stream>>>(x, shape, vec4, scratch);
  LCE_CUDA_CHECK(cudaGetLastError());
  SumChunks<<<static_cast<unsigned>((shape.tiles + 127) / 128), 128, 0, stream>>>(scratch, shape.tiles, out);
  LCE_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace lce::cuda
