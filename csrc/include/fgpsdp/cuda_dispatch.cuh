// dtype dispatch for the torch-free kernels: one switch, used by every launcher.
#pragma once

#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "fgpsdp/kernel_api.h"

namespace fgpsdp {
namespace cuda {

// Runs BODY with `scalar_t` bound to the C++ type of DTYPE.
#define FGPSDP_DISPATCH_DTYPE(DTYPE, scalar_t, ...)                      \
  [&]() -> cudaError_t {                                                 \
    switch (DTYPE) {                                                     \
      case ::fgpsdp::cuda::DType::kFloat32: {                            \
        using scalar_t = float;                                          \
        return __VA_ARGS__();                                            \
      }                                                                  \
      case ::fgpsdp::cuda::DType::kFloat64: {                            \
        using scalar_t = double;                                         \
        return __VA_ARGS__();                                            \
      }                                                                  \
      case ::fgpsdp::cuda::DType::kFloat16: {                            \
        using scalar_t = __half;                                         \
        return __VA_ARGS__();                                            \
      }                                                                  \
      case ::fgpsdp::cuda::DType::kBFloat16: {                           \
        using scalar_t = __nv_bfloat16;                                  \
        return __VA_ARGS__();                                            \
      }                                                                  \
    }                                                                    \
    return cudaErrorInvalidValue;                                        \
  }()

template <typename T>
__device__ __forceinline__ double to_double(T v) { return static_cast<double>(v); }
template <>
__device__ __forceinline__ double to_double<__half>(__half v) { return static_cast<double>(__half2float(v)); }
template <>
__device__ __forceinline__ double to_double<__nv_bfloat16>(__nv_bfloat16 v) {
  return static_cast<double>(__bfloat162float(v));
}

template <typename T>
__device__ __forceinline__ float to_float(T v) { return static_cast<float>(v); }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v) { return static_cast<T>(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// A double narrowed as torch's CPU casts narrow it: to float first, then to Out.
template <typename T>
__device__ __forceinline__ T from_double(double v) { return from_float<T>(static_cast<float>(v)); }
template <>
__device__ __forceinline__ double from_double<double>(double v) { return v; }

// Scale-and-cast in float, or in double when either side is double (half and
// bfloat16 included: the CPU twin and ops.reference_* compute so too).
template <typename Out, typename In>
__device__ __forceinline__ Out scale_cast(In v, float scale_f, double scale_d) {
  if constexpr (std::is_same<In, double>::value || std::is_same<Out, double>::value) {
    return from_double<Out>(to_double(v) * scale_d);
  } else {
    return from_float<Out>(to_float(v) * scale_f);
  }
}

}  // namespace cuda
}  // namespace fgpsdp
