// Matmuls on GGUF block-quantized weights, read as llama.cpp stores them: y[M, N] = x[M, K] @ W[N, K]^T
// with W's rows kept as their raw blocks. Built on first use by kernels/cpu_build.py (load_quant) for
// the CPU capability torch reports; kernels/cpu_quant.py is the Python side and says which path runs
// when.
//
// Block formats (byte layout of one block; value of weight i):
//   Q8_0  32 weights, 34 bytes: fp16 scale d, int8 q[32]                 d * q[i]
//   Q4_0  32 weights, 18 bytes: fp16 scale d, 16 bytes of nibbles        d * (nibble(i) - 8)
//   Q4_1  32 weights, 20 bytes: fp16 scale d, fp16 min m, 16 nibbles     d * nibble(i) + m
//     nibble(i): the low nibble of byte i for i < 16, the high nibble of byte i - 16 otherwise.
//   Q4_K  256 weights (a super-block of 8 sub-blocks j of 32), 144 bytes: fp16 d, fp16 dmin,
//         12 bytes of 6-bit scales sc[j] and mins mn[j] (q4_k_scales_mins draws the packing), then
//         128 bytes of nibbles: bytes 32c..32c+31 hold sub-block 2c in their low nibbles and 2c+1
//         in their high ones.                                    (d * sc[j]) * nibble - dmin * mn[j]
//   Q6_K  256 weights (16 groups of 16, each with its int8 scale), 210 bytes: 128 bytes ql of low
//         nibbles, 64 bytes qh of 2-bit high parts, int8 sc[16], fp16 d. Each half h of 128 weights
//         reads ql[64h..64h+63] and qh[32h..32h+31]; its quarter t (32 weights, l = 0..31) takes
//         the low (t < 2) or high (t >= 2) nibble of ql[64h + 32(t % 2) + l] and bits 2t..2t+1 of
//         qh[32h + l] as bits 4..5.                              (d * sc[i / 16]) * (q6(i) - 32)
//   BF16  32 weights, 64 bytes: bfloat16 w[32], no scale                   w[i] (its bits << 16)
//         Not a GGUF block but a checkpoint's bfloat16 matrix as stored: float32 activations (and
//         bf16 ones without AVX512_BF16) meet it widened in registers by the same kernels, bf16 ones
//         on AVX512_BF16 in bf16 dot products (linear_bf16_dots_impl, linear_bf16_outer below).
// gguf.quants.dequantize, the oracle, reads them so. Every product above is exact in float32 (fp16
// mantissas times small integers), so each weight is the oracle's float whatever the order of the
// operations, FMA or not.
//
// Two kernels:
//   linear_f32   dequantizes each block into float registers and FMAs it against up to eight float
//                activation rows at once (one dequantization serves them all); exact float math, so
//                it agrees with "dequantize, then a float matmul" to summation order. For decode and
//                small batches, where the weight bytes streamed per token are the cost.
//   linear_q8    llama.cpp's way, for the 32-weight formats: the activation rows quantized to int8
//                per 32-block (scale amax / 127), then integer dot products (AVX-512 VNNI vpdpbusd,
//                unsigned nibbles x signed activations) and one float FMA per block. Fewer
//                instructions per weight than linear_f32, at the price of the activations' int8
//                rounding (about 0.4% per block).
//   dequantize   whole rows to float or bfloat16, for the prefill path (a oneDNN/MKL GEMM on the
//                dequantized matrix beats both kernels once enough rows share each weight).
// Threads split the output rows N (at::parallel_for, or HelperPool below): each thread streams its
// own weight rows, prefetched ahead in software, once per group of activation rows (8, or at most 4).
// linear_dequant_gemm: dequantize + ATen's bf16 GEMM a slice of rows per task, for the pool's helpers.

// ATen's tensor and the few ops used, not <torch/extension.h>: an engine's first start compiles
// this file, and all of libtorch's C++ API is header parsing it does not need.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 and its at::Tensor caster
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/Half.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>  // the AVX2 / AVX-512 kernels, and _mm_pause in the helper pool's spin waits
#endif

namespace {

// The caller and `helpers` threads of its own take a loop's chunks from a shared counter, and the
// caller waits only for chunks a helper has taken and not finished, never for a helper to arrive:
// beside busy loops a helper the scheduler has not run takes no chunk and holds nothing up, where an
// OpenMP team's barrier waits for every thread, so beside busy loops the pool beats one thread where
// a team falls below it (benchmarks/threads/optional_helper.cpp; BENCHMARKS.md, "Threads on shared
// CPUs"). helpers == 0 (the default): at::parallel_for, exactly as before.
class HelperPool {
 public:
  static constexpr int kCallerSpins = 2000;  // ~40 us of _mm_pause before a caller sleeps
  static HelperPool& get() {
    static HelperPool* pool = new HelperPool();  // never destroyed: its threads may wait at exit
    return *pool;
  }
  int64_t helpers() const { return helpers_.load(std::memory_order_relaxed); }
  int64_t helper_chunks() const { return helper_chunks_.load(std::memory_order_relaxed); }
  void set_helpers(int64_t n) {
    std::lock_guard<std::mutex> lock(m_);
    for (int64_t i = static_cast<int64_t>(started_); i < n; ++i, ++started_)
      std::thread([this, i] { loop(i); }).detach();
    helpers_.store(n);
  }
  template <typename F>
  void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
    const int64_t n = end - begin, h = helpers();
    if (n <= 0) return;
    if (h == 0) {
      at::parallel_for(begin, end, grain, f);
      return;
    }
    const int64_t chunk = std::max<int64_t>(std::max<int64_t>(grain, 1), (n + 4 * (h + 1) - 1) / (4 * (h + 1)));
    // A loop inside a chunk (a kernel reached from another's loop) or an OpenMP region runs on its
    // caller, as at::parallel_for's nested loops do: the pool serves one level.
    if (n <= chunk || in_chunk_ || at::in_parallel_region()) {
      f(begin, end);
      return;
    }
    auto job = std::make_shared<Job>();
    job->fn = std::ref(f);
    job->begin = begin;
    job->end = end;
    job->chunk = chunk;
    job->chunks = (n + chunk - 1) / chunk;
    {
      std::lock_guard<std::mutex> lock(m_);
      current_ = job;
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    job->work();
    // A helper's chunk still running: spin a moment, then sleep till its last chunk wakes us. A
    // helper descheduled mid-chunk (by another process) is waited for either way; sleeping leaves
    // this CPU to it or to that process instead of spinning it away, at no measurable cost.
    for (int spin = 0; job->done.load(std::memory_order_seq_cst) < job->chunks; ++spin) {
      if (spin < kCallerSpins) {
#if defined(__x86_64__)
        _mm_pause();
#endif
        continue;
      }
      std::unique_lock<std::mutex> lock(job->wait_m);
      job->waiting.store(true, std::memory_order_seq_cst);
      job->wait_cv.wait(lock, [&] { return job->done.load(std::memory_order_seq_cst) >= job->chunks; });
      break;
    }
    {
      std::lock_guard<std::mutex> lock(m_);
      if (current_ == job) current_.reset();  // f lives on this frame: no later reader
    }
    if (job->error) std::rethrow_exception(job->error);
  }

 private:
  struct Job {
    std::function<void(int64_t, int64_t)> fn;
    int64_t begin = 0, end = 0, chunk = 1, chunks = 0;
    std::atomic<int64_t> next{0}, done{0};
    std::atomic<bool> waiting{false};  // the caller sleeps on wait_cv till done == chunks
    std::mutex wait_m;
    std::condition_variable wait_cv;
    std::exception_ptr error;
    std::mutex error_m;
    int64_t work() {
      in_chunk_ = true;
      int64_t taken = 0;
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < chunks; ++taken) {
        try {
          fn(begin + i * chunk, std::min(end, begin + (i + 1) * chunk));
        } catch (...) {
          std::lock_guard<std::mutex> lock(error_m);
          if (!error) error = std::current_exception();
        }
        if (done.fetch_add(1, std::memory_order_seq_cst) + 1 == chunks && waiting.load(std::memory_order_seq_cst)) {
          std::lock_guard<std::mutex> lock(wait_m);  // the caller is between its check and its wait, or in it
          wait_cv.notify_all();
        }
      }
      in_chunk_ = false;
      return taken;
    }
  };
  static thread_local bool in_chunk_;

  void loop(int64_t index) {
    // A helper's chunk may call oneDNN's GEMM (linear_dequant_gemm), which would start an OpenMP
    // team of every CPU from a thread outside torch's: one thread here. omp_set_num_threads is this
    // thread's own setting; at::set_num_threads is not (it sets torch's count for the whole process).
    omp_set_num_threads(1);
    uint64_t seen = generation_.load();
    for (;;) {
      for (int spin = 0; spin < 4000 && generation_.load(std::memory_order_acquire) == seen; ++spin) {
#if defined(__x86_64__)
        _mm_pause();
#endif
      }
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(m_);
        cv_.wait(lock, [&] { return generation_.load() != seen; });
        seen = generation_.load();
        job = current_;
      }
      // An old job's chunks are all taken: no call.
      if (job && index < helpers()) helper_chunks_.fetch_add(job->work(), std::memory_order_relaxed);
    }
  }

  std::mutex m_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  std::shared_ptr<Job> current_;
  std::atomic<int64_t> helpers_{0};
  std::atomic<int64_t> helper_chunks_{0};
  uint64_t started_ = 0;
};

thread_local bool HelperPool::in_chunk_ = false;

template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  HelperPool::get().parallel_for(begin, end, grain, f);
}

// The pool for kernels/cpu_ops.cpp's loops (its address travels through Python, as the matmuls'
// do): one pool, so one set of helpers, serves both libraries.
void pool_parallel_for(int64_t begin, int64_t end, int64_t grain, void (*fn)(const void*, int64_t, int64_t),
                       const void* context) {
  HelperPool::get().parallel_for(begin, end, grain, [&](int64_t b, int64_t e) { fn(context, b, e); });
}
int64_t pool_helpers() { return HelperPool::get().helpers(); }

enum Format : int64_t { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2, kQ4_K = 3, kQ6_K = 4, kBF16 = 5 };
constexpr int64_t kNumFormats = 6;
constexpr int64_t kBlockWeights[kNumFormats] = {32, 32, 32, 256, 256, 32};
constexpr int64_t kBlockBytes[kNumFormats] = {34, 18, 20, 144, 210, 64};

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Q4_K's 8 sub-block scales and 8 mins, 6 bits each, from 12 bytes: for j < 4, the low 6 bits of
// bytes j (scale) and 4 + j (min); for j >= 4, the nibbles of byte 4 + j (scale low, min high)
// below the top 2 bits of bytes j - 4 (scale) and j (min). Four bytes at a time: sm = sc[0..7],
// mn[0..7].
inline void q4_k_scales_mins(const uint8_t* s, uint8_t* sm) {
  uint32_t lo_sc, lo_mn, nib;
  std::memcpy(&lo_sc, s, 4);
  std::memcpy(&lo_mn, s + 4, 4);
  std::memcpy(&nib, s + 8, 4);
  const uint32_t out[4] = {
      lo_sc & 0x3F3F3F3Fu,
      (nib & 0x0F0F0F0Fu) | ((lo_sc >> 2) & 0x30303030u),  // each byte's top 2 bits -> its bits 4..5
      lo_mn & 0x3F3F3F3Fu,
      ((nib >> 4) & 0x0F0F0F0Fu) | ((lo_mn >> 2) & 0x30303030u),
  };
  std::memcpy(sm, out, 16);
}

// ---- one block as floats, scalar: the portable path, and the dequantize op's ---------------------

inline void decode_q8_0(const uint8_t* b, float* w) {
  const float d = half_at(b);
  const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
  for (int i = 0; i < 32; ++i) w[i] = d * q[i];
}

// Q4_0 and Q4_1: d * nibble + m, with m = -8d for Q4_0.
inline void decode_q4(const uint8_t* qs, float d, float m, float* w) {
  for (int i = 0; i < 16; ++i) {
    w[i] = static_cast<float>(qs[i] & 0x0F) * d + m;
    w[i + 16] = static_cast<float>(qs[i] >> 4) * d + m;
  }
}

inline void decode_q4_k(const uint8_t* b, float* w) {
  const float d = half_at(b), dmin = half_at(b + 2);
  uint8_t sm[16];
  q4_k_scales_mins(b + 4, sm);
  for (int j = 0; j < 8; ++j) {
    const float scale = d * sm[j], min = dmin * sm[8 + j];
    const uint8_t* q = b + 16 + (j / 2) * 32;
    const int shift = (j % 2) * 4;
    for (int i = 0; i < 32; ++i) w[j * 32 + i] = scale * ((q[i] >> shift) & 0x0F) - min;
  }
}

inline void decode_q6_k(const uint8_t* b, float* w) {
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_at(b + 208);
  for (int i = 0; i < 256; ++i) {
    const int h = i / 128, t = (i % 128) / 32, l = i % 32;
    const int low = (b[64 * h + 32 * (t % 2) + l] >> (4 * (t / 2))) & 0x0F;
    const int high = (b[128 + 32 * h + l] >> (2 * t)) & 3;
    w[i] = (d * sc[i / 16]) * ((low | (high << 4)) - 32);
  }
}

inline void decode_bf16(const uint8_t* b, float* w) {
  for (int i = 0; i < 32; ++i) {
    uint16_t bits;
    std::memcpy(&bits, b + 2 * i, 2);
    const uint32_t widened = static_cast<uint32_t>(bits) << 16;
    std::memcpy(w + i, &widened, 4);
  }
}

template <int64_t F>
inline void decode_scalar(const uint8_t* b, float* w) {
  if constexpr (F == kQ8_0) decode_q8_0(b, w);
  if constexpr (F == kQ4_0) decode_q4(b + 2, half_at(b), -8.0f * half_at(b), w);
  if constexpr (F == kQ4_1) decode_q4(b + 4, half_at(b), half_at(b + 2), w);
  if constexpr (F == kQ4_K) decode_q4_k(b, w);
  if constexpr (F == kQ6_K) decode_q6_k(b, w);
  if constexpr (F == kBF16) decode_bf16(b, w);
}

// Output rows per work item: small enough that both threads of a decode get work on the smallest
// projection (192 rows), large enough to amortise the per-item overhead.
constexpr int64_t kRowsPerTask = 16;

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)

// A Q6_K super-block's 6-bit values q (0..63, before the -32) as 16 groups of 16 bytes, in order:
// emit(g, q) with group g holding weights 16g..16g+15. Each half h of 128 weights reads 64 bytes
// of ql and 32 of qh; its quarter t (two groups) takes the low (t < 2) or high nibbles of ql's
// bytes 32(t % 2).. and bits 2t..2t+1 of qh as bits 4..5. The AVX-512 and AVX2 decoders widen
// the groups to their vector width.
template <typename Emit>
inline void q6_k_values(const uint8_t* b, Emit&& emit) {
  const __m128i mask4 = _mm_set1_epi8(0x0F), mask2 = _mm_set1_epi8(3);
  const auto load = [](const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); };
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = b + 64 * h;
    const uint8_t* qh = b + 128 + 32 * h;
    const __m128i l[4] = {load(ql), load(ql + 16), load(ql + 32), load(ql + 48)};
    const __m128i hb[2] = {load(qh), load(qh + 16)};
    for (int t = 0; t < 4; ++t) {
      const __m128i shift = _mm_cvtsi32_si128(2 * t);
      for (int i = 0; i < 2; ++i) {
        const __m128i src = l[2 * (t % 2) + i];
        const __m128i low = _mm_and_si128(t < 2 ? src : _mm_srli_epi16(src, 4), mask4);
        const __m128i high = _mm_and_si128(_mm_srl_epi16(hb[i], shift), mask2);
        emit(8 * h + 2 * t + i, _mm_or_si128(low, _mm_slli_epi16(high, 4)));
      }
    }
  }
}

// A Q4_0 / Q4_1 block's 16 bytes of nibbles (at qs) as 32 unsigned bytes in weight order: the low
// nibbles (weights 0..15), then the high ones (16..31). The int8-activation dot products read these.
inline __m256i q4_bytes(const uint8_t* qs) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), mask = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
}

// How far ahead of the block being multiplied its weight row is prefetched into L1, by format
// (measured on the 2-core AVX-512 machine: 1-3 KB all ~2x faster than none with cold weights; see
// benchmarks/quant/README.md). BF16 rows stream the fastest and do best nearer (1 KB ahead); the
// block formats lose a little there, so those stay at 2 KB.
constexpr int64_t kPrefetchBytes[kNumFormats] = {2048, 2048, 2048, 2048, 2048, 1024};

// The software prefetches of a decode matmul's weights are non-temporal: a step reads each weight
// once, and asked for with T0 those lines (270 MB a step for the default model in bf16) pushed
// everything else out of L2 and L3 on their way through: the KV cache, the activations, the norms'
// weights, the interpreter's own state. With NTA whole bf16 batch-1 decode steps run a few percent
// faster and the block formats within noise.
constexpr auto kWeightHint = _MM_HINT_NTA;

// The software prefetch of a decode row (one or two activation rows), as the hardware prefetchers
// alone left a decode matmul at 40% of the bytes per second: every cache line of the bytes
// kPrefetchBytes[F] past block wb, a fixed count per block (one for blocks of up to 64 bytes; lines
// already asked for are asked again, at one load slot each). Asking only for each new line as the
// stream reached it took a branch per block that 20-byte blocks mispredict, which made Q4_1 at one
// row slower.
template <int64_t F>
inline void prefetch_ahead(const uint8_t* wb) {
  for (int64_t o = 0; o < kBlockBytes[F]; o += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(wb) + kPrefetchBytes[F] + o, kWeightHint);
  }
}

#endif

#if defined(CPU_CAPABILITY_AVX512)

// ---- one block as float vectors (AVX-512): decode<F>(block, sink) calls sink(i, w0, w1) for each
// run of 32 weights i..i+31 of the block (w0: the first 16, w1: the next 16) ----------------------

// An fp16 at p broadcast to 16 floats, in vector registers (vcvtph2ps): the scalar conversion
// costs more than the rest of a 32-weight block's dequantization.
inline __m512 half_bcast(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(bits)));
}

inline __m512 u8_to_ps(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)); }

template <typename Sink>
inline void decode_q8_0(const uint8_t* b, Sink&& sink) {
  const __m512 d = half_bcast(b);
  const auto q = [&](int i) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + i))));
  };
  sink(0, _mm512_mul_ps(q(0), d), _mm512_mul_ps(q(16), d));
}

template <typename Sink>
inline void decode_q4(const uint8_t* qs, __m512 d, __m512 m, Sink&& sink) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), mask = _mm_set1_epi8(0x0F);
  sink(0, _mm512_fmadd_ps(u8_to_ps(_mm_and_si128(v, mask)), d, m),
       _mm512_fmadd_ps(u8_to_ps(_mm_and_si128(_mm_srli_epi16(v, 4), mask)), d, m));
}

template <typename Sink>
inline void decode_q4_k(const uint8_t* b, Sink&& sink) {
  // The 8 scales and 8 mins as floats at once (d * sc, -dmin * mn), then one broadcast each per
  // sub-block: unpacking them one by one in scalar code cost as much as the nibbles.
  uint8_t sm[16];  // sc[0..7], mn[0..7]
  q4_k_scales_mins(b + 4, sm);
  const __m256i ints = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm)));
  const __m256i ints_min = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm + 8)));
  alignas(32) float scale[8], neg_min[8];
  _mm256_store_ps(scale, _mm256_mul_ps(_mm512_castps512_ps256(half_bcast(b)), _mm256_cvtepi32_ps(ints)));
  _mm256_store_ps(neg_min, _mm256_mul_ps(_mm512_castps512_ps256(half_bcast(b + 2)),
                                         _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_setzero_si256(), ints_min))));
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int c = 0; c < 4; ++c) {  // 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high ones
    const __m128i v0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 + 32 * c));
    const __m128i v1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 32 + 32 * c));
    const auto sub = [&](int j, __m128i q0, __m128i q1) {
      const __m512 d = _mm512_set1_ps(scale[j]), m = _mm512_set1_ps(neg_min[j]);
      sink(32 * j, _mm512_fmadd_ps(u8_to_ps(q0), d, m), _mm512_fmadd_ps(u8_to_ps(q1), d, m));
    };
    sub(2 * c, _mm_and_si128(v0, mask), _mm_and_si128(v1, mask));
    sub(2 * c + 1, _mm_and_si128(_mm_srli_epi16(v0, 4), mask), _mm_and_si128(_mm_srli_epi16(v1, 4), mask));
  }
}

template <typename Sink>
inline void decode_q6_k(const uint8_t* b, Sink&& sink) {
  // Per group g of 16 weights: its scale d * sc[g], and -32 times it, so that one FMA gives
  // (d * sc) * q - 32 (d * sc), which is (d * sc) * (q - 32) exactly.
  alignas(64) float scale[16], offset[16];
  const __m512 s = _mm512_mul_ps(half_bcast(b + 208), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)))));
  _mm512_store_ps(scale, s);
  _mm512_store_ps(offset, _mm512_mul_ps(s, _mm512_set1_ps(-32.0f)));
  __m512 w[2];  // a run of 32 weights: two groups
  q6_k_values(b, [&](int g, __m128i q) {
    w[g % 2] = _mm512_fmadd_ps(u8_to_ps(q), _mm512_set1_ps(scale[g]), _mm512_set1_ps(offset[g]));
    if (g % 2) sink(16 * (g - 1), w[0], w[1]);
  });
}

// 16 bfloat16 at p as 16 floats: each one's bits moved to the top of a 32-bit lane (exact).
inline __m512 bf16_to_ps(const uint8_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

template <typename Sink>
inline void decode_bf16(const uint8_t* b, Sink&& sink) {
  sink(0, bf16_to_ps(b), bf16_to_ps(b + 32));
}

template <int64_t F, typename Sink>
inline void decode(const uint8_t* b, Sink&& sink) {
  if constexpr (F == kQ8_0) decode_q8_0(b, sink);
  if constexpr (F == kQ4_0) decode_q4(b + 2, half_bcast(b), _mm512_mul_ps(half_bcast(b), _mm512_set1_ps(-8.0f)), sink);
  if constexpr (F == kQ4_1) decode_q4(b + 4, half_bcast(b), half_bcast(b + 2), sink);
  if constexpr (F == kQ4_K) decode_q4_k(b, sink);
  if constexpr (F == kQ6_K) decode_q6_k(b, sink);
  if constexpr (F == kBF16) decode_bf16(b, sink);
}

template <int64_t F>
inline void decode_floats(const uint8_t* b, float* w) {
  decode<F>(b, [&](int64_t i, __m512 w0, __m512 w1) {
    _mm512_storeu_ps(w + i, w0);
    _mm512_storeu_ps(w + i + 16, w1);
  });
}

// R activation rows (stride K) against one weight row of nb blocks: R dot products.
template <int64_t F, int R>
inline void dot_rows(const uint8_t* w, int64_t nb, const float* x, int64_t K, float* out) {
  constexpr int64_t bw = kBlockWeights[F], bb = kBlockBytes[F];
  // Two accumulators per row (one per half of a 32-weight run): with one, a decode row (R = 1)
  // waits on the FMA latency chain, measured 1.4x slower than the block's dequantization alone.
  __m512 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  // One or two rows: prefetch_ahead (into the next rows at a row's end). With more rows the block's
  // FMAs hide the memory latency and the prefetches only cost (measured 15-30% slower at 4 rows).
  for (int64_t b = 0; b < nb; ++b) {
    if constexpr (R <= 2) prefetch_ahead<F>(w + b * bb);
    decode<F>(w + b * bb, [&](int64_t i, __m512 w0, __m512 w1) {
      const float* xb = x + b * bw + i;
      for (int r = 0; r < R; ++r) {
        acc0[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb + r * K), acc0[r]);
        acc1[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + r * K + 16), acc1[r]);
      }
    });
  }
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r]));
}

#elif defined(CPU_CAPABILITY_AVX2)

// The same kernels on 256-bit vectors (AVX2 + FMA + F16C: AMD Zen 2/3, Intel before Skylake-X): a
// run of 32 weights is four vectors of 8 floats. The products are those of the AVX-512 path, so the
// two builds give the same weights bit for bit.

inline __m256 half_bcast(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(bits)));
}

// The low 8 bytes of v as 8 floats, unsigned or signed.
inline __m256 u8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
inline __m256 i8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }
inline __m128i high_half(__m128i v) { return _mm_unpackhi_epi64(v, v); }

// sink(i, w) for each run of 32 weights i..i+31 of the block, w[0..3] 8 weights each in order.
template <typename Sink>
inline void decode_q8_0(const uint8_t* b, Sink&& sink) {
  const __m256 d = half_bcast(b);
  __m256 w[4];
  for (int k = 0; k < 4; ++k)  // 8 bytes at a time, widened straight from memory (as q4_run)
    w[k] = _mm256_mul_ps(i8_to_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * k))), d);
  sink(0, w);
}

// 16 bytes of nibbles -> 32 weights q * d + m: byte i holds weight i (low nibble) and i + 16 (high).
// Each 8 bytes are widened to 32-bit lanes straight from memory (vpmovzxbd with its load), and
// the nibbles split there: one AND and one shift per 8 bytes instead of splitting the 16 bytes
// first and moving each half into place: 1.26x faster on one thread (Q8_0 the same way: 1.38x).
inline void q4_run(const uint8_t* qs, __m256 d, __m256 m, __m256 w[4]) {
  const __m256i mask = _mm256_set1_epi32(0x0F);
  for (int c = 0; c < 2; ++c) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * c)));
    w[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, mask)), d, m);
    w[2 + c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), d, m);
  }
}

template <typename Sink>
inline void decode_q4(const uint8_t* qs, __m256 d, __m256 m, Sink&& sink) {
  __m256 w[4];
  q4_run(qs, d, m, w);
  sink(0, w);
}

template <typename Sink>
inline void decode_q4_k(const uint8_t* b, Sink&& sink) {
  uint8_t sm[16];  // sc[0..7], mn[0..7]
  q4_k_scales_mins(b + 4, sm);
  const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm))));
  const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm + 8))));
  alignas(32) float scale[8], neg_min[8];
  _mm256_store_ps(scale, _mm256_mul_ps(half_bcast(b), sc));
  _mm256_store_ps(neg_min, _mm256_mul_ps(half_bcast(b + 2), _mm256_sub_ps(_mm256_setzero_ps(), mn)));
  const __m256i mask = _mm256_set1_epi32(0x0F);
  for (int c = 0; c < 4; ++c) {  // 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high ones
    const __m256 d0 = _mm256_set1_ps(scale[2 * c]), m0 = _mm256_set1_ps(neg_min[2 * c]);
    const __m256 d1 = _mm256_set1_ps(scale[2 * c + 1]), m1 = _mm256_set1_ps(neg_min[2 * c + 1]);
    __m256 lo[4], hi[4];
    for (int k = 0; k < 4; ++k) {  // 8 bytes at a time, widened straight from memory (as q4_run)
      const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 16 + 32 * c + 8 * k)));
      lo[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, mask)), d0, m0);
      hi[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), d1, m1);
    }
    sink(64 * c, lo);
    sink(64 * c + 32, hi);
  }
}

template <typename Sink>
inline void decode_q6_k(const uint8_t* b, Sink&& sink) {
  // As the AVX-512 path: one FMA gives (d * sc) * q - 32 (d * sc), which is (d * sc) * (q - 32).
  alignas(32) float scale[16], offset[16];
  const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
  const __m256 d = half_bcast(b + 208);
  const __m256 s0 = _mm256_mul_ps(d, i8_to_ps(sc)), s1 = _mm256_mul_ps(d, i8_to_ps(high_half(sc)));
  _mm256_store_ps(scale, s0);
  _mm256_store_ps(scale + 8, s1);
  _mm256_store_ps(offset, _mm256_mul_ps(s0, _mm256_set1_ps(-32.0f)));
  _mm256_store_ps(offset + 8, _mm256_mul_ps(s1, _mm256_set1_ps(-32.0f)));
  __m256 w[4];  // a run of 32 weights: two groups of two vectors
  q6_k_values(b, [&](int g, __m128i q) {
    const __m256 scale_g = _mm256_set1_ps(scale[g]), offset_g = _mm256_set1_ps(offset[g]);
    w[2 * (g % 2)] = _mm256_fmadd_ps(u8_to_ps(q), scale_g, offset_g);
    w[2 * (g % 2) + 1] = _mm256_fmadd_ps(u8_to_ps(high_half(q)), scale_g, offset_g);
    if (g % 2) sink(16 * (g - 1), w);
  });
}

// 32 bfloat16 -> four vectors of 8 floats, each 8 widened straight from memory and shifted into
// the top half of their lanes (exact).
template <typename Sink>
inline void decode_bf16(const uint8_t* b, Sink&& sink) {
  __m256 w[4];
  for (int k = 0; k < 4; ++k) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * k)));
    w[k] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  }
  sink(0, w);
}

template <int64_t F, typename Sink>
inline void decode(const uint8_t* b, Sink&& sink) {
  if constexpr (F == kQ8_0) decode_q8_0(b, sink);
  if constexpr (F == kQ4_0) decode_q4(b + 2, half_bcast(b), _mm256_mul_ps(half_bcast(b), _mm256_set1_ps(-8.0f)), sink);
  if constexpr (F == kQ4_1) decode_q4(b + 4, half_bcast(b), half_bcast(b + 2), sink);
  if constexpr (F == kQ4_K) decode_q4_k(b, sink);
  if constexpr (F == kQ6_K) decode_q6_k(b, sink);
  if constexpr (F == kBF16) decode_bf16(b, sink);
}

template <int64_t F>
inline void decode_floats(const uint8_t* b, float* w) {
  decode<F>(b, [&](int64_t i, const __m256* v) {
    for (int k = 0; k < 4; ++k) _mm256_storeu_ps(w + i + 8 * k, v[k]);
  });
}

// 8 floats -> 8 bfloat16, rounded to nearest even; NaN stays NaN.
inline __m128i to_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  // Each value fits 16 bits; packus works within 128-bit lanes, so gather the two lanes' halves.
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// R activation rows (stride K) against one weight row of nb blocks: R dot products. A decode row
// (R <= 2) keeps four accumulators so the FMA latency chain does not bind; up to 4 rows keep two
// each and 8 rows one (their 8 independent chains already cover the latency), as 16 vector
// registers hold no more.
template <int64_t F, int R>
inline void dot_rows(const uint8_t* w, int64_t nb, const float* x, int64_t K, float* out) {
  constexpr int64_t bw = kBlockWeights[F], bb = kBlockBytes[F];
  constexpr int A = R <= 2 ? 4 : R <= 4 ? 2 : 1;
  __m256 acc[R][A];
  for (int r = 0; r < R; ++r)
    for (int a = 0; a < A; ++a) acc[r][a] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if constexpr (R <= 2) prefetch_ahead<F>(w + b * bb);  // as the AVX-512 dot_rows
    decode<F>(w + b * bb, [&](int64_t i, const __m256* v) {
      const float* xb = x + b * bw + i;
      for (int r = 0; r < R; ++r)
        for (int k = 0; k < 4; ++k) acc[r][k % A] = _mm256_fmadd_ps(v[k], _mm256_loadu_ps(xb + r * K + 8 * k), acc[r][k % A]);
    });
  }
  for (int r = 0; r < R; ++r) {
    __m256 s = acc[r][0];
    for (int a = 1; a < A; ++a) s = _mm256_add_ps(s, acc[r][a]);
    out[r] = hsum(s);
  }
}

#else

template <int64_t F>
inline void decode_floats(const uint8_t* b, float* w) {
  decode_scalar<F>(b, w);
}

template <int64_t F, int R>
inline void dot_rows(const uint8_t* w, int64_t nb, const float* x, int64_t K, float* out) {
  constexpr int64_t bw = kBlockWeights[F], bb = kBlockBytes[F];
  float acc[R] = {};
  float wf[bw];
  for (int64_t b = 0; b < nb; ++b) {
    decode_scalar<F>(w + b * bb, wf);
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * K + b * bw;
      for (int64_t c = 0; c < bw; c += 32) {
        float s = 0.0f;
        for (int64_t i = c; i < c + 32; ++i) s += wf[i] * xb[i];
        acc[r] += s;
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

#endif

// Activation rows go through dot_rows in groups: of 8 while 8 remain, then of at most 4. One pass
// over the weights serves a group, so 8 rows decode each block once where two groups of 4 decode
// it twice, which made 8 and 16 rows about a tenth faster on the AVX2 machine.
constexpr int64_t kWideGroup = 8;

template <int64_t F, typename Out>
void linear_f32_impl(const float* x, const uint8_t* w, Out* y, int64_t M, int64_t N, int64_t K) {
  const int64_t nb = K / kBlockWeights[F], row_bytes = nb * kBlockBytes[F];
  parallel_for(0, N, kRowsPerTask, [&](int64_t n0, int64_t n1) {
    float out[kWideGroup];
    for (int64_t m = 0, rows = 0; m < M; m += rows) {
      rows = M - m >= kWideGroup ? kWideGroup : std::min<int64_t>(4, M - m);
      const float* xm = x + m * K;
      for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* wn = w + n * row_bytes;
        switch (rows) {
          case kWideGroup: dot_rows<F, kWideGroup>(wn, nb, xm, K, out); break;
          case 4: dot_rows<F, 4>(wn, nb, xm, K, out); break;
          case 3: dot_rows<F, 3>(wn, nb, xm, K, out); break;
          case 2: dot_rows<F, 2>(wn, nb, xm, K, out); break;
          default: dot_rows<F, 1>(wn, nb, xm, K, out); break;
        }
        for (int64_t r = 0; r < rows; ++r) y[(m + r) * N + n] = static_cast<Out>(out[r]);
      }
    }
  });
}

void check_weight(const at::Tensor& w, int64_t fmt, int64_t K) {
  TORCH_CHECK(fmt >= 0 && fmt < kNumFormats, "unknown block format ", fmt);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "quantized weight: contiguous uint8 [N, row bytes]");
  const int64_t bw = kBlockWeights[fmt], row_bytes = K / bw * kBlockBytes[fmt];
  TORCH_CHECK(K % bw == 0, "in_features ", K, " is not a multiple of the format's block of ", bw, " weights");
  TORCH_CHECK(w.size(1) == row_bytes, "quantized weight rows hold ", w.size(1), " bytes, not ", row_bytes, " for ",
              K, " inputs");
}

// ---- Q8 activations + integer dot products (the 32-weight formats) -------------------------------

constexpr int64_t kBlock = 32;

// Activation rows as integer blocks of 32 with a float scale each: int8 (amax / 127, llama.cpp's
// block_q8_1 without the fp16 rounding of its two floats) or int16 (amax / 32767: the integer dots'
// speed without int8's rounding; see linear_q16). Per block, d and d * sum(q) side by side, so one
// 8-byte load and one multiply by the weight block's own [d, m] give both of a block's scales. The
// second is what the min of a Q4_1 block and the -8 offset of a Q4_0 block multiply. It is the sum
// of the rounded values, not of x: then the rounding error meets the centred weights q d + m
// (|q - 8| <= 8), not the nibbles alone (0..15); with sum(x) the default model's perplexity moved
// 1.5-2x as much under int8.
template <typename I>
struct QRows {
  std::vector<I> q;        // [M, K]
  std::vector<float> ds;   // [M, K / 32, 2]: d, d * sum(q)
};
using Q8Rows = QRows<int8_t>;
using Q16Rows = QRows<int16_t>;

template <typename I>
QRows<I> quantize_rows(const float* x, int64_t M, int64_t K) {
  constexpr float kLevels = std::is_same_v<I, int8_t> ? 127.0f : 32767.0f;
  const int64_t nb = K / kBlock;
  QRows<I> a{std::vector<I>(M * K), std::vector<float>(2 * M * nb)};
  parallel_for(0, M * nb, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* xb = x + i * kBlock;
      I* qb = a.q.data() + i * kBlock;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
      // The scalar loop below, 8 lanes at a time: cvtps rounds to nearest even as nearbyint does
      // under the default rounding mode, so both give the same values.
      const __m256 sign = _mm256_set1_ps(-0.0f);
      __m256 v[4], amax = _mm256_setzero_ps();
      for (int k = 0; k < 4; ++k) {
        v[k] = _mm256_loadu_ps(xb + 8 * k);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[k]));
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      const float d = std::max(_mm_cvtss_f32(m4), _mm_cvtss_f32(_mm_movehdup_ps(m4))) / kLevels;
      const __m256 inv = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
      __m256i q[4];
      for (int k = 0; k < 4; ++k) q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], inv));
      __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
      const int sum = _mm_cvtsi128_si32(s4);
      // Pack 32 int32 to I in order (|q| <= kLevels: nothing saturates). packs works within 128-bit
      // lanes; the permutes put the lanes back in order.
      const __m256i p0 = _mm256_packs_epi32(q[0], q[1]), p1 = _mm256_packs_epi32(q[2], q[3]);
      if constexpr (std::is_same_v<I, int8_t>) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb),
                            _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p0, p1),
                                                        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), _mm256_permute4x64_epi64(p0, 0xD8));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + 16), _mm256_permute4x64_epi64(p1, 0xD8));
      }
#else
      float amax = 0.0f;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float d = amax / kLevels, inv = d != 0.0f ? 1.0f / d : 0.0f;
      int sum = 0;
      for (int j = 0; j < 32; ++j) {
        const int q = static_cast<int>(std::nearbyint(xb[j] * inv));
        qb[j] = static_cast<I>(q);
        sum += q;
      }
#endif
      a.ds[2 * i] = d;
      a.ds[2 * i + 1] = d * static_cast<float>(sum);
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
  constexpr int64_t bb = kBlockBytes[F];
  __m256 acc[R];
  float offset[R] = {};  // the min / -8 terms: sum over blocks of m_w * d_x * sum(q_x)
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
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
      wq = q4_bytes(wb + (F == kQ4_1 ? 4 : 2));
    }
    const float mw = F == kQ4_1 ? half_at(wb + 2) : -8.0f * d;
    for (int r = 0; r < R; ++r) {
      const int64_t i = (m + r) * nb + b;
      __m256i xq = _mm256_loadu_si256((const __m256i*)(a.q.data() + (m + r) * K + b * kBlock));
      if constexpr (F == kQ8_0) xq = _mm256_mask_sub_epi8(xq, neg, _mm256_setzero_si256(), xq);
      const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wq, xq);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * a.ds[2 * i]), acc[r]);
      if constexpr (F != kQ8_0) offset[r] += mw * a.ds[2 * i + 1];
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
#elif defined(CPU_CAPABILITY_AVX2)
// AVX2 has no vpdpbusd: for int8 activations vpmaddubsw multiplies unsigned weight bytes by signed
// activation bytes into 16-bit pair sums (at most 2 x 15 x 127, or 2 x 127 x 127 for Q8_0's |q|: no
// saturation), and vpmaddwd by ones widens them to 8 int32 lanes, as llama.cpp's AVX2 dot products
// do; for int16 activations (linear_q16) the weights are widened to int16 and vpmaddwd multiplies
// directly. A block's two fp16 numbers (Q4_1's d and m) convert in one vcvtph2ps, and one multiply
// by the activation block's [d, d * sum(q)] gives the dot's scale (lane 0) and the min term (lane
// 1), which a vector accumulates: no scalar fp16 conversion or scalar FMA chain per block (Q4_1
// rows ~1.3x the per-block scalar version, one measurement).
template <int64_t F, int R, typename I>
inline void dot_rows_q8(const uint8_t* w, int64_t nb, const QRows<I>& a, int64_t m, int64_t K, float* out) {
  constexpr int64_t bb = kBlockBytes[F];
  constexpr bool int8 = std::is_same_v<I, int8_t>;
  __m256 acc[R];
  __m128 offset[R];  // lane 1: sum over blocks of m_w * d_x * sum(q_x) (Q4_1; m_w = -8 d_w for Q4_0)
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    offset[r] = _mm_setzero_ps();
  }
  const __m256i ones = _mm256_set1_epi16(1);
  const __m128 q4_0_offset = _mm_setr_ps(1.0f, -8.0f, 0.0f, 0.0f);
  const __m128i nibble = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    if constexpr (R <= 2) prefetch_ahead<F>(w + b * bb);  // as dot_rows
    const uint8_t* wb = w + b * bb;
    __m128 dm;  // [d_w, m_w] (Q4_1), [d_w, -8 d_w] (Q4_0), [d_w, 0] (Q8_0)
    if constexpr (F == kQ4_1) {
      uint32_t bits;
      std::memcpy(&bits, wb, 4);
      dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(bits)));
    } else {
      uint16_t bits;
      std::memcpy(&bits, wb, 2);
      dm = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
      if constexpr (F == kQ4_0) dm = _mm_mul_ps(_mm_moveldup_ps(dm), q4_0_offset);
    }
    // int8: wq the weights as bytes (Q8_0: |q|, its sign moved onto the activations by wsign);
    // int16: w0, w1 weights 0-15 and 16-31 as int16.
    __m256i wq, wsign, w0, w1;
    if constexpr (int8 && F == kQ8_0) {
      wsign = _mm256_loadu_si256((const __m256i*)(wb + 2));
      wq = _mm256_sign_epi8(wsign, wsign);
    } else if constexpr (int8) {
      wq = q4_bytes(wb + (F == kQ4_1 ? 4 : 2));
    } else if constexpr (F == kQ8_0) {
      w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 2)));
      w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 18)));
    } else {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + (F == kQ4_1 ? 4 : 2)));
      w0 = _mm256_cvtepu8_epi16(_mm_and_si128(v, nibble));
      w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), nibble));
    }
    for (int r = 0; r < R; ++r) {
      const int64_t i = (m + r) * nb + b;
      const I* xb = a.q.data() + (m + r) * K + b * kBlock;
      __m256i dot;
      if constexpr (int8) {
        __m256i xq = _mm256_loadu_si256((const __m256i*)xb);
        if constexpr (F == kQ8_0) xq = _mm256_sign_epi8(xq, wsign);
        dot = _mm256_madd_epi16(_mm256_maddubs_epi16(wq, xq), ones);
      } else {
        dot = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i*)xb)),
                               _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i*)(xb + 16))));
      }
      const __m128 scales = _mm_mul_ps(dm, _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(a.ds.data() + 2 * i))));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcastss_ps(scales), acc[r]);
      if constexpr (F != kQ8_0) offset[r] = _mm_add_ps(offset[r], scales);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) + _mm_cvtss_f32(_mm_movehdup_ps(offset[r]));
}

bool has_vnni() { return false; }
#else
template <int64_t F, int R>
inline void dot_rows_q8(const uint8_t* w, int64_t nb, const Q8Rows& a, int64_t m, int64_t K, float* out) {
  constexpr int64_t bb = kBlockBytes[F];
  float wf[32];
  for (int r = 0; r < R; ++r) out[r] = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    decode_scalar<F>(w + b * bb, wf);
    for (int r = 0; r < R; ++r) {
      const int64_t i = (m + r) * nb + b;
      const int8_t* xq = a.q.data() + (m + r) * K + b * kBlock;
      float s = 0.0f;
      for (int j = 0; j < 32; ++j) s += wf[j] * xq[j];
      out[r] += s * a.ds[2 * i];
    }
  }
}

bool has_vnni() { return false; }
#endif

template <int64_t F, typename Rows>
void linear_q8_impl(const Rows& a, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t nb = K / kBlock, row_bytes = nb * kBlockBytes[F];
  parallel_for(0, N, kRowsPerTask, [&](int64_t n0, int64_t n1) {
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

// ---- bf16 activations at many rows: weight tiles dequantized to bf16, multiplied by brgemm --------
//
// Above a handful of rows the weight's dequantization, paid once per row group by linear_f32, is the
// cost, and dequantizing the whole matrix first (then a GEMM) writes and rereads it through memory:
// for a 49152 x 576 LM head that is 56 MB a call. Here each thread dequantizes kTileRows weight rows
// at a time into a bf16 tile that stays in its L2 (576 inputs: 72 KB), in the VNNI layout oneDNN's
// bf16 brgemm reads (pairs of consecutive inputs of a row side by side, rows next to each other),
// and multiplies every activation row against it with at::native::cpublas::brgemm (AMX or AVX-512
// BF16 where the CPU has them), kTileM rows per call so that oneDNN JITs at most a few dozen kernel
// shapes whatever M is. Weights are rounded to bf16 once, as dequantize(bf16) then F.linear does.

#if defined(CPU_CAPABILITY_AVX512)

constexpr int64_t kTileRows = 64;  // weight rows per tile: brgemm's N and the tile's leading dimension
constexpr int64_t kTileM = 32;     // activation rows per brgemm call

// 16 floats -> 16 bfloat16, rounded to nearest even; NaN stays NaN.
inline __m256i to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// 32 floats (w0, then w1) -> 32 bfloat16 in order: 16 dwords, dword j holding weights 2j and 2j + 1.
inline __m512i bf16_pairs(__m512 w0, __m512 w1) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(to_bf16(w0)), to_bf16(w1), 1);
}

// r[0..15] <- its transpose, as 16 x 16 dwords.
inline void transpose_16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // Now r[4a + b] holds, in each 128-bit lane L, row (4L + ..) parts: exchange the lanes.
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD);
  }
}

// 16 weight rows (at w, row_bytes apart) -> their VNNI columns of the tile (at out, kTileRows apart):
// each block of the 16 rows decoded into an L1 stage, then 16 pairs x 16 rows transposed at a time,
// so every store is a whole 64-byte run (a scatter per 32 weights cost 3x the decoding). Pairs:
// how 32 floats become 16 dwords of bf16 pairs (bf16_pairs, or one vcvtne2ps2bf16 where the CPU has
// AVX512_BF16: the conversion was half this function's instructions).
template <int64_t F, typename Pairs>
inline void dequantize_16_rows(const uint8_t* w, int64_t row_bytes, int64_t nb, int32_t* out, Pairs&& pairs) {
  constexpr int64_t bw = kBlockWeights[F], bb = kBlockBytes[F];
  alignas(64) int32_t stage[16][bw / 2];
  for (int64_t b = 0; b < nb; ++b) {
    for (int r = 0; r < 16; ++r) {
      decode<F>(w + r * row_bytes + b * bb, [&](int64_t i, __m512 w0, __m512 w1) {
        _mm512_store_si512(stage[r] + i / 2, pairs(w0, w1));
      });
    }
    for (int64_t j0 = 0; j0 < bw / 2; j0 += 16) {
      __m512i v[16];
      for (int r = 0; r < 16; ++r) v[r] = _mm512_load_si512(stage[r] + j0);
      transpose_16x16(v);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(out + (b * bw / 2 + j0 + j) * kTileRows, v[j]);
    }
  }
}

// Compiled for AVX512_BF16 (the lambda too: a target attribute would not reach it), called only
// where the CPU has it.
#pragma GCC push_options
#pragma GCC target("avx512bf16")
template <int64_t F>
void dequantize_16_rows_native(const uint8_t* w, int64_t row_bytes, int64_t nb, int32_t* out) {
  dequantize_16_rows<F>(w, row_bytes, nb, out, [](__m512 w0, __m512 w1) {
    return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(w1, w0));
  });
}
#pragma GCC pop_options

template <int64_t F>
void dequantize_16_rows_portable(const uint8_t* w, int64_t row_bytes, int64_t nb, int32_t* out) {
  dequantize_16_rows<F>(w, row_bytes, nb, out, bf16_pairs);
}

bool has_brgemm_bf16() { return at::native::cpublas::could_pack(at::kBFloat16); }

template <int64_t F>
void linear_bf16_tiled_impl(const c10::BFloat16* x, const uint8_t* w, c10::BFloat16* y, int64_t M, int64_t N,
                            int64_t K) {
  constexpr int64_t bw = kBlockWeights[F], bb = kBlockBytes[F];
  const int64_t nb = K / bw, row_bytes = nb * bb, tiles = (N + kTileRows - 1) / kTileRows;
  static const bool native_bf16 = __builtin_cpu_supports("avx512bf16");
  parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<int32_t> tile(K / 2 * kTileRows);  // pair j (inputs 2j, 2j + 1) of row n at [j * kTileRows + n]
    std::vector<float> acc(kTileM * kTileRows);
    const __m512i stride = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(kTileRows));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kTileRows, rows = std::min(kTileRows, N - n0);
      int64_t n = 0;
      for (; n + 16 <= rows; n += 16) {
        if (native_bf16) dequantize_16_rows_native<F>(w + (n0 + n) * row_bytes, row_bytes, nb, tile.data() + n);
        else dequantize_16_rows_portable<F>(w + (n0 + n) * row_bytes, row_bytes, nb, tile.data() + n);
      }
      for (; n < rows; ++n) {  // a last tile's rows past a multiple of 16: one row at a time
        const uint8_t* wn = w + (n0 + n) * row_bytes;
        for (int64_t b = 0; b < nb; ++b) {
          decode<F>(wn + b * bb, [&](int64_t i, __m512 w0, __m512 w1) {
            // 32 weights -> 16 pairs, each to its own VNNI row of the tile.
            _mm512_i32scatter_epi32(tile.data() + (b * bw + i) / 2 * kTileRows + n, stride, bf16_pairs(w0, w1), 4);
          });
        }
      }
      const __mmask16 tail = static_cast<__mmask16>((1u << (rows % 16)) - 1);
      for (int64_t m0 = 0; m0 < M; m0 += kTileM) {
        const int64_t mt = std::min(kTileM, M - m0);
        at::native::cpublas::brgemm(mt, rows, K, K, kTileRows, kTileRows, false,
                                    reinterpret_cast<const at::BFloat16*>(x + m0 * K),
                                    reinterpret_cast<const at::BFloat16*>(tile.data()), acc.data(), true);
        for (int64_t m = 0; m < mt; ++m) {
          auto* out = reinterpret_cast<__m256i*>(y + (m0 + m) * N + n0);
          const float* a = acc.data() + m * kTileRows;
          int64_t c = 0;
          for (; c + 16 <= rows; c += 16) _mm256_storeu_si256(out + c / 16, to_bf16(_mm512_loadu_ps(a + c)));
          if (c < rows) _mm256_mask_storeu_epi16(out + c / 16, tail, to_bf16(_mm512_maskz_loadu_ps(tail, a + c)));
        }
      }
    }
    at::native::cpublas::brgemm_release();
  });
}

#else

bool has_brgemm_bf16() { return false; }

template <int64_t F>
void linear_bf16_tiled_impl(const c10::BFloat16*, const uint8_t*, c10::BFloat16*, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "linear_bf16_tiled needs the AVX-512 build");
}

#endif

// ---- bf16 rows against BF16 weights: bf16 dot products (AVX512_BF16) ---------------------------
//
// A bfloat16 model's bf16 checkpoint matrices held as stored (engine/loading/weights.py KeepBF16) at the
// register kernel's rows: vdpbf16ps multiplies 32 weights by 32 activations an instruction, in float32
// (a bf16 product is exact in float32; the pairs' sums round as FMAs do, denormals flushed to zero),
// where linear_f32 widens both to float32 first. The matmul oneDNN would run instead, on its packed
// copy, costs ~12 us a call beyond reading the weight, so at up to 16 rows of the default model's
// layer shapes this kernel runs at least its speed, where oneDNN's GEMM on the matrix as stored runs
// slower (benchmarks/quant/bf16_rows.py). Past 16 rows its sums across vectors cost too much:
// linear_bf16_outer below takes those. Each weight row's next group is prefetched a step ahead, as
// without it the hardware prefetchers leave the rows waiting (a prefetch past the matrix's end does
// not fault).
#if defined(CPU_CAPABILITY_AVX512)

#pragma GCC push_options
#pragma GCC target("avx512bf16")
// R activation rows (stride K) against W weight rows (stride K), K a multiple of 32: out[j * R + r].
template <int R, int W>
inline void dot_bf16(const uint16_t* w, const uint16_t* x, int64_t K, float* out) {
  __m512 acc[W][R];
  for (int j = 0; j < W; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512i wv[W];
    for (int j = 0; j < W; ++j) {
      wv[j] = _mm512_loadu_si512(w + j * K + k);
      _mm_prefetch(reinterpret_cast<const char*>(w + (W + j) * K + k), kWeightHint);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + r * K + k));
      for (int j = 0; j < W; ++j) acc[j][r] = _mm512_dpbf16_ps(acc[j][r], reinterpret_cast<__m512bh>(wv[j]), xv);
    }
  }
  for (int j = 0; j < W; ++j)
    for (int r = 0; r < R; ++r) out[j * R + r] = _mm512_reduce_add_ps(acc[j][r]);
}

// W weight rows at a time: 4 up to 4 activation rows (four independent sums to cover the
// instruction's latency at one row, four weight streams), 3 at 8 (24 accumulators of 32 registers).
// Against 2 at every row count (one run each, cold weights): at 8 rows 3 ran 1.1-1.3x as fast (the LM
// head 0.94x oneDNN's packed call against 0.68x), at 3-4 rows 4 ran 1.1-1.35x on three shapes of five,
// 0.76-0.97x on the other two.
template <int R>
inline void dot_bf16_rows(const uint16_t* w, int64_t n0, int64_t n1, const uint16_t* x, int64_t K, int64_t N,
                          c10::BFloat16* y) {
  constexpr int W = R <= 4 ? 4 : 3;
  float o[W * R];
  int64_t n = n0;
  const auto store = [&](int64_t at, int rows_w) {
    for (int j = 0; j < rows_w; ++j)
      for (int r = 0; r < R; ++r) y[r * N + at + j] = c10::BFloat16(o[j * R + r]);
  };
  for (; n + W <= n1; n += W) {
    dot_bf16<R, W>(w + n * K, x, K, o);
    store(n, W);
  }
  for (; n < n1; ++n) {
    dot_bf16<R, 1>(w + n * K, x, K, o);
    store(n, 1);
  }
}

// Weight rows n0 .. n1 against every activation row, in groups of 8, then of at most 4.
inline void dot_bf16_block(const uint16_t* w, int64_t n0, int64_t n1, const uint16_t* x, int64_t M, int64_t K,
                           int64_t N, c10::BFloat16* y) {
  for (int64_t m = 0, rows = 0; m < M; m += rows) {
    rows = M - m >= 8 ? 8 : std::min<int64_t>(4, M - m);
    const uint16_t* xm = x + m * K;
    c10::BFloat16* ym = y + m * N;
    switch (rows) {
      case 8: dot_bf16_rows<8>(w, n0, n1, xm, K, N, ym); break;
      case 4: dot_bf16_rows<4>(w, n0, n1, xm, K, N, ym); break;
      case 3: dot_bf16_rows<3>(w, n0, n1, xm, K, N, ym); break;
      case 2: dot_bf16_rows<2>(w, n0, n1, xm, K, N, ym); break;
      default: dot_bf16_rows<1>(w, n0, n1, xm, K, N, ym); break;
    }
  }
}

void linear_bf16_dots_impl(const c10::BFloat16* x, const uint8_t* w, c10::BFloat16* y, int64_t M, int64_t N,
                           int64_t K) {
  const uint16_t* wb = reinterpret_cast<const uint16_t*>(w);
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x);
  parallel_for(0, N, kRowsPerTask, [&](int64_t n0, int64_t n1) {
    // kRowsPerTask weight rows at a time (a thread's range can be half the matrix), so they stay in L1
    // from one group of activation rows to the next (over the whole range they were read again from
    // memory per group: the LM head at 64 rows ran 0.46x oneDNN's packed call, 0.64x taken so).
    for (int64_t c0 = n0; c0 < n1; c0 += kRowsPerTask)
      dot_bf16_block(wb, c0, std::min(c0 + kRowsPerTask, n1), xb, M, K, N, y);
  });
}

// ---- many rows: pairs of 16 weight rows transposed once, outer products without reductions ----
//
// 17-64 rows of a layer's matrix (kernels/cpu_quant.py BF16_OUTER_ROWS): 0.83-1.34x oneDNN's packed
// call at 32-64 rows on the default model's layer shapes, where its GEMM on the matrix as stored ran
// 0.78-0.88x. The two transposed blocks (32 rows x K bf16: 36 KB at K = 576) are read again for every
// 12 activation rows, from L1 or L2.
//
// Pair p (inputs 2p, 2p + 1) of 16 weight rows as one vector, lane j row j's pair: out[p].
inline void transpose_pairs(const uint16_t* w, int64_t K, int64_t k, __m512i out[16]) {
  __m512i r[16], t[16];
  for (int j = 0; j < 16; ++j) {
    r[j] = _mm512_loadu_si512(w + j * K + k);
    // The next block's rows (32 on) at the same inputs, non-temporal as the decode matmuls', since
    // the hardware's prefetchers alone left batched bf16 decode steps slower; past the matrix's end
    // a prefetch does not fault.
    _mm_prefetch(reinterpret_cast<const char*>(w + (j + 32) * K + k), kWeightHint);
  }
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // r[4i + q], 128-bit lane L: pair 4L + q of rows 4i..4i+3.
  for (int q = 0; q < 4; ++q) {
    const __m512i x = _mm512_shuffle_i32x4(r[q], r[4 + q], 0x88), y = _mm512_shuffle_i32x4(r[q], r[4 + q], 0xdd);
    const __m512i x2 = _mm512_shuffle_i32x4(r[8 + q], r[12 + q], 0x88);
    const __m512i y2 = _mm512_shuffle_i32x4(r[8 + q], r[12 + q], 0xdd);
    out[q] = _mm512_shuffle_i32x4(x, x2, 0x88);
    out[8 + q] = _mm512_shuffle_i32x4(x, x2, 0xdd);
    out[4 + q] = _mm512_shuffle_i32x4(y, y2, 0x88);
    out[12 + q] = _mm512_shuffle_i32x4(y, y2, 0xdd);
  }
}

// G activation rows (stride K) against the 32 weight rows whose pairs buf holds ([2][P] vectors):
// per pair two vector loads, G broadcasts and 2G dot products, each output's sum in one lane (no
// reduction), 16 outputs a store.
template <int G>
inline void outer_rows(const __m512i* buf, int64_t P, const int32_t* x, c10::BFloat16* y, int64_t N) {
  __m512 acc[2][G];
  for (int b = 0; b < 2; ++b)
    for (int r = 0; r < G; ++r) acc[b][r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < P; ++p) {
    const __m512bh t0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(buf + p));
    const __m512bh t1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(buf + P + p));
    for (int r = 0; r < G; ++r) {
      int32_t pair;  // two bf16 inputs (a memcpy: x need not be 4-byte aligned)
      std::memcpy(&pair, x + r * P + p, 4);
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      acc[0][r] = _mm512_dpbf16_ps(acc[0][r], t0, xv);
      acc[1][r] = _mm512_dpbf16_ps(acc[1][r], t1, xv);
    }
  }
  for (int r = 0; r < G; ++r)
    for (int b = 0; b < 2; ++b)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * N + 16 * b),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(acc[b][r])));
}

// Weight rows n .. n + 31 against every activation row: the two blocks' pairs transposed once into
// buf, then activation rows in groups of 12 (24 accumulators), the rest in groups of 4 and 1-3.
void outer_block(const uint16_t* w, const uint16_t* x, int64_t M, int64_t K, int64_t N, int64_t n,
                 c10::BFloat16* y, __m512i* buf) {
  const int64_t P = K / 2;
  for (int b = 0; b < 2; ++b)
    for (int64_t k = 0; k < K; k += 32) transpose_pairs(w + (n + 16 * b) * K, K, k, buf + b * P + k / 2);
  const int32_t* xp = reinterpret_cast<const int32_t*>(x);
  for (int64_t m = 0, rows = 0; m < M; m += rows) {
    rows = M - m >= 12 ? 12 : M - m >= 4 ? 4 : M - m;
    const int32_t* xm = xp + m * P;
    c10::BFloat16* ym = y + m * N + n;
    switch (rows) {
      case 12: outer_rows<12>(buf, P, xm, ym, N); break;
      case 4: outer_rows<4>(buf, P, xm, ym, N); break;
      case 3: outer_rows<3>(buf, P, xm, ym, N); break;
      case 2: outer_rows<2>(buf, P, xm, ym, N); break;
      default: outer_rows<1>(buf, P, xm, ym, N); break;
    }
  }
}

void linear_bf16_outer_impl(const c10::BFloat16* x, const uint8_t* w, c10::BFloat16* y, int64_t M, int64_t N,
                            int64_t K) {
  const uint16_t* wb = reinterpret_cast<const uint16_t*>(w);
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x);
  const int64_t whole = N / 32 * 32;
  parallel_for(0, whole / 32, 1, [&](int64_t b0, int64_t b1) {
    std::vector<__m512i> buf(K);  // two blocks' transposed pairs: 2 x K / 2 vectors
    for (int64_t b = b0; b < b1; ++b) outer_block(wb, xb, M, K, N, 32 * b, y, buf.data());
  });
  if (whole < N) dot_bf16_block(wb, whole, N, xb, M, K, N, y);  // the last < 32 weight rows
}
#pragma GCC pop_options

bool has_bf16_dots() {
  static const bool native = __builtin_cpu_supports("avx512bf16");
  return native;
}

#else

bool has_bf16_dots() { return false; }

void linear_bf16_dots_impl(const c10::BFloat16*, const uint8_t*, c10::BFloat16*, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "bf16 dot products need the AVX-512 build");
}

void linear_bf16_outer_impl(const c10::BFloat16*, const uint8_t*, c10::BFloat16*, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "bf16 dot products need the AVX-512 build");
}

#endif

template <typename Fn>
void by_format(int64_t fmt, Fn&& fn) {
  switch (fmt) {
    case kQ8_0: fn(std::integral_constant<int64_t, kQ8_0>{}); break;
    case kQ4_0: fn(std::integral_constant<int64_t, kQ4_0>{}); break;
    case kQ4_1: fn(std::integral_constant<int64_t, kQ4_1>{}); break;
    case kQ4_K: fn(std::integral_constant<int64_t, kQ4_K>{}); break;
    case kQ6_K: fn(std::integral_constant<int64_t, kQ6_K>{}); break;
    case kBF16: fn(std::integral_constant<int64_t, kBF16>{}); break;
    default: TORCH_CHECK(false, "unknown block format ", fmt);
  }
}

// ---- the ops -------------------------------------------------------------------------------------

// x [M, K] float32 or bfloat16 contiguous, w [N, K / block weights * block bytes] uint8 -> y [M, N] in
// x's dtype. bf16 rows are widened here: at one row the conversions as separate torch ops cost more
// host time than the matmul of a small projection. Sums are rounded to bf16 as they are written for one
// row; for more, into a float result converted once (vectorized, not c10's scalar rounding per output).
at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w, int64_t fmt) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16 || x.scalar_type() == at::kFloat) && x.dim() == 2 && x.is_contiguous(),
              "x: contiguous float32 or bfloat16 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_weight(w, fmt, K);
  auto y = at::empty({M, N}, x.options());
  if (bf16 && fmt == kBF16 && has_bf16_dots()) {  // bf16 by bf16, nothing to decode (above)
    linear_bf16_dots_impl(x.data_ptr<c10::BFloat16>(), w.data_ptr<uint8_t>(), y.data_ptr<c10::BFloat16>(), M, N, K);
    return y;
  }
  std::vector<float> widened;
  const float* xf = nullptr;
  if (bf16) {
    widened.resize(M * K);
    const c10::BFloat16* xb = x.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < M * K; ++i) widened[i] = static_cast<float>(xb[i]);
    xf = widened.data();
  } else {
    xf = x.data_ptr<float>();
  }
  by_format(fmt, [&](auto F) {
    constexpr int64_t f = decltype(F)::value;
    if (bf16 && M == 1) linear_f32_impl<f>(xf, w.data_ptr<uint8_t>(), y.data_ptr<c10::BFloat16>(), M, N, K);
    else if (bf16) {
      auto yf = at::empty({M, N}, x.options().dtype(at::kFloat));
      linear_f32_impl<f>(xf, w.data_ptr<uint8_t>(), yf.data_ptr<float>(), M, N, K);
      y.copy_(yf);
    } else linear_f32_impl<f>(xf, w.data_ptr<uint8_t>(), y.data_ptr<float>(), M, N, K);
  });
  return y;
}

// bf16 x [M, K] by BF16 blocks w [N, K * 2] -> bf16 [M, N], for the rows past the register kernel's
// where oneDNN's GEMM on the matrix as stored is slower (kernels/cpu_quant.py BF16_OUTER_ROWS).
at::Tensor linear_bf16_outer(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(has_bf16_dots(), "linear_bf16_outer needs AVX512_BF16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_weight(w, kBF16, K);
  auto y = at::empty({M, N}, x.options());
  linear_bf16_outer_impl(x.data_ptr<c10::BFloat16>(), w.data_ptr<uint8_t>(), y.data_ptr<c10::BFloat16>(), M, N, K);
  return y;
}

// Whether linear_q16 runs here (its kernel is written for AVX2; AVX-512 builds have VNNI's int8).
bool has_int16_dots() {
#if defined(CPU_CAPABILITY_AVX2)
  return true;
#else
  return false;
#endif
}

// Whether linear_q8 has integer dot products here (AVX2's vpmaddubsw, or AVX-512 VNNI's vpdpbusd on
// an AVX-512 build); without them its portable loop is slower than linear_f32.
bool has_int8_dots() {
#if defined(CPU_CAPABILITY_AVX512)
  return has_vnni();
#elif defined(CPU_CAPABILITY_AVX2)
  return true;
#else
  return false;
#endif
}

// x [M, K] float32 or bfloat16 -> y [M, N] in x's dtype, x's rows quantized to I per block; each row
// on its own, so a row's result does not depend on the rows beside it (a decode step and a 16-token
// chunk agree).
template <typename I>
at::Tensor linear_int(const at::Tensor& x, const at::Tensor& w, int64_t fmt, const char* name) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16 || x.scalar_type() == at::kFloat) && x.dim() == 2 && x.is_contiguous(),
              "x: contiguous float32 or bfloat16 [M, K]");
  TORCH_CHECK(fmt == kQ8_0 || fmt == kQ4_0 || fmt == kQ4_1, name, " reads Q8_0, Q4_0 and Q4_1 blocks only");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_weight(w, fmt, K);
  const at::Tensor xf = bf16 ? x.to(at::kFloat) : x;
  auto y = at::empty({M, N}, xf.options());
  const QRows<I> a = quantize_rows<I>(xf.data_ptr<float>(), M, K);
  by_format(fmt, [&](auto F) {
    constexpr int64_t f = decltype(F)::value;
    if constexpr (f == kQ8_0 || f == kQ4_0 || f == kQ4_1) {
      linear_q8_impl<f>(a, w.data_ptr<uint8_t>(), y.data_ptr<float>(), M, N, K);
    }
  });
  return bf16 ? y.to(at::kBFloat16) : y;
}

at::Tensor linear_q8(const at::Tensor& x, const at::Tensor& w, int64_t fmt) {
#if defined(CPU_CAPABILITY_AVX512)
  TORCH_CHECK(has_vnni(), "linear_q8 needs AVX-512 VNNI, which this CPU lacks");
#endif
  return linear_int<int8_t>(x, w, fmt, "linear_q8");
}

// int16 activations: the kernel is written for AVX2 builds only.
at::Tensor linear_q16(const at::Tensor& x, const at::Tensor& w, int64_t fmt) {
#if defined(CPU_CAPABILITY_AVX2)
  return linear_int<int16_t>(x, w, fmt, "linear_q16");
#else
  TORCH_CHECK(false, "linear_q16 is built for AVX2 only");
#endif
}

// x [M, K] bfloat16 contiguous -> y [M, N] bfloat16 (float32 accumulation); see the tiled kernel above.
at::Tensor linear_bf16_tiled(const at::Tensor& x, const at::Tensor& w, int64_t fmt) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "x: contiguous bfloat16 [M, K]");
  TORCH_CHECK(has_brgemm_bf16(), "linear_bf16_tiled needs oneDNN's bf16 brgemm, which this CPU or torch build lacks");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_weight(w, fmt, K);
  auto y = at::empty({M, N}, x.options());
  by_format(fmt, [&](auto F) {
    linear_bf16_tiled_impl<decltype(F)::value>(x.data_ptr<c10::BFloat16>(), w.data_ptr<uint8_t>(),
                                               y.data_ptr<c10::BFloat16>(), M, N, K);
  });
  return y;
}

// x [M, K] float32 contiguous -> y [M, N] float32: float activations past the register kernel's rows
// where there is no bf16 brgemm (an AVX2 CPU; float32 models anywhere). Each task dequantizes 64
// weight rows into a float tile that stays in L2 (64 x K x 4 bytes: 384 KiB at K = 1536) and
// multiplies it with one single-threaded sgemm (inside the parallel region BLAS runs on the
// calling thread; on AVX2, the micro-kernel below), so the weight is decoded once per step and
// never written out whole: the old path dequantized every matrix to a full float copy each step,
// then ran the GEMM.
constexpr int64_t kFloatTileRows = 64;

#if !defined(CPU_CAPABILITY_AVX2)
// The BLAS torch links (MKL in the x86 wheels) exports Fortran sgemm_ but not ATen's cpublas::gemm
// for float; weak, so a torch without it still loads this module and takes at::mm instead.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc) __attribute__((weak));

// y[:, :rows] (row stride ldy) = x [M, K] @ tile[rows, K]^T.
void tile_gemm(const float* tile, int64_t rows, const float* x, int64_t M, int64_t K, float* y, int64_t ldy) {
  if (sgemm_ != nullptr) {  // column-major: y^T (rows x M) = tile^T' (rows x K) . x^T (K x M)
    const int m = static_cast<int>(rows), n = static_cast<int>(M), k = static_cast<int>(K), ldc = static_cast<int>(ldy);
    const float one = 1.0f, zero = 0.0f;
    sgemm_("T", "N", &m, &n, &k, &one, tile, &k, x, &k, &zero, y, &ldc);
    return;
  }
  auto opts = at::TensorOptions().dtype(at::kFloat);
  auto out = at::mm(at::from_blob(const_cast<float*>(x), {M, K}, opts),
                    at::from_blob(const_cast<float*>(tile), {rows, K}, opts).t());
  for (int64_t m = 0; m < M; ++m) std::memcpy(y + m * ldy, out.data_ptr<float>() + m * rows, rows * sizeof(float));
}
#endif

#if defined(CPU_CAPABILITY_AVX2)
// On AVX2 the tile's GEMM is a register-blocked micro-kernel of our own instead of sgemm: sgemm
// pays its packing and dispatch on every 64-row tile, which the micro-kernel does not, so it runs
// the default model's Q4_1 matrices faster at 16-256 activation rows. Above TILED_GEMM_ROWS one
// large MKL GEMM on the dequantized weight is still faster, so that path stays.
// The activations are packed once per call, transposed in slabs of kSlab rows ([K][kSlab] each,
// zero-padded), so the kernel's inner loop reads one slab row (two vectors) and broadcasts one
// weight from each of kMicroRows tile rows: 2 x kMicroRows FMAs per k into 2 x kMicroRows
// accumulators (12 of the 16 vector registers), as BLIS's Haswell kernel does. Each y element is
// one accumulator's sum over k in order: float math, summation order only.
constexpr int64_t kSlab = 16;       // activation rows per slab (two 8-float vectors)
constexpr int64_t kMicroRows = 6;   // weight rows per micro-tile

// slabs [ceil(M / kSlab)][K][kSlab] <- x [M, K] (rows past M zero).
std::vector<float> pack_slabs(const float* x, int64_t M, int64_t K) {
  const int64_t slabs = (M + kSlab - 1) / kSlab;
  std::vector<float> out(slabs * K * kSlab, 0.0f);
  parallel_for(0, slabs, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s)
      for (int64_t j = 0; j < kSlab && s * kSlab + j < M; ++j) {
        const float* row = x + (s * kSlab + j) * K;
        float* dst = out.data() + s * K * kSlab + j;
        for (int64_t k = 0; k < K; ++k) dst[k * kSlab] = row[k];
      }
  });
  return out;
}

// y[m0 + j, n] for the slab's rows j < valid and the tile rows n < rows (row stride ldy) =
// tile[n, :] . slab[:, j]; tile [rows, K] row-major, its rows past `rows` never read.
// The accumulators are named variables, not an array: GCC kept an array's 12 vectors in registers
// but also stored each to the stack on every k (12 stores per 12 FMAs, measured 2.4x slower).
template <int NR>
inline void micro_tile(const float* tile, int64_t K, const float* slab, float* y, int64_t ldy, int64_t valid) {
  static_assert(NR >= 1 && NR <= kMicroRows, "a micro-tile holds 1 to 6 weight rows");
  const __m256 zero = _mm256_setzero_ps();
  __m256 c00 = zero, c01 = zero, c10 = zero, c11 = zero, c20 = zero, c21 = zero;
  __m256 c30 = zero, c31 = zero, c40 = zero, c41 = zero, c50 = zero, c51 = zero;
#define PAGEWISE_MICRO_ROW(i)                                                  \
  if constexpr (NR > i) {                                                      \
    const __m256 a = _mm256_broadcast_ss(tile + i * K + k);                    \
    c##i##0 = _mm256_fmadd_ps(a, b0, c##i##0);                                 \
    c##i##1 = _mm256_fmadd_ps(a, b1, c##i##1);                                 \
  }
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(slab + k * kSlab), b1 = _mm256_loadu_ps(slab + k * kSlab + 8);
    PAGEWISE_MICRO_ROW(0) PAGEWISE_MICRO_ROW(1) PAGEWISE_MICRO_ROW(2)
    PAGEWISE_MICRO_ROW(3) PAGEWISE_MICRO_ROW(4) PAGEWISE_MICRO_ROW(5)
  }
#undef PAGEWISE_MICRO_ROW
  alignas(32) float out[kSlab];
  const __m256 rows[kMicroRows][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
  for (int i = 0; i < NR; ++i) {
    _mm256_store_ps(out, rows[i][0]);
    _mm256_store_ps(out + 8, rows[i][1]);
    for (int64_t j = 0; j < valid; ++j) y[j * ldy + i] = out[j];
  }
}

// y[:, :rows] (row stride ldy) = x [M, K] @ tile[rows, K]^T, x given as its slabs.
void tile_panels(const float* tile, int64_t rows, const float* slabs, int64_t M, int64_t K, float* y, int64_t ldy) {
  for (int64_t s = 0; s * kSlab < M; ++s) {
    const float* slab = slabs + s * K * kSlab;
    const int64_t valid = std::min(kSlab, M - s * kSlab);
    float* ys = y + s * kSlab * ldy;
    int64_t n = 0;
    for (; n + kMicroRows <= rows; n += kMicroRows)
      micro_tile<kMicroRows>(tile + n * K, K, slab, ys + n, ldy, valid);
    switch (rows - n) {
      case 5: micro_tile<5>(tile + n * K, K, slab, ys + n, ldy, valid); break;
      case 4: micro_tile<4>(tile + n * K, K, slab, ys + n, ldy, valid); break;
      case 3: micro_tile<3>(tile + n * K, K, slab, ys + n, ldy, valid); break;
      case 2: micro_tile<2>(tile + n * K, K, slab, ys + n, ldy, valid); break;
      case 1: micro_tile<1>(tile + n * K, K, slab, ys + n, ldy, valid); break;
      default: break;
    }
  }
}
#endif

at::Tensor linear_f32_tiled(const at::Tensor& x, const at::Tensor& w, int64_t fmt) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_weight(w, fmt, K);
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t bw = kBlockWeights[fmt], bb = kBlockBytes[fmt], nb = K / bw, row_bytes = nb * bb;
  const int64_t tiles = (N + kFloatTileRows - 1) / kFloatTileRows;
#if defined(CPU_CAPABILITY_AVX2)
  const std::vector<float> slabs = pack_slabs(xp, M, K);
#endif
  by_format(fmt, [&](auto F) {
    parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      std::vector<float> tile(kFloatTileRows * K);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n0 = t * kFloatTileRows, rows = std::min(kFloatTileRows, N - n0);
        for (int64_t n = 0; n < rows; ++n)
          for (int64_t b = 0; b < nb; ++b)
            decode_floats<decltype(F)::value>(wp + (n0 + n) * row_bytes + b * bb, tile.data() + n * K + b * bw);
#if defined(CPU_CAPABILITY_AVX2)
        tile_panels(tile.data(), rows, slabs.data(), M, K, yp + n0, N);
#else
        tile_gemm(tile.data(), rows, xp, M, K, yp + n0, N);
#endif
      }
    });
  });
  return y;
}

// Rows [n0, n1) of w (nb blocks of format F a row) -> out_f32 or out_bf16 (whichever is
// not null; each weight rounded once), row n at (n - n0) * K.
template <int64_t F>
void dequantize_rows(const uint8_t* wp, int64_t n0, int64_t n1, int64_t nb, int64_t K, float* out_f32,
                     c10::BFloat16* out_bf16) {
  constexpr int64_t bw = kBlockWeights[F], bb = kBlockBytes[F];
  float buf[256];
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t b = 0; b < nb; ++b) {
      decode_floats<F>(wp + n * nb * bb + b * bb, buf);
      if (out_f32) {
        std::memcpy(out_f32 + (n - n0) * K + b * bw, buf, bw * sizeof(float));
      } else {
        c10::BFloat16* o = out_bf16 + (n - n0) * K + b * bw;
#if defined(CPU_CAPABILITY_AVX512)
        for (int64_t i = 0; i < bw; i += 16)  // c10's scalar rounding cost 4x the decoding
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), to_bf16(_mm512_loadu_ps(buf + i)));
#elif defined(CPU_CAPABILITY_AVX2)
        for (int64_t i = 0; i < bw; i += 8)
          _mm_storeu_si128(reinterpret_cast<__m128i*>(o + i), to_bf16(_mm256_loadu_ps(buf + i)));
#else
        for (int64_t i = 0; i < bw; ++i) o[i] = c10::BFloat16(buf[i]);
#endif
      }
    }
  }
}

// w [N, row bytes] -> [N, K] float32, or bfloat16 (each weight rounded once) when bf16.
at::Tensor dequantize(const at::Tensor& w, int64_t fmt, int64_t K, bool bf16) {
  check_weight(w, fmt, K);
  const int64_t N = w.size(0), nb = K / kBlockWeights[fmt];
  auto out = at::empty({N, K}, w.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  // The output's pointers once: data_ptr per block was a tenth of a bf16 dequantization's time.
  float* out_f32 = bf16 ? nullptr : out.data_ptr<float>();
  c10::BFloat16* out_bf16 = bf16 ? out.data_ptr<c10::BFloat16>() : nullptr;
  by_format(fmt, [&](auto F) {
    parallel_for(0, N, kRowsPerTask, [&](int64_t n0, int64_t n1) {
      dequantize_rows<decltype(F)::value>(wp, n0, n1, nb, K, out_f32 ? out_f32 + n0 * K : nullptr,
                                          out_bf16 ? out_bf16 + n0 * K : nullptr);
    });
  });
  return out;
}

// The bf16 weight slice a linear_dequant_gemm task dequantizes and multiplies at once: about half
// an L2 (at 64 rows of x, 64-1,024 weight rows a task measured fastest at 256-512 for K = 576, per-task
// overhead dominating below 128, an LM head of 49,152 rows included).
constexpr int64_t kGemmTileBytes = 512 << 10;

// bf16 x [M, K] @ dequant(w)^T -> bf16 [M, N]: each task dequantizes a slice of weight rows to bf16
// and multiplies it by ATen's bf16 GEMM (oneDNN's) on its own thread, so the pool's helpers share
// the GEMM too, where dequantize + F.linear runs it on torch's team alone. oneDNN's results do not
// depend on how N is sliced: the same bits as F.linear(x, dequantize(w), bias).
at::Tensor linear_dequant_gemm(const at::Tensor& x, const at::Tensor& w, int64_t fmt,
                               const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_weight(w, fmt, K);
  const int64_t tile_rows = std::max<int64_t>(64, kGemmTileBytes / (2 * K) / 16 * 16);
  auto y = at::empty({M, N}, x.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  const int64_t nb = K / kBlockWeights[fmt], tasks = (N + tile_rows - 1) / tile_rows;
  by_format(fmt, [&](auto F) {
    parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
      auto tile = at::empty({tile_rows, K}, x.options());
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n0 = t * tile_rows, rows = std::min(tile_rows, N - n0);
        dequantize_rows<decltype(F)::value>(wp, n0, n0 + rows, nb, K, nullptr, tile.data_ptr<c10::BFloat16>());
        // (ATen's bf16 gemm entry points are not exported to extensions: at::linear reaches oneDNN.)
        const at::Tensor part = at::linear(x, tile.narrow(0, 0, rows),
                                           bias ? c10::optional<at::Tensor>(bias->narrow(0, n0, rows)) : c10::nullopt);
        const c10::BFloat16* pp = part.data_ptr<c10::BFloat16>();
        for (int64_t m = 0; m < M; ++m) std::memcpy(yp + m * N + n0, pp + m * rows, rows * sizeof(c10::BFloat16));
      }
    });
  });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_helpers", [](int64_t n) { HelperPool::get().set_helpers(n); },
        "threads of this extension's own that join the caller in its loops (0: torch's OpenMP team)");
  m.def("helpers", [] { return HelperPool::get().helpers(); }, "set_helpers' count");
  m.def("helper_chunks", [] { return HelperPool::get().helper_chunks(); },
        "how many loop chunks helpers have run in this process (tests: that they join at all)");
  m.def("parallel_for_address", [] { return reinterpret_cast<int64_t>(&pool_parallel_for); },
        "the address of the pool's loop for kernels/cpu_ops.cpp (the same process and libtorch)");
  m.def("helpers_address", [] { return reinterpret_cast<int64_t>(&pool_helpers); },
        "the address of the pool's helper count, for kernels/cpu_ops.cpp");
  m.def("linear_f32", &linear_f32, "x @ dequant(w)^T, blocks dequantized to float in registers");
  // For kernels/cpu_ops.cpp's DecoderLayers, which calls linear_f32 without a trip through Python.
  m.def("linear_f32_address", [] { return reinterpret_cast<int64_t>(&linear_f32); },
        "the address of linear_f32 (the same process and libtorch)");
  m.def("linear_f32_tiled_address", [] { return reinterpret_cast<int64_t>(&linear_f32_tiled); },
        "the address of linear_f32_tiled (for kernels/cpu_ops.cpp's fused_moe on block-format experts)");
  m.def("linear_q8_address", [] { return reinterpret_cast<int64_t>(&linear_q8); },
        "the address of linear_q8 (the same process and libtorch)");
  m.def("linear_q16", &linear_q16, "x @ dequant(w)^T with x quantized to int16 per 32-block (AVX2)");
  m.def("linear_q16_address", [] { return reinterpret_cast<int64_t>(&linear_q16); },
        "the address of linear_q16 (the same process and libtorch)");
  m.def("has_int16_dots", &has_int16_dots, "whether linear_q16 runs on this build");
  m.def("has_int8_dots", &has_int8_dots, "whether linear_q8 has integer dot products on this build and CPU");
  m.def("linear_bf16_outer", &linear_bf16_outer, "bf16 x @ BF16 w^T: 32 weight rows transposed at a time, outer products");
  m.def("has_bf16_dots", &has_bf16_dots, "whether linear_f32 multiplies bf16 rows by BF16 weights in bf16 dot products here");
  m.def("linear_q8", &linear_q8, "x @ dequant(w)^T with x quantized to int8 per 32-block (integer dots)");
  m.def("linear_f32_tiled", &linear_f32_tiled, "float32 x @ dequant(w)^T: float weight tiles in L2, sgemm");
  m.def("linear_bf16_tiled", &linear_bf16_tiled, "bf16 x @ dequant(w)^T: bf16 weight tiles in L2, brgemm");
  m.def("has_brgemm_bf16", &has_brgemm_bf16, "whether linear_bf16_tiled can run here");
  m.def("dequantize", &dequantize, "block-quantized rows -> float32 / bfloat16 [N, K]");
  m.def("linear_dequant_gemm", &linear_dequant_gemm, "bf16 x @ dequant(w)^T: bf16 weight slices, ATen's GEMM per task");
  m.def("has_vnni", &has_vnni, "whether linear_q8 runs on AVX-512 VNNI");
}
