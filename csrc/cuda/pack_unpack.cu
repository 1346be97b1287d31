// Multi-tensor pack (many tensors -> one flat bucket) and unpack (flat -> many),
// with a scale and a dtype cast, in one launch per table of tensors.
// Torch-free: compiles with plain nvcc (CI checks it for sm_90).
#include "fgpsdp/cuda_dispatch.cuh"
#include "fgpsdp/kernel_api.h"

namespace fgpsdp {
namespace cuda {
namespace {

constexpr int kUnroll = 4;  // independent loads in flight per thread

// Direction-agnostic body: copies chunk `chunk` of table entry `t` between
// tensors[t] and flat[flat_offset[t]...].
template <typename Src, typename Dst, bool kToFlat>
__global__ void __launch_bounds__(kThreads)
copy_scale_kernel(TensorTable table, void* flat, float scale_f, double scale_d) {
  const int t = table.block_tensor[blockIdx.x];
  const int64_t n = table.numel[t];
  const int64_t begin = static_cast<int64_t>(table.block_chunk[blockIdx.x]) * kChunkElements;
  const int64_t end = begin + kChunkElements < n ? begin + kChunkElements : n;
  const Src* src;
  Dst* dst;
  if (kToFlat) {
    src = static_cast<const Src*>(table.tensors[t]);
    dst = static_cast<Dst*>(flat) + table.flat_offset[t];
  } else {
    src = static_cast<const Src*>(flat) + table.flat_offset[t];
    dst = static_cast<Dst*>(table.tensors[t]);
  }
  for (int64_t base = begin + threadIdx.x; base < end; base += kThreads * kUnroll) {
    Src v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * kThreads;
      if (i < end) v[u] = src[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * kThreads;
      if (i < end) dst[i] = scale_cast<Dst, Src>(v[u], scale_f, scale_d);
    }
  }
}

template <bool kToFlat>
cudaError_t launch(const TensorTable& table, int blocks, DType src_dtype, DType dst_dtype,
                   void* flat, double scale, cudaStream_t stream) {
  if (blocks <= 0) return cudaSuccess;
  return FGPSDP_DISPATCH_DTYPE(src_dtype, src_t, [&] {
    return FGPSDP_DISPATCH_DTYPE(dst_dtype, dst_t, [&] {
      copy_scale_kernel<src_t, dst_t, kToFlat><<<blocks, kThreads, 0, stream>>>(
          table, flat, static_cast<float>(scale), scale);
      return cudaGetLastError();
    });
  });
}

}  // namespace

cudaError_t launch_pack(const TensorTable& table, int blocks, DType tensor_dtype, void* flat,
                        DType flat_dtype, double scale, cudaStream_t stream) {
  return launch<true>(table, blocks, tensor_dtype, flat_dtype, flat, scale, stream);
}

cudaError_t launch_unpack(const TensorTable& table, int blocks, const void* flat,
                          DType flat_dtype, DType tensor_dtype, double scale,
                          cudaStream_t stream) {
  return launch<false>(table, blocks, flat_dtype, tensor_dtype, const_cast<void*>(flat), scale,
                       stream);
}

}  // namespace cuda
}  // namespace fgpsdp
