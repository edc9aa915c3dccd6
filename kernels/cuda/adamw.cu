// The AdamW step of a head shard on the GPU (HeadTrainer's CUDA implementation): one pass over the
// fp32 master weights, moments and gradient that also writes the serving weight in the head's dtype,
// so each byte is read or written once (16 B read + 14 B written a parameter for a 16-bit head).
#include "cuda/cuda_check.h"
#include "cuda/dtype_dispatch.cuh"
#include "cuda/kernels.h"

namespace lce::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 4;  // float4 of master, m, v and grad per thread and iteration

// The fp32 update of one parameter: the operations of lce::AdamWStep (kernels/training.cc) in the same
// order, each rounded on its own (the _rn intrinsics keep nvcc from fusing them), so that the kernel
// and the host loop give the same bits.
struct AdamWMath {
  AdamWKernelArgs a;
  __device__ __forceinline__ void operator()(float& p, float& m, float& v, float grad) const {
    const float g = __fmul_rn(grad, a.grad_scale);
    p = __fmul_rn(p, a.decay);
    m = __fadd_rn(__fmul_rn(a.beta1, m), __fmul_rn(a.one_minus_beta1, g));
    v = __fadd_rn(__fmul_rn(a.beta2, v), __fmul_rn(__fmul_rn(a.one_minus_beta2, g), g));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), a.bc2_sqrt), a.eps);
    p = __fsub_rn(p, __fdiv_rn(__fmul_rn(a.step_size, m), denom));
  }
};

// Four serving elements, stored with one 8-byte (16-bit dtypes) or 16-byte (fp32) write.
template <typename T>
struct alignas(kVec * sizeof(T)) ServingVec {
  T v[kVec];
};

template <typename T>
__global__ void __launch_bounds__(kThreads)
AdamWKernel(float* __restrict__ master, float* __restrict__ m, float* __restrict__ v, const float* __restrict__ grad,
            T* __restrict__ serving, int64_t n, AdamWMath math) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t vec_n = n / kVec;  // whole float4 groups; the tail below
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < vec_n; i += stride) {
    float4 p = reinterpret_cast<float4*>(master)[i];
    float4 mm = reinterpret_cast<float4*>(m)[i];
    float4 vv = reinterpret_cast<float4*>(v)[i];
    const float4 g = reinterpret_cast<const float4*>(grad)[i];
    math(p.x, mm.x, vv.x, g.x);
    math(p.y, mm.y, vv.y, g.y);
    math(p.z, mm.z, vv.z, g.z);
    math(p.w, mm.w, vv.w, g.w);
    reinterpret_cast<float4*>(master)[i] = p;
    reinterpret_cast<float4*>(m)[i] = mm;
    reinterpret_cast<float4*>(v)[i] = vv;
    ServingVec<T> out;
    out.v[0] = FromFloat<T>(p.x);
    out.v[1] = FromFloat<T>(p.y);
    out.v[2] = FromFloat<T>(p.z);
    out.v[3] = FromFloat<T>(p.w);
    reinterpret_cast<ServingVec<T>*>(serving)[i] = out;
  }
  for (int64_t i = vec_n * kVec + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    float p = master[i], mm = m[i], vv = v[i];
    math(p, mm, vv, grad[i]);
    master[i] = p;
    m[i] = mm;
    v[i] = vv;
    serving[i] = FromFloat<T>(p);
  }
}

}  // namespace

absl::Status LaunchAdamW(float* master, float* exp_avg, float* exp_avg_sq, const float* grad, DType dtype,
                         void* serving, int64_t n, const AdamWKernelArgs& args, cudaStream_t stream) {
  if (n <= 0) return absl::OkStatus();
  const void* buffers[] = {master, exp_avg, exp_avg_sq, grad, serving};
  for (const void* p : buffers) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return absl::InvalidArgumentError("AdamW buffers must be 16-byte aligned");
  }
  int device = 0, sms = 0;
  LCE_CUDA_CHECK(cudaGetDevice(&device));
  LCE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return DispatchDType(dtype, [&](auto tag) -> absl::Status {
    using T = typename decltype(tag)::type;
    // One wave of as many blocks as fit on the GPU at once, each striding over the whole buffer: every
    // SM's memory pipeline stays full to the end, with no tail of late blocks.
    int per_sm = 0;
    LCE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, AdamWKernel<T>, kThreads, 0));
    const int64_t want = (n / kVec + kThreads - 1) / kThreads;
    const unsigned blocks =
        static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(want, int64_t{sms} * std::max(per_sm, 1))));
    AdamWKernel<T><<<blocks, kThreads, 0, stream>>>(master, exp_avg, exp_avg_sq, grad, static_cast<T*>(serving), n,
                                                    AdamWMath{args});
    LCE_CUDA_CHECK(cudaGetLastError());
    return absl::OkStatus();
  });
}

}  // namespace lce::cuda
