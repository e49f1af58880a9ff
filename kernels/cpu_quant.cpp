// Matmuls on GGUF block-quantized weights, read as llama.cpp stores them: y[M, N] = x[M, K] @ W[N, K]^T
// with W's rows kept as their raw blocks of 32 weights. Built on first use by kernels/cpu_build.py
// (load_quant) for the CPU capability torch reports; kernels/cpu_quant.py is the Python side and
// says which path runs when.
//
// Block formats (byte layout of one block; value of weight i, i in 0..31):
//   Q8_0  fp16 scale d, int8 q[32]                 d * q[i]
//   Q4_0  fp16 scale d, 16 bytes of nibbles        d * (nibble(i) - 8)
//   Q4_1  fp16 scale d, fp16 min m, 16 nibbles     d * nibble(i) + m
// nibble(i): the low nibble of byte i for i < 16, the high nibble of byte i - 16 otherwise
// (gguf.quants.dequantize, the oracle, reads them so).
//
// Two kernels:
//   linear_f32   dequantizes each block into float registers and FMAs it against up to four float
//                activation rows at once (one dequantization serves them all); exact float math, so
//                it agrees with "dequantize, then a float matmul" to summation order. For decode and
//                small batches, where the weight bytes streamed per token are the cost.
//   linear_q8    llama.cpp's way: the activation rows quantized to int8 per 32-block (scale
//                amax / 127), then integer dot products (AVX-512 VNNI vpdpbusd, unsigned nibbles x
//                signed activations) and one float FMA per block. Fewer instructions per weight than
//                linear_f32, at the price of the activations' int8 rounding (about 0.4% per block).
//   dequantize   whole rows to float or bfloat16, for the prefill path (a oneDNN/MKL GEMM on the
//                dequantized matrix beats both kernels once enough rows share each weight).
// Threads split the output rows N (at::parallel_for): each thread streams its own weight rows once
// and keeps them in L1 while it walks every activation row.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace {

enum Format : int64_t { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2 };
constexpr int64_t kBlock = 32;

inline int64_t block_bytes(int64_t fmt) {
  switch (fmt) {
    case kQ8_0: return 34;
    case kQ4_0: return 18;
    case kQ4_1: return 20;
  }
  TORCH_CHECK(false, "unknown block format ", fmt);
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// One block as 32 floats (the portable path, and the reference inside the AVX-512 file).
template <int64_t F>
inline void dequant_block_scalar(const uint8_t* b, float* w) {
  const float d = half_at(b);
  if constexpr (F == kQ8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    for (int i = 0; i < 32; ++i) w[i] = d * q[i];
  } else {
    const uint8_t* qs = b + (F == kQ4_1 ? 4 : 2);
    const float m = F == kQ4_1 ? half_at(b + 2) : -8.0f * d;
    for (int i = 0; i < 16; ++i) {
      w[i] = std::fma(static_cast<float>(qs[i] & 0x0F), d, m);
      w[i + 16] = std::fma(static_cast<float>(qs[i] >> 4), d, m);
    }
  }
}

// Output rows per work item: small enough that both threads of a decode get work on the smallest
// projection (192 rows), large enough to amortise the per-item overhead.
constexpr int64_t kRowsPerTask = 16;

#if defined(CPU_CAPABILITY_AVX512)

// A block's 32 weights as two float vectors (weights 0..15, 16..31).
// An fp16 at p broadcast to 16 floats, in vector registers (vcvtph2ps): the scalar conversion
// costs more than the rest of a block's dequantization.
inline __m512 half_bcast(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(bits)));
}

template <int64_t F>
inline void dequant_block(const uint8_t* b, __m512& w0, __m512& w1) {
  const __m512 d = half_bcast(b);
  if constexpr (F == kQ8_0) {
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 2)))), d);
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 18)))), d);
  } else {
    const __m128i v = _mm_loadu_si128((const __m128i*)(b + (F == kQ4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(v, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
    const __m512 m = F == kQ4_1 ? half_bcast(b + 2) : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
    w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), d, m);
    w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), d, m);
  }
}

// R activation rows (stride K) against one weight row of nb blocks: R dot products.
template <int64_t F, int R>
inline void dot_rows(const uint8_t* w, int64_t nb, const float* x, int64_t K, float* out) {
  constexpr int64_t bb = F == kQ8_0 ? 34 : (F == kQ4_0 ? 18 : 20);
  // Two accumulators per row (one per half block): with one, a decode row (R = 1) waits on the
  // FMA latency chain, measured 1.4x slower than the block's dequantization alone.
  __m512 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512 w0, w1;
    dequant_block<F>(w + b * bb, w0, w1);
    const float* xb = x + b * kBlock;
    for (int r = 0; r < R; ++r) {
      acc0[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb + r * K), acc0[r]);
      acc1[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + r * K + 16), acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r]));
}

#else

template <int64_t F, int R>
inline void dot_rows(const uint8_t* w, int64_t nb, const float* x, int64_t K, float* out) {
  constexpr int64_t bb = F == kQ8_0 ? 34 : (F == kQ4_0 ? 18 : 20);
  float acc[R] = {};
  float wf[32];
  for (int64_t b = 0; b < nb; ++b) {
    dequant_block_scalar<F>(w + b * bb, wf);
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * K + b * kBlock;
      float s = 0.0f;
      for (int i = 0; i < 32; ++i) s = std::fma(wf[i], xb[i], s);
      acc[r] += s;
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

#endif

template <int64_t F>
void linear_f32_impl(const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t nb = K / kBlock, row_bytes = nb * block_bytes(F);
  at::parallel_for(0, N, kRowsPerTask, [&](int64_t n0, int64_t n1) {
    float out[4];
    for (int64_t m = 0; m < M; m += 4) {
      const int64_t rows = std::min<int64_t>(4, M - m);
      const float* xm = x + m * K;
      for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* wn = w + n * row_bytes;
        switch (rows) {
          case 4: dot_rows<F, 4>(wn, nb, xm, K, out); break;
          case 3: dot_rows<F, 3>(wn, nb, xm, K, out); break;
          case 2: dot_rows<F, 2>(wn, nb, xm, K, out); break;
          default: dot_rows<F, 1>(wn, nb, xm, K, out); break;
        }
        for (int64_t r = 0; r < rows; ++r) y[(m + r) * N + n] = out[r];
      }
    }
  });
}

void check_weight(const at::Tensor& w, int64_t fmt, int64_t K) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "quantized weight: contiguous uint8 [N, row bytes]");
  TORCH_CHECK(K % kBlock == 0, "in_features ", K, " is not a multiple of the block size 32");
  TORCH_CHECK(w.size(1) == K / kBlock * block_bytes(fmt), "quantized weight rows hold ", w.size(1),
              " bytes, not ", K / kBlock * block_bytes(fmt), " for ", K, " inputs");
}

// ---- Q8 activations + integer dot products ------------------------------------------------------

// Activation rows as int8 blocks of 32 with a float scale each (llama.cpp's block_q8_0 without the
// fp16 rounding of the scale) and the block's sum of q times its scale, which the min of a Q4_1
// block and the -8 offset of a Q4_0 block multiply.
struct Q8Rows {
  std::vector<int8_t> q;   // [M, K]
  std::vector<float> d;    // [M, K / 32]
  std::vector<float> s;    // [M, K / 32]: d * sum(q) of the block
};

Q8Rows quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / kBlock;
  Q8Rows a{std::vector<int8_t>(M * K), std::vector<float>(M * nb), std::vector<float>(M * nb)};
  at::parallel_for(0, M * nb, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* xb = x + i * kBlock;
      float amax = 0.0f;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float d = amax / 127.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
      int sum = 0;
      for (int j = 0; j < 32; ++j) {
        const int q = static_cast<int>(std::nearbyint(xb[j] * inv));
        a.q[i * kBlock + j] = static_cast<int8_t>(q);
        sum += q;
      }
      a.d[i] = d;
      a.s[i] = d * static_cast<float>(sum);
    }
  });
  return a;
}

#if defined(CPU_CAPABILITY_AVX512)
#define PAGEWISE_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))

// One weight row against R quantized activation rows; the integer dot of a block is 8 int32 lanes
// (256-bit vpdpbusd), turned to float and FMA'd with the product of the two scales.
template <int64_t F, int R>
PAGEWISE_VNNI inline void dot_rows_q8(const uint8_t* w, int64_t nb, const Q8Rows& a, int64_t m, int64_t K,
                                      float* out) {
  constexpr int64_t bb = F == kQ8_0 ? 34 : (F == kQ4_0 ? 18 : 20);
  __m256 acc[R];
  float offset[R] = {};  // the min / -8 terms: sum over blocks of m_w * d_x * sum(q_x)
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = w + b * bb;
    const float d = half_at(wb);
    __m256i wq;  // Q4: the nibbles as unsigned bytes; Q8_0: |q|, its sign moved onto the activations
    __mmask32 neg = 0;
    if constexpr (F == kQ8_0) {
      const __m256i q = _mm256_loadu_si256((const __m256i*)(wb + 2));
      neg = _mm256_movepi8_mask(q);
      wq = _mm256_abs_epi8(q);
    } else {
      const __m128i v = _mm_loadu_si128((const __m128i*)(wb + (F == kQ4_1 ? 4 : 2)));
      wq = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
    }
    const float mw = F == kQ4_1 ? half_at(wb + 2) : -8.0f * d;
    for (int r = 0; r < R; ++r) {
      const int64_t i = (m + r) * nb + b;
      __m256i xq = _mm256_loadu_si256((const __m256i*)(a.q.data() + (m + r) * K + b * kBlock));
      if constexpr (F == kQ8_0) xq = _mm256_mask_sub_epi8(xq, neg, _mm256_setzero_si256(), xq);
      const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wq, xq);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * a.d[i]), acc[r]);
      if constexpr (F != kQ8_0) offset[r] += mw * a.s[i];
    }
  }
  for (int r = 0; r < R; ++r) {
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_movehdup_ps(v));
    out[r] = _mm_cvtss_f32(v) + offset[r];
  }
}

bool has_vnni() { return __builtin_cpu_supports("avx512vnni"); }
#else
template <int64_t F, int R>
inline void dot_rows_q8(const uint8_t* w, int64_t nb, const Q8Rows& a, int64_t m, int64_t K, float* out) {
  constexpr int64_t bb = F == kQ8_0 ? 34 : (F == kQ4_0 ? 18 : 20);
  float wf[32];
  for (int r = 0; r < R; ++r) out[r] = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    dequant_block_scalar<F>(w + b * bb, wf);
    for (int r = 0; r < R; ++r) {
      const int64_t i = (m + r) * nb + b;
      const int8_t* xq = a.q.data() + (m + r) * K + b * kBlock;
      float s = 0.0f;
      for (int j = 0; j < 32; ++j) s += wf[j] * xq[j];
      out[r] += s * a.d[i];
    }
  }
}

bool has_vnni() { return false; }
#endif

template <int64_t F>
void linear_q8_impl(const Q8Rows& a, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t nb = K / kBlock, row_bytes = nb * block_bytes(F);
  at::parallel_for(0, N, kRowsPerTask, [&](int64_t n0, int64_t n1) {
    float out[4];
    for (int64_t m = 0; m < M; m += 4) {
      const int64_t rows = std::min<int64_t>(4, M - m);
      for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* wn = w + n * row_bytes;
        switch (rows) {
          case 4: dot_rows_q8<F, 4>(wn, nb, a, m, K, out); break;
          case 3: dot_rows_q8<F, 3>(wn, nb, a, m, K, out); break;
          case 2: dot_rows_q8<F, 2>(wn, nb, a, m, K, out); break;
          default: dot_rows_q8<F, 1>(wn, nb, a, m, K, out); break;
        }
        for (int64_t r = 0; r < rows; ++r) y[(m + r) * N + n] = out[r];
      }
    }
  });
}

template <typename Fn>
void by_format(int64_t fmt, Fn&& fn) {
  switch (fmt) {
    case kQ8_0: fn(std::integral_constant<int64_t, kQ8_0>{}); break;
    case kQ4_0: fn(std::integral_constant<int64_t, kQ4_0>{}); break;
    case kQ4_1: fn(std::integral_constant<int64_t, kQ4_1>{}); break;
    default: TORCH_CHECK(false, "unknown block format ", fmt);
  }
}

// ---- the ops -------------------------------------------------------------------------------------

// x [M, K] float32 contiguous, w [N, K / 32 * block bytes] uint8 -> y [M, N] float32.
at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w, int64_t fmt) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_weight(w, fmt, K);
  auto y = at::empty({M, N}, x.options());
  by_format(fmt, [&](auto F) {
    linear_f32_impl<decltype(F)::value>(x.data_ptr<float>(), w.data_ptr<uint8_t>(), y.data_ptr<float>(), M, N, K);
  });
  return y;
}

at::Tensor linear_q8(const at::Tensor& x, const at::Tensor& w, int64_t fmt) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_weight(w, fmt, K);
#if defined(CPU_CAPABILITY_AVX512)
  TORCH_CHECK(has_vnni(), "linear_q8 needs AVX-512 VNNI, which this CPU lacks");
#endif
  auto y = at::empty({M, N}, x.options());
  const Q8Rows a = quantize_rows(x.data_ptr<float>(), M, K);
  by_format(fmt, [&](auto F) {
    linear_q8_impl<decltype(F)::value>(a, w.data_ptr<uint8_t>(), y.data_ptr<float>(), M, N, K);
  });
  return y;
}

// w [N, row bytes] -> [N, K] float32, or bfloat16 (each weight rounded once) when bf16.
at::Tensor dequantize(const at::Tensor& w, int64_t fmt, int64_t K, bool bf16) {
  check_weight(w, fmt, K);
  const auto dtype = bf16 ? at::kBFloat16 : at::kFloat;
  const int64_t N = w.size(0), nb = K / kBlock, bb = block_bytes(fmt);
  auto out = at::empty({N, K}, w.options().dtype(dtype));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  by_format(fmt, [&](auto F) {
    at::parallel_for(0, N, kRowsPerTask, [&](int64_t n0, int64_t n1) {
      float buf[32];
      for (int64_t n = n0; n < n1; ++n) {
        for (int64_t b = 0; b < nb; ++b) {
          dequant_block_scalar<decltype(F)::value>(wp + n * nb * bb + b * bb, buf);
          if (dtype == at::kFloat) {
            std::memcpy(out.data_ptr<float>() + n * K + b * kBlock, buf, sizeof(buf));
          } else {
            c10::BFloat16* o = out.data_ptr<c10::BFloat16>() + n * K + b * kBlock;
            for (int i = 0; i < 32; ++i) o[i] = c10::BFloat16(buf[i]);
          }
        }
      }
    });
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_f32", &linear_f32, "x @ dequant(w)^T, blocks dequantized to float in registers");
  m.def("linear_q8", &linear_q8, "x @ dequant(w)^T with x quantized to int8 per 32-block (integer dots)");
  m.def("dequantize", &dequantize, "block-quantized rows -> float32 / bfloat16 [N, K]");
  m.def("has_vnni", &has_vnni, "whether linear_q8 runs on AVX-512 VNNI");
}
