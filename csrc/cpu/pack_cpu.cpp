// Multi-tensor pack/unpack with scale and dtype cast on CPU (OpenMP through
// at::parallel_for): the CPU twin of csrc/cuda/pack_unpack.cu.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "fgpsdp/kernels.h"

namespace fgpsdp {
namespace cpu {
namespace {

constexpr int64_t kGrain = 1 << 16;

// One contiguous run: dst[i] = Dst(Src(src[i]) * scale), in the wider of the two types.
template <typename Src, typename Dst>
void copy_scale(const Src* src, Dst* dst, int64_t n, double scale) {
  using Compute = std::conditional_t<std::is_same_v<Src, double> || std::is_same_v<Dst, double>,
                                     double, float>;
  const Compute s = static_cast<Compute>(scale);
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      dst[i] = static_cast<Dst>(static_cast<Compute>(src[i]) * s);
    }
  });
}

template <bool kToFlat>
void run(const std::vector<at::Tensor>& tensors, const at::Tensor& flat,
         const std::vector<int64_t>& offsets, double scale) {
  for (size_t t = 0; t < tensors.size(); ++t) {
    const auto& tensor = tensors[t];
    const int64_t n = tensor.numel();
    if (n == 0) continue;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, tensor.scalar_type(), "pack_tensor", [&] {
      using tensor_t = scalar_t;
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, flat.scalar_type(), "pack_flat", [&] {
        using flat_t = scalar_t;
        flat_t* flat_ptr = const_cast<flat_t*>(flat.const_data_ptr<flat_t>()) + offsets[t];
        tensor_t* tensor_ptr = const_cast<tensor_t*>(tensor.const_data_ptr<tensor_t>());
        if (kToFlat) {
          copy_scale<tensor_t, flat_t>(tensor_ptr, flat_ptr, n, scale);
        } else {
          copy_scale<flat_t, tensor_t>(flat_ptr, tensor_ptr, n, scale);
        }
      });
    });
  }
}

}  // namespace

void multi_tensor_pack(const std::vector<at::Tensor>& tensors, const at::Tensor& flat,
                       const std::vector<int64_t>& offsets, double scale) {
  run<true>(tensors, flat, offsets, scale);
}

void multi_tensor_unpack(const at::Tensor& flat, const std::vector<at::Tensor>& tensors,
                         const std::vector<int64_t>& offsets, double scale) {
  run<false>(tensors, flat, offsets, scale);
}

}  // namespace cpu
}  // namespace fgpsdp
