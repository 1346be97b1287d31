// Multi-tensor sum of squares accumulated in float64, written to a device
// scalar with a non-finite flag: no host synchronisation.
// Torch-free: compiles with plain nvcc (CI checks it for sm_90).
#include <math.h>

#include "fgpsdp/cuda_dispatch.cuh"
#include "fgpsdp/kernel_api.h"

namespace fgpsdp {
namespace cuda {
namespace {

__device__ __forceinline__ double block_sum(double v) {
  __shared__ double warp_sums[kThreads / 32];
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  v = threadIdx.x < kThreads / 32 ? warp_sums[threadIdx.x] : 0.0;
  if (warp == 0) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  }
  return v;  // valid in thread 0
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
sq_norm_partials_kernel(TensorTable table, double* partials, int block_base) {
  const int t = table.block_tensor[blockIdx.x];
  const int64_t n = table.numel[t];
  const int64_t begin = static_cast<int64_t>(table.block_chunk[blockIdx.x]) * kChunkElements;
  const int64_t end = begin + kChunkElements < n ? begin + kChunkElements : n;
  const T* data = static_cast<const T*>(table.tensors[t]);
  double acc = 0.0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const double v = to_double(data[i]);
    acc += v * v;
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) partials[block_base + blockIdx.x] = acc;
}

__global__ void __launch_bounds__(kThreads)
sq_norm_finish_kernel(const double* partials, int count, double* out) {
  double acc = 0.0;
  for (int i = threadIdx.x; i < count; i += kThreads) acc += partials[i];
  acc = block_sum(acc);
  if (threadIdx.x == 0) {
    out[0] = acc;
    out[1] = isfinite(acc) ? 0.0 : 1.0;
  }
}

}  // namespace

cudaError_t launch_sq_norm_partials(const TensorTable& table, int blocks, DType dtype,
                                    double* partials, int block_base, cudaStream_t stream) {
  if (blocks <= 0) return cudaSuccess;
  return FGPSDP_DISPATCH_DTYPE(dtype, scalar_t, [&] {
    sq_norm_partials_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(table, partials, block_base);
    return cudaGetLastError();
  });
}

cudaError_t launch_sq_norm_finish(const double* partials, int count, double* out,
                                  cudaStream_t stream) {
  sq_norm_finish_kernel<<<1, kThreads, 0, stream>>>(partials, count, out);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace fgpsdp
