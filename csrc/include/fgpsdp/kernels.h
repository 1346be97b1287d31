// Declarations of the host entry points bound in csrc/bindings.cpp.
// Each kernel has a CPU version (csrc/cpu/) and, when built with CUDA, a
// device version (csrc/cuda/); the entry point dispatches on the device.
#pragma once

#include <vector>

#include <torch/extension.h>

namespace fgpsdp {

// Sum of squares of every element of `tensors`, accumulated in float64, and a
// flag that is 1.0 when that sum is not finite (an inf or NaN in the input).
// Returns a float64 tensor of shape [2] on the tensors' device: {sum, flag}.
at::Tensor multi_tensor_sq_norm(const std::vector<at::Tensor>& tensors);

namespace cpu {
at::Tensor multi_tensor_sq_norm(const std::vector<at::Tensor>& tensors);
}  // namespace cpu

// Shared argument checks: same device, contiguous, supported dtype.
void check_tensor_list(const std::vector<at::Tensor>& tensors, const char* what);

}  // namespace fgpsdp
