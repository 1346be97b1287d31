// CUDA launchers: checks are done by the binding; here tensors become kernel
// tables (csrc/include/fgpsdp/kernel_api.h), on the current stream.
// Built only when torch has CUDA and nvcc exists (setup.py).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "fgpsdp/kernel_api.h"
#include "fgpsdp/kernels.h"

namespace fgpsdp {
namespace cuda {
namespace {

DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kDouble: return DType::kFloat64;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: TORCH_CHECK(false, "fgpsdp CUDA kernels: unsupported dtype ", t);
  }
}

void check(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, ": ", cudaGetErrorString(err));
}

// Walks the tensors in tables of at most kMaxTensorsPerLaunch tensors and
// kMaxBlocksPerLaunch chunks, and calls launch(table, blocks, dtype) for each;
// all tensors of one table share a dtype.
template <typename Launch>
void for_each_table(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>* offsets,
                    Launch launch) {
  TensorTable table{};
  int n_tensors = 0, n_blocks = 0;
  at::ScalarType dtype = at::kFloat;
  // Launches what the table holds; a tensor with chunks left moves to slot 0.
  auto launch_and_reset = [&](bool keep_last_tensor) {
    if (n_blocks > 0) launch(table, n_blocks, dtype);
    const int last = n_tensors - 1;
    TensorTable next{};
    if (keep_last_tensor) {
      next.tensors[0] = table.tensors[last];
      next.numel[0] = table.numel[last];
      next.flat_offset[0] = table.flat_offset[last];
    }
    table = next;
    n_tensors = keep_last_tensor ? 1 : 0;
    n_blocks = 0;
  };
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    const int64_t n = t.numel();
    if (n == 0) continue;
    if (n_tensors > 0 && (t.scalar_type() != dtype || n_tensors == kMaxTensorsPerLaunch)) {
      launch_and_reset(false);
    }
    dtype = t.scalar_type();
    int slot = n_tensors++;
    table.tensors[slot] = t.data_ptr();
    table.numel[slot] = n;
    table.flat_offset[slot] = offsets ? (*offsets)[i] : 0;
    const int64_t chunks = (n + kChunkElements - 1) / kChunkElements;
    for (int64_t c = 0; c < chunks; ++c) {
      table.block_tensor[n_blocks] = slot;
      table.block_chunk[n_blocks] = static_cast<int>(c);
      if (++n_blocks == kMaxBlocksPerLaunch) {
        const bool more = c + 1 < chunks;
        launch_and_reset(more);
        slot = 0;
      }
    }
  }
  if (n_blocks > 0) launch(table, n_blocks, dtype);
}

}  // namespace

void multi_tensor_pack(const std::vector<at::Tensor>& tensors, const at::Tensor& flat,
                       const std::vector<int64_t>& offsets, double scale) {
  c10::cuda::CUDAGuard guard(flat.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  for_each_table(tensors, &offsets, [&](const TensorTable& table, int blocks, at::ScalarType dt) {
    check(launch_pack(table, blocks, to_dtype(dt), flat.data_ptr(), to_dtype(flat.scalar_type()),
                      scale, stream),
          "multi_tensor_pack");
  });
}

void multi_tensor_unpack(const at::Tensor& flat, const std::vector<at::Tensor>& tensors,
                         const std::vector<int64_t>& offsets, double scale) {
  c10::cuda::CUDAGuard guard(flat.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  for_each_table(tensors, &offsets, [&](const TensorTable& table, int blocks, at::ScalarType dt) {
    check(launch_unpack(table, blocks, flat.data_ptr(), to_dtype(flat.scalar_type()), to_dtype(dt),
                        scale, stream),
          "multi_tensor_unpack");
  });
}

at::Tensor multi_tensor_sq_norm(const std::vector<at::Tensor>& tensors) {
  const auto device = tensors.front().device();
  c10::cuda::CUDAGuard guard(device);
  auto stream = at::cuda::getCurrentCUDAStream();
  const auto f64 = at::TensorOptions().dtype(at::kDouble).device(device);
  int64_t total_blocks = 0;
  for (const auto& t : tensors) total_blocks += (t.numel() + kChunkElements - 1) / kChunkElements;
  auto partials = at::zeros({std::max<int64_t>(total_blocks, 1)}, f64);
  auto out = at::empty({2}, f64);
  int base = 0;
  for_each_table(tensors, nullptr, [&](const TensorTable& table, int blocks, at::ScalarType dt) {
    check(launch_sq_norm_partials(table, blocks, to_dtype(dt), partials.data_ptr<double>(), base,
                                  stream),
          "multi_tensor_sq_norm");
    base += blocks;
  });
  check(launch_sq_norm_finish(partials.data_ptr<double>(), std::max(base, 1), out.data_ptr<double>(),
                              stream),
        "multi_tensor_sq_norm");
  return out;
}

}  // namespace cuda
}  // namespace fgpsdp
