// The torch-free interface between the CUDA launchers (csrc/cuda/launchers.cpp,
// which use torch for checks, streams and allocation) and the kernels
// (csrc/cuda/*.cu, which compile with plain nvcc so CI can check them without
// a GPU or a CUDA build of torch).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace fgpsdp {
namespace cuda {

// Element types the kernels handle; the launcher maps torch dtypes onto them.
enum class DType : int { kFloat32 = 0, kFloat64 = 1, kFloat16 = 2, kBFloat16 = 3 };

// Tensors and blocks per launch: the table travels as a kernel argument
// (< 4 KiB), so many tensors take several launches.
constexpr int kMaxTensorsPerLaunch = 48;
constexpr int kMaxBlocksPerLaunch = 320;
constexpr int kChunkElements = 1 << 14;  // elements one block handles per table entry
constexpr int kThreads = 512;

struct TensorTable {
  void* tensors[kMaxTensorsPerLaunch];       // the many-tensor side
  int64_t numel[kMaxTensorsPerLaunch];
  int64_t flat_offset[kMaxTensorsPerLaunch];  // where each tensor sits in the flat buffer
  int block_tensor[kMaxBlocksPerLaunch];      // table entry of each block
  int block_chunk[kMaxBlocksPerLaunch];       // chunk of that tensor each block handles
};

// pack:   flat[flat_offset[t] + i] = cast(tensors[t][i] * scale)
// unpack: tensors[t][i] = cast(flat[flat_offset[t] + i] * scale)
cudaError_t launch_pack(const TensorTable& table, int blocks, DType tensor_dtype, void* flat,
                        DType flat_dtype, double scale, cudaStream_t stream);
cudaError_t launch_unpack(const TensorTable& table, int blocks, const void* flat,
                          DType flat_dtype, DType tensor_dtype, double scale,
                          cudaStream_t stream);

// Sum of squares in float64: each block adds its partial sum into
// partials[block_base + block]; finish writes {sum, non-finite flag} to out[0..1].
cudaError_t launch_sq_norm_partials(const TensorTable& table, int blocks, DType dtype,
                                    double* partials, int block_base, cudaStream_t stream);
cudaError_t launch_sq_norm_finish(const double* partials, int count, double* out,
                                  cudaStream_t stream);

}  // namespace cuda
}  // namespace fgpsdp
