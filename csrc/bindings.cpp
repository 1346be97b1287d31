// The one binding file of fgpsdp_runtime._C: argument checks and device
// dispatch live here, kernels in csrc/cpu and csrc/cuda.
#include <torch/extension.h>

#include "fgpsdp/kernels.h"

namespace fgpsdp {

void check_tensor_list(const std::vector<at::Tensor>& tensors, const char* what) {
  if (tensors.empty()) return;
  const auto device = tensors.front().device();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    TORCH_CHECK(t.device() == device, what, ": tensor ", i, " is on ", t.device(),
                ", tensor 0 on ", device);
    TORCH_CHECK(t.is_contiguous(), what, ": tensor ", i, " is not contiguous");
    TORCH_CHECK(!t.is_sparse(), what, ": tensor ", i, " is sparse");
    const auto st = t.scalar_type();
    TORCH_CHECK(st == at::kFloat || st == at::kDouble || st == at::kHalf || st == at::kBFloat16,
                what, ": tensor ", i, " has unsupported dtype ", st);
  }
}

at::Tensor multi_tensor_sq_norm(const std::vector<at::Tensor>& tensors) {
  check_tensor_list(tensors, "multi_tensor_sq_norm");
  if (tensors.empty() || tensors.front().device().is_cpu()) {
    return cpu::multi_tensor_sq_norm(tensors);
  }
  TORCH_CHECK(false, "multi_tensor_sq_norm: no kernel for device ", tensors.front().device(),
              " in this build");
}

}  // namespace fgpsdp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fgpsdp_runtime kernels";
  m.def("multi_tensor_sq_norm", &fgpsdp::multi_tensor_sq_norm,
        "Sum of squares (float64) and non-finite flag of many tensors -> float64[2]");
}
