// Multi-LoRA on the CPU, Punica's two ops: lora_shrink (x @ A^T into a float32 buffer, per token's
// adapter slot) and lora_expand (y += buffer @ B^T per output slice, in place). kernels/reference.py
// defines both; kernels/cpu_lora.py is the Python side. Built on first use by kernels/cpu_build.py
// (load_lora) with ATen's SIMD types for the CPU capability torch reports, threaded with
// at::parallel_for over (token, block of output columns): a decode step's few tokens still split
// across cores, and each work item reads only its token's adapter.
//
// Shapes: x [T, K] (rows contiguous, any row stride), lora_a [S, N, K], token_slots [T] int32
// (-1: no adapter), buf [T, N] float32, y [T, M] (rows contiguous), lora_b [S, M, R], out_slices with
// sum M and len * R == N. Sums are float32; y gets the sum rounded to its dtype, then added.

// ATen's tensor and the few ops used, not <torch/extension.h>: header parsing a first LoRA call waits for.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 (with its STL casters) and its at::Tensor caster
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kF = fVec::size();
constexpr int64_t kRows = 4;            // rows of A or B sharing each load of x or of the buffer
constexpr int64_t kExpandRows = 64;     // output columns of one expand work item
constexpr int64_t kItemWork = 1 << 15;  // multiply-adds below which a loop chunk is not worth a thread

// n <= kF elements of T as floats, lanes past n zero. AVX-512 loads a partial vector under a mask, so
// an odd rank costs no more than a full one; elsewhere ATen's partial load copies through a buffer.
template <typename T>
inline fVec load_f(const T* p, int64_t n = kF) {
  if constexpr (std::is_same_v<T, float>) {
#if defined(CPU_CAPABILITY_AVX512)
    if (n < kF) return fVec(_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p));
#endif
    return fVec::loadu(p, n);
  } else {
#if defined(CPU_CAPABILITY_AVX512)
    const __m256i raw = n == kF ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                : _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p);
    if constexpr (std::is_same_v<T, c10::BFloat16>)
      return fVec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
    else
      return fVec(_mm512_cvtph_ps(raw));
#else
#if defined(CPU_CAPABILITY_AVX2)
    if (n == kF) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      if constexpr (std::is_same_v<T, c10::BFloat16>)
        return fVec(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)));
      else
        return fVec(_mm256_cvtph_ps(raw));
    }
#endif
    auto v = at::vec::Vectorized<T>::loadu(p, n);
    return std::get<0>(at::vec::convert_to_float<T>(v));
#endif
  }
}

inline float sum_lanes(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, v);
}

// out[i] = a[i * lda : i * lda + len] . v for ROWS rows of a, in float32.
template <int ROWS, typename T, typename V>
inline void dot_rows(const T* a, int64_t lda, const V* v, int64_t len, float* out) {
  fVec acc[ROWS];
  for (int i = 0; i < ROWS; ++i) acc[i] = fVec(0.f);
  int64_t k = 0;
  for (; k + kF <= len; k += kF) {
    const fVec vv = load_f(v + k);
    for (int i = 0; i < ROWS; ++i) acc[i] = at::vec::fmadd(load_f(a + i * lda + k), vv, acc[i]);
  }
  if (k < len) {
    const fVec vv = load_f(v + k, len - k);
    for (int i = 0; i < ROWS; ++i) acc[i] = at::vec::fmadd(load_f(a + i * lda + k, len - k), vv, acc[i]);
  }
  for (int i = 0; i < ROWS; ++i) out[i] = sum_lanes(acc[i]);
}

// Every slot in [-1, slots) (read once, serially, so that the threaded loops never index out of range).
void check_slots(const at::Tensor& token_slots, int64_t tokens, int64_t slots) {
  TORCH_CHECK(token_slots.scalar_type() == at::kInt && token_slots.dim() == 1 && token_slots.numel() == tokens &&
                  token_slots.is_contiguous(),
              "token_slots must be a contiguous int32 [", tokens, "] tensor");
  const int32_t* s = token_slots.data_ptr<int32_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(s[t] >= -1 && s[t] < slots, "token ", t, " has adapter slot ", s[t], "; the weights hold ", slots);
}

template <typename T>
void shrink_impl(const at::Tensor& x, const at::Tensor& lora_a, const int32_t* slots, at::Tensor& buf) {
  const int64_t tokens = x.size(0), k = x.size(1), n = lora_a.size(1), stride = x.stride(0);
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  const T* ap = reinterpret_cast<const T*>(lora_a.data_ptr());
  float* out = buf.data_ptr<float>();
  const int64_t groups = (n + kRows - 1) / kRows;
  const int64_t grain = std::max<int64_t>(1, kItemWork / (kRows * std::max<int64_t>(k, 1)));
  at::parallel_for(0, tokens * groups, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / groups, row = item % groups * kRows, rows = std::min(kRows, n - row);
      float* o = out + t * n + row;
      if (slots[t] < 0) {
        std::fill(o, o + rows, 0.f);
        continue;
      }
      const T* a = ap + (slots[t] * n + row) * k;
      const T* xt = xp + t * stride;
      if (rows == kRows) {
        dot_rows<kRows>(a, k, xt, k, o);
      } else {
        for (int64_t i = 0; i < rows; ++i) dot_rows<1>(a + i * k, k, xt, k, o + i);
      }
    }
  });
}

at::Tensor lora_shrink(const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& token_slots) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [T, K] with contiguous rows");
  TORCH_CHECK(lora_a.dim() == 3 && lora_a.is_contiguous() && lora_a.size(2) == x.size(1) &&
                  lora_a.scalar_type() == x.scalar_type(),
              "lora_a must be a contiguous [S, N, K] tensor of x's dtype");
  check_slots(token_slots, x.size(0), lora_a.size(0));
  at::Tensor buf = at::empty({x.size(0), lora_a.size(1)}, x.options().dtype(at::kFloat));
  const int32_t* slots = token_slots.data_ptr<int32_t>();
  switch (x.scalar_type()) {
    case at::kFloat: shrink_impl<float>(x, lora_a, slots, buf); break;
    case at::kBFloat16: shrink_impl<c10::BFloat16>(x, lora_a, slots, buf); break;
    case at::kHalf: shrink_impl<c10::Half>(x, lora_a, slots, buf); break;
    default: TORCH_CHECK(false, "lora_shrink takes float32, bfloat16 or float16, not ", x.scalar_type());
  }
  return buf;
}

struct Block {
  int64_t slice, begin, end;  // output columns [begin, end) of one slice
};

template <typename T>
void expand_impl(at::Tensor& y, const at::Tensor& buf, const at::Tensor& lora_b, const int32_t* slots,
                 const std::vector<Block>& blocks) {
  const int64_t tokens = y.size(0), m = y.size(1), r = lora_b.size(2), n = buf.size(1), stride = y.stride(0);
  T* yp = reinterpret_cast<T*>(y.data_ptr());
  const T* bp = reinterpret_cast<const T*>(lora_b.data_ptr());
  const float* buf_p = buf.data_ptr<float>();
  const int64_t count = static_cast<int64_t>(blocks.size());
  const int64_t grain = std::max<int64_t>(1, kItemWork / (kExpandRows * r));
  at::parallel_for(0, tokens * count, grain, [&](int64_t begin, int64_t end) {
    float sums[kRows];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / count;
      if (slots[t] < 0) continue;
      const Block& block = blocks[item % count];
      const float* v = buf_p + t * n + block.slice * r;
      const T* b = bp + slots[t] * m * r;
      T* out = yp + t * stride;
      for (int64_t col = block.begin; col < block.end; col += kRows) {
        const int64_t cols = std::min(kRows, block.end - col);
        if (cols == kRows) {
          dot_rows<kRows>(b + col * r, r, v, r, sums);
        } else {
          for (int64_t i = 0; i < cols; ++i) dot_rows<1>(b + (col + i) * r, r, v, r, sums + i);
        }
        // The sum rounded to y's dtype, then added (and rounded) in it, as `y += delta.to(y.dtype)`.
        for (int64_t i = 0; i < cols; ++i)
          out[col + i] = static_cast<T>(static_cast<float>(out[col + i]) + static_cast<float>(static_cast<T>(sums[i])));
      }
    }
  });
}

void lora_expand(at::Tensor& y, const at::Tensor& buf, const at::Tensor& lora_b, const at::Tensor& token_slots,
                 const std::vector<int64_t>& out_slices) {
  TORCH_CHECK(y.dim() == 2 && y.stride(1) == 1, "y must be [T, M] with contiguous rows");
  TORCH_CHECK(lora_b.dim() == 3 && lora_b.is_contiguous() && lora_b.size(1) == y.size(1) &&
                  lora_b.scalar_type() == y.scalar_type(),
              "lora_b must be a contiguous [S, M, R] tensor of y's dtype");
  const int64_t r = lora_b.size(2), slices = static_cast<int64_t>(out_slices.size());
  TORCH_CHECK(buf.scalar_type() == at::kFloat && buf.is_contiguous() && buf.dim() == 2 && buf.size(0) == y.size(0) &&
                  buf.size(1) == slices * r,
              "buf must be lora_shrink's contiguous float32 [T, len(out_slices) * R]");
  check_slots(token_slots, y.size(0), lora_b.size(0));
  std::vector<Block> blocks;
  int64_t offset = 0;
  for (int64_t i = 0; i < slices; ++i) {
    TORCH_CHECK(out_slices[i] >= 0, "out_slices must not be negative");
    for (int64_t col = offset; col < offset + out_slices[i]; col += kExpandRows)
      blocks.push_back({i, col, std::min(col + kExpandRows, offset + out_slices[i])});
    offset += out_slices[i];
  }
  TORCH_CHECK(offset == y.size(1), "out_slices sum to ", offset, ", not y's ", y.size(1), " columns");
  if (blocks.empty() || r == 0) return;
  const int32_t* slots = token_slots.data_ptr<int32_t>();
  switch (y.scalar_type()) {
    case at::kFloat: expand_impl<float>(y, buf, lora_b, slots, blocks); break;
    case at::kBFloat16: expand_impl<c10::BFloat16>(y, buf, lora_b, slots, blocks); break;
    case at::kHalf: expand_impl<c10::Half>(y, buf, lora_b, slots, blocks); break;
    default: TORCH_CHECK(false, "lora_expand takes float32, bfloat16 or float16, not ", y.scalar_type());
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lora_shrink", &lora_shrink, "buf [T, N] float32 = x @ lora_a[slot]^T per token (0 for slot -1)");
  m.def("lora_expand", &lora_expand, "y += buf @ lora_b[slot]^T per output slice, in place (slot -1 untouched)");
}
