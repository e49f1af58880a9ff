// CPU kernels for the engine's hot path: paged attention straight from the block tables (decode
// and prefill rows alike), the KV-cache store, the fused elementwise ops around the matmuls (residual
// add + RMSNorm, rotary, SwiGLU) and the fused mixture-of-experts layer. Built on first use by
// kernels/cpu_build.py with ATen's SIMD types (at::vec::Vectorized) for the CPU capability torch
// reports, threaded with at::parallel_for, or through kernels/cpu_quant.cpp's helper pool once
// use_pool hands its address here (cpu_build does when both libraries are loaded).
//
// Every op rounds where transformers' eager 16-bit code rounds (kernels/reference.py is the
// oracle): float math inside, one rounding to the storage dtype at each point the reference
// materializes a tensor.
//
// Cache layout (kernels/cpu_ops.py allocates it; the logical view is the reference's
// [num_blocks, block_size, num_kv_heads, head_dim]):
//   key   [num_kv_heads, num_blocks, head_dim, block_size]  a block's keys transposed, so one
//         head dimension of block_size keys is a contiguous vector: q.k for a whole block is
//         head_dim broadcast-FMAs, no horizontal sums
//   value [num_kv_heads, num_blocks, block_size, head_dim]  a key's value row is contiguous
// The cache's elements are the model's dtype, or fp8 e4m3 (kv_cache_dtype "fp8"): x / scale
// saturated to +-448 when stored, e4m3 * scale when read, converted in the attention's inner loops
// (no dequantized copy of the cache), with one float scale per tensor (k_scale, v_scale).

// ATen's tensor and the few ops used, not <torch/extension.h>: an engine's first start compiles
// this file, and all of libtorch's C++ API is header parsing it does not need.
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 and its at::Tensor caster
#include <ATen/core/dispatch/Dispatcher.h>  // DecoderLayers: oneDNN's packed linear, called boxed
#include <ATen/core/stack.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>  // at::native::cpublas::brgemm: oneDNN's microkernel (the fused MoE)
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#ifdef __linux__
#include <sched.h>  // sched_setaffinity: set_thread_cpus
#endif
#include <tuple>
#include <vector>

namespace {

using fVec = at::vec::Vectorized<float>;
using fp8 = c10::Float8_e4m3fn;
constexpr int64_t kF = fVec::size();
constexpr float kFp8Max = 448.f;  // the largest finite e4m3 value

// kernels/cpu_quant.cpp's pool_parallel_for (its helper pool, whose caller never waits for a helper
// that has not arrived; at::parallel_for while it has no helpers), or null before use_pool.
using PoolFn = void (*)(int64_t, int64_t, int64_t, void (*)(const void*, int64_t, int64_t), const void*);
using HelpersFn = int64_t (*)();
std::atomic<PoolFn> g_pool{nullptr};
std::atomic<HelpersFn> g_pool_helpers{nullptr};

// The threads a loop may run on: torch's, and the pool's helpers.
int64_t loop_threads() {
  const HelpersFn helpers = g_pool_helpers.load(std::memory_order_acquire);
  return at::get_num_threads() + (helpers ? helpers() : 0);
}

template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const PoolFn pool = g_pool.load(std::memory_order_acquire);
  if (pool == nullptr) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  pool(begin, end, grain, [](const void* context, int64_t b, int64_t e) { (*static_cast<const F*>(context))(b, e); },
       &f);
}

// n <= kF e4m3 elements as floats, exactly (lanes past n are zero). An e4m3 byte's magnitude bits
// moved down one place, under the sign bit, are a float16 of the same mantissa whose exponent bias
// is 15 instead of 7: the hardware's float16 -> float32 conversion (subnormals included, which come
// out as normal floats) and one multiply by 2^8 give the value. NaN (0x7f, 0xff) reads as +-480:
// stores saturate at +-448, so only a NaN the model made is stored as one.
inline fVec load_fp8(const uint8_t* p, int64_t n) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m128i bytes = n == kF ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))
                                : _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << n) - 1), p);
  const __m256i x = _mm256_cvtepu8_epi16(bytes);
  const __m256i half = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(x, 7), _mm256_set1_epi16(0x3f80)),
                                       _mm256_and_si256(_mm256_slli_epi16(x, 8), _mm256_set1_epi16(-0x8000)));
  return fVec(_mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.f)));
#elif defined(CPU_CAPABILITY_AVX2)
  int64_t eight = 0;
  std::memcpy(&eight, p, n);
  const __m128i x = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(eight));
  const __m128i half = _mm_or_si128(_mm_and_si128(_mm_slli_epi16(x, 7), _mm_set1_epi16(0x3f80)),
                                    _mm_and_si128(_mm_slli_epi16(x, 8), _mm_set1_epi16(-0x8000)));
  return fVec(_mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.f)));
#else
  float buf[kF] = {};
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(fp8(p[i], fp8::from_bits()));
  return fVec::loadu(buf);
#endif
}

// n <= kF elements of T as floats (lanes past n are zero).
template <typename T>
inline fVec load_f(const T* p, int64_t n = kF) {
  if constexpr (std::is_same_v<T, float>) {
    return fVec::loadu(p, n);
  } else if constexpr (std::is_same_v<T, fp8>) {
    return load_fp8(reinterpret_cast<const uint8_t*>(p), n);
  } else {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    // A whole vector's worth of 16-bit values, widened in registers: Vectorized<T>::loadu(p, n)
    // holds twice kF elements, so a count of kF took its partial-load path (a copy through a
    // buffer), which made a bfloat16 cache under a float32 model slower than a float32 one.
    if (n == kF) {
      using Half16 = std::conditional_t<kF == 16, __m256i, __m128i>;
      Half16 raw;
      std::memcpy(&raw, p, sizeof(raw));
#if defined(CPU_CAPABILITY_AVX512)
      if constexpr (std::is_same_v<T, c10::BFloat16>) return fVec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
      else return fVec(_mm512_cvtph_ps(raw));
#else
      if constexpr (std::is_same_v<T, c10::BFloat16>) return fVec(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)));
      else return fVec(_mm256_cvtph_ps(raw));
#endif
    }
#endif
    auto v = at::vec::Vectorized<T>::loadu(p, n);
    return std::get<0>(at::vec::convert_to_float<T>(v));
  }
}

// Round to T (nearest even, as torch's casts) and store the first n lanes.
template <typename T>
inline void store_f(T* p, const fVec& v, int64_t n = kF) {
  if constexpr (std::is_same_v<T, float>) {
    v.store(p, n);
  } else {
    at::vec::convert_from_float<T>(v, v).store(p, n);
  }
}

// Pairs of float vectors: a 16-bit vector holds 2 * kF lanes, and converting both halves at once
// costs what converting one does, so the elementwise ops walk their rows 2 * kF at a time.
constexpr int64_t kP = 2 * kF;

// n <= kP elements of T as two float vectors (lanes past n are zero).
template <typename T>
inline void load2(const T* p, int64_t n, fVec& lo, fVec& hi) {
  if constexpr (std::is_same_v<T, float>) {
    lo = fVec::loadu(p, std::min(n, kF));
    hi = n > kF ? fVec::loadu(p + kF, n - kF) : fVec(0.f);
  } else {
    std::tie(lo, hi) = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p, n));
  }
}

template <typename T>
inline void store2(T* p, const fVec& lo, const fVec& hi, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    lo.store(p, std::min(n, kF));
    if (n > kF) hi.store(p + kF, n - kF);
  } else {
    at::vec::convert_from_float<T>(lo, hi).store(p, n);
  }
}

// Both vectors rounded to T and back: where the reference materializes a 16-bit intermediate.
template <typename T>
inline void round2(fVec& lo, fVec& hi) {
  if constexpr (!std::is_same_v<T, float>) {
    std::tie(lo, hi) = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(lo, hi));
  }
}

// exp for an op whose result is rounded to T: Sleef's 1-ulp exp for float32 (what torch's own
// kernels use), ATen's faster polynomial (about 2 ulp of float) where the result becomes 16-bit.
template <typename T>
inline fVec exp_for(const fVec& x) {
  if constexpr (std::is_same_v<T, float>) {
    return x.exp();
  } else {
    return x.exp_u20();
  }
}

#define PW_DISPATCH(dtype, NAME, ...)                                                       \
  [&] {                                                                                     \
    switch (dtype) {                                                                        \
      case at::kFloat: { using scalar_t = float; return __VA_ARGS__(); }                    \
      case at::kBFloat16: { using scalar_t = c10::BFloat16; return __VA_ARGS__(); }         \
      case at::kHalf: { using scalar_t = c10::Half; return __VA_ARGS__(); }                 \
      default: TORCH_CHECK(false, NAME, ": dtype ", dtype, " is not float32/bfloat16/float16"); \
    }                                                                                       \
  }()

// ---- RMSNorm, optionally after the residual add -----------------------------------------------

// out = weight * norm(x + residual) and new_residual = x + residual (rounded to T first, as the
// reference adds in T); without residual, out = weight * norm(x).
template <typename T>
void rms_norm_impl(const T* x, const T* res, const T* w, T* out, T* sum_out, int64_t rows, int64_t dim,
                   float eps) {
  parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(dim + kP);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * dim;
      fVec acc(0.f);
      for (int64_t d = 0; d < dim; d += kP) {
        const int64_t n = std::min(kP, dim - d);
        fVec lo, hi;
        load2(xr + d, n, lo, hi);
        if (res != nullptr) {
          fVec rlo, rhi;
          load2(res + r * dim + d, n, rlo, rhi);
          lo = lo + rlo;
          hi = hi + rhi;
          round2<T>(lo, hi);
          store2(sum_out + r * dim + d, lo, hi, n);
        }
        lo.store(buf.data() + d);
        hi.store(buf.data() + d + kF);  // lanes past n are zero: the sum of squares is unchanged
        acc = at::vec::fmadd(lo, lo, at::vec::fmadd(hi, hi, acc));
      }
      const fVec inv(1.f / std::sqrt(acc.reduce_add() / static_cast<float>(dim) + eps));
      for (int64_t d = 0; d < dim; d += kP) {
        const int64_t n = std::min(kP, dim - d);
        // transformers: weight * (x * inv).to(dtype), the product rounded again.
        fVec lo = fVec::loadu(buf.data() + d) * inv, hi = fVec::loadu(buf.data() + d + kF) * inv;
        round2<T>(lo, hi);
        fVec wlo, whi;
        load2(w + d, n, wlo, whi);
        store2(out + r * dim + d, lo * wlo, hi * whi, n);
      }
    }
  });
}

std::vector<at::Tensor> rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight,
                                    double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "rms_norm: x and weight must be contiguous");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight dtypes differ");
  int64_t dim = x.size(-1), rows = x.numel() / dim;
  auto out = at::empty_like(x);
  at::Tensor sum;
  if (residual.has_value()) {
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes() &&
                residual->scalar_type() == x.scalar_type(), "rms_norm: residual must match x");
    sum = at::empty_like(x);
  }
  PW_DISPATCH(x.scalar_type(), "rms_norm", [&] {
    rms_norm_impl<scalar_t>(x.data_ptr<scalar_t>(), residual ? residual->data_ptr<scalar_t>() : nullptr,
                            weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            residual ? sum.data_ptr<scalar_t>() : nullptr, rows, dim, static_cast<float>(eps));
  });
  if (residual.has_value()) return {out, sum};
  return {out};
}

// ---- rotary, in place ---------------------------------------------------------------------------

// x [tokens, heads, head_dim] (rows may be strided, a head's dims contiguous), cos/sin
// [tokens, head_dim / 2] in T: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s), each product and the sum
// rounded to T as transformers' eager `q * cos + rotate_half(q) * sin` rounds them.
template <typename T>
void rotary_impl(T* x, const T* cos, const T* sin, int64_t tokens, int64_t heads, int64_t half,
                 int64_t token_stride, int64_t head_stride) {
  parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * half;
      const T* s = sin + t * half;
      for (int64_t d = 0; d < half; d += kP) {
        const int64_t n = std::min(kP, half - d);
        fVec clo, chi, slo, shi;
        load2(c + d, n, clo, chi);
        load2(s + d, n, slo, shi);
        for (int64_t h = 0; h < heads; ++h) {
          T* x1 = x + t * token_stride + h * head_stride + d;
          T* x2 = x1 + half;
          fVec alo, ahi, blo, bhi;
          load2(x1, n, alo, ahi);
          load2(x2, n, blo, bhi);
          fVec ac_lo = alo * clo, ac_hi = ahi * chi, bs_lo = blo * slo, bs_hi = bhi * shi;
          fVec bc_lo = blo * clo, bc_hi = bhi * chi, as_lo = alo * slo, as_hi = ahi * shi;
          round2<T>(ac_lo, ac_hi);
          round2<T>(bs_lo, bs_hi);
          round2<T>(bc_lo, bc_hi);
          round2<T>(as_lo, as_hi);
          store2(x1, ac_lo - bs_lo, ac_hi - bs_hi, n);
          store2(x2, bc_lo + as_lo, bc_hi + as_hi, n);
        }
      }
    }
  });
}

void rotary_(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary_: x must be [tokens, heads, head_dim], head dims contiguous");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == x.scalar_type() &&
              sin.scalar_type() == x.scalar_type(), "rotary_: cos/sin must be contiguous, in x's dtype");
  int64_t half = x.size(2) / 2;
  TORCH_CHECK(cos.numel() == x.size(0) * half && sin.numel() == cos.numel(), "rotary_: cos/sin must be [tokens, head_dim/2]");
  PW_DISPATCH(x.scalar_type(), "rotary_", [&] {
    rotary_impl<scalar_t>(x.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), x.size(0),
                          x.size(1), half, x.stride(0), x.stride(1));
  });
}

// ---- SwiGLU ----------------------------------------------------------------------------------

// x [tokens, 2 * inter] = [gate | up] -> silu(gate) * up, silu rounded to T before the product.
at::Tensor silu_and_mul(at::Tensor x) {
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2 && x.size(1) % 2 == 0, "silu_and_mul: x must be contiguous [tokens, 2 * inter]");
  int64_t tokens = x.size(0), inter = x.size(1) / 2;
  auto out = at::empty({tokens, inter}, x.options());
  PW_DISPATCH(x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* in = x.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
      const fVec one(1.f);
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* g = in + t * 2 * inter;
        const scalar_t* u = g + inter;
        for (int64_t d = 0; d < inter; d += kP) {
          const int64_t n = std::min(kP, inter - d);
          fVec glo, ghi, ulo, uhi;
          load2(g + d, n, glo, ghi);
          load2(u + d, n, ulo, uhi);
          fVec alo = glo / (one + exp_for<scalar_t>(glo.neg())), ahi = ghi / (one + exp_for<scalar_t>(ghi.neg()));
          round2<scalar_t>(alo, ahi);
          store2(o + t * inter + d, alo * ulo, ahi * uhi, n);
        }
      }
    });
  });
  return out;
}

// ---- KV cache store ------------------------------------------------------------------------------

// x / scale in float, saturated, rounded to e4m3 (as kernels/reference.py's quantize_kv: a true
// division, as torch's; std::clamp passes NaN through).
inline fp8 to_fp8(float x, float scale) {
  return fp8(std::clamp(x / scale, -kFp8Max, kFp8Max));
}

// key/value [tokens, kv_heads, head_dim] in T into a cache of C (T itself, or fp8 divided by the
// tensor's scale); slot -1 = padding, skipped.
template <typename T, typename C>
void write_kv_impl(const T* key, const T* value, C* kc, C* vc, const int64_t* slots, int64_t tokens, int64_t heads,
                   int64_t dim, int64_t num_blocks, int64_t bs, int64_t key_stride, int64_t value_stride,
                   float k_scale, float v_scale) {
  parallel_for(0, tokens, 32, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      int64_t slot = slots[t];
      if (slot < 0) continue;
      int64_t block = slot / bs, off = slot % bs;
      for (int64_t h = 0; h < heads; ++h) {
        const T* k = key + t * key_stride + h * dim;
        const T* v = value + t * value_stride + h * dim;
        C* kb = kc + ((h * num_blocks + block) * dim) * bs + off;
        C* vb = vc + ((h * num_blocks + block) * bs + off) * dim;
        if constexpr (std::is_same_v<T, C>) {
          for (int64_t d = 0; d < dim; ++d) kb[d * bs] = k[d];
          std::copy(v, v + dim, vb);
        } else if constexpr (!std::is_same_v<C, fp8>) {  // a 16-bit cache under float32: rounded to nearest even
          for (int64_t d = 0; d < dim; ++d) kb[d * bs] = static_cast<C>(static_cast<float>(k[d]));
          for (int64_t d = 0; d < dim; ++d) vb[d] = static_cast<C>(static_cast<float>(v[d]));
        } else {
          for (int64_t d = 0; d < dim; ++d) kb[d * bs] = to_fp8(static_cast<float>(k[d]), k_scale);
          for (int64_t d = 0; d < dim; ++d) vb[d] = to_fp8(static_cast<float>(v[d]), v_scale);
        }
      }
    }
  });
}

// A bfloat16 / float16 cache under float32 activations (kernels/cpu_ops.py narrow_cache): written
// rounded, read widened, as an fp8 cache is.
inline bool narrow_cache(at::ScalarType activations, at::ScalarType cache) {
  return activations == at::kFloat && (cache == at::kBFloat16 || cache == at::kHalf);
}

void write_kv(at::Tensor key, at::Tensor value, at::Tensor k_cache, at::Tensor v_cache,
              at::Tensor slot_mapping, double k_scale, double v_scale) {
  // k_cache [kv_heads, num_blocks, head_dim, block_size], v_cache [kv_heads, num_blocks, block_size, head_dim]
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "write_kv: caches must be the physical tensors");
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 &&
              value.stride(1) == value.size(2), "write_kv: key/value heads must be contiguous rows");
  const bool quantize = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  const bool narrow = narrow_cache(key.scalar_type(), k_cache.scalar_type());
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && value.scalar_type() == key.scalar_type() &&
              (quantize || narrow || key.scalar_type() == k_cache.scalar_type()),
              "write_kv: key/value dtype must match the cache's (or the cache be fp8 e4m3, or 16-bit under float32)");
  TORCH_CHECK(k_scale > 0 && v_scale > 0, "write_kv: k_scale and v_scale must be positive");
  auto slots = slot_mapping.to(at::kLong).contiguous();
  int64_t heads = k_cache.size(0), num_blocks = k_cache.size(1), dim = k_cache.size(2), bs = k_cache.size(3);
  TORCH_CHECK(key.size(1) == heads && key.size(2) == dim, "write_kv: key shape does not match the cache");
  int64_t total = num_blocks * bs;
  // A loop, not slots.max(): an ATen reduction and .item() cost microseconds, on every layer of a step.
  const int64_t* slot = slots.data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(slot, slot + slots.numel(), [&](int64_t s) { return s < total; }),
              "write_kv: slot outside the cache");
  if (narrow) {  // float32 keys and values; the cache bfloat16 or float16
    PW_DISPATCH(k_cache.scalar_type(), "write_kv", [&] {
      write_kv_impl<float, scalar_t>(key.data_ptr<float>(), value.data_ptr<float>(), k_cache.data_ptr<scalar_t>(),
                                     v_cache.data_ptr<scalar_t>(), slots.data_ptr<int64_t>(), key.size(0), heads,
                                     dim, num_blocks, bs, key.stride(0), value.stride(0), 1.f, 1.f);
    });
    return;
  }
  PW_DISPATCH(key.scalar_type(), "write_kv", [&] {
    if (quantize) {
      write_kv_impl<scalar_t, fp8>(key.data_ptr<scalar_t>(), value.data_ptr<scalar_t>(), k_cache.data_ptr<fp8>(),
                                   v_cache.data_ptr<fp8>(), slots.data_ptr<int64_t>(), key.size(0), heads, dim,
                                   num_blocks, bs, key.stride(0), value.stride(0), static_cast<float>(k_scale),
                                   static_cast<float>(v_scale));
    } else {
      write_kv_impl<scalar_t, scalar_t>(key.data_ptr<scalar_t>(), value.data_ptr<scalar_t>(),
                                        k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                                        slots.data_ptr<int64_t>(), key.size(0), heads, dim, num_blocks, bs,
                                        key.stride(0), value.stride(0), 1.f, 1.f);
    }
  });
}

// ---- paged attention ---------------------------------------------------------------------------

// Ask for a block's cache lines before they are needed: the blocks of a sequence are scattered
// over the cache, so the hardware prefetcher cannot guess the next one, and a decode step streams
// every layer's keys and values from memory (measured: 2x slower without, 30 layers' caches).
// Blocks ahead: one block's work is shorter than a memory round trip. 2 rather than 4 or 1 (each
// block's lines asked for at once, a key block and a value block a step), because 2 ran fastest on
// cold caches (benchmarks/quant/attention_ab.py): likely, more lines asked for at once than the core
// can have in flight stall it.
constexpr int64_t kAhead = 2;

inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off);
}

// Scores of GC query heads (scaled, float) against one block of keys: block_size-wide vectors,
// one key-column load per head dimension shared by the GC heads. Even and odd dimensions add into
// separate sums: two independent FMA chains per head instead of one long one.
template <typename T, int GC>
inline void block_scores(const float* q, int64_t dim, const T* kb, int64_t bs, float* scores, int64_t stride) {
  for (int64_t c = 0; c < bs; c += kF) {
    const int64_t n = std::min(kF, bs - c);
    fVec even[GC], odd[GC];
    for (int g = 0; g < GC; ++g) even[g] = odd[g] = fVec(0.f);
    int64_t d = 0;
    for (; d + 1 < dim; d += 2) {
      const fVec k0 = load_f(kb + d * bs + c, n), k1 = load_f(kb + (d + 1) * bs + c, n);
      for (int g = 0; g < GC; ++g) {
        even[g] = at::vec::fmadd(fVec(q[g * dim + d]), k0, even[g]);
        odd[g] = at::vec::fmadd(fVec(q[g * dim + d + 1]), k1, odd[g]);
      }
    }
    if (d < dim) {
      const fVec k0 = load_f(kb + d * bs + c, n);
      for (int g = 0; g < GC; ++g) even[g] = at::vec::fmadd(fVec(q[g * dim + d]), k0, even[g]);
    }
    for (int g = 0; g < GC; ++g) (even[g] + odd[g]).store(scores + g * stride + c, n);
  }
}

// acc[g, :] = sum over the sequence's keys of p[g, key] * v[key, :], GC heads at once. With NV
// whole vectors per value row (head_dim = NV * kF), every key's row is loaded once and all GC x NV
// sums stay in registers; NV = 0 is the general case, one vector of the row at a time.
template <typename T, int GC, int NV>
inline void weighted_values(const float* p, int64_t stride, const T* vc, const int64_t* table, int64_t len,
                            int64_t bs, int64_t dim, int64_t block_base, float* acc) {
  const int64_t block_bytes = bs * dim * static_cast<int64_t>(sizeof(T));
  if constexpr (NV > 0) {
    fVec sum[GC][NV];
    for (int g = 0; g < GC; ++g)
      for (int i = 0; i < NV; ++i) sum[g][i] = fVec(0.f);
    // Block by block, then the block's keys: no division by the (runtime) block size per key.
    for (int64_t j = 0, k0 = 0; k0 < len; ++j, k0 += bs) {
      if ((j + kAhead) * bs < len) prefetch(vc + (block_base + table[j + kAhead]) * bs * dim, block_bytes);
      const T* rows = vc + (block_base + table[j]) * bs * dim;
      const float* pk = p + k0;
      for (int64_t k = 0, n = std::min(bs, len - k0); k < n; ++k) {
        const T* row = rows + k * dim;
        for (int i = 0; i < NV; ++i) {
          const fVec v = load_f(row + i * kF);
          for (int g = 0; g < GC; ++g) sum[g][i] = at::vec::fmadd(fVec(pk[g * stride + k]), v, sum[g][i]);
        }
      }
    }
    for (int g = 0; g < GC; ++g)
      for (int i = 0; i < NV; ++i) sum[g][i].store(acc + g * dim + i * kF);
  } else {
    for (int64_t d0 = 0; d0 < dim; d0 += kF) {
      const int64_t n = std::min(kF, dim - d0);
      fVec sum[GC];
      for (int g = 0; g < GC; ++g) sum[g] = fVec(0.f);
      for (int64_t j = 0, k0 = 0; k0 < len; ++j, k0 += bs) {
        const T* rows = vc + (block_base + table[j]) * bs * dim + d0;
        for (int64_t k = 0, m = std::min(bs, len - k0); k < m; ++k) {
          const fVec v = load_f(rows + k * dim, n);
          for (int g = 0; g < GC; ++g) sum[g] = at::vec::fmadd(fVec(p[g * stride + k0 + k]), v, sum[g]);
        }
      }
      for (int g = 0; g < GC; ++g) sum[g].store(acc + g * dim + d0, n);
    }
  }
}

template <typename T, int GC>
inline void weighted_values_any(const float* p, int64_t stride, const T* vc, const int64_t* table, int64_t len,
                                int64_t bs, int64_t dim, int64_t block_base, float* acc) {
  switch (dim == kF ? 1 : dim == 2 * kF ? 2 : dim == 4 * kF ? 4 : dim == 8 * kF ? 8 : 0) {
    case 1: return weighted_values<T, GC, 1>(p, stride, vc, table, len, bs, dim, block_base, acc);
    case 2: return weighted_values<T, GC, 2>(p, stride, vc, table, len, bs, dim, block_base, acc);
    case 4: return weighted_values<T, GC, 4>(p, stride, vc, table, len, bs, dim, block_base, acc);
    case 8: return weighted_values<T, GC, 8>(p, stride, vc, table, len, bs, dim, block_base, acc);
    default: return weighted_values<T, GC, 0>(p, stride, vc, table, len, bs, dim, block_base, acc);
  }
}

// With fewer (row, KV head) work items than twice the threads, each row's context is split into
// chunks of about this many keys (whole blocks), each its own work item, their softmax partials
// merged after: a decode row alone has only kv_heads items, and the default model's 3 KV heads on 2
// threads left one thread idle for a third of every layer's attention (split, one row: 1.01-1.09x at
// 200 keys, 1.06-1.08x at 500, 1.12-1.16x at 1,800; benchmarks/quant/attention_ab.py). With many rows
// the items already balance and a split would only add partials and a merge pass (at 32 rows it
// measured 0.94-0.98x, within the 5% that the same code measured against itself). Up to kChunkKeys
// keys a row is one chunk, computed as without the split.
constexpr int64_t kChunkKeys = 128;

// The optional attention features (kernels/reference.py defines them); zero / null = off, and an
// off feature costs one branch per score row, none per key.
struct AttentionFeatures {
  int64_t window = 0;            // sliding window: a row at position p sees keys > p - window
  float soft_cap = 0.f;          // scores become soft_cap * tanh(score / soft_cap)
  const float* sinks = nullptr;  // [heads]: one logit per query head in each row's softmax denominator
};

// One work item: query row r's KV head h over blocks [j0, j1) of its table. part < 0: the row's
// whole context (normalized here, written to out); else the index of its partial sums.
struct AttentionItem {
  int64_t r, h, j0, j1, part;
};

// Every query row attends to the first `len` keys of its sequence: a decode row to the whole
// context, a prefill row causally (len = its position + 1); with a window, only to its last
// `window` of them, and its work items start at the block holding the first of those (blocks
// wholly before it are neither read nor checked, so a windowed row costs its window, not its context). Work item = (query row, KV head, chunk
// of the context): its `group` query heads share every key and value load (in chunks of up to 4
// heads, whose accumulators stay in registers). The softmax is exact (max, then exp and sum over a
// float score row; a split context's chunks are merged by their maxima and sums); slots past `len`
// are set to -inf before it and never read for values, so stale or NaN cache contents there cannot
// leak in.
// T: query and output; C: cache elements (T, or fp8 read as e4m3 * scale). A per-tensor scale
// factors out of each sum: k_scale joins the query's scale, v_scale multiplies the output once.
template <typename T, typename C>
void attention_rows_impl(T* out, const T* query, const C* kc, const C* vc, const int64_t* tables,
                         const int64_t* row_seq, const int64_t* lens, int64_t num_rows, int64_t num_seqs, int64_t heads,
                         int64_t kv_heads, int64_t dim, int64_t num_blocks, int64_t bs, int64_t table_width, float scale,
                         float v_scale, int64_t q_stride, int64_t out_stride, const AttentionFeatures& features) {
  const int64_t group = heads / kv_heads;
  const int64_t part_size = group * (dim + 2);  // a partial: acc [group, dim], then max and sum [group]
  std::vector<AttentionItem> items;
  std::vector<std::pair<int64_t, int64_t>> splits;  // each split (row, KV head): its first item, its chunks
  int64_t parts = 0;
  const bool split = num_rows * kv_heads < 2 * loop_threads();
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t s = row_seq[r], len = lens[r], n_blocks = (len + bs - 1) / bs;
    const int64_t j_lo = features.window > 0 ? std::max<int64_t>(0, len - features.window) / bs : 0;
    // A bad batch is a caller's bug: refuse it before reading anything.
    bool ok = s >= 0 && s < num_seqs && len >= 1 && n_blocks <= table_width;
    for (int64_t j = j_lo; ok && j < n_blocks; ++j) ok = tables[s * table_width + j] >= 0 && tables[s * table_width + j] < num_blocks;
    TORCH_CHECK(ok, "paged_attention: a row's sequence has no block table, its key count is < 1 or beyond its table, or a block id is outside the cache");
    const int64_t seen_blocks = n_blocks - j_lo, seen_keys = len - j_lo * bs;
    const int64_t wanted = split ? std::min(seen_blocks, (seen_keys + kChunkKeys - 1) / kChunkKeys) : 1;
    const int64_t per_chunk = (seen_blocks + wanted - 1) / wanted;
    const int64_t chunks = (seen_blocks + per_chunk - 1) / per_chunk;  // whole blocks each: may be fewer
    for (int64_t h = 0; h < kv_heads; ++h) {
      if (chunks > 1) splits.emplace_back(static_cast<int64_t>(items.size()), chunks);
      for (int64_t j0 = j_lo; j0 < n_blocks; j0 += per_chunk)
        items.push_back({r, h, j0, std::min(n_blocks, j0 + per_chunk), chunks > 1 ? parts++ : -1});
    }
  }
  std::vector<float> partials(parts * part_size);
  parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * dim), acc(group * dim), scores;
    for (int64_t i = begin; i < end; ++i) {
      const AttentionItem& it = items[i];
      const int64_t len = lens[it.r];
      const int64_t keys = std::min(it.j1 * bs, len) - it.j0 * bs, n_blocks = it.j1 - it.j0;
      // Keys of this item before the window's first (only in the item that holds that first key).
      const int64_t hidden = features.window > 0 ? std::max<int64_t>(0, len - features.window - it.j0 * bs) : 0;
      const int64_t stride = (n_blocks * bs + kF - 1) / kF * kF;  // a score row, whole vectors
      const int64_t* table = tables + row_seq[it.r] * table_width + it.j0;
      const T* qrow = query + it.r * q_stride + it.h * group * dim;
      for (int64_t k = 0; k < group * dim; ++k) q[k] = static_cast<float>(qrow[k]) * scale;
      scores.resize(group * stride);
      const int64_t block_base = it.h * num_blocks;
      const int64_t block_bytes = dim * bs * static_cast<int64_t>(sizeof(C));
      for (int64_t j = 0; j < std::min(kAhead, n_blocks); ++j) {
        prefetch(kc + (block_base + table[j]) * dim * bs, block_bytes);
        prefetch(vc + (block_base + table[j]) * dim * bs, block_bytes);
      }
      for (int64_t g0 = 0; g0 < group; g0 += 4) {
        const int64_t gc = std::min<int64_t>(4, group - g0);
        for (int64_t j = 0; j < n_blocks; ++j) {
          const C* kb = kc + (block_base + table[j]) * dim * bs;
          if (j + kAhead < n_blocks) prefetch(kc + (block_base + table[j + kAhead]) * dim * bs, block_bytes);
          float* sc = scores.data() + g0 * stride + j * bs;
          const float* qg = q.data() + g0 * dim;
          switch (gc) {
            case 1: block_scores<C, 1>(qg, dim, kb, bs, sc, stride); break;
            case 2: block_scores<C, 2>(qg, dim, kb, bs, sc, stride); break;
            case 3: block_scores<C, 3>(qg, dim, kb, bs, sc, stride); break;
            default: block_scores<C, 4>(qg, dim, kb, bs, sc, stride); break;
          }
        }
      }
      float* part = it.part < 0 ? nullptr : partials.data() + it.part * part_size;
      const fVec neg_inf(-std::numeric_limits<float>::infinity());
      for (int64_t g = 0; g < group; ++g) {
        float* sc = scores.data() + g * stride;
        if (features.soft_cap > 0.f) {
          const fVec cap(features.soft_cap), inv_cap(1.f / features.soft_cap);
          for (int64_t k = 0; k < keys; k += kF) (((fVec::loadu(sc + k) * inv_cap).tanh()) * cap).store(sc + k);
        }
        std::fill(sc, sc + hidden, -std::numeric_limits<float>::infinity());
        std::fill(sc + keys, sc + stride, -std::numeric_limits<float>::infinity());
        fVec mx = neg_inf;
        for (int64_t k = 0; k < stride; k += kF) mx = at::vec::maximum(mx, fVec::loadu(sc + k));
        float top = mx.reduce_max();
        // A sink joins a whole row's softmax: here when the row is one item, in the merge when split.
        const float sink = features.sinks && !part ? features.sinks[it.h * group + g] : 0.f;
        if (features.sinks && !part) top = std::max(top, sink);
        fVec total(0.f);
        for (int64_t k = 0; k < stride; k += kF) {
          fVec e = exp_for<T>(fVec::loadu(sc + k) - fVec(top));
          e.store(sc + k);
          total = total + e;
        }
        if (part) {  // a chunk keeps its max and sum for the merge; its weights stay unnormalized
          part[group * dim + g] = top;
          part[group * dim + group + g] = total.reduce_add();
          continue;
        }
        const float sink_weight = features.sinks ? std::exp(sink - top) : 0.f;
        const fVec inv(1.f / (total.reduce_add() + sink_weight));
        for (int64_t k = 0; k < stride; k += kF) (fVec::loadu(sc + k) * inv).store(sc + k);
      }
      float* a = part ? part : acc.data();
      for (int64_t g0 = 0; g0 < group; g0 += 4) {
        const int64_t gc = std::min<int64_t>(4, group - g0);
        const float* p = scores.data() + g0 * stride;
        float* ag = a + g0 * dim;
        switch (gc) {
          case 1: weighted_values_any<C, 1>(p, stride, vc, table, keys, bs, dim, block_base, ag); break;
          case 2: weighted_values_any<C, 2>(p, stride, vc, table, keys, bs, dim, block_base, ag); break;
          case 3: weighted_values_any<C, 3>(p, stride, vc, table, keys, bs, dim, block_base, ag); break;
          default: weighted_values_any<C, 4>(p, stride, vc, table, keys, bs, dim, block_base, ag); break;
        }
      }
      if (part) continue;
      T* orow = out + it.r * out_stride + it.h * group * dim;
      for (int64_t k = 0; k < group * dim; k += kF) {
        const int64_t n = std::min(kF, group * dim - k);
        store_f(orow + k, fVec::loadu(acc.data() + k, n) * fVec(v_scale), n);
      }
    }
  });
  // Merge each split (row, KV head): its chunks are consecutive items, their partials consecutive.
  parallel_for(0, static_cast<int64_t>(splits.size()), 16, [&](int64_t begin, int64_t end) {
    std::vector<float> sum(dim);
    for (int64_t f = begin; f < end; ++f) {
      const auto [first, chunks] = splits[f];
      const AttentionItem& it = items[first];
      const float* p0 = partials.data() + it.part * part_size;
      T* orow = out + it.r * out_stride + it.h * group * dim;
      for (int64_t g = 0; g < group; ++g) {
        float top = -std::numeric_limits<float>::infinity(), total = 0.f;
        for (int64_t c = 0; c < chunks; ++c) top = std::max(top, p0[c * part_size + group * dim + g]);
        if (features.sinks) {  // the sink: one more term of the denominator, with no value
          const float sink = features.sinks[it.h * group + g];
          top = std::max(top, sink);
          total = std::exp(sink - top);
        }
        std::fill(sum.begin(), sum.end(), 0.f);
        for (int64_t c = 0; c < chunks; ++c) {
          const float* pc = p0 + c * part_size;
          const float w = std::exp(pc[group * dim + g] - top);
          total += w * pc[group * dim + group + g];
          for (int64_t d = 0; d < dim; d += kF) {
            const int64_t n = std::min(kF, dim - d);
            (fVec::loadu(sum.data() + d, n) + fVec::loadu(pc + g * dim + d, n) * fVec(w)).store(sum.data() + d, n);
          }
        }
        const fVec inv(v_scale / total);
        for (int64_t d = 0; d < dim; d += kF) {
          const int64_t n = std::min(kF, dim - d);
          store_f(orow + g * dim + d, fVec::loadu(sum.data() + d, n) * inv, n);
        }
      }
    }
  });
}

// query/out [rows, heads, head_dim]; row r reads block_tables[row_seq[r]] up to lens[r] keys.
// An fp8 (e4m3) cache is read as e4m3 * k_scale / v_scale; other caches have the query's dtype.
// window 0 / soft_cap 0 / no sinks: those features off (AttentionFeatures).
void paged_attention(at::Tensor out, at::Tensor query, at::Tensor k_cache, at::Tensor v_cache,
                     at::Tensor block_tables, at::Tensor row_seq, at::Tensor lens, double scale,
                     double k_scale, double v_scale, int64_t window, double soft_cap,
                     c10::optional<at::Tensor> sinks) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_attention: caches must be the physical tensors");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2) && out.stride(2) == 1 &&
              out.stride(1) == out.size(2), "paged_attention: query/out heads must be contiguous rows");
  const bool fp8_cache = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  const bool narrow = narrow_cache(query.scalar_type(), k_cache.scalar_type());
  TORCH_CHECK((fp8_cache || narrow || query.scalar_type() == k_cache.scalar_type()) &&
              v_cache.scalar_type() == k_cache.scalar_type() && out.scalar_type() == query.scalar_type(),
              "paged_attention: query, out and cache dtypes must match (or the cache be fp8 e4m3, or 16-bit under "
              "float32)");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() && row_seq.scalar_type() == at::kLong &&
              row_seq.is_contiguous() && lens.scalar_type() == at::kLong && lens.is_contiguous(),
              "paged_attention: block_tables, row_seq and lens must be contiguous int64 (kernels/cpu_ops.py plans them)");
  int64_t kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), dim = k_cache.size(2), bs = k_cache.size(3);
  int64_t heads = query.size(1), rows = lens.numel();
  TORCH_CHECK(heads % kv_heads == 0 && query.size(2) == dim, "paged_attention: query heads do not match the cache");
  TORCH_CHECK(row_seq.numel() == rows && rows <= query.size(0) && rows <= out.size(0), "paged_attention: one sequence and length per query row");
  TORCH_CHECK(window >= 0 && soft_cap >= 0, "paged_attention: sliding window and soft cap must be positive (0 = off)");
  AttentionFeatures features{window, static_cast<float>(soft_cap), nullptr};
  if (sinks) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->numel() == heads,
                "paged_attention: sinks must be contiguous float32, one per query head");
    features.sinks = sinks->data_ptr<float>();
  }
  PW_DISPATCH(query.scalar_type(), "paged_attention", [&] {
    auto run = [&](auto cache_elem) {
      using C = decltype(cache_elem);
      const float k = std::is_same_v<C, fp8> ? static_cast<float>(k_scale) : 1.f;
      const float v = std::is_same_v<C, fp8> ? static_cast<float>(v_scale) : 1.f;
      attention_rows_impl<scalar_t, C>(out.data_ptr<scalar_t>(), query.data_ptr<scalar_t>(), k_cache.data_ptr<C>(),
                                       v_cache.data_ptr<C>(), block_tables.data_ptr<int64_t>(),
                                       row_seq.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), rows,
                                       block_tables.size(0), heads, kv_heads, dim, num_blocks, bs, block_tables.size(1),
                                       static_cast<float>(scale) * k, v, query.stride(0), out.stride(0), features);
    };
    if (fp8_cache) {
      run(fp8());
    } else if (narrow) {
      if constexpr (std::is_same_v<scalar_t, float>) {
        if (k_cache.scalar_type() == at::kBFloat16) run(c10::BFloat16());
        else run(c10::Half());
      }
    } else {
      run(scalar_t());
    }
  });
}

}  // namespace

// ---- structured output: mask the tokens a grammar forbids ----------------------------------------

// logits [rows, vocab] float32; bitmask [rows, ceil(vocab / 32)] int32, bit j of word w set when
// token 32 * w + j is allowed (xgrammar's layout). Forbidden tokens become -inf, in place. A word
// of all ones (most of a JSON grammar's vocabulary, mid-string) is skipped at once.
void apply_token_bitmask_(at::Tensor logits, at::Tensor bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat,
              "apply_token_bitmask_: logits must be contiguous float32 [rows, vocab]");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.is_contiguous() && bitmask.scalar_type() == at::kInt &&
                  bitmask.size(0) == logits.size(0) && bitmask.size(1) * 32 >= logits.size(1),
              "apply_token_bitmask_: bitmask must be contiguous int32 [rows, >= vocab / 32]");
  const int64_t rows = logits.size(0), vocab = logits.size(1), words = bitmask.size(1);
  float* l = logits.data_ptr<float>();
  const uint32_t* b = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const float ninf = -std::numeric_limits<float>::infinity();
  parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = l + r * vocab;
      const uint32_t* mask = b + r * words;
      for (int64_t w = 0; w * 32 < vocab; ++w) {
        uint32_t allowed = mask[w];
        if (allowed == 0xffffffffu) continue;
        const int64_t base = w * 32, n = std::min<int64_t>(32, vocab - base);
        for (int64_t j = 0; j < n; ++j)
          if (!((allowed >> j) & 1u)) row[base + j] = ninf;
      }
    }
  });
}

// ---- greedy sampling: each row's first maximum -------------------------------------------------

// torch.max(dim).indices' answer: the first index of the row's largest value, and the first NaN's
// when the row has one (NaN compares largest). Per lane, a strict > keeps a value's first index;
// across lanes, the smallest index among the lanes holding the maximum. torch's own reduction
// reads bfloat16 logits at ~5 GB/s here (4.8 ms for 256 x 49,152), a sixth of a plain read.
template <typename T>
int64_t argmax_row(const T* row, int64_t n) {
  int64_t start = 0, best_at = 0;
  float best = -std::numeric_limits<float>::infinity();
  bool nan = false;
#if defined(CPU_CAPABILITY_AVX512)
  if (n >= kF) {
    const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512 vbest = ninf;
    __m512i vidx = _mm512_setzero_si512(), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nans = 0;
    const int64_t whole = n / kF * kF;
    for (int64_t i = 0; i < whole; i += kF) {
      const __m512 v = load_f(row + i);
      nans |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, vbest, _CMP_GT_OQ);
      vbest = _mm512_mask_mov_ps(vbest, gt, v);
      vidx = _mm512_mask_mov_epi32(vidx, gt, idx);
      idx = _mm512_add_epi32(idx, step);
    }
    nan = nans != 0;
    best = _mm512_reduce_max_ps(vbest);
    best_at = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(vbest, _mm512_set1_ps(best), _CMP_EQ_OQ), vidx);
    if (best == -std::numeric_limits<float>::infinity()) best_at = 0;  // every value -inf: index 0
    start = whole;
  }
#elif defined(CPU_CAPABILITY_AVX2)
  // The same on 8 lanes for float logits (the scalar loop took ~40 us a 49,152-token row here).
  if constexpr (std::is_same_v<T, float>) {
    if (n >= 8) {
      const float ninf = -std::numeric_limits<float>::infinity();
      __m256 vbest = _mm256_set1_ps(ninf), nans = _mm256_setzero_ps();
      __m256i vidx = _mm256_setzero_si256(), idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      const __m256i step = _mm256_set1_epi32(8);
      const int64_t whole = n / 8 * 8;
      for (int64_t i = 0; i < whole; i += 8) {
        const __m256 v = _mm256_loadu_ps(row + i);
        nans = _mm256_or_ps(nans, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        const __m256 gt = _mm256_cmp_ps(v, vbest, _CMP_GT_OQ);  // strict: each lane keeps its first maximum
        vbest = _mm256_blendv_ps(vbest, v, gt);
        vidx = _mm256_blendv_epi8(vidx, idx, _mm256_castps_si256(gt));
        idx = _mm256_add_epi32(idx, step);
      }
      nan = _mm256_movemask_ps(nans) != 0;
      alignas(32) float lane_best[8];
      alignas(32) int32_t lane_at[8];
      _mm256_store_ps(lane_best, vbest);
      _mm256_store_si256(reinterpret_cast<__m256i*>(lane_at), vidx);
      best = *std::max_element(lane_best, lane_best + 8);
      best_at = n;
      for (int j = 0; j < 8; ++j)
        if (lane_best[j] == best) best_at = std::min<int64_t>(best_at, lane_at[j]);
      if (best == ninf) best_at = 0;  // every value -inf: index 0
      start = whole;
    }
  }
#endif
  for (int64_t i = start; i < n && !nan; ++i) {
    const float v = static_cast<float>(row[i]);
    if (std::isnan(v)) nan = true;
    else if (v > best) best = v, best_at = i;
  }
  if (nan) {
    for (int64_t i = 0; i < n; ++i)
      if (std::isnan(static_cast<float>(row[i]))) return i;
  }
  return best_at;
}

// A step's attention rows (kernels/cpu_ops.py plan_attention): the block tables as int64, and per
// query row its sequence and its key count (its position + 1), from query_start_loc [seqs + 1] and
// seq_lens [seqs] (any integer dtype). One call: the same as eight torch ops cost ~0.15 ms of a
// decode step on a slow core.
std::vector<at::Tensor> plan_rows(at::Tensor block_tables, at::Tensor query_start_loc,
                                     at::Tensor seq_lens) {
  const auto starts = query_start_loc.to(at::kLong).contiguous(), lens = seq_lens.to(at::kLong).contiguous();
  const int64_t seqs = lens.numel();
  TORCH_CHECK(starts.numel() == seqs + 1, "plan_rows: query_start_loc must have one more entry than seq_lens");
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* ln = lens.data_ptr<int64_t>();
  const int64_t rows = st[seqs];
  TORCH_CHECK(st[0] == 0, "plan_rows: query_start_loc must start at 0");
  auto row_seq = at::empty({rows}, starts.options()), row_lens = at::empty({rows}, starts.options());
  int64_t* rs = row_seq.data_ptr<int64_t>();
  int64_t* rl = row_lens.data_ptr<int64_t>();
  for (int64_t s = 0; s < seqs; ++s) {
    TORCH_CHECK(st[s] <= st[s + 1] && st[s + 1] <= rows, "plan_rows: query_start_loc must not decrease");
    for (int64_t r = st[s]; r < st[s + 1]; ++r) {  // row r is the (st[s + 1] - r)-th last query of s
      rs[r] = s;
      rl[r] = ln[s] - (st[s + 1] - r) + 1;
    }
  }
  return {block_tables.to(at::kLong).contiguous(), row_seq, row_lens};
}

// logits [rows, vocab] -> int64 [rows].
at::Tensor argmax_rows(at::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "argmax_rows: logits must be contiguous [rows, vocab]");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0, "argmax_rows: an empty row has no maximum");
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  PW_DISPATCH(logits.scalar_type(), "argmax_rows", [&] {
    const scalar_t* l = logits.data_ptr<scalar_t>();
    parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(l + r * vocab, vocab);
    });
  });
  return out;
}

// ---- mixture of experts ---------------------------------------------------------------------------
//
// x [T, H]; topk_ids [T, k] int64 global expert ids; topk_weights [T, k] float32. This rank holds
// experts [expert_offset, expert_offset + E); a slot (token, j) routed elsewhere adds nothing.
// One pass counting-sorts the T * k slots by local expert, each active expert's tokens are gathered
// into one contiguous segment, and per expert: one [n, H] x [H, 2F] matmul for gate and up together,
// the fused SwiGLU above, one [n, F] x [F, H] matmul. A last pass sums each token's k expert rows
// with their routing weights in float32 (the reference's accumulator) and rounds once: per token,
// not a scatter-add per expert, so no two threads ever add into one row and the sum is deterministic.
//
// Matmuls, by the layout cpu_ops.pack_moe_weights chose at load:
// - brgemm (bf16 where the CPU has AMX): oneDNN's brgemm microkernel (at::native::cpublas::brgemm)
//   on each expert's weights packed once into VNNI tiles of kMoeTileN output columns. One parallel
//   region runs every (expert, gate/up tile) work item with the SwiGLU in the tile's epilogue, a
//   second every (expert, down tile) item; threads take items from a shared counter, so a core busy
//   with another process slows the op by its share of the items, not by a whole expert. Each item
//   writes its own columns of its expert's rows, so the result does not depend on which thread ran
//   what. Measured against the next way on mixtral-tiny's layers (8 experts of 768 x 1024, top-2,
//   12 layers' weights in turn so they come from memory, 2 threads, min of 20 interleaved runs), ms
//   a layer: 1 token 0.47 -> 0.34, 16 tokens 2.08 -> 1.64, 64: 2.32 -> 1.74, 256: 3.31 -> 2.95; and
//   when another process holds a core, the median at 256 tokens 12.6 -> 4.2 (576 x 768).
// - matmul (bf16 without AMX): oneDNN matmul primitives on each expert's weights prepacked at load,
//   one expert after another, each call parallel inside; at 64 tokens 1.3x faster than at::linear
//   on the plain weights (0.96 vs 1.25 ms).
// - blocks (bf16 on a CPU without native bf16 matmuls: AVX2, where oneDNN's bf16 GEMM runs 3-8x
//   slower than float32): each expert's weights as cpu_quant.cpp block-format rows (a bf16 matrix as
//   stored is already BF16 blocks: no copy), one expert after another; a segment's rows widened to
//   float32 once and multiplied by that file's register kernel (linear_f32) up to `register_rows`
//   rows, its tiled one (linear_f32_tiled) above, the outputs rounded to x's dtype where the
//   reference rounds (gate/up, h, down). Measured on the AVX2 machine (kernels.cpu_bench, 12 layers
//   of 8 experts of 576 x 768, 2 threads) against the plain bf16 weights: 16 tokens 2.6x, 64 3.5x,
//   256 5.4x, 2,048 6.5x.
// - none (float32, float16): at::linear on the plain stacked weights (float32: MKL's sgemm, which
//   measured 1.17x faster than packed oneDNN at 64 tokens and within 5% at 2048).
//
// matmul pads each segment to padded_rows(n) rows (cpu_ops.padded_num_tokens' sizes; a test holds
// them equal): oneDNN keeps state for every row count it multiplies, measured here at about 1 MiB per
// new count for one 1536 x 576 bf16 weight, packed or not, and per-expert counts vary on every step.
// brgemm needs no padding: its microkernels are cached per thread by (M, N, K), and M is at most
// kMoeTileM (a segment runs as tiles of that many rows), so the cache is bounded by the layer shapes.


constexpr int64_t kMoeTileM = 32;  // rows of one brgemm call (two AMX tiles of 16)
constexpr int64_t kMoeTileN = 32;  // output columns of one gate/up work item (32 of each)
constexpr int64_t kMoeDownTileN = 32;  // output columns of one down work item
constexpr int64_t kVnniN = 16;     // a packed tile's width is padded to a multiple of this (an AMX tile's)

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// kernels/cpu_ops.py padded_num_tokens: n up to 16, above that one of eight sizes per power of two.
int64_t padded_rows(int64_t n) {
  if (n <= 16) return n;
  const int64_t step = int64_t{1} << (64 - __builtin_clzll(static_cast<uint64_t>(n)) - 4);
  return (n + step - 1) / step * step;
}

// Whether pack_moe_brgemm's layout can run here: bf16 brgemm on VNNI-packed weights (AMX).
bool moe_brgemm_available() { return at::native::cpublas::could_pack(at::kBFloat16); }

// A block-format matmul of kernels/cpu_quant.cpp (x, blocks, format id) -> x @ dequant(blocks)^T,
// reached through the address that module hands out (both are built against the same libtorch).
using LinearFn = at::Tensor (*)(const at::Tensor&, const at::Tensor&, int64_t);

// One layer's expert weights, packed once at load (cpu_ops.pack_moe_weights); the plain stacked
// weights can then be freed.
//   matmul: w13 / w2 hold one oneDNN-blocked tensor per expert, [2F, H] and [H, F].
//   brgemm: w13 / w2 hold one tensor each, every expert's VNNI tiles (pack_moe_brgemm).
//   blocks: w13 / w2 hold one block-format tensor per expert (pack_moe_blocks), `fmt` its format.
struct PackedExperts {
  std::string layout;
  std::vector<at::Tensor> w13, w2;
  int64_t num_experts, hidden, ffn;
  int64_t fmt = -1, register_rows = 0;  // blocks: the format id; the most rows the register kernel takes
  LinearFn register_kernel = nullptr, tiled_kernel = nullptr;  // blocks: cpu_quant.cpp's matmuls

  PackedExperts(std::vector<at::Tensor> w13_, std::vector<at::Tensor> w2_, int64_t hidden_, int64_t ffn_)
      : layout("matmul"), w13(std::move(w13_)), w2(std::move(w2_)), num_experts(w13.size()), hidden(hidden_),
        ffn(ffn_) {
    TORCH_CHECK(!w13.empty() && w13.size() == w2.size(), "PackedExperts: one w13 and one w2 per expert");
    for (size_t e = 0; e < w13.size(); ++e)
      TORCH_CHECK(w13[e].scalar_type() == w13[0].scalar_type() && w2[e].scalar_type() == w13[0].scalar_type(),
                  "PackedExperts: every expert's weights share one dtype");
  }
  PackedExperts(at::Tensor vnni13, at::Tensor vnni2, int64_t num_experts_, int64_t hidden_, int64_t ffn_)
      : layout("brgemm"), w13{std::move(vnni13)}, w2{std::move(vnni2)}, num_experts(num_experts_), hidden(hidden_),
        ffn(ffn_) {}
  at::ScalarType dtype() const { return w13[0].scalar_type(); }  // (blocks: uint8, any float x)
  int64_t nbytes() const {
    int64_t total = 0;
    for (size_t e = 0; e < w13.size(); ++e) total += w13[e].nbytes() + w2[e].nbytes();
    return total;
  }
};

// brgemm's packed layout. A tile is columns [n0, n0 + nt) of a weight w [N, K] (row n: output n),
// transposed to K x nt and stored VNNI: pairs of k interleaved, [K / 2][width][2], its width nt
// padded with zero columns to a multiple of kVnniN. gate/up tiles hold the gate's nt columns, then
// (at column round_up(nt, kVnniN)) the up's same columns, so one brgemm call computes both and the
// SwiGLU runs on its output. Tile nb starts at element 2 * H * n0 of its expert's w13 block, and at
// F * n0 of its w2 block (every tile but the last is kMoeTileN, or kMoeDownTileN, wide).
int64_t vnni13_expert_stride(int64_t hidden, int64_t ffn) { return 2 * hidden * round_up(ffn, kVnniN); }
int64_t vnni2_expert_stride(int64_t hidden, int64_t ffn) { return ffn * round_up(hidden, kVnniN); }

// w [N, K] rows [n0, n0 + nt) into dst's columns [col, col + nt) of a [K / 2][width][2] tile.
void pack_vnni_columns(const c10::BFloat16* w, int64_t K, int64_t n0, int64_t nt, int64_t col, int64_t width,
                       c10::BFloat16* dst) {
  for (int64_t c = 0; c < nt; ++c) {
    const c10::BFloat16* row = w + (n0 + c) * K;
    for (int64_t k = 0; k < K; ++k) dst[(k / 2) * width * 2 + (col + c) * 2 + k % 2] = row[k];
  }
}

// w13 [E, 2F, H], w2 [E, H, F] bf16 -> PackedExperts in the brgemm layout.
PackedExperts pack_moe_brgemm(at::Tensor w13, at::Tensor w2) {
  TORCH_CHECK(moe_brgemm_available(), "pack_moe_brgemm: this CPU has no bf16 brgemm on packed weights (AMX)");
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.size(0) == w2.size(0) && w13.size(2) == w2.size(1) &&
              w13.size(1) == 2 * w2.size(2), "pack_moe_brgemm: w13 must be [experts, 2 * ffn, hidden] and w2 [experts, hidden, ffn]");
  TORCH_CHECK(w13.scalar_type() == at::kBFloat16 && w2.scalar_type() == at::kBFloat16, "pack_moe_brgemm: bf16 only");
  const int64_t experts = w13.size(0), hidden = w13.size(2), ffn = w2.size(2);
  TORCH_CHECK(hidden % 2 == 0 && ffn % 2 == 0, "pack_moe_brgemm: VNNI pairs need an even hidden size and ffn");
  const auto a13 = w13.contiguous(), a2 = w2.contiguous();
  const int64_t s13 = vnni13_expert_stride(hidden, ffn), s2 = vnni2_expert_stride(hidden, ffn);
  auto p13 = at::zeros({experts * s13}, w13.options()), p2 = at::zeros({experts * s2}, w2.options());
  const auto* src13 = a13.data_ptr<c10::BFloat16>();
  const auto* src2 = a2.data_ptr<c10::BFloat16>();
  auto* dst13 = p13.data_ptr<c10::BFloat16>();
  auto* dst2 = p2.data_ptr<c10::BFloat16>();
  at::parallel_for(0, experts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e) {
      const c10::BFloat16* gate = src13 + e * 2 * ffn * hidden;
      for (int64_t n0 = 0; n0 < ffn; n0 += kMoeTileN) {
        const int64_t nt = std::min(kMoeTileN, ffn - n0), half = round_up(nt, kVnniN);
        c10::BFloat16* tile = dst13 + e * s13 + 2 * hidden * n0;
        pack_vnni_columns(gate, hidden, n0, nt, 0, 2 * half, tile);
        pack_vnni_columns(gate + ffn * hidden, hidden, n0, nt, half, 2 * half, tile);
      }
      for (int64_t n0 = 0; n0 < hidden; n0 += kMoeDownTileN) {
        const int64_t nt = std::min(kMoeDownTileN, hidden - n0);
        pack_vnni_columns(src2 + e * hidden * ffn, ffn, n0, nt, 0, round_up(nt, kVnniN), dst2 + e * s2 + ffn * n0);
      }
    }
  });
  return PackedExperts(p13, p2, experts, hidden, ffn);
}

// One block-format tensor per expert (uint8 [2F, H / block weights * block bytes] and [H, F / ...]) ->
// PackedExperts in the blocks layout; the addresses are cpu_quant's linear_f32 and linear_f32_tiled.
PackedExperts pack_moe_blocks(std::vector<at::Tensor> w13, std::vector<at::Tensor> w2, int64_t hidden, int64_t ffn,
                              int64_t fmt, int64_t register_rows, int64_t register_address, int64_t tiled_address) {
  TORCH_CHECK(!w13.empty() && w13.size() == w2.size(), "pack_moe_blocks: one w13 and one w2 per expert");
  for (size_t e = 0; e < w13.size(); ++e)
    TORCH_CHECK(w13[e].scalar_type() == at::kByte && w2[e].scalar_type() == at::kByte && w13[e].size(0) == 2 * ffn &&
                w2[e].size(0) == hidden, "pack_moe_blocks: expert ", e, " is not uint8 blocks [2 * ffn, ...], [hidden, ...]");
  PackedExperts p(std::move(w13), std::move(w2), hidden, ffn);
  p.layout = "blocks";
  p.fmt = fmt;
  p.register_rows = register_rows;
  p.register_kernel = reinterpret_cast<LinearFn>(register_address);
  p.tiled_kernel = reinterpret_cast<LinearFn>(tiled_address);
  return p;
}

// torch.ops.mkldnn._linear_pointwise (what cpu_ops.linear calls), reached through the dispatcher.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                            c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
  return op.call(x, packed, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(),
                 std::optional<c10::string_view>(""));
}

// Slots grouped by local expert: segment e is rows [start[e], start[e + 1]) of the gathered buffer,
// its first count[e] rows real tokens, the rest padding.
struct ExpertSegments {
  std::vector<int64_t> count, start;
  std::vector<int64_t> row_token;  // [rows]: the token a buffer row holds, -1 for padding
  std::vector<int64_t> slot_row;   // [T * k]: the buffer row of a slot, -1 when its expert is not held here
};

ExpertSegments sort_by_expert(const int64_t* ids, int64_t slots, int64_t top_k, int64_t experts, int64_t offset,
                              bool pad) {
  ExpertSegments s;
  s.count.assign(experts, 0);
  for (int64_t i = 0; i < slots; ++i) {
    const int64_t e = ids[i] - offset;
    if (e >= 0 && e < experts) ++s.count[e];
  }
  s.start.assign(experts + 1, 0);
  for (int64_t e = 0; e < experts; ++e) s.start[e + 1] = s.start[e] + (pad ? padded_rows(s.count[e]) : s.count[e]);
  s.row_token.assign(s.start[experts], -1);
  s.slot_row.assign(slots, -1);
  std::vector<int64_t> next(s.start.begin(), s.start.end() - 1);
  for (int64_t i = 0; i < slots; ++i) {
    const int64_t e = ids[i] - offset;
    if (e < 0 || e >= experts) continue;
    const int64_t r = next[e]++;
    s.row_token[r] = i / top_k;
    s.slot_row[i] = r;
  }
  return s;
}

// out[t] = sum over j of weights[t, j] * expert_rows[slot_row[t * k + j]], in float, rounded once.
template <typename T>
void combine_impl(T* out, const float* weights, const std::vector<const T*>& slot_src, int64_t tokens, int64_t top_k,
                  int64_t hidden) {
  parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(hidden);
    for (int64_t t = begin; t < end; ++t) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < top_k; ++j) {
        const T* y = slot_src[t * top_k + j];
        if (y == nullptr) continue;
        const fVec w(weights[t * top_k + j]);
        for (int64_t d = 0; d < hidden; d += kF) {
          const int64_t n = std::min(kF, hidden - d);
          (fVec::loadu(acc.data() + d, n) + w * load_f(y + d, n)).store(acc.data() + d, n);
        }
      }
      for (int64_t d = 0; d < hidden; d += kF) {
        const int64_t n = std::min(kF, hidden - d);
        store_f(out + t * hidden + d, fVec::loadu(acc.data() + d, n), n);
      }
    }
  });
}

// x's rows into the expert-sorted buffer, zeros in the padding rows.
at::Tensor gather_rows(const at::Tensor& x, const std::vector<int64_t>& row_token) {
  const int64_t rows = row_token.size(), row_bytes = x.size(1) * x.element_size();
  auto buf = at::empty({rows, x.size(1)}, x.options());
  const char* src = static_cast<const char*>(x.data_ptr());
  char* dst = static_cast<char*>(buf.data_ptr());
  parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (row_token[r] >= 0) std::memcpy(dst + r * row_bytes, src + row_token[r] * row_bytes, row_bytes);
      else std::memset(dst + r * row_bytes, 0, row_bytes);
    }
  });
  return buf;
}

// Runs item(i, threads) for every i in [0, items) on the op's threads, each taking the next item
// from a shared counter; a thread that ran a brgemm gives its AMX state back before the region ends
// (torch's flash attention does the same: the next oneDNN primitive on that thread configures its own
// tiles).
template <typename F>
void for_each_item(int64_t items, const F& item) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(items, at::get_num_threads());
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < items;
         i = next.fetch_add(1, std::memory_order_relaxed))
      item(i, threads);
    at::native::cpublas::brgemm_release();
  });
}

// A layer's expert weights are far larger than the caches, and brgemm waits on every weight tile it
// loads from memory (measured alone: a 32 x 64 x 768 call reaches 530 GFLOP/s on a tile in L2,
// 400 on one streamed from memory; 64 rows: 1,100 and 400). So each item asks for the tile its thread
// will most likely run next (the threads take items in turn) a few lines per row as it works, and
// that tile is in L2 when its brgemm starts: 7% off the 256-token op on 2 threads.
struct TilePrefetch {
  const char* tile = nullptr;
  int64_t lines = 0, done = 0, per_row = 0;
  TilePrefetch(const void* next_tile, int64_t bytes, int64_t rows)
      : tile(static_cast<const char*>(next_tile)), lines(next_tile ? bytes / 64 : 0),
        per_row((lines + rows - 1) / std::max<int64_t>(rows, 1)) {}
  void row() {
    for (const int64_t end = std::min(lines, done + per_row); done < end; ++done)
      __builtin_prefetch(tile + done * 64, 0, 2);  // read, into L2
  }
};

// The brgemm layout's expert matmuls: xs [rows, H] (segments of seg) -> ys [rows, H], through
// h [rows, F] = silu(gate) * up, rounded where the reference rounds (gate, up, silu, h, y).
void experts_brgemm(const PackedExperts& p, const ExpertSegments& seg, const c10::BFloat16* xs, c10::BFloat16* h,
                    c10::BFloat16* ys) {
  using bf16 = c10::BFloat16;
  const int64_t H = p.hidden, F = p.ffn;
  const int64_t tiles13 = (F + kMoeTileN - 1) / kMoeTileN, tiles2 = (H + kMoeDownTileN - 1) / kMoeDownTileN;
  const auto* w13 = p.w13[0].data_ptr<bf16>();
  const auto* w2 = p.w2[0].data_ptr<bf16>();
  const int64_t s13 = vnni13_expert_stride(H, F), s2 = vnni2_expert_stride(H, F);
  std::vector<int64_t> active;
  for (int64_t e = 0; e < p.num_experts; ++e)
    if (seg.count[e] > 0) active.push_back(e);
  const int64_t experts = active.size();

  // gate/up: item (expert, tile) runs every row tile of the expert against one weight tile.
  // Item i's weight tile and its bytes (every tile but an expert's last is kMoeTileN wide).
  const auto tile13 = [&](int64_t i) { return w13 + active[i / tiles13] * s13 + 2 * H * (i % tiles13) * kMoeTileN; };
  const auto bytes13 = [&](int64_t i) {
    return 2 * H * 2 * round_up(std::min(kMoeTileN, F - (i % tiles13) * kMoeTileN), kVnniN);
  };
  for_each_item(experts * tiles13, [&](int64_t i, int64_t threads) {
    const int64_t e = active[i / tiles13], n0 = (i % tiles13) * kMoeTileN;
    const int64_t nt = std::min(kMoeTileN, F - n0), half = round_up(nt, kVnniN);
    const bf16* b = tile13(i);
    const int64_t ahead = i + threads;
    TilePrefetch prefetch(ahead < experts * tiles13 ? tile13(ahead) : nullptr, bytes13(ahead), seg.count[e]);
    alignas(64) float c[kMoeTileM * 2 * kMoeTileN];
    const fVec one(1.f);
    for (int64_t r0 = seg.start[e], r1 = seg.start[e] + seg.count[e]; r0 < r1; r0 += kMoeTileM) {
      const int64_t m = std::min(kMoeTileM, r1 - r0);
      at::native::cpublas::brgemm(m, 2 * half, H, H, 2 * half, 2 * half, false, xs + r0 * H, b, c);
      for (int64_t r = 0; r < m; ++r) {
        prefetch.row();
        const float* g = c + r * 2 * half;
        const float* u = g + half;
        bf16* out = h + (r0 + r) * F + n0;
        for (int64_t d = 0; d < nt; d += kP) {
          const int64_t n = std::min(kP, nt - d);
          fVec glo, ghi, ulo, uhi;
          load2(g + d, n, glo, ghi);
          load2(u + d, n, ulo, uhi);
          round2<bf16>(glo, ghi);  // the gate/up matmul's bf16 output
          round2<bf16>(ulo, uhi);
          fVec alo = glo / (one + exp_for<bf16>(glo.neg())), ahi = ghi / (one + exp_for<bf16>(ghi.neg()));
          round2<bf16>(alo, ahi);
          store2(out + d, alo * ulo, ahi * uhi, n);
        }
      }
    }
  });

  // down: item (expert, tile of H) likewise, its rows rounded to bf16 (the down matmul's output).
  const auto tile2 = [&](int64_t i) { return w2 + active[i / tiles2] * s2 + F * (i % tiles2) * kMoeDownTileN; };
  const auto bytes2 = [&](int64_t i) { return F * 2 * round_up(std::min(kMoeDownTileN, H - (i % tiles2) * kMoeDownTileN), kVnniN); };
  for_each_item(experts * tiles2, [&](int64_t i, int64_t threads) {
    const int64_t e = active[i / tiles2], n0 = (i % tiles2) * kMoeDownTileN;
    const int64_t nt = std::min(kMoeDownTileN, H - n0), width = round_up(nt, kVnniN);
    const bf16* b = tile2(i);
    const int64_t ahead = i + threads;
    TilePrefetch prefetch(ahead < experts * tiles2 ? tile2(ahead) : nullptr, bytes2(ahead), seg.count[e]);
    alignas(64) float c[kMoeTileM * kMoeDownTileN];
    for (int64_t r0 = seg.start[e], r1 = seg.start[e] + seg.count[e]; r0 < r1; r0 += kMoeTileM) {
      const int64_t m = std::min(kMoeTileM, r1 - r0);
      at::native::cpublas::brgemm(m, width, F, F, width, width, false, h + r0 * F, b, c);
      for (int64_t r = 0; r < m; ++r) {
        prefetch.row();
        for (int64_t d = 0; d < nt; d += kP) {
          const int64_t n = std::min(kP, nt - d);
          fVec lo, hi;
          load2(c + r * width + d, n, lo, hi);
          store2(ys + (r0 + r) * H + n0 + d, lo, hi, n);
        }
      }
    }
  });
}

// w13 [E, 2F, H] / w2 [E, H, F] plain, or (when `packed` is given) ignored and possibly empty.
at::Tensor fused_moe(at::Tensor x, at::Tensor topk_weights, at::Tensor topk_ids, at::Tensor w13,
                        at::Tensor w2, int64_t expert_offset, const PackedExperts* packed) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "fused_moe: x must be contiguous [tokens, hidden]");
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong && topk_ids.is_contiguous() && topk_ids.dim() == 2 &&
              topk_ids.size(0) == x.size(0), "fused_moe: topk_ids must be contiguous int64 [tokens, top_k]");
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat && topk_weights.is_contiguous() &&
              topk_weights.sizes() == topk_ids.sizes(), "fused_moe: topk_weights must be contiguous float32 like topk_ids");
  const int64_t tokens = x.size(0), hidden = x.size(1), top_k = topk_ids.size(1);
  int64_t experts;
  if (packed != nullptr) {
    TORCH_CHECK(packed->hidden == hidden && (packed->layout == "blocks" || packed->dtype() == x.scalar_type()),
                "fused_moe: the packed experts' hidden size or dtype does not match x");
    experts = packed->num_experts;
  } else {
    TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.size(0) == w2.size(0) && w13.size(2) == hidden &&
                w2.size(1) == hidden && w13.size(1) == 2 * w2.size(2),
                "fused_moe: w13 must be [experts, 2 * ffn, hidden] and w2 [experts, hidden, ffn]");
    TORCH_CHECK(w13.scalar_type() == x.scalar_type() && w2.scalar_type() == x.scalar_type(),
                "fused_moe: expert weights and x dtypes differ");
    experts = w13.size(0);
  }
  auto out = at::empty({tokens, hidden}, x.options());
  if (tokens == 0) return out;
  const bool brgemm = packed != nullptr && packed->layout == "brgemm";
  const bool blocks = packed != nullptr && packed->layout == "blocks";  // no per-shape state: no padding
  const auto seg = sort_by_expert(topk_ids.data_ptr<int64_t>(), tokens * top_k, top_k, experts, expert_offset,
                                  !brgemm && !blocks);
  const auto xs = gather_rows(x, seg.row_token);
  const int64_t rows = seg.start[experts];
  // Each sorted row's expert output, alive until the combine: one buffer (brgemm), or one per expert.
  at::Tensor y_rows;
  std::vector<at::Tensor> ys(experts);
  if (brgemm) {
    auto h = at::empty({rows, packed->ffn}, x.options());
    y_rows = at::empty({rows, hidden}, x.options());
    experts_brgemm(*packed, seg, xs.data_ptr<c10::BFloat16>(), h.data_ptr<c10::BFloat16>(),
                   y_rows.data_ptr<c10::BFloat16>());
  } else {
    for (int64_t e = 0; e < experts; ++e) {
      if (seg.count[e] == 0) continue;
      const auto xe = xs.narrow(0, seg.start[e], seg.start[e + 1] - seg.start[e]);
      if (blocks) {
        const auto matmul = [&](const at::Tensor& rows, const at::Tensor& w) {
          const auto wide = rows.to(at::kFloat).contiguous();
          const LinearFn fn = wide.size(0) <= packed->register_rows ? packed->register_kernel : packed->tiled_kernel;
          return fn(wide, w, packed->fmt).to(x.scalar_type());
        };
        ys[e] = matmul(silu_and_mul(matmul(xe, packed->w13[e]).contiguous()), packed->w2[e]);
      } else if (packed != nullptr) {
        ys[e] = packed_linear(silu_and_mul(packed_linear(xe, packed->w13[e]).contiguous()), packed->w2[e]);
      } else {
        ys[e] = at::linear(silu_and_mul(at::linear(xe, w13[e]).contiguous()), w2[e]);
      }
      ys[e] = ys[e].contiguous();
    }
  }
  PW_DISPATCH(x.scalar_type(), "fused_moe", [&] {
    std::vector<const scalar_t*> slot_src(tokens * top_k, nullptr);
    for (int64_t i = 0; i < tokens * top_k; ++i) {
      const int64_t r = seg.slot_row[i];
      if (r < 0) continue;
      if (brgemm) {
        slot_src[i] = y_rows.data_ptr<scalar_t>() + r * hidden;
        continue;
      }
      const int64_t e = std::upper_bound(seg.start.begin(), seg.start.end(), r) - seg.start.begin() - 1;
      slot_src[i] = ys[e].data_ptr<scalar_t>() + (r - seg.start[e]) * hidden;
    }
    combine_impl<scalar_t>(out.data_ptr<scalar_t>(), topk_weights.data_ptr<float>(), slot_src, tokens, top_k, hidden);
  });
  return out;
}

// ---- a decode step's decoder layers in one call ------------------------------------------------

// What the Llama-family modules (engine/models/llama.py) run per layer on the cpu backend, op for
// op and in their order, without the ~250 us of Python and dispatch those modules cost per layer
// on a slow core (a third of a single-sequence decode step there). The quantized matmul is
// kernels/cpu_quant.cpp's linear_f32, or its linear_q8 / linear_q16 for a weight whose format
// carries kInt8Activations / kInt16Activations, reached through the addresses that module hands
// out (both are built against the same libtorch). Per layer, 9 weights: [input norm, qkv, o,
// post-attention norm, gate_up, down, qkv bias (Qwen2), q norm, k norm (Qwen3)], an empty tensor
// where the model has none; formats [qkv, o, gate_up, down] (a GGUF block format, or kPlainWeight /
// kPackedWeight); caches [key, value] (the physical tensors); kv_scales [k_scale, v_scale]. engine/models/cpu_fused_layers.py decides when this path is the
// modules' path (dense MLP, one rank, the register kernel's rows) and checks it against them.
constexpr size_t kLayerWeights = 9;
// A float weight's "format": plain (F.linear) or packed by oneDNN (kernels/cpu_ops.py
// pack_linear_weight, multiplied by mkldnn::_linear_pointwise, called boxed here so that no C++
// signature of a private op is assumed).
constexpr int64_t kPlainWeight = -1, kPackedWeight = -2;
// Added to a block format: the module quantizes its activations to int8 (linear_q8) or int16
// (linear_q16), as engine/models/cpu_fused_layers.py's ACTIVATION_CODES says.
constexpr int64_t kInt8Activations = 256, kInt16Activations = 512;

// cpu_quant.cpp's block-format matmuls: float activations, int8 ones and int16 ones, and the most rows
// each integer kind takes (kernels/cpu_quant.py ACTIVATION_ROWS; more rows take float activations).
struct Linears {
  LinearFn f32, q8, q16;
  int64_t q8_rows, q16_rows;
};

// x @ w^T (+ bias) exactly as the module's matmul computes it: GGUF blocks through linear_f32 (or
// the integer-activation kernel its format code names) with the bias added in place after, float
// weights through the same ATen / oneDNN op with the bias in it.
at::Tensor layer_linear(Linears linear, const at::Tensor& x, const at::Tensor& w, int64_t fmt,
                        const at::Tensor& bias) {
  const bool has_bias = bias.defined() && bias.numel();
  if (fmt >= 0) {
    const int64_t rows = x.size(0);
    auto y = fmt >= kInt16Activations ? (rows <= linear.q16_rows ? linear.q16(x, w, fmt - kInt16Activations)
                                                                 : linear.f32(x, w, fmt - kInt16Activations))
             : fmt >= kInt8Activations ? (rows <= linear.q8_rows ? linear.q8(x, w, fmt - kInt8Activations)
                                                                 : linear.f32(x, w, fmt - kInt8Activations))
                                       : linear.f32(x, w, fmt);
    if (has_bias) y += bias;
    return y;
  }
  const c10::optional<at::Tensor> b = has_bias ? c10::optional<at::Tensor>(bias) : c10::nullopt;
  if (fmt == kPlainWeight) return at::linear(x, w, b);
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, w, b.has_value() ? c10::IValue(*b) : c10::IValue(), c10::IValue("none"),
                          c10::IValue(c10::List<c10::optional<at::Scalar>>()), c10::IValue("")};
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

// kernels/cpu_lora.cpp's two ops (engine/layers/lora.py calls them per linear; so does DecoderLayers):
// y += each token's adapter's B A x, the sums in float32, slot -1 for none.
using LoraShrinkFn = at::Tensor (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&);
using LoraExpandFn = void (*)(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const std::vector<int64_t>&);

// A model's decoder layers bound once: the per-layer weights, formats, caches and scales, the
// attention shape and the matmuls' addresses. A step then passes only its own tensors, not the
// weight list (270 tensors for the default model) converted from Python again on every call (~25 us
// a step on the AVX2 machine). Bound again whenever the runner allocates new caches.
struct DecoderLayers {
  std::vector<at::Tensor> weights;
  std::vector<int64_t> formats;
  std::vector<at::Tensor> caches;
  std::vector<double> kv_scales;
  int64_t num_heads, num_kv_heads;
  double eps, scale;
  Linears linear;
  // LoRA (bind_lora): per layer A and B of qkv, o, gate_up, down (8 tensors, the modules' slots, filled
  // in place), each linear's output rows per part (qkv's 3, o's 1, gate_up's 2, down's 1), the two ops.
  std::vector<at::Tensor> lora;
  std::vector<std::vector<int64_t>> lora_slices;
  std::vector<at::Tensor> lora_filled;  // per linear: bool [slots], the slots whose adapter targets it
  LoraShrinkFn lora_shrink = nullptr;
  LoraExpandFn lora_expand = nullptr;

  DecoderLayers(std::vector<at::Tensor> weights_, std::vector<int64_t> formats_, std::vector<at::Tensor> caches_,
                std::vector<double> kv_scales_, int64_t num_heads_, int64_t num_kv_heads_, double eps_, double scale_,
                int64_t linear_address, int64_t linear_q8_address, int64_t linear_q16_address, int64_t q8_rows,
                int64_t q16_rows)
      : weights(std::move(weights_)), formats(std::move(formats_)), caches(std::move(caches_)),
        kv_scales(std::move(kv_scales_)), num_heads(num_heads_), num_kv_heads(num_kv_heads_), eps(eps_),
        scale(scale_),
        linear{reinterpret_cast<LinearFn>(linear_address), reinterpret_cast<LinearFn>(linear_q8_address),
               reinterpret_cast<LinearFn>(linear_q16_address), q8_rows, q16_rows} {
    const size_t layers = weights.size() / kLayerWeights;
    TORCH_CHECK(weights.size() == kLayerWeights * layers && formats.size() == 4 * layers &&
                caches.size() == 2 * layers && kv_scales.size() == 2 * layers,
                "DecoderLayers: 9 weights, 4 formats, 2 caches, 2 scales a layer");
  }

  void bind_lora(std::vector<at::Tensor> ab, std::vector<std::vector<int64_t>> slices,
                 std::vector<at::Tensor> filled, int64_t shrink_address, int64_t expand_address) {
    const size_t layers = weights.size() / kLayerWeights;
    TORCH_CHECK(ab.size() == 8 * layers && slices.size() == 4 * layers && filled.size() == 4 * layers,
                "DecoderLayers.bind_lora: A and B of 4 linears a layer, each linear's part sizes and filled slots");
    lora = std::move(ab);
    lora_slices = std::move(slices);
    lora_filled = std::move(filled);
    lora_shrink = reinterpret_cast<LoraShrinkFn>(shrink_address);
    lora_expand = reinterpret_cast<LoraExpandFn>(expand_address);
  }

  // (hidden, residual) after every layer, for a step's hidden states [tokens, hidden] (residual
  // None where the first layer starts the residual stream); lora_slots: each token's adapter slot
  // (int32, -1 none) when the step runs adapters (bind_lora first).
  std::vector<at::Tensor> forward(at::Tensor hidden, c10::optional<at::Tensor> residual, at::Tensor cos,
                                     at::Tensor sin, at::Tensor slot_mapping, at::Tensor block_tables,
                                     at::Tensor row_seq, at::Tensor lens,
                                     c10::optional<at::Tensor> lora_slots) const;
};

std::vector<at::Tensor> DecoderLayers::forward(at::Tensor hidden, c10::optional<at::Tensor> residual,
                                                  at::Tensor cos, at::Tensor sin, at::Tensor slot_mapping,
                                                  at::Tensor block_tables, at::Tensor row_seq,
                                                  at::Tensor lens, c10::optional<at::Tensor> lora_slots) const {
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "DecoderLayers: hidden must be contiguous [tokens, hidden]");
  const size_t layers = weights.size() / kLayerWeights;
  const bool adapted = lora_slots.has_value();
  TORCH_CHECK(!adapted || (!lora.empty() && lora_slots->scalar_type() == at::kInt && lora_slots->is_contiguous() &&
                           lora_slots->numel() == hidden.size(0)),
              "DecoderLayers: lora_slots need bind_lora and one int32 slot a token");
  std::vector<int32_t> step_slots;  // the distinct adapter slots of this step's tokens
  if (adapted) {
    const int32_t* s = lora_slots->data_ptr<int32_t>();
    for (int64_t t = 0; t < lora_slots->numel(); ++t) {
      if (s[t] >= 0 && std::find(step_slots.begin(), step_slots.end(), s[t]) == step_slots.end()) {
        step_slots.push_back(s[t]);
      }
    }
  }
  // The layer's linear, then its adapters' B A x where one of the step's adapters targets it.
  auto adapted_linear = [&](size_t l, int which, const at::Tensor& x, const at::Tensor& w, int64_t fmt,
                            const at::Tensor& bias) {
    auto y = layer_linear(linear, x, w, fmt, bias);
    const bool* filled = adapted ? lora_filled[4 * l + which].data_ptr<bool>() : nullptr;
    if (adapted && std::any_of(step_slots.begin(), step_slots.end(), [&](int32_t s) { return filled[s]; })) {
      const at::Tensor buf = lora_shrink(x, lora[8 * l + 2 * which], *lora_slots);
      lora_expand(y, buf, lora[8 * l + 2 * which + 1], *lora_slots, lora_slices[4 * l + which]);
    }
    return y;
  };
  const int64_t tokens = hidden.size(0), heads = num_heads + num_kv_heads, rows = row_seq.numel();
  at::Tensor x, res = residual.has_value() ? *residual : at::Tensor();
  for (size_t l = 0; l < layers; ++l) {
    const at::Tensor* w = &weights[kLayerWeights * l];
    const int64_t* f = &formats[4 * l];
    const double k_scale = kv_scales[2 * l], v_scale = kv_scales[2 * l + 1];
    if (!res.defined()) {  // the first layer of a stage that starts the residual stream
      res = hidden;
      x = rms_norm(hidden, c10::nullopt, w[0], eps)[0];
    } else {
      auto outs = rms_norm(hidden, res, w[0], eps);
      x = outs[0];
      res = outs[1];
    }
    auto qkv = adapted_linear(l, 0, x, w[1], f[0], w[6]);
    const int64_t head_dim = qkv.size(1) / (heads + num_kv_heads);
    auto qk = qkv.narrow(1, 0, heads * head_dim).view({tokens, heads, head_dim});
    auto v = qkv.narrow(1, heads * head_dim, num_kv_heads * head_dim).view({tokens, num_kv_heads, head_dim});
    if (w[7].numel()) {  // Qwen3: each head's q and k normalized, then side by side again
      qk = at::cat({rms_norm(qk.narrow(1, 0, num_heads).contiguous(), c10::nullopt, w[7], eps)[0],
                    rms_norm(qk.narrow(1, num_heads, num_kv_heads).contiguous(), c10::nullopt, w[8], eps)[0]}, 1);
    }
    rotary_(qk, cos, sin);
    write_kv(qk.narrow(1, num_heads, num_kv_heads), v, caches[2 * l], caches[2 * l + 1], slot_mapping, k_scale,
             v_scale);
    auto q = qk.narrow(1, 0, num_heads);
    auto o = at::empty(q.sizes(), q.options());
    paged_attention(o, q, caches[2 * l], caches[2 * l + 1], block_tables, row_seq, lens, scale, k_scale, v_scale, 0,
                    0.0, c10::nullopt);
    if (rows < tokens) o.narrow(0, rows, tokens - rows).zero_();
    const at::Tensor none;
    auto attn = adapted_linear(l, 1, o.view({tokens, num_heads * head_dim}), w[2], f[1], none);
    auto outs = rms_norm(attn, res, w[3], eps);
    res = outs[1];
    auto gate_up = adapted_linear(l, 2, outs[0], w[4], f[2], none);
    hidden = adapted_linear(l, 3, silu_and_mul(gate_up), w[5], f[3], none);
  }
  return {hidden, res};
}

// Sets the CPUs each of the op threads (torch's OpenMP team, the calling thread first) may run on:
// thread i gets cpus[i] alone when one_each (a thread per CPU: beside busy loops the scheduler's
// placement of unbound threads at times cost two thirds of their rate, engine/runner/cpu_threads.py), else
// every thread gets all of cpus. Each thread sets its own mask; at::parallel_for over one index per
// thread hands thread t the index t (ATen's OpenMP split), and a team smaller than asked still
// covers its threads. Returns how many threads set theirs; a failed call (a CPU outside the cgroup's
// set) leaves that thread's mask as it was.
int64_t set_thread_cpus(const std::vector<int64_t>& cpus, bool one_each) {
  TORCH_CHECK(!cpus.empty(), "set_thread_cpus: no CPUs given");
  std::atomic<int64_t> done{0};
#ifdef __linux__
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t begin, int64_t) {
    cpu_set_t mask;
    CPU_ZERO(&mask);
    if (one_each) {
      CPU_SET(cpus[begin % static_cast<int64_t>(cpus.size())], &mask);
    } else {
      for (int64_t cpu : cpus) CPU_SET(cpu, &mask);
    }
    done += sched_setaffinity(0, sizeof(mask), &mask) == 0;
  });
#endif  // elsewhere no thread's mask is set: the op says 0
  return done.load();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<DecoderLayers>(m, "DecoderLayers")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<at::Tensor>,
                          std::vector<double>, int64_t, int64_t, double, double, int64_t, int64_t, int64_t, int64_t,
                          int64_t>())
      .def("bind_lora", &DecoderLayers::bind_lora, "the layers' LoRA slots (engine/layers/lora.py)")
      .def("forward", &DecoderLayers::forward, "a decode step through every layer, the modules' ops in their order",
           pybind11::arg("hidden"), pybind11::arg("residual"), pybind11::arg("cos"), pybind11::arg("sin"),
           pybind11::arg("slot_mapping"), pybind11::arg("block_tables"), pybind11::arg("row_seq"),
           pybind11::arg("lens"), pybind11::arg("lora_slots") = pybind11::none());
  m.def("use_pool", [](int64_t loop, int64_t helpers) {
          g_pool_helpers.store(reinterpret_cast<HelpersFn>(helpers), std::memory_order_release);
          g_pool.store(reinterpret_cast<PoolFn>(loop), std::memory_order_release);
        },
        "run the loops through kernels/cpu_quant.cpp's pool (its parallel_for_address and helpers_address; "
        "0, 0: at::parallel_for)");
  m.def("set_thread_cpus", &set_thread_cpus, "the CPUs each op thread may run on: one each, or all of them");
  m.def("rms_norm", &rms_norm, "weight * norm(x [+ residual]) and the new residual");
  m.def("rotary_", &rotary_, "rotate [tokens, heads, head_dim] in place");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("write_kv", &write_kv, "store keys and values at their slots");
  m.def("apply_token_bitmask_", &apply_token_bitmask_, "set the tokens a grammar's bitmask forbids to -inf, in place");
  m.def("plan_rows", &plan_rows, "a step's attention rows: int64 block tables, each row's sequence and key count");
  m.def("argmax_rows", &argmax_rows, "each row's first maximum (NaN first), as torch.max(dim).indices");
  m.def("paged_attention", &paged_attention, "paged attention, each query row over its first lens[r] keys",
        pybind11::arg("out"), pybind11::arg("query"), pybind11::arg("k_cache"), pybind11::arg("v_cache"),
        pybind11::arg("block_tables"), pybind11::arg("row_seq"), pybind11::arg("lens"), pybind11::arg("scale"),
        pybind11::arg("k_scale"), pybind11::arg("v_scale"), pybind11::arg("window") = 0,
        pybind11::arg("soft_cap") = 0.0, pybind11::arg("sinks").none(true) = pybind11::none());
  m.def("padded_rows", &padded_rows, "the rows an expert's segment of n tokens is padded to");
  m.def("moe_brgemm_available", &moe_brgemm_available, "whether pack_moe_brgemm's layout runs on this CPU (AMX)");
  m.def("pack_moe_brgemm", &pack_moe_brgemm, "bf16 expert weights in VNNI tiles for the brgemm microkernel");
  m.def("pack_moe_blocks", &pack_moe_blocks, "block-format expert weights, multiplied by cpu_quant's kernels");
  pybind11::class_<PackedExperts>(m, "PackedExperts")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t, int64_t>())
      .def_readonly("layout", &PackedExperts::layout)
      .def_readonly("hidden", &PackedExperts::hidden)
      .def_readonly("ffn", &PackedExperts::ffn)
      .def_readonly("num_experts", &PackedExperts::num_experts)
      .def_property_readonly("nbytes", &PackedExperts::nbytes);
  m.def("fused_moe", &fused_moe, "mixture of experts: routed tokens through their local experts, combined",
        pybind11::arg("x"), pybind11::arg("topk_weights"), pybind11::arg("topk_ids"), pybind11::arg("w13"),
        pybind11::arg("w2"), pybind11::arg("expert_offset"), pybind11::arg("packed").none(true));
}
