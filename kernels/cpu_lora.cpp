// Multi-LoRA on the CPU, Punica's two ops: lora_shrink (x @ A^T into a float32 buffer, per token's
// adapter slot) and lora_expand (y += buffer @ B^T per output slice, in place). kernels/reference.py
// defines both; kernels/cpu_lora.py is the Python side. Built on first use by kernels/cpu_build.py
// (load_lora) with ATen's SIMD types for the CPU capability torch reports, threaded with
// at::parallel_for, so that a decode step's few tokens still split across cores.
//   Both ops first group the tokens by slot (a counting sort of token_slots), so that a slot's
//   tokens share each load of its adapter's weights and read them from memory once per call.
//   shrink  work items are (up to 4 tokens of one slot, 4 rows of A): vectorised dot products over
//           K, the tokens sharing each load of A's rows and the rows each load of x.
//   expand  work items are blocks of kExpandRows output columns of one slice: a slot's tokens share
//           the block's B rows, transposed once in registers, so that each token's sums are
//           broadcast FMAs over columns (no horizontal sums).
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
constexpr int64_t kRows = 4;            // rows of A sharing each load of x
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

// Every slot in [-1, slots) (read once, serially, so that the threaded loops never index out of range).
void check_slots(const at::Tensor& token_slots, int64_t tokens, int64_t slots) {
  TORCH_CHECK(token_slots.scalar_type() == at::kInt && token_slots.dim() == 1 && token_slots.numel() == tokens &&
                  token_slots.is_contiguous(),
              "token_slots must be a contiguous int32 [", tokens, "] tensor");
  const int32_t* s = token_slots.data_ptr<int32_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(s[t] >= -1 && s[t] < slots, "token ", t, " has adapter slot ", s[t], "; the weights hold ", slots);
}

// The tokens grouped by slot (a counting sort; slot -1's are left out): slot s's tokens are
// order[starts[s] .. starts[s + 1]), in token order.
void group_by_slot(const int32_t* slots, int64_t tokens, int64_t num_slots, std::vector<int64_t>& starts,
                   std::vector<int64_t>& order) {
  starts.assign(num_slots + 1, 0);
  for (int64_t t = 0; t < tokens; ++t)
    if (slots[t] >= 0) ++starts[slots[t] + 1];
  for (int64_t s = 0; s < num_slots; ++s) starts[s + 1] += starts[s];
  order.resize(starts[num_slots]);
  std::vector<int64_t> next(starts.begin(), starts.end() - 1);
  for (int64_t t = 0; t < tokens; ++t)
    if (slots[t] >= 0) order[next[slots[t]]++] = t;
}

// Tokens of one shrink tile: each load of A's rows serves this many tokens (AVX2 has half the registers).
constexpr int64_t kShrinkTokens = kF >= 16 ? 4 : 2;

// out[u][i] = a[i * k : (i + 1) * k] . x[u][0 : k] for ROWS rows of a and TOKENS rows of x, in float32.
template <int ROWS, int TOKENS, typename T>
inline void shrink_tile(const T* a, const T* const* x, int64_t k, float* const* out) {
  fVec acc[TOKENS][ROWS];
  for (int u = 0; u < TOKENS; ++u)
    for (int i = 0; i < ROWS; ++i) acc[u][i] = fVec(0.f);
  int64_t c = 0;
  for (; c + kF <= k; c += kF) {
    fVec rows[ROWS];
    for (int i = 0; i < ROWS; ++i) rows[i] = load_f(a + i * k + c);
    for (int u = 0; u < TOKENS; ++u) {
      const fVec xv = load_f(x[u] + c);
      for (int i = 0; i < ROWS; ++i) acc[u][i] = at::vec::fmadd(rows[i], xv, acc[u][i]);
    }
  }
  if (c < k) {
    fVec rows[ROWS];
    for (int i = 0; i < ROWS; ++i) rows[i] = load_f(a + i * k + c, k - c);
    for (int u = 0; u < TOKENS; ++u) {
      const fVec xv = load_f(x[u] + c, k - c);
      for (int i = 0; i < ROWS; ++i) acc[u][i] = at::vec::fmadd(rows[i], xv, acc[u][i]);
    }
  }
  for (int u = 0; u < TOKENS; ++u)
    for (int i = 0; i < ROWS; ++i) out[u][i] = sum_lanes(acc[u][i]);
}

template <int TOKENS, typename T>
inline void shrink_rows(const T* a, const T* const* x, int64_t k, int64_t rows, float* const* out) {
  if (rows == kRows) return shrink_tile<kRows, TOKENS>(a, x, k, out);
  float* shifted[TOKENS];
  for (int64_t i = 0; i < rows; ++i) {
    for (int u = 0; u < TOKENS; ++u) shifted[u] = out[u] + i;
    shrink_tile<1, TOKENS>(a + i * k, x, k, shifted);
  }
}

// Work items are (up to kShrinkTokens tokens of one slot, kRows rows of A): the tokens share each
// load of A's rows, the rows each load of x.
template <typename T>
void shrink_impl(const at::Tensor& x, const at::Tensor& lora_a, const int32_t* slots, at::Tensor& buf) {
  const int64_t tokens = x.size(0), k = x.size(1), n = lora_a.size(1), stride = x.stride(0);
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  const T* ap = reinterpret_cast<const T*>(lora_a.data_ptr());
  float* out = buf.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t)
    if (slots[t] < 0) std::fill(out + t * n, out + (t + 1) * n, 0.f);
  std::vector<int64_t> starts, order, chunks;  // chunks: the first index into order of each tile's tokens
  group_by_slot(slots, tokens, lora_a.size(0), starts, order);
  for (int64_t s = 0; s + 1 < static_cast<int64_t>(starts.size()); ++s)
    for (int64_t i = starts[s]; i < starts[s + 1]; i += kShrinkTokens) chunks.push_back(i);
  const int64_t groups = (n + kRows - 1) / kRows, count = static_cast<int64_t>(chunks.size());
  // Multiply-adds of an item, its tile's tokens averaged: a decode step of one token is 1, not 4.
  const int64_t tile_tokens = std::max<int64_t>(1, static_cast<int64_t>(order.size()) / std::max<int64_t>(count, 1));
  const int64_t grain = std::max<int64_t>(1, kItemWork / (kRows * std::max<int64_t>(k, 1) * tile_tokens));
  at::parallel_for(0, count * groups, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t first = chunks[item / groups], row = item % groups * kRows, rows = std::min(kRows, n - row);
      const int64_t slot = slots[order[first]];
      const int64_t size = std::min(kShrinkTokens, starts[slot + 1] - first);
      const T* xs[4];
      float* os[4];
      for (int64_t u = 0; u < size; ++u) {
        xs[u] = xp + order[first + u] * stride;
        os[u] = out + order[first + u] * n + row;
      }
      const T* a = ap + (slot * n + row) * k;
      switch (size) {
        case 1: shrink_rows<1>(a, xs, k, rows, os); break;
        case 2: shrink_rows<2>(a, xs, k, rows, os); break;
        case 3: shrink_rows<3>(a, xs, k, rows, os); break;
        default: shrink_rows<4>(a, xs, k, rows, os);
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

// Round to T (nearest even, as torch's casts) and store the first n lanes: a whole vector (or, on
// AVX-512, any part) straight from the register, not through ATen's partial store's buffer.
template <typename T>
inline void store_f(T* p, const fVec& v, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
#if defined(CPU_CAPABILITY_AVX512)
    if (n < kF) return _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v);
#endif
    v.store(p, n);
  } else {
    const auto half = at::vec::convert_from_float<T>(v, v);  // 2 * kF lanes; the first kF are v's
#if defined(CPU_CAPABILITY_AVX512)
    const __m256i low = _mm512_castsi512_si256(half);
    if (n == kF) return _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), low);
    return _mm256_mask_storeu_epi16(p, static_cast<__mmask16>((1u << n) - 1), low);
#elif defined(CPU_CAPABILITY_AVX2)
    if (n == kF) return _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(half));
#endif
    half.store(p, n);
  }
}

// v rounded to T and back: the LoRA sum is rounded to y's dtype before the add.
template <typename T>
inline fVec round_f(const fVec& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return std::get<0>(at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(v, v)));
  }
}

// y[0:n] = y + round(sums), rounded to T, as `y += delta.to(y.dtype)`.
template <typename T>
inline void add_f(T* y, const fVec& sums, int64_t n) {
  store_f(y, load_f(y, n) + round_f<T>(sums), n);
}

// v[c] becomes column c of the kF x kF matrix whose rows were v[0 .. kF): a transpose in registers.
inline void transpose_in_registers(fVec* v) {
#if defined(CPU_CAPABILITY_AVX512)
  // Within each 128-bit lane, four rows at a time: u[4g + e] holds, lane L, rows 4g..4g+3 of column 4L + e.
  __m512 u[16];
  for (int g = 0; g < 4; ++g) {
    const __m512 t0 = _mm512_unpacklo_ps(v[4 * g], v[4 * g + 1]), t1 = _mm512_unpackhi_ps(v[4 * g], v[4 * g + 1]);
    const __m512 t2 = _mm512_unpacklo_ps(v[4 * g + 2], v[4 * g + 3]);
    const __m512 t3 = _mm512_unpackhi_ps(v[4 * g + 2], v[4 * g + 3]);
    u[4 * g] = _mm512_shuffle_ps(t0, t2, 0x44);
    u[4 * g + 1] = _mm512_shuffle_ps(t0, t2, 0xEE);
    u[4 * g + 2] = _mm512_shuffle_ps(t1, t3, 0x44);
    u[4 * g + 3] = _mm512_shuffle_ps(t1, t3, 0xEE);
  }
  // Then the 4 x 4 transpose of 128-bit lanes: column 4L + e is lane L of u[e], u[4 + e], u[8 + e], u[12 + e].
  for (int e = 0; e < 4; ++e) {
    const __m512 a = _mm512_shuffle_f32x4(u[e], u[4 + e], 0x44), b = _mm512_shuffle_f32x4(u[e], u[4 + e], 0xEE);
    const __m512 c = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0x44);
    const __m512 d = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0xEE);
    v[e] = fVec(_mm512_shuffle_f32x4(a, c, 0x88));
    v[4 + e] = fVec(_mm512_shuffle_f32x4(a, c, 0xDD));
    v[8 + e] = fVec(_mm512_shuffle_f32x4(b, d, 0x88));
    v[12 + e] = fVec(_mm512_shuffle_f32x4(b, d, 0xDD));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 u[8];
  for (int g = 0; g < 2; ++g) {
    const __m256 t0 = _mm256_unpacklo_ps(v[4 * g], v[4 * g + 1]), t1 = _mm256_unpackhi_ps(v[4 * g], v[4 * g + 1]);
    const __m256 t2 = _mm256_unpacklo_ps(v[4 * g + 2], v[4 * g + 3]);
    const __m256 t3 = _mm256_unpackhi_ps(v[4 * g + 2], v[4 * g + 3]);
    u[4 * g] = _mm256_shuffle_ps(t0, t2, 0x44);
    u[4 * g + 1] = _mm256_shuffle_ps(t0, t2, 0xEE);
    u[4 * g + 2] = _mm256_shuffle_ps(t1, t3, 0x44);
    u[4 * g + 3] = _mm256_shuffle_ps(t1, t3, 0xEE);
  }
  for (int e = 0; e < 4; ++e) {
    v[e] = fVec(_mm256_permute2f128_ps(u[e], u[4 + e], 0x20));
    v[4 + e] = fVec(_mm256_permute2f128_ps(u[e], u[4 + e], 0x31));
  }
#else
  float m[kF][kF];
  for (int64_t i = 0; i < kF; ++i) v[i].store(m[i]);
  for (int64_t c = 0; c < kF; ++c) {
    float column[kF];
    for (int64_t i = 0; i < kF; ++i) column[i] = m[i][c];
    v[c] = fVec::loadu(column);
  }
#endif
}

// Columns of one block as float rows of B^T: bt[k * kExpandRows + j] = B[col + j, k] for the rows
// j < n, zero up to the next multiple of kF: kF x kF tiles of B widened and transposed in registers.
template <typename T>
void transpose_block(const T* rows, int64_t r, int64_t n, float* bt) {
  for (int64_t j0 = 0; j0 < n; j0 += kF) {
    const int64_t nj = std::min(kF, n - j0);
    for (int64_t k0 = 0; k0 < r; k0 += kF) {
      const int64_t nk = std::min(kF, r - k0);
      fVec tile[kF];
      for (int64_t i = 0; i < kF; ++i) tile[i] = i < nj ? load_f(rows + (j0 + i) * r + k0, nk) : fVec(0.f);
      transpose_in_registers(tile);
      for (int64_t c = 0; c < nk; ++c) tile[c].store(bt + (k0 + c) * kExpandRows + j0);
    }
  }
}

constexpr int kTileTokens = 4;                 // tokens of one register tile
constexpr int64_t kTileVecs = kF >= 16 ? 4 : 2;  // column vectors of one register tile

// TOKENS tokens' sums over up to kTileVecs * kF columns from bt, added to their rows of y.
template <int TOKENS, typename T>
inline void expand_tile(const float* bt, int64_t r, const float* const* v, T* const* y, int64_t cols) {
  fVec acc[TOKENS][kTileVecs];
  for (int i = 0; i < TOKENS; ++i)
    for (int64_t c = 0; c < kTileVecs; ++c) acc[i][c] = fVec(0.f);
  for (int64_t k = 0; k < r; ++k) {
    fVec b[kTileVecs];
    for (int64_t c = 0; c < kTileVecs; ++c) b[c] = fVec::loadu(bt + k * kExpandRows + c * kF);
    for (int i = 0; i < TOKENS; ++i) {
      const fVec vi(v[i][k]);
      for (int64_t c = 0; c < kTileVecs; ++c) acc[i][c] = at::vec::fmadd(vi, b[c], acc[i][c]);
    }
  }
  for (int i = 0; i < TOKENS; ++i)
    for (int64_t c = 0; c < kTileVecs && c * kF < cols; ++c)
      add_f(y[i] + c * kF, acc[i][c], std::min(kF, cols - c * kF));
}

// The slot's tokens order[first .. last) add their slice's buf row times B's rows col .. col + n:
// B's rows transposed once (bt) serve all of them, each token's sums broadcast FMAs over columns
// with no horizontal sums (faster than a dot product of R per column even for one token).
template <typename T>
void expand_block(T* yp, int64_t stride, const float* buf, int64_t n_buf, const T* b, int64_t r, int64_t col,
                  int64_t n, int64_t slice, const int64_t* order, int64_t first, int64_t last, float* bt) {
  const T* rows = b + col * r;
  transpose_block(rows, r, n, bt);
  for (int64_t c = 0; c < n; c += kTileVecs * kF) {
    const int64_t cols = std::min(kTileVecs * kF, n - c);
    for (int64_t i = first; i < last; i += kTileTokens) {
      const float* v[kTileTokens];
      T* y[kTileTokens];
      const int64_t count = std::min<int64_t>(kTileTokens, last - i);
      for (int64_t u = 0; u < count; ++u) {
        v[u] = buf + order[i + u] * n_buf + slice * r;
        y[u] = yp + order[i + u] * stride + col + c;
      }
      switch (count) {
        case 4: expand_tile<4>(bt + c, r, v, y, cols); break;
        case 3: expand_tile<3>(bt + c, r, v, y, cols); break;
        case 2: expand_tile<2>(bt + c, r, v, y, cols); break;
        default: expand_tile<1>(bt + c, r, v, y, cols);
      }
    }
  }
}

template <typename T>
void expand_impl(at::Tensor& y, const at::Tensor& buf, const at::Tensor& lora_b, const int32_t* slots,
                 const std::vector<Block>& blocks) {
  const int64_t tokens = y.size(0), m = y.size(1), r = lora_b.size(2), n_buf = buf.size(1), stride = y.stride(0);
  const int64_t num_slots = lora_b.size(0);
  std::vector<int64_t> starts, order;
  group_by_slot(slots, tokens, num_slots, starts, order);
  if (order.empty()) return;
  T* yp = reinterpret_cast<T*>(y.data_ptr());
  const T* bp = reinterpret_cast<const T*>(lora_b.data_ptr());
  const float* buf_p = buf.data_ptr<float>();
  const int64_t per_block = kExpandRows * r * static_cast<int64_t>(order.size());
  const int64_t grain = std::max<int64_t>(1, kItemWork / std::max<int64_t>(per_block, 1));
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), grain, [&](int64_t begin, int64_t end) {
    std::vector<float> bt(kExpandRows * r);
    for (int64_t item = begin; item < end; ++item) {
      const Block& block = blocks[item];
      for (int64_t s = 0; s < num_slots; ++s) {
        if (starts[s] == starts[s + 1]) continue;
        expand_block(yp, stride, buf_p, n_buf, bp + s * m * r, r, block.begin, block.end - block.begin, block.slice,
                     order.data(), starts[s], starts[s + 1], bt.data());
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
  // For kernels/cpu_ops.cpp's DecoderLayers, which adds the adapters without a trip through Python.
  m.def("addresses", []() {
    return std::vector<int64_t>{reinterpret_cast<int64_t>(&lora_shrink), reinterpret_cast<int64_t>(&lora_expand)};
  });
  m.def("lora_shrink", &lora_shrink, "buf [T, N] float32 = x @ lora_a[slot]^T per token (0 for slot -1)");
  m.def("lora_expand", &lora_expand, "y += buf @ lora_b[slot]^T per output slice, in place (slot -1 untouched)");
}
