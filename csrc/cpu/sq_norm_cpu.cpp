// Multi-tensor sum of squares on CPU, float64 accumulation.
//
// Why not torch.linalg.vector_norm: on CPU it accumulates fp32 input in fp32,
// which is off by ~1e-5 relative at 1M elements; clipping must give the same
// coefficient on every rank and match a float64 reference.
//
// Summation order. Every code path below adds in exactly this order, so the
// result depends only on the input, never on the thread count, timing or the
// CPU's ISA:
//   * each tensor is cut into chunks of kGrain elements (the last may be
//     shorter), whatever the thread count; threads share out whole chunks;
//   * within a chunk [b, e), lane l (0 <= l < kLanes) accumulates
//     x[b + kLanes*k + l]^2 for k = 0, 1, ... over its full blocks of kLanes
//     elements, and the last (e - b) % kLanes elements are added in order into
//     `tail`; the lanes are folded pairwise (lane l += lane l + w, w = kLanes/2,
//     ..., 1) and `tail` is added last;
//   * the chunks' sums are added in chunk order, then the tensors' in list order.
// The thread count must not matter: a speculative step measures its bucket's
// norm on the scheduler thread, which keeps the intra-op thread count it started
// with, while the loop's thread may have changed its own since
// (torch.set_num_threads); splitting by thread count made the two differ in the
// last bits, and with them the clip coefficient of two_stage from serial's.
// For float, half and bfloat16 input the square of the value widened to double
// is exact (at most 48 significant bits), so an FMA (AVX2 path) and a separate
// multiply and add (generic path) round identically. float64 input always takes
// the generic path.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "fgpsdp/kernels.h"

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(FGPSDP_NO_X86_SIMD)
#define FGPSDP_SQ_NORM_AVX2 1
#include <immintrin.h>
#endif

namespace fgpsdp {
namespace cpu {
namespace {

constexpr int64_t kGrain = 1 << 15;  // elements per task: big enough to amortise a task
constexpr int kLanes = 32;           // independent float64 accumulators (8 AVX2 vectors)

inline double widen(float v) { return v; }
inline double widen(double v) { return v; }
inline double widen(c10::Half v) { return static_cast<float>(v); }
inline double widen(c10::BFloat16 v) { return static_cast<float>(v); }

inline double fold_lanes(double* acc, double tail) {
  for (int w = kLanes / 2; w >= 1; w /= 2) {
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  }
  return acc[0] + tail;
}

template <typename T>
double sum_squares_generic(const T* x, int64_t n) {
  double acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const double v = widen(x[i + l]);
      acc[l] += v * v;
    }
  }
  double tail = 0.0;
  for (; i < n; ++i) {
    const double v = widen(x[i]);
    tail += v * v;
  }
  return fold_lanes(acc, tail);
}

#ifdef FGPSDP_SQ_NORM_AVX2
#define FGPSDP_AVX2 __attribute__((target("avx2,fma,f16c")))

// Four elements widened to float (exact for all three types).
FGPSDP_AVX2 inline __m128 load4(const float* p) { return _mm_loadu_ps(p); }
FGPSDP_AVX2 inline __m128 load4(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(bits), 16));
}
FGPSDP_AVX2 inline __m128 load4(const c10::Half* p) {
  return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

template <typename T>
FGPSDP_AVX2 inline void accumulate_block(const T* p, __m256d* acc) {
  for (int v = 0; v < kLanes / 4; ++v) {
    const __m256d d = _mm256_cvtps_pd(load4(p + 4 * v));
    acc[v] = _mm256_fmadd_pd(d, d, acc[v]);  // lanes 4v .. 4v+3
  }
}

template <typename T>
FGPSDP_AVX2 double sum_squares_avx2(const T* x, int64_t n, int64_t readable) {
  // Software prefetch this far ahead (the hardware prefetcher alone leaves
  // ~10% of single-thread bandwidth unused), only inside [x, x + readable):
  // the rest of the tensor, past this chunk's n elements, so that each chunk's
  // end is prefetched too.
  constexpr int64_t kAheadBytes = 16 << 10;
  constexpr int64_t kAhead = kAheadBytes / static_cast<int64_t>(sizeof(T));
  constexpr int kBlockBytes = kLanes * static_cast<int>(sizeof(T));
  __m256d acc[kLanes / 4];
  for (auto& a : acc) a = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + kLanes <= n && i + kLanes + kAhead <= readable; i += kLanes) {
    const char* ahead = reinterpret_cast<const char*>(x + i + kAhead);
    for (int b = 0; b < kBlockBytes; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
    accumulate_block(x + i, acc);
  }
  for (; i + kLanes <= n; i += kLanes) accumulate_block(x + i, acc);
  alignas(32) double lanes[kLanes];
  for (int v = 0; v < kLanes / 4; ++v) _mm256_store_pd(lanes + 4 * v, acc[v]);
  double tail = 0.0;
  for (; i < n; ++i) {
    const double v = widen(x[i]);
    tail += v * v;
  }
  return fold_lanes(lanes, tail);
}

bool have_avx2() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }();
  return ok;
}
#endif  // FGPSDP_SQ_NORM_AVX2

// The sum of squares of x[0, n); x[n, readable) may be read ahead (prefetch).
template <typename T>
double sum_squares(const T* x, int64_t n, int64_t readable) {
#ifdef FGPSDP_SQ_NORM_AVX2
  if (have_avx2()) return sum_squares_avx2<T>(x, n, readable);
#endif
  return sum_squares_generic<T>(x, n);
}

// float64 input must not pass through float; it has no SIMD path (an FMA would
// round differently from the generic multiply-add).
template <>
double sum_squares<double>(const double* x, int64_t n, int64_t) {
  return sum_squares_generic<double>(x, n);
}

template <typename T>
double tensor_sum_squares(const at::Tensor& t) {
  const T* data = t.const_data_ptr<T>();
  const int64_t n = t.numel();
  const int64_t chunks = (n + kGrain - 1) / kGrain;
  if (chunks == 1) return 0.0 + sum_squares<T>(data, n, n);  // as below, no task
  std::vector<double> partial(chunks, 0.0);
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t lo = c * kGrain;
      partial[c] = sum_squares<T>(data + lo, std::min(kGrain, n - lo), n - lo);
    }
  });
  double total = 0.0;
  for (const double p : partial) total += p;
  return total;
}

}  // namespace

at::Tensor multi_tensor_sq_norm(const std::vector<at::Tensor>& tensors) {
  double total = 0.0;
  for (const auto& t : tensors) {
    if (t.numel() == 0) continue;
    switch (t.scalar_type()) {
      case at::kFloat: total += tensor_sum_squares<float>(t); break;
      case at::kDouble: total += tensor_sum_squares<double>(t); break;
      case at::kHalf: total += tensor_sum_squares<c10::Half>(t); break;
      case at::kBFloat16: total += tensor_sum_squares<c10::BFloat16>(t); break;
      default: TORCH_CHECK(false, "multi_tensor_sq_norm: unsupported dtype ", t.scalar_type());
    }
  }
  // Squares are non-negative, so an inf or NaN element leaves the sum inf or NaN.
  auto out = at::empty({2}, at::TensorOptions().dtype(at::kDouble));
  auto* o = out.data_ptr<double>();
  o[0] = total;
  o[1] = std::isfinite(total) ? 0.0 : 1.0;
  return out;
}

}  // namespace cpu
}  // namespace fgpsdp
