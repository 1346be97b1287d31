// Declarations of the host entry points bound in csrc/bindings.cpp.
// Each kernel has a CPU version (csrc/cpu/) and, when built with CUDA, a
// device version (csrc/cuda/launchers.cpp + *.cu); the binding checks the
// arguments and dispatches on the device.
#pragma once

#include <vector>

#include <torch/extension.h>

namespace fgpsdp {

#define FGPSDP_DECLARE_KERNELS                                                              \
  /* flat[offsets[i] + j] = cast(tensors[i][j] * scale) */                                  \
  void multi_tensor_pack(const std::vector<at::Tensor>& tensors, const at::Tensor& flat,    \
                         const std::vector<int64_t>& offsets, double scale);               \
  /* tensors[i][j] = cast(flat[offsets[i] + j] * scale) */                                  \
  void multi_tensor_unpack(const at::Tensor& flat, const std::vector<at::Tensor>& tensors,  \
                           const std::vector<int64_t>& offsets, double scale);             \
  /* float64 {sum of squares, 1.0 if that sum is not finite} on the tensors' device */      \
  at::Tensor multi_tensor_sq_norm(const std::vector<at::Tensor>& tensors);

namespace cpu {
FGPSDP_DECLARE_KERNELS
}  // namespace cpu

namespace cuda {
FGPSDP_DECLARE_KERNELS
}  // namespace cuda

}  // namespace fgpsdp
