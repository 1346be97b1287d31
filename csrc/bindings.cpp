// The one binding file of fgpsdp_runtime._C: argument checks and device
// dispatch live here, kernels in csrc/cpu and csrc/cuda.
#include <torch/extension.h>

#include "fgpsdp/kernels.h"
#include "fgpsdp/shm_barrier.h"

namespace fgpsdp {
namespace {

bool supported(at::ScalarType st) {
  return st == at::kFloat || st == at::kDouble || st == at::kHalf || st == at::kBFloat16;
}

void check_tensor(const at::Tensor& t, const at::Device& device, const char* what, int64_t i) {
  TORCH_CHECK(t.device() == device, what, ": tensor ", i, " is on ", t.device(), ", expected ",
              device);
  TORCH_CHECK(!t.is_sparse(), what, ": tensor ", i, " is sparse");
  TORCH_CHECK(t.is_contiguous(), what, ": tensor ", i, " is not contiguous");
  TORCH_CHECK(supported(t.scalar_type()), what, ": tensor ", i, " has unsupported dtype ",
              t.scalar_type());
}

void check_list(const std::vector<at::Tensor>& tensors, const at::Device& device, const char* what) {
  for (size_t i = 0; i < tensors.size(); ++i) check_tensor(tensors[i], device, what, i);
}

void check_flat(const std::vector<at::Tensor>& tensors, const at::Tensor& flat,
                const std::vector<int64_t>& offsets, const char* what) {
  TORCH_CHECK(flat.is_contiguous(), what, ": the flat buffer is not contiguous");
  TORCH_CHECK(supported(flat.scalar_type()), what, ": the flat buffer has unsupported dtype ",
              flat.scalar_type());
  TORCH_CHECK(offsets.size() == tensors.size(), what, ": ", tensors.size(), " tensors but ",
              offsets.size(), " offsets");
  check_list(tensors, flat.device(), what);
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(offsets[i] >= 0 && offsets[i] + tensors[i].numel() <= flat.numel(), what,
                ": tensor ", i, " (", tensors[i].numel(), " elements at offset ", offsets[i],
                ") does not fit in the flat buffer of ", flat.numel());
  }
}

[[noreturn]] void no_cuda(const char* what) {
  TORCH_CHECK(false, what, ": this build of fgpsdp_runtime._C has no CUDA kernels "
              "(rebuild with torch+CUDA and nvcc, without FGPSDP_SKIP_CUDA)");
}

}  // namespace

void multi_tensor_pack(const std::vector<at::Tensor>& tensors, const at::Tensor& flat,
                       const std::vector<int64_t>& offsets, double scale) {
  check_flat(tensors, flat, offsets, "multi_tensor_pack");
  if (flat.device().is_cpu()) return cpu::multi_tensor_pack(tensors, flat, offsets, scale);
#ifdef FGPSDP_WITH_CUDA
  if (flat.device().is_cuda()) return cuda::multi_tensor_pack(tensors, flat, offsets, scale);
#endif
  no_cuda("multi_tensor_pack");
}

void multi_tensor_unpack(const at::Tensor& flat, const std::vector<at::Tensor>& tensors,
                         const std::vector<int64_t>& offsets, double scale) {
  check_flat(tensors, flat, offsets, "multi_tensor_unpack");
  if (flat.device().is_cpu()) return cpu::multi_tensor_unpack(flat, tensors, offsets, scale);
#ifdef FGPSDP_WITH_CUDA
  if (flat.device().is_cuda()) return cuda::multi_tensor_unpack(flat, tensors, offsets, scale);
#endif
  no_cuda("multi_tensor_unpack");
}

at::Tensor multi_tensor_sq_norm(const std::vector<at::Tensor>& tensors) {
  if (tensors.empty()) return at::zeros({2}, at::TensorOptions().dtype(at::kDouble));
  check_list(tensors, tensors.front().device(), "multi_tensor_sq_norm");
  if (tensors.front().device().is_cpu()) return cpu::multi_tensor_sq_norm(tensors);
#ifdef FGPSDP_WITH_CUDA
  if (tensors.front().device().is_cuda()) return cuda::multi_tensor_sq_norm(tensors);
#endif
  no_cuda("multi_tensor_sq_norm");
}

bool has_cuda_kernels() {
#ifdef FGPSDP_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace fgpsdp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fgpsdp_runtime kernels (CPU always, CUDA when built with it)";
  m.def("multi_tensor_pack", &fgpsdp::multi_tensor_pack,
        "flat[offsets[i] + j] = cast(tensors[i][j] * scale), one pass");
  m.def("multi_tensor_unpack", &fgpsdp::multi_tensor_unpack,
        "tensors[i][j] = cast(flat[offsets[i] + j] * scale), one pass");
  m.def("multi_tensor_sq_norm", &fgpsdp::multi_tensor_sq_norm,
        "float64 [sum of squares, non-finite flag] of many tensors, on their device");
  m.def("has_cuda_kernels", &fgpsdp::has_cuda_kernels);
  m.def("shm_barrier_supported", &fgpsdp::cpu::shm_barrier_supported);
  // It may wait for as long as the group's timeout: the GIL is let go meanwhile.
  m.def("shm_barrier_wait", &fgpsdp::cpu::shm_barrier_wait,
        py::call_guard<py::gil_scoped_release>(),
        "publish an arrival and wait for every rank's; 0 passed, else why not");
}
