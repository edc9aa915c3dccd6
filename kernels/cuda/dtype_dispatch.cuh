// The one place where the head's DType becomes a CUDA element type (device code only).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "lce/head.h"

namespace lce::cuda {

template <typename T> struct DTypeTag { using type = T; };

// Calls f(DTypeTag<T>{}) with T = __nv_bfloat16, __half or float.
template <typename F>
decltype(auto) DispatchDType(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kBFloat16: return f(DTypeTag<__nv_bfloat16>{});
    case DType::kFloat16: return f(DTypeTag<__half>{});
    case DType::kFloat32: break;
  }
  return f(DTypeTag<float>{});
}

template <typename T> __device__ __forceinline__ T FromFloat(float v);
template <> __device__ __forceinline__ float FromFloat<float>(float v) { return v; }
template <> __device__ __forceinline__ __half FromFloat<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename T> __device__ __forceinline__ float ToFloat(T v);
template <> __device__ __forceinline__ float ToFloat<float>(float v) { return v; }
template <> __device__ __forceinline__ float ToFloat<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float ToFloat<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

// Block-wide reductions over blockDim.x threads (a multiple of 32, at most 1024).
__device__ __forceinline__ float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

}  // namespace lce::cuda
