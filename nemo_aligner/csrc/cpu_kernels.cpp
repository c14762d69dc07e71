// Fused float32 CPU kernels for megatron-core GPTs.
//
// A decode step (one new token per row) of a small model is a few hundred small ops; eager
// PyTorch pays a dispatch, an allocation and a pass over memory for each. These kernels do a
// layer's glue in four calls:
//   add_rms_norm      residual add + RMSNorm, one pass
//   rope_cache_write  RoPE on the new queries and key + the key/value write into the cache
//   decode_attention  one query per row against the cache: each cached key and value read once
//   swiglu            silu(gate) * up, one pass
// Training uses swiglu and swiglu_backward (one pass each instead of five elementwise ops) and
// rms_norm_forward/backward (one pass each instead of ~6 and ~7 ops); float32 or bf16 tensors,
// bf16 computed in float32 and rounded once.
// pack_linear/pack_matrix/packed_gemm: an AVX2/FMA (or AVX-512) GEMM over packed column panels, for decode
// steps, prefills and (cpu_gemm.NativeLinear) training matmuls. amx_pack/amx_linear: a bf16 GEMM on
// AMX tiles for the decode steps of bf16 models. Built at first use by
// nemo_aligner/utils/cpu_kernels.py; torch's ops are the reference (tests/test_cpu_kernels.py).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#ifdef __linux__
#include <sys/mman.h>
#include <unistd.h>
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define NA_AVX2 1
#endif

#if defined(__linux__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512F__)
#include <sys/syscall.h>
#include <unistd.h>
#define NA_AMX 1
#endif

namespace {

constexpr int64_t kMinTaskFloats = 1 << 15;  // below this much work a kernel runs on one thread

inline void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, ": expected a float32 CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor");
}

inline int64_t grain_rows(int64_t row_floats) {
  return std::max<int64_t>(1, kMinTaskFloats / std::max<int64_t>(1, row_floats));
}

#ifdef NA_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp for x in [-87.3, 88.3] (clamped), Cephes' expf polynomial: ~1 ulp.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  __m256 y = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

// float32 or bf16 activations, read into and written from float32 (bf16: round to nearest even).
inline float load1(const float* p) { return *p; }
inline float load1(const at::BFloat16* p) { return static_cast<float>(*p); }
inline void store1(float* p, float v) { *p = v; }
inline void store1(at::BFloat16* p, float v) { *p = at::BFloat16(v); }

#ifdef NA_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
// one instruction: round to nearest even, a NaN stays a quiet NaN (denormals flush to zero)
inline void store8(at::BFloat16* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), (__m128i)_mm256_cvtneps_pbh(v));
}
#else
inline void store8(at::BFloat16* p, __m256 v) {
  __m256i bits = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
  // a NaN stays a (quiet) NaN: rounding could carry it into infinity
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_or_si256(bits, _mm256_set1_epi32(0x400000)), nan);
  __m256i high = _mm256_srli_epi32(rounded, 16);
  __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
#endif
#endif

inline void check_f32_or_bf16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16), name,
              ": expected a float32 or bf16 CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor");
}

// n floats of src (float32 or bf16) as float32: src itself, or converted into buf.
template <typename T>
inline const float* as_float(const T* src, float* buf, int64_t n) {
  if constexpr (std::is_same<T, float>::value) {
    return src;
  } else {
    int64_t i = 0;
#ifdef NA_AVX2
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(buf + i, load8(src + i));
#endif
    for (; i < n; ++i) buf[i] = load1(src + i);
    return buf;
  }
}

// n float32 values into dst (bf16: rounded to nearest even).
template <typename T>
inline void store_floats(const float* src, T* dst, int64_t n) {
  int64_t i = 0;
#ifdef NA_AVX2
  for (; i + 8 <= n; i += 8) store8(dst + i, _mm256_loadu_ps(src + i));
#endif
  for (; i < n; ++i) store1(dst + i, src[i]);
}

inline float exp1(float x) {
  return std::exp(std::min(std::max(x, -87.3f), 88.3f));
}

// y[i] = exp(x[i]) for n floats.
inline void exp_array(const float* x, float* y, int64_t n) {
  int64_t i = 0;
#ifdef NA_AVX2
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, exp8(_mm256_loadu_ps(x + i)));
#endif
  for (; i < n; ++i) y[i] = exp1(x[i]);
}

// a . b over n values; b float32 or bf16 (a KV cache), read as float32.
template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#ifdef NA_AVX2
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), load8(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc0);
  s = hsum(_mm256_add_ps(acc0, acc1));
#endif
  for (; i < n; ++i) s += a[i] * load1(b + i);
  return s;
}

#ifdef NA_AVX2
// a . b_u for four rows b_u, each summed exactly as dot() sums it (four independent chains: the
// query's loads are shared and the chains' latencies overlap).
template <typename T>
inline void dot4(const float* a, const T* b0, const T* b1, const T* b2, const T* b3, int64_t n, float* out) {
  __m256 x0 = _mm256_setzero_ps(), x1 = x0, x2 = x0, x3 = x0, y0 = x0, y1 = x0, y2 = x0, y3 = x0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 lo = _mm256_loadu_ps(a + i), hi = _mm256_loadu_ps(a + i + 8);
    x0 = _mm256_fmadd_ps(lo, load8(b0 + i), x0);
    y0 = _mm256_fmadd_ps(hi, load8(b0 + i + 8), y0);
    x1 = _mm256_fmadd_ps(lo, load8(b1 + i), x1);
    y1 = _mm256_fmadd_ps(hi, load8(b1 + i + 8), y1);
    x2 = _mm256_fmadd_ps(lo, load8(b2 + i), x2);
    y2 = _mm256_fmadd_ps(hi, load8(b2 + i + 8), y2);
    x3 = _mm256_fmadd_ps(lo, load8(b3 + i), x3);
    y3 = _mm256_fmadd_ps(hi, load8(b3 + i + 8), y3);
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 lo = _mm256_loadu_ps(a + i);
    x0 = _mm256_fmadd_ps(lo, load8(b0 + i), x0);
    x1 = _mm256_fmadd_ps(lo, load8(b1 + i), x1);
    x2 = _mm256_fmadd_ps(lo, load8(b2 + i), x2);
    x3 = _mm256_fmadd_ps(lo, load8(b3 + i), x3);
  }
  float s0 = hsum(_mm256_add_ps(x0, y0)), s1 = hsum(_mm256_add_ps(x1, y1)), s2 = hsum(_mm256_add_ps(x2, y2)),
        s3 = hsum(_mm256_add_ps(x3, y3));
  for (; i < n; ++i) {  // std::fma: one rounding in every instantiation, however the compiler vectorises them
    s0 = std::fma(a[i], load1(b0 + i), s0);
    s1 = std::fma(a[i], load1(b1 + i), s1);
    s2 = std::fma(a[i], load1(b2 + i), s2);
    s3 = std::fma(a[i], load1(b3 + i), s3);
  }
  out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}
#endif

#if defined(NA_AVX2) && defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

// The 64 values of a cache row from `p` on, requested ahead of use: a task's keys and values are a
// few 4 KiB pages each, and the hardware prefetcher starts over at every page (measured on the
// small benchmark shape: the attention alone 14-21% faster over float32 and bf16 caches; a whole
// greedy `generate` 1% (float32) and 3% (bf16), same tokens).
template <typename T>
inline void prefetch_row(const T* p) {
  const char* line = reinterpret_cast<const char*>(p);
  for (int64_t l = 0; l < 64 * static_cast<int64_t>(sizeof(T)); l += 64) __builtin_prefetch(line + l, 0, 3);
}

// y[i] += sum over t < end of w[t] * x[t * d + i] for i < d (t with keep[t] false skipped; x float32
// or bf16, a KV cache's values, read as float32), each y[i] accumulated in t order; 64 columns at a
// time stay in registers across the rows instead of being read and written once per row (16-wide
// registers where the build has AVX-512: ~7% faster over a float32 cache than 8-wide ones).
template <typename T>
inline void weighted_rows(const float* w, const T* x, const bool* keep, int64_t end, int64_t d, float* y) {
  int64_t i = 0;
#if defined(NA_AVX2) && defined(__AVX512F__)
  for (; i + 64 <= d; i += 64) {
    __m512 r0 = _mm512_loadu_ps(y + i), r1 = _mm512_loadu_ps(y + i + 16), r2 = _mm512_loadu_ps(y + i + 32),
           r3 = _mm512_loadu_ps(y + i + 48);
    for (int64_t t = 0; t < end; ++t) {
      if (t + 8 < end) prefetch_row(x + (t + 8) * d + i);
      if (keep != nullptr && !keep[t]) continue;
      const __m512 a = _mm512_set1_ps(w[t]);
      const T* v = x + t * d + i;
      r0 = _mm512_fmadd_ps(a, load16(v), r0);
      r1 = _mm512_fmadd_ps(a, load16(v + 16), r1);
      r2 = _mm512_fmadd_ps(a, load16(v + 32), r2);
      r3 = _mm512_fmadd_ps(a, load16(v + 48), r3);
    }
    _mm512_storeu_ps(y + i, r0), _mm512_storeu_ps(y + i + 16, r1), _mm512_storeu_ps(y + i + 32, r2);
    _mm512_storeu_ps(y + i + 48, r3);
  }
#elif defined(NA_AVX2)
  for (; i + 64 <= d; i += 64) {
    __m256 r0 = _mm256_loadu_ps(y + i), r1 = _mm256_loadu_ps(y + i + 8), r2 = _mm256_loadu_ps(y + i + 16),
           r3 = _mm256_loadu_ps(y + i + 24), r4 = _mm256_loadu_ps(y + i + 32), r5 = _mm256_loadu_ps(y + i + 40),
           r6 = _mm256_loadu_ps(y + i + 48), r7 = _mm256_loadu_ps(y + i + 56);
    for (int64_t t = 0; t < end; ++t) {
      if (t + 8 < end) prefetch_row(x + (t + 8) * d + i);
      if (keep != nullptr && !keep[t]) continue;
      const __m256 a = _mm256_set1_ps(w[t]);
      const T* v = x + t * d + i;
      r0 = _mm256_fmadd_ps(a, load8(v), r0);
      r1 = _mm256_fmadd_ps(a, load8(v + 8), r1);
      r2 = _mm256_fmadd_ps(a, load8(v + 16), r2);
      r3 = _mm256_fmadd_ps(a, load8(v + 24), r3);
      r4 = _mm256_fmadd_ps(a, load8(v + 32), r4);
      r5 = _mm256_fmadd_ps(a, load8(v + 40), r5);
      r6 = _mm256_fmadd_ps(a, load8(v + 48), r6);
      r7 = _mm256_fmadd_ps(a, load8(v + 56), r7);
    }
    _mm256_storeu_ps(y + i, r0), _mm256_storeu_ps(y + i + 8, r1), _mm256_storeu_ps(y + i + 16, r2);
    _mm256_storeu_ps(y + i + 24, r3), _mm256_storeu_ps(y + i + 32, r4), _mm256_storeu_ps(y + i + 40, r5);
    _mm256_storeu_ps(y + i + 48, r6), _mm256_storeu_ps(y + i + 56, r7);
  }
#endif
#ifdef NA_AVX2
  for (; i + 8 <= d; i += 8) {
    __m256 r = _mm256_loadu_ps(y + i);
    for (int64_t t = 0; t < end; ++t)
      if (keep == nullptr || keep[t]) r = _mm256_fmadd_ps(_mm256_set1_ps(w[t]), load8(x + t * d + i), r);
    _mm256_storeu_ps(y + i, r);
  }
#endif
  for (; i < d; ++i)
    for (int64_t t = 0; t < end; ++t)
      if (keep == nullptr || keep[t]) y[i] = std::fma(w[t], load1(x + t * d + i), y[i]);
}

// o = row * rsqrt(mean(row^2) + eps) * w over h floats; returns the rsqrt.
inline float rms_norm_row(const float* row, const float* w, float* o, int64_t h, float eps) {
  const float inv = 1.0f / std::sqrt(dot(row, row, h) / static_cast<float>(h) + eps);
  for (int64_t i = 0; i < h; ++i) o[i] = row[i] * inv * w[i];
  return inv;
}

}  // namespace

// x [B, H] += residual (when given, in place); returns RMSNorm(x) * weight as a new [B, H] tensor.
at::Tensor add_rms_norm(at::Tensor x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight, double eps) {
  check_f32(x, "x");
  check_f32(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1), "add_rms_norm: x [B, H], weight [H]");
  const int64_t rows = x.size(0), h = x.size(1);
  const float* res = nullptr;
  if (residual.has_value()) {
    check_f32(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "add_rms_norm: residual must have x's shape");
    res = residual->data_ptr<float>();
  }
  at::Tensor out = at::empty_like(x);
  float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_rows(h), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = xp + r * h;
      if (res != nullptr) {
        const float* rr = res + r * h;
        for (int64_t i = 0; i < h; ++i) row[i] += rr[i];
      }
      rms_norm_row(row, w, op + r * h, h, feps);
    }
  });
  return out;
}

template <typename T>
void rope_cache_write_rows(float* q, const float* table, const at::TensorAccessor<int64_t, 1>& pacc, T* c,
                           int64_t rows, int64_t row_width, int64_t slot, int64_t t_len, int64_t d, int64_t rot,
                           int64_t groups, int64_t per_group) {
  const int64_t half = rot / 2;
  // Each step writes a fresh slot, whose cache lines are in memory, not in cache: every line is
  // requested before the arithmetic so that the misses overlap (one row store at a time, they queue:
  // ~2 ms a step for the small benchmark model's 12 layers at batch 32).
  constexpr int64_t kLine = 64 / sizeof(T);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t stop) {
    for (int64_t b = begin; b < stop; ++b)
      for (int64_t g = 0; g < groups; ++g) {
        const T* dst = c + ((b * groups + g) * 2 * t_len + slot) * d;
        for (int64_t i = 0; i < d; i += kLine) {
          __builtin_prefetch(dst + i, 1, 3);
          __builtin_prefetch(dst + t_len * d + i, 1, 3);
        }
      }
    for (int64_t b = begin; b < stop; ++b) {
      const float* cs = table != nullptr ? table + pacc[b] * rot : nullptr;
      for (int64_t g = 0; g < groups; ++g) {
        float* group = q + b * row_width + g * (per_group + 2) * d;
        if (cs != nullptr) {
          for (int64_t j = 0; j <= per_group; ++j) {  // the queries and the key
            float* x1 = group + j * d;
            float* x2 = x1 + half;
            for (int64_t i = 0; i < half; ++i) {
              const float a = x1[i], bb = x2[i], co = cs[i], si = cs[half + i];
              x1[i] = a * co - bb * si;
              x2[i] = bb * co + a * si;
            }
          }
        }
        T* dst = c + ((b * groups + g) * 2 * t_len + slot) * d;
        store_floats(group + per_group * d, dst, d);                // key
        store_floats(group + (per_group + 1) * d, dst + t_len * d, d);  // value
      }
    }
  });
}

// qkv [B, groups * (per_group + 2) * d]: per query group its per_group query heads, then one key and
// one value head (megatron-core's layout). Rotates the queries and the key in place by RoPE (the
// first 2 * half channels of each head, halves not interleaved; rope_table [max_len, 2 * half]: cos
// then sin, row positions[b]), then writes key and value into cache [B, groups, 2, T, d] at `slot`
// (float32, or bf16: each value rounded once).
void rope_cache_write(at::Tensor qkv, const c10::optional<at::Tensor>& rope_table, const at::Tensor& positions,
                      at::Tensor cache, int64_t slot, int64_t groups, int64_t per_group) {
  check_f32(qkv, "qkv");
  check_f32_or_bf16(cache, "cache");
  TORCH_CHECK(cache.dim() == 5 && cache.size(2) == 2, "rope_cache_write: cache [B, groups, 2, T, d]");
  const int64_t rows = qkv.size(0), d = cache.size(4), t_len = cache.size(3);
  TORCH_CHECK(cache.size(0) == rows && cache.size(1) == groups, "rope_cache_write: cache rows/groups mismatch");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == groups * (per_group + 2) * d, "rope_cache_write: qkv width");
  TORCH_CHECK(slot >= 0 && slot < t_len, "rope_cache_write: slot out of range");
  const float* table = nullptr;
  int64_t rot = 0, table_len = 0;
  if (rope_table.has_value()) {
    check_f32(*rope_table, "rope_table");
    rot = rope_table->size(1);
    table_len = rope_table->size(0);
    TORCH_CHECK(rot % 2 == 0 && rot <= d, "rope_cache_write: rope table width");
    table = rope_table->data_ptr<float>();
  }
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == rows, "rope_cache_write: positions [B] int64");
  auto pos = positions.reshape({rows});
  auto pacc = pos.accessor<int64_t, 1>();
  if (table != nullptr)
    for (int64_t b = 0; b < rows; ++b)
      TORCH_CHECK(pacc[b] >= 0 && pacc[b] < table_len, "rope_cache_write: position out of the RoPE table");
  if (cache.scalar_type() == at::kBFloat16)
    rope_cache_write_rows(qkv.data_ptr<float>(), table, pacc, cache.data_ptr<at::BFloat16>(), rows, qkv.size(1),
                          slot, t_len, d, rot, groups, per_group);
  else
    rope_cache_write_rows(qkv.data_ptr<float>(), table, pacc, cache.data_ptr<float>(), rows, qkv.size(1), slot,
                          t_len, d, rot, groups, per_group);
}

template <typename T>
void decode_attention_rows(const float* q, int64_t row_width, const T* c, float* o, const bool* mask,
                           int64_t mask_stride, int64_t rows, int64_t end, int64_t t_len, int64_t d, float fscale,
                           int64_t groups, int64_t per_group) {
  const int64_t tasks = rows * groups;
  at::parallel_for(0, tasks, grain_rows(2 * end * d), [&](int64_t begin, int64_t stop) {
    std::vector<float> scores(per_group * end);
    std::vector<float> acc(per_group * d);
    std::vector<float> inv_sum(per_group);
    for (int64_t task = begin; task < stop; ++task) {
      const int64_t b = task / groups, g = task % groups;
      const float* qg = q + b * row_width + g * (per_group + 2) * d;
      const T* keys = c + (b * groups + g) * 2 * t_len * d;
      const T* values = keys + t_len * d;
      const bool* m = mask != nullptr ? mask + b * mask_stride : nullptr;
      constexpr float kSkip = -std::numeric_limits<float>::infinity();
      int64_t t = 0;
#ifdef NA_AVX2
      for (; t + 4 <= end; t += 4) {  // four keys at a time (see dot4)
        const T* k = keys + t * d;
        if (t + 12 <= end)  // the keys two passes ahead
          for (int64_t r = 8; r < 12; ++r)
            for (int64_t i = 0; i < d; i += 64) prefetch_row(k + r * d + i);
        for (int64_t j = 0; j < per_group; ++j) {
          float four[4];
          dot4(qg + j * d, k, k + d, k + 2 * d, k + 3 * d, d, four);
          for (int64_t u = 0; u < 4; ++u)
            scores[j * end + t + u] = m == nullptr || m[t + u] ? four[u] * fscale : kSkip;
        }
      }
#endif
      for (; t < end; ++t) {
        const bool keep = m == nullptr || m[t];
        const T* k = keys + t * d;
        for (int64_t j = 0; j < per_group; ++j) scores[j * end + t] = keep ? dot(qg + j * d, k, d) * fscale : kSkip;
      }
      for (int64_t j = 0; j < per_group; ++j) {
        float* s = scores.data() + j * end;
        float mx = kSkip;
        for (int64_t t = 0; t < end; ++t) mx = std::max(mx, s[t]);
        // every slot masked cannot happen (a row always sees its own new key); guard anyway
        if (mx == kSkip) mx = 0.f;
        for (int64_t t = 0; t < end; ++t) s[t] -= mx;  // masked slots stay -inf: exp gives 0
        exp_array(s, s, end);
        float sum = 0.f;
        for (int64_t t = 0; t < end; ++t) sum += s[t];
        inv_sum[j] = sum > 0.f ? 1.0f / sum : 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < per_group; ++j) weighted_rows(scores.data() + j * end, values, m, end, d, acc.data() + j * d);
      float* og = o + (b * groups + g) * per_group * d;
      for (int64_t j = 0; j < per_group; ++j)
        for (int64_t i = 0; i < d; ++i) og[j * d + i] = acc[j * d + i] * inv_sum[j];
    }
  });
}

// One query per row against the cache: qkv as in rope_cache_write (the queries already rotated),
// cache [B, groups, 2, T, d] (float32 or bf16), slots [0, end) attended (those with key_mask[b, t] false skipped).
// Returns [B, groups * per_group * d]: softmax(scale * q k^T) v per query head.
at::Tensor decode_attention(const at::Tensor& qkv, const at::Tensor& cache, int64_t end,
                            const c10::optional<at::Tensor>& key_mask, double scale, int64_t groups,
                            int64_t per_group) {
  check_f32(qkv, "qkv");
  check_f32_or_bf16(cache, "cache");
  const int64_t rows = qkv.size(0), d = cache.size(4), t_len = cache.size(3);
  TORCH_CHECK(cache.dim() == 5 && cache.size(0) == rows && cache.size(1) == groups && cache.size(2) == 2,
              "decode_attention: cache [B, groups, 2, T, d]");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == groups * (per_group + 2) * d, "decode_attention: qkv width");
  TORCH_CHECK(end >= 1 && end <= t_len, "decode_attention: end out of range");
  const bool* mask = nullptr;
  int64_t mask_stride = 0;
  at::Tensor mask_c;
  if (key_mask.has_value()) {
    TORCH_CHECK(key_mask->scalar_type() == at::kBool && key_mask->dim() == 2 && key_mask->size(0) == rows &&
                    key_mask->size(1) >= end, "decode_attention: key_mask [B, >= end] bool");
    mask_c = key_mask->contiguous();
    mask = mask_c.data_ptr<bool>();
    mask_stride = mask_c.size(1);
  }
  at::Tensor out = at::empty({rows, groups * per_group * d}, qkv.options());
  if (cache.scalar_type() == at::kBFloat16)
    decode_attention_rows(qkv.data_ptr<float>(), qkv.size(1), cache.data_ptr<at::BFloat16>(), out.data_ptr<float>(),
                          mask, mask_stride, rows, end, t_len, d, static_cast<float>(scale), groups, per_group);
  else
    decode_attention_rows(qkv.data_ptr<float>(), qkv.size(1), cache.data_ptr<float>(), out.data_ptr<float>(), mask,
                          mask_stride, rows, end, t_len, d, static_cast<float>(scale), groups, per_group);
  return out;
}

// x [B, 2F] (gate then up, as megatron-core's fc1 output) -> silu(gate) * up [B, F].
template <typename T>
void swiglu_rows(const T* xp, T* op, int64_t rows, int64_t f) {
  at::parallel_for(0, rows, grain_rows(2 * f), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = xp + r * 2 * f;
      const T* up = gate + f;
      T* o = op + r * f;
      int64_t i = 0;
#ifdef NA_AVX2
      const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
      for (; i + 8 <= f; i += 8) {
        __m256 g = load8(gate + i);
        __m256 e = exp8(_mm256_sub_ps(zero, g));
        store8(o + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), load8(up + i)));
      }
#endif
      for (; i < f; ++i) {
        const float g = load1(gate + i);
        store1(o + i, g / (1.0f + exp1(-g)) * load1(up + i));
      }
    }
  });
}

at::Tensor swiglu(const at::Tensor& x) {
  check_f32_or_bf16(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "swiglu: x [B, 2F]");
  const int64_t rows = x.size(0), f = x.size(1) / 2;
  at::Tensor out = at::empty({rows, f}, x.options());
  if (x.scalar_type() == at::kBFloat16)
    swiglu_rows(x.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, f);
  else
    swiglu_rows(x.data_ptr<float>(), out.data_ptr<float>(), rows, f);
  return out;
}

// The gradient of swiglu: grad [N, F], x [N, 2F] (gate then up) -> dx [N, 2F]. With s = sigmoid(gate):
// d_gate = grad * up * s * (1 + gate * (1 - s)) (aten's silu_backward), d_up = grad * gate * s.
// One pass, and nothing saved from the forward but x (silu(gate) is recomputed with s).
template <typename T>
void swiglu_backward_rows(const T* gp, const T* xp, T* dp, int64_t rows, int64_t f) {
  at::parallel_for(0, rows, grain_rows(3 * f), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gp + r * f;
      const T* gate = xp + r * 2 * f;
      const T* up = gate + f;
      T* d_gate = dp + r * 2 * f;
      T* d_up = d_gate + f;
      int64_t i = 0;
#ifdef NA_AVX2
      const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
      for (; i + 8 <= f; i += 8) {
        __m256 a = load8(gate + i), u = load8(up + i), gr = load8(g + i);
        __m256 s = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, a))));
        __m256 silu = _mm256_mul_ps(a, s);
        store8(d_up + i, _mm256_mul_ps(gr, silu));
        __m256 deriv = _mm256_mul_ps(s, _mm256_fmadd_ps(a, _mm256_sub_ps(one, s), one));
        store8(d_gate + i, _mm256_mul_ps(_mm256_mul_ps(gr, u), deriv));
      }
#endif
      for (; i < f; ++i) {
        const float a = load1(gate + i), s = 1.0f / (1.0f + exp1(-a)), gi = load1(g + i);
        store1(d_up + i, gi * (a * s));
        store1(d_gate + i, gi * load1(up + i) * (s * (1.0f + a * (1.0f - s))));
      }
    }
  });
}

at::Tensor swiglu_backward(const at::Tensor& grad, const at::Tensor& x) {
  check_f32_or_bf16(grad, "grad");
  check_f32_or_bf16(x, "x");
  TORCH_CHECK(grad.scalar_type() == x.scalar_type(), "swiglu_backward: grad and x must have one dtype");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0 && grad.dim() == 2 && grad.size(0) == x.size(0) &&
                  grad.size(1) * 2 == x.size(1), "swiglu_backward: grad [N, F], x [N, 2F]");
  const int64_t rows = x.size(0), f = grad.size(1);
  at::Tensor dx = at::empty_like(x);
  if (x.scalar_type() == at::kBFloat16)
    swiglu_backward_rows(grad.data_ptr<at::BFloat16>(), x.data_ptr<at::BFloat16>(), dx.data_ptr<at::BFloat16>(), rows, f);
  else
    swiglu_backward_rows(grad.data_ptr<float>(), x.data_ptr<float>(), dx.data_ptr<float>(), rows, f);
  return dx;
}

// A norm weight (float32 or bf16, any layout) as a contiguous float32 tensor.
inline at::Tensor float_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "weight: expected a float32 or bf16 CPU tensor");
  return weight.to(at::kFloat).contiguous();
}

template <typename T>
void rms_norm_forward_rows(const T* xp, const float* w, T* op, float* rp, int64_t rows, int64_t h, float eps) {
  constexpr bool kFloat = std::is_same<T, float>::value;
  at::parallel_for(0, rows, grain_rows(h), [&](int64_t begin, int64_t end) {
    std::vector<float> in(kFloat ? 0 : h), out(kFloat ? 0 : h);
    for (int64_t r = begin; r < end; ++r) {
      const float* row = as_float(xp + r * h, in.data(), h);
      if constexpr (kFloat) {
        rp[r] = rms_norm_row(row, w, op + r * h, h, eps);
      } else {
        rp[r] = rms_norm_row(row, w, out.data(), h, eps);
        store_floats(out.data(), op + r * h, h);
      }
    }
  });
}

// RMSNorm for training: x [N, H] -> (x * rstd * weight, rstd [N]), rstd = rsqrt(mean(x^2) + eps).
// x float32 or bf16 (bf16: computed in float32, the output rounded once); weight float32 or bf16;
// rstd float32.
std::vector<at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_f32_or_bf16(x, "x");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1), "rms_norm_forward: x [N, H], weight [H]");
  const int64_t rows = x.size(0), h = x.size(1);
  const at::Tensor w = float_weight(weight);
  at::Tensor out = at::empty_like(x);
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  const float feps = static_cast<float>(eps);
  if (x.scalar_type() == at::kBFloat16)
    rms_norm_forward_rows(x.data_ptr<at::BFloat16>(), w.data_ptr<float>(), out.data_ptr<at::BFloat16>(),
                          rstd.data_ptr<float>(), rows, h, feps);
  else
    rms_norm_forward_rows(x.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), rstd.data_ptr<float>(),
                          rows, h, feps);
  return {out, rstd};
}

template <typename T>
void rms_norm_backward_rows(const T* gp, const T* xp, const float* w, const float* rp, T* dp, float* partial,
                            int64_t blocks, int64_t rows, int64_t h) {
  constexpr bool kFloat = std::is_same<T, float>::value;
  at::parallel_for(0, blocks, 1, [&](int64_t block_begin, int64_t block_end) {
    std::vector<float> normed(h), gn(h), g_buf(kFloat ? 0 : h), x_buf(kFloat ? 0 : h), d_buf(kFloat ? 0 : h);
    for (int64_t block = block_begin; block < block_end; ++block) {
      float* acc = partial + block * h;
      for (int64_t r = rows * block / blocks; r < rows * (block + 1) / blocks; ++r) {
        const float* g = as_float(gp + r * h, g_buf.data(), h);
        const float* row = as_float(xp + r * h, x_buf.data(), h);
        const float inv = rp[r];
        for (int64_t i = 0; i < h; ++i) {
          normed[i] = row[i] * inv;
          gn[i] = g[i] * w[i];
        }
        const float mean = dot(gn.data(), normed.data(), h) / static_cast<float>(h);
        float* d = kFloat ? reinterpret_cast<float*>(dp + r * h) : d_buf.data();
        for (int64_t i = 0; i < h; ++i) d[i] = (gn[i] - normed[i] * mean) * inv;
        if constexpr (!kFloat) store_floats(d, dp + r * h, h);
        for (int64_t i = 0; i < h; ++i) acc[i] += g[i] * normed[i];
      }
    }
  });
}

// Its gradient: grad, x [N, H], weight [H], rstd [N] -> (dx [N, H], dweight [H]). With n = x * rstd and
// gn = grad * weight: dx = rstd * (gn - n * mean(gn * n)), dweight = sum over rows of grad * n.
// grad and x float32 or bf16 (one dtype; dx in it, rounded once); dweight float32.
std::vector<at::Tensor> rms_norm_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight,
                                          const at::Tensor& rstd) {
  check_f32_or_bf16(grad, "grad");
  check_f32_or_bf16(x, "x");
  check_f32(rstd, "rstd");
  TORCH_CHECK(grad.scalar_type() == x.scalar_type(), "rms_norm_backward: grad and x must have one dtype");
  TORCH_CHECK(x.dim() == 2 && grad.sizes() == x.sizes() && weight.dim() == 1 && weight.size(0) == x.size(1) &&
                  rstd.numel() == x.size(0),
              "rms_norm_backward: grad, x [N, H], weight [H], rstd [N]");
  const int64_t rows = x.size(0), h = x.size(1);
  const at::Tensor w = float_weight(weight);
  at::Tensor dx = at::empty_like(x);
  // Row blocks, each with its own partial sum of grad * n (no shared accumulator between threads).
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows * h / kMinTaskFloats));
  std::vector<float> partial(static_cast<size_t>(blocks * h), 0.f);
  if (x.scalar_type() == at::kBFloat16)
    rms_norm_backward_rows(grad.data_ptr<at::BFloat16>(), x.data_ptr<at::BFloat16>(), w.data_ptr<float>(),
                           rstd.data_ptr<float>(), dx.data_ptr<at::BFloat16>(), partial.data(), blocks, rows, h);
  else
    rms_norm_backward_rows(grad.data_ptr<float>(), x.data_ptr<float>(), w.data_ptr<float>(), rstd.data_ptr<float>(),
                           dx.data_ptr<float>(), partial.data(), blocks, rows, h);
  at::Tensor dweight = at::zeros({h}, x.options().dtype(at::kFloat));
  float* dw = dweight.data_ptr<float>();
  for (int64_t block = 0; block < blocks; ++block)
    for (int64_t i = 0; i < h; ++i) dw[i] += partial[block * h + i];
  return {dx, dweight};
}

// GEMM through packed panels: out (+)= x @ B (+ bias), float32, AVX2 + FMA or AVX-512.
// B is packed as kPanel-column panels [ceil(N / kPanel), K, kPanel] (zero-padded): pack_linear packs
// a linear layer's weight [N, K] (B = weight^T), pack_matrix a row-major B [K, N] (plain copies of
// each row's kPanel-column segments). A register block of kBlock rows streams one panel row per k
// with two vector loads: 6 x 16 with AVX2, 12 x 32 with AVX-512 (twice the FMA width; at the
// 32-row decode matmuls of the small benchmark model ~10% faster than MKL's packed GEMM on a Xeon
// with AVX-512, see cpu_gemm.py).
// x is row-major [rows, K], or transposed ([K, rows]: a weight gradient's grad_output^T, read in
// place). Work is split into blocks of up to kRowBlock rows times one panel; the k loop runs in
// chunks of kChunk, each chunk of a panel (8 or 16 KiB) used by every register block of the row
// block before the next chunk is read, and the next chunk prefetched while the current one is used
// (a decode step streams every weight from memory once: without it the first row block stalls on
// memory while the others run from cache). has_packed_linear() says whether this build has it.
#if defined(NA_AVX2) && defined(__AVX512F__)
#define NA_AVX512 1
constexpr int64_t kPanel = 32;  // two 16-float vectors per panel row
constexpr int kBlock = 12;      // rows per register block: 12 x 2 accumulators of the 32 registers
#else
constexpr int64_t kPanel = 16;
constexpr int kBlock = 6;
#endif
constexpr int64_t kChunk = 128;     // k steps summed in registers before joining the running total
constexpr int64_t kRowBlock = 192;  // rows that share a panel's chunks (their x rows stay in cache)

// Packs columns of B, where element (k, j) of B is at b[k * k_stride + j * j_stride], into p
// ([panels, k, kPanel]). T: a float, or a pair of bf16 (two consecutive k) as one 32-bit word.
template <typename T>
void pack_panels(const T* b, T* p, int64_t k, int64_t n, int64_t k_stride, int64_t j_stride) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel) {
      const int64_t cols = std::min(kPanel, n - panel * kPanel);
      T* dst = p + panel * k * kPanel;
      if (cols < kPanel) std::fill(dst, dst + k * kPanel, T(0));  // the last panel's padding columns
      if (j_stride == 1 && cols == kPanel) {  // row-major B: each panel row is a contiguous segment
        for (int64_t i = 0; i < k; ++i)  // a constant size: compiled to two vector moves
          std::memcpy(dst + i * kPanel, b + i * k_stride + panel * kPanel, kPanel * sizeof(T));
      } else if (j_stride == 1) {
        for (int64_t i = 0; i < k; ++i)
          std::memcpy(dst + i * kPanel, b + i * k_stride + panel * kPanel, cols * sizeof(T));
      } else {
        // A transpose (a linear layer's weight rows become panel columns), in blocks of 16 k: the
        // block's kPanel source segments and its 16 destination rows stay in L1 (column by column
        // over the whole k took ~4x as long on the small benchmark model's weights).
        for (int64_t i0 = 0; i0 < k; i0 += 16) {
          const int64_t len = std::min<int64_t>(16, k - i0);
          for (int64_t j = 0; j < cols; ++j) {
            const T* src = b + (panel * kPanel + j) * j_stride + i0 * k_stride;
            T* out = dst + i0 * kPanel + j;
            for (int64_t i = 0; i < len; ++i) out[i * kPanel] = src[i * k_stride];
          }
        }
      }
    }
  });
}

// A zero-filled CPU tensor of `sizes` and `dtype` whose memory asks for 2 MiB pages where it spans
// at least one (Linux: fresh anonymous memory aligned to 2 MiB, madvise(MADV_HUGEPAGE); elsewhere,
// or where that fails, at::zeros). For buffers a decode step streams once per step and that are kept
// across generate calls (packed weights, the KV cache: decode_buffers.py): with 4 KiB pages nearly
// every page they read misses the TLB (the small benchmark model's float32 decode matmuls: 34
// instead of 41 ms a step, 2-core Xeon). Fresh huge pages cost more to fault in than 4 KiB ones
// (0.7-1.3 s per GB on that VM), so only buffers that are kept are worth them.
constexpr size_t kHugePage = size_t(2) << 20;

at::Tensor huge_page_zeros(at::IntArrayRef sizes, at::ScalarType dtype) {
  const auto options = at::TensorOptions().dtype(dtype).device(at::kCPU);
  int64_t numel = 1;
  for (const int64_t d : sizes) {
    TORCH_CHECK(d >= 0, "huge_page_zeros: negative size");
    numel *= d;
  }
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
#ifdef __linux__
  if (bytes >= kHugePage) {
    const size_t span = bytes + kHugePage;
    void* base = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base != MAP_FAILED) {  // fresh anonymous memory reads as zeros
      const uintptr_t first = reinterpret_cast<uintptr_t>(base);
      const uintptr_t start = (first + kHugePage - 1) & ~(uintptr_t(kHugePage) - 1);
      const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
      const size_t keep = (bytes + page - 1) / page * page, head = start - first, tail = span - head - keep;
      if (head > 0) munmap(base, head);
      if (tail > 0) munmap(reinterpret_cast<void*>(start + keep), tail);
      void* data = reinterpret_cast<void*>(start);
      madvise(data, keep, MADV_HUGEPAGE);  // a request: without it (THP off) the pages stay 4 KiB
      return at::from_blob(data, sizes, [keep](void* p) { munmap(p, keep); }, options);
    }
  }
#endif
  return at::zeros(sizes, options);
}

// The tensor a pack of `shape` and `dtype` is written into: `reuse` where it is a contiguous CPU
// tensor of exactly that shape and dtype (the pack a kept buffer held from the previous generate
// call), else fresh memory: on 2 MiB pages where `huge_pages` (a pack that will be kept), else
// uninitialised (packed per call in training: no zeroing pass).
at::Tensor pack_target(at::IntArrayRef shape, at::ScalarType dtype, const c10::optional<at::Tensor>& reuse,
                       bool huge_pages) {
  if (reuse.has_value() && reuse->defined() && reuse->device().is_cpu() && reuse->scalar_type() == dtype &&
      reuse->is_contiguous() && reuse->sizes() == shape)
    return *reuse;
  return huge_pages ? huge_page_zeros(shape, dtype) : at::empty(shape, at::TensorOptions().dtype(dtype));
}

at::Tensor pack_panels(const float* b, int64_t k, int64_t n, int64_t k_stride, int64_t j_stride,
                       const c10::optional<at::Tensor>& reuse = c10::nullopt, bool huge_pages = false) {
  at::Tensor packed = pack_target({(n + kPanel - 1) / kPanel, k, kPanel}, at::kFloat, reuse, huge_pages);
  pack_panels(b, packed.data_ptr<float>(), k, n, k_stride, j_stride);
  return packed;
}

bool has_bf16_gemm();

// reuse / huge_pages: see pack_target (a generate call's packs, kept across calls by decode_buffers.py).
at::Tensor pack_linear(const at::Tensor& weight, const c10::optional<at::Tensor>& reuse, bool huge_pages) {
  if (weight.scalar_type() == at::kBFloat16) {
    // bf16: panels of column pairs [panels, K / 2, kPanel] of 32-bit words (int32 storage), each
    // word a column's two consecutive k, as VDPBF16PS multiplies them
    TORCH_CHECK(has_bf16_gemm(), "pack_linear: this build has no bf16 GEMM (AVX512_BF16)");
    TORCH_CHECK(weight.device().is_cpu() && weight.is_contiguous() && weight.dim() == 2 && weight.size(1) % 2 == 0,
                "pack_linear: a bf16 weight must be a contiguous CPU [N, K] matrix with K even");
    const int64_t n = weight.size(0), pairs = weight.size(1) / 2;
    at::Tensor packed = pack_target({(n + kPanel - 1) / kPanel, pairs, kPanel}, at::kInt, reuse, huge_pages);
    pack_panels(reinterpret_cast<const uint32_t*>(weight.data_ptr<at::BFloat16>()),
                reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>()), pairs, n, 1, pairs);
    return packed;
  }
  check_f32(weight, "weight");
  TORCH_CHECK(weight.dim() == 2, "pack_linear: weight [N, K]");
  const int64_t n = weight.size(0), k = weight.size(1);
  return pack_panels(weight.data_ptr<float>(), k, n, 1, k, reuse, huge_pages);
}

at::Tensor pack_matrix(const at::Tensor& b) {
  check_f32(b, "b");
  TORCH_CHECK(b.dim() == 2, "pack_matrix: b [K, N]");
  const int64_t k = b.size(0), n = b.size(1);
  return pack_panels(b.data_ptr<float>(), k, n, n, 1);
}

#ifdef NA_AVX2
#ifdef NA_AVX512
// One k step of a register block row: a float of x times 32 panel columns (two FMAs), or, for bf16,
// a 32-bit word of x (two consecutive k) against 32 columns' words (two VDPBF16PS, each adding both
// products to the float32 sums).
inline __m512 panel_load(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 broadcast(float x) { return _mm512_set1_ps(x); }
inline __m512 multiply_add(__m512 sum, __m512 a, __m512 w) { return _mm512_fmadd_ps(a, w, sum); }
#ifdef __AVX512BF16__
#define NA_BF16_GEMM 1
inline __m512bh panel_load(const uint32_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh broadcast(uint32_t x) { return (__m512bh)_mm512_set1_epi32(static_cast<int>(x)); }
inline __m512 multiply_add(__m512 sum, __m512bh a, __m512bh w) { return _mm512_dpbf16_ps(sum, a, w); }
#endif

// acc[ROWS][32] += x[ROWS, len] @ panel[len, 32]. Row r, step i of x is at x[r * ld + i], or at
// x[r + i * ld] when TRANSPOSED (T: float; or a bf16 pair per step, row-major). Up to 12 x 2
// accumulators: 24 of the 32 vector registers, enough independent FMA chains to cover the FMA
// latency, and two panel loads per 24 FMAs. `prefetch`: `prefetch_lines` panel rows (two 64-byte
// lines each) to bring into cache, one per k step.
template <int ROWS, bool TRANSPOSED, typename T>
inline void panel_chunk(const T* __restrict x, int64_t ld, int64_t len, const T* __restrict panel,
                        float* __restrict acc, const T* prefetch, int64_t prefetch_lines) {
  __m512 c0_0 = _mm512_setzero_ps(), c0_1 = c0_0, c1_0 = c0_0, c1_1 = c0_0, c2_0 = c0_0, c2_1 = c0_0, c3_0 = c0_0,
         c3_1 = c0_0, c4_0 = c0_0, c4_1 = c0_0, c5_0 = c0_0, c5_1 = c0_0, c6_0 = c0_0, c6_1 = c0_0, c7_0 = c0_0,
         c7_1 = c0_0, c8_0 = c0_0, c8_1 = c0_0, c9_0 = c0_0, c9_1 = c0_0, c10_0 = c0_0, c10_1 = c0_0, c11_0 = c0_0,
         c11_1 = c0_0;
  for (int64_t i = 0; i < len; ++i) {
    if (i < prefetch_lines) {
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + i * kPanel), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + i * kPanel + 16), _MM_HINT_T1);
    }
    const auto w0 = panel_load(panel + i * kPanel), w1 = panel_load(panel + i * kPanel + 16);
#define NA_PANEL_ROW(R)                                                                          \
  if (ROWS > R) {                                                                                \
    const auto a = broadcast(TRANSPOSED ? x[R + i * ld] : x[R * ld + i]);                        \
    c##R##_0 = multiply_add(c##R##_0, a, w0);                                                    \
    c##R##_1 = multiply_add(c##R##_1, a, w1);                                                    \
  }
    NA_PANEL_ROW(0) NA_PANEL_ROW(1) NA_PANEL_ROW(2) NA_PANEL_ROW(3) NA_PANEL_ROW(4) NA_PANEL_ROW(5)
    NA_PANEL_ROW(6) NA_PANEL_ROW(7) NA_PANEL_ROW(8) NA_PANEL_ROW(9) NA_PANEL_ROW(10) NA_PANEL_ROW(11)
#undef NA_PANEL_ROW
  }
  const __m512 sums[12][2] = {{c0_0, c0_1}, {c1_0, c1_1}, {c2_0, c2_1}, {c3_0, c3_1}, {c4_0, c4_1}, {c5_0, c5_1},
                              {c6_0, c6_1}, {c7_0, c7_1}, {c8_0, c8_1}, {c9_0, c9_1}, {c10_0, c10_1}, {c11_0, c11_1}};
  for (int r = 0; r < ROWS; ++r) {
    float* a = acc + r * kPanel;
    _mm512_store_ps(a, _mm512_add_ps(_mm512_load_ps(a), sums[r][0]));
    _mm512_store_ps(a + 16, _mm512_add_ps(_mm512_load_ps(a + 16), sums[r][1]));
  }
}
#else
// acc[ROWS][16] += x[ROWS, len] @ panel[len, 16]. Row r, step i of x is at x[r * ld + i], or at
// x[r + i * ld] when TRANSPOSED. Up to 6 x 2 accumulators (12 of the 16 vector registers): enough
// independent FMA chains to cover the FMA latency. `prefetch`: `prefetch_lines` 64-byte lines (panel
// rows) to bring into cache, one per k step from the first.
template <int ROWS, bool TRANSPOSED>
inline void panel_chunk(const float* __restrict x, int64_t ld, int64_t len, const float* __restrict panel,
                        float* __restrict acc, const float* prefetch, int64_t prefetch_lines) {
  // Named registers (a first version with an accumulator array and 4-row blocks ran at 50 GFLOP/s).
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t i = 0; i < len; ++i) {
    if (i < prefetch_lines) _mm_prefetch(reinterpret_cast<const char*>(prefetch + i * kPanel), _MM_HINT_T0);
    const __m256 w0 = _mm256_loadu_ps(panel + i * kPanel), w1 = _mm256_loadu_ps(panel + i * kPanel + 8);
#define NA_PANEL_ROW(R)                                                                          \
  if (ROWS > R) {                                                                                \
    const __m256 a = _mm256_broadcast_ss(TRANSPOSED ? x + R + i * ld : x + R * ld + i);          \
    c##R##0 = _mm256_fmadd_ps(a, w0, c##R##0);                                                   \
    c##R##1 = _mm256_fmadd_ps(a, w1, c##R##1);                                                   \
  }
    NA_PANEL_ROW(0) NA_PANEL_ROW(1) NA_PANEL_ROW(2) NA_PANEL_ROW(3) NA_PANEL_ROW(4) NA_PANEL_ROW(5)
#undef NA_PANEL_ROW
  }
  const __m256 sums[6][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
  for (int r = 0; r < ROWS; ++r) {
    float* a = acc + r * kPanel;
    _mm256_store_ps(a, _mm256_add_ps(_mm256_load_ps(a), sums[r][0]));
    _mm256_store_ps(a + 8, _mm256_add_ps(_mm256_load_ps(a + 8), sums[r][1]));
  }
}
#endif  // NA_AVX512

// panel_chunk for a remainder of `rows` (1 .. kBlock - 1) rows.
template <bool TRANSPOSED, int ROWS = kBlock - 1, typename T>
inline void remainder_chunk(int64_t rows, const T* x, int64_t ld, int64_t len, const T* panel, float* acc,
                            const T* prefetch, int64_t prefetch_lines) {
  if constexpr (ROWS > 0) {
    if (rows == ROWS)
      panel_chunk<ROWS, TRANSPOSED>(x, ld, len, panel, acc, prefetch, prefetch_lines);
    else
      remainder_chunk<TRANSPOSED, ROWS - 1>(rows, x, ld, len, panel, acc, prefetch, prefetch_lines);
  }
}

template <bool TRANSPOSED, typename T>
inline void chunk_rows(int64_t rows, const T* x, int64_t ld, int64_t len, const T* panel, float* acc,
                       const T* prefetch) {
  // Each register block prefetches its share of the next chunk's lines: spread out, the requests
  // overlap the arithmetic instead of queueing behind each other.
  const int64_t step = TRANSPOSED ? 1 : ld, blocks = (rows + kBlock - 1) / kBlock;
  const int64_t share = prefetch != nullptr ? (len + blocks - 1) / blocks : 0;
  int64_t r = 0, block = 0;
  auto lines = [&](int64_t b) { return std::max<int64_t>(0, std::min(share, len - b * share)); };
  for (; r + kBlock <= rows; r += kBlock, ++block)
    panel_chunk<kBlock, TRANSPOSED>(x + r * step, ld, len, panel, acc + r * kPanel,
                                    prefetch + block * share * kPanel, lines(block));
  if (r < rows)
    remainder_chunk<TRANSPOSED>(rows - r, x + r * step, ld, len, panel, acc + r * kPanel,
                                prefetch + block * share * kPanel, lines(block));
}

// One task: rows [r0, r0 + rows) of the output times one panel (kPanel columns from col). T: float,
// or (the bf16 GEMM) a pair of bf16 per k step.
template <bool TRANSPOSED, typename T>
void gemm_task(const T* x, int64_t ld, int64_t k, int64_t r0, int64_t rows, const T* panel,
               const T* packed_end, float* out, int64_t n, int64_t col, const float* bias, bool accumulate) {
  alignas(64) float acc[kRowBlock * kPanel];
  std::fill(acc, acc + rows * kPanel, 0.0f);
  const T* xb = TRANSPOSED ? x + r0 : x + r0 * ld;
  for (int64_t k0 = 0; k0 < k; k0 += kChunk) {
    const int64_t len = std::min(kChunk, k - k0);
    // The panels are contiguous: after a panel's last chunk comes the next panel's first.
    const T* next = panel + (k0 + kChunk) * kPanel;
    const T* prefetch = next + kChunk * kPanel <= packed_end ? next : nullptr;
    chunk_rows<TRANSPOSED>(rows, TRANSPOSED ? xb + k0 * ld : xb + k0, ld, len, panel + k0 * kPanel, acc, prefetch);
  }
  const int64_t cols = std::min(kPanel, n - col);
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + (r0 + r) * n + col;
    const float* a = acc + r * kPanel;
    for (int64_t j = 0; j < cols; ++j) {
      float v = a[j];
      if (bias != nullptr) v += bias[j];
      o[j] = accumulate ? o[j] + v : v;
    }
  }
}
#endif

// (rows per register block, columns per panel) of this build's packed GEMM.
std::vector<int64_t> packed_gemm_tile() { return {kBlock, kPanel}; }

bool has_packed_linear() {
#ifdef NA_AVX2
  return true;
#else
  return false;
#endif
}

// Whether packed_gemm multiplies bf16 (AVX512_BF16 in this build).
bool has_bf16_gemm() {
#ifdef NA_BF16_GEMM
  return true;
#else
  return false;
#endif
}

#ifdef NA_AVX2
// The tasks of one product: row blocks of equal size (a multiple of kBlock rows, at most kRowBlock;
// the threads get equal shares of the tasks, so equal tasks keep them equally busy), each running
// its panels in order: its x rows stay in cache, the panels stream.
template <bool TRANSPOSED, typename T>
void run_packed_gemm(const T* xp, int64_t ld, int64_t k, int64_t rows, const T* pp, int64_t panels,
                     const T* packed_end, float* op, int64_t n, const float* b, bool accumulate) {
  const int64_t blocks = std::max<int64_t>(1, (rows + kRowBlock - 1) / kRowBlock);
  const int64_t block_rows = std::min(kRowBlock, ((rows + blocks - 1) / blocks + kBlock - 1) / kBlock * kBlock);
  at::parallel_for(0, blocks * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t block = task / panels, panel = task % panels;
      const int64_t r0 = block * block_rows, nrows = std::min(block_rows, rows - r0), col = panel * kPanel;
      if (nrows <= 0) continue;
      gemm_task<TRANSPOSED>(xp, ld, k, r0, nrows, pp + panel * k * kPanel, packed_end, op, n, col,
                            b != nullptr ? b + col : nullptr, accumulate);
    }
  });
}
#endif

// Whether `packed` holds kPanel-column panels of `k_steps` steps covering exactly n columns.
inline bool packed_fits(const at::Tensor& packed, int64_t k_steps, int64_t n) {
  const int64_t panels = packed.size(0);
  return packed.dim() == 3 && packed.size(1) == k_steps && packed.size(2) == kPanel && panels * kPanel >= n &&
         (panels - 1) * kPanel < n;
}

// x [..., K] bf16 @ a bf16 weight packed by pack_linear (+ float32 bias): float32 [..., n], the
// products summed in float32 and not rounded to bf16.
at::Tensor packed_gemm_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n, const float* b) {
  TORCH_CHECK(has_bf16_gemm(), "packed_gemm: this build has no bf16 GEMM (AVX512_BF16)");
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "packed_gemm: x must be a contiguous CPU tensor");
  TORCH_CHECK(packed.scalar_type() == at::kInt && packed.is_contiguous(),
              "packed_gemm: a bf16 x takes a bf16 weight packed by pack_linear");
  const int64_t k = x.size(-1), panels = packed.size(0);
  TORCH_CHECK(k % 2 == 0 && packed_fits(packed, k / 2, n), "packed_gemm: packed matrix does not match x or n");
  const int64_t rows = k == 0 ? 0 : x.numel() / k;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor result = at::empty(shape, x.options().dtype(at::kFloat));
#ifdef NA_BF16_GEMM
  const uint32_t* pp = reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>());
  run_packed_gemm<false>(reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>()), k / 2, k / 2, rows, pp,
                         panels, pp + packed.numel(), result.data_ptr<float>(), n, b, false);
#endif
  return result;
}

// out (+)= x @ B (+ bias) with B packed by pack_linear / pack_matrix ([K, n] after packing).
// x: [..., K] row-major, or with x_transposed a [K, rows] matrix whose transpose is the left
// operand. out: None for a new [..., n] tensor, else a contiguous [rows, n] tensor added into.
at::Tensor packed_gemm(const at::Tensor& x, bool x_transposed, const at::Tensor& packed, int64_t n,
                       const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& out) {
  const float* b = nullptr;
  if (bias.has_value()) {
    check_f32(*bias, "bias");
    TORCH_CHECK(bias->numel() == n, "packed_gemm: bias [N]");
    b = bias->data_ptr<float>();
  }
  if (x.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(!x_transposed && !out.has_value(), "packed_gemm: a bf16 x is read row-major into a new tensor");
    return packed_gemm_bf16(x, packed, n, b);
  }
  check_f32(x, "x");
  check_f32(packed, "packed");
  TORCH_CHECK(has_packed_linear(), "packed_gemm: this build has no AVX2 + FMA kernel");
  TORCH_CHECK(!x_transposed || x.dim() == 2, "packed_gemm: a transposed x is a [K, rows] matrix");
  const int64_t k = x_transposed ? x.size(0) : x.size(-1), panels = packed.size(0);
  TORCH_CHECK(packed_fits(packed, k, n), "packed_gemm: packed matrix does not match x or n");
  const int64_t rows = x_transposed ? x.size(1) : (k == 0 ? 0 : x.numel() / k);
  at::Tensor result;
  if (out.has_value()) {
    check_f32(*out, "out");
    TORCH_CHECK(out->numel() == rows * n && out->size(-1) == n, "packed_gemm: out [rows, n]");
    result = *out;
  } else {
    std::vector<int64_t> shape;
    if (x_transposed) {
      shape = {rows, n};
    } else {
      shape.assign(x.sizes().begin(), x.sizes().end());
      shape.back() = n;
    }
    result = at::empty(shape, x.options());
  }
#ifdef NA_AVX2
  int64_t ld = x_transposed ? rows : k;
  at::Tensor padded;
  if (x_transposed && ld % 1024 == 0) {
    // A transposed x is read one row per k step; rows a multiple of 4 KiB apart all fall in the
    // same cache set and evict each other (measured: 110 against 175 GFLOP/s). Read a copy with
    // 16 floats of padding per row instead.
    padded = at::empty({k, ld + kPanel}, x.options());
    padded.narrow(1, 0, ld).copy_(x);
    ld += kPanel;
  }
  const float* xp = padded.defined() ? padded.data_ptr<float>() : x.data_ptr<float>();
  const float* pp = packed.data_ptr<float>();
  const float* packed_end = pp + packed.numel();
  float* op = result.data_ptr<float>();
  if (x_transposed)
    run_packed_gemm<true>(xp, ld, k, rows, pp, panels, packed_end, op, n, b, out.has_value());
  else
    run_packed_gemm<false>(xp, ld, k, rows, pp, panels, packed_end, op, n, b, out.has_value());
#endif
  return result;
}

// AMX bf16 GEMM for decode steps: out [rows, n] = x [rows, K] (float32 rounded to bf16, or bf16) @
// weight^T, float32 sums returned unrounded. amx_pack lays a bf16 weight [N, K] out as tiles
// [ceil(N / 16), ceil(K / 32), 16, 32]: tile (panel, step) holds columns 16 * panel.. and k
// 32 * step.., row r of the tile the pairs (k = 2r, 2r + 1) of its 16 columns, as TDPBF16PS reads its
// second operand; the padding is zeros. A task is two adjacent panels (32 columns) against 32 rows of
// x at a time (four accumulator tiles, two x tiles, two weight tiles): the weight tiles stream
// from memory once per task, the x rows stay in cache. On the small benchmark shape's 32-row decode
// matmuls, ~20 GB/s of weights against ~11 GB/s for oneDNN's packed bf16 GEMM with the casts around
// it (2-core Xeon with AMX). Linux only: the kernel asks for the tile state once (arch_prctl).
constexpr int64_t kAmxCols = 16, kAmxDepth = 32;  // a weight tile: 16 columns x 32 k (1 KiB)

bool has_amx() {
#ifdef NA_AMX
  // ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18): without it the first tile
  // instruction raises SIGILL. Once per process; the answer is kept.
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
#else
  return false;
#endif
}

// reuse / huge_pages: as pack_linear's.
at::Tensor amx_pack(const at::Tensor& weight, const c10::optional<at::Tensor>& reuse, bool huge_pages) {
  TORCH_CHECK(has_amx(), "amx_pack: this build or process has no AMX tiles");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu() && weight.is_contiguous() &&
                  weight.dim() == 2,
              "amx_pack: weight must be a contiguous bf16 CPU [N, K] matrix");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t panels = (n + kAmxCols - 1) / kAmxCols, steps = (k + kAmxDepth - 1) / kAmxDepth;
  at::Tensor packed = pack_target({panels, steps, 16, 32}, at::kBFloat16, reuse, huge_pages);
  const uint16_t* src = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel)
      for (int64_t step = 0; step < steps; ++step) {
        uint16_t* tile = dst + (panel * steps + step) * 512;
        const int64_t k0 = step * kAmxDepth;
        if (k % 2 == 0 && (panel + 1) * kAmxCols <= n && k0 + kAmxDepth <= k) {  // a whole tile: 32-bit pairs
          uint32_t* words = reinterpret_cast<uint32_t*>(tile);
          for (int64_t c = 0; c < kAmxCols; ++c) {
            const uint32_t* pairs = reinterpret_cast<const uint32_t*>(src + (panel * kAmxCols + c) * k + k0);
            for (int64_t r = 0; r < 16; ++r) words[r * 16 + c] = pairs[r];
          }
          continue;
        }
        for (int64_t c = 0; c < kAmxCols; ++c) {
          const int64_t col = panel * kAmxCols + c;
          for (int64_t i = 0; i < kAmxDepth; ++i)  // tile row i / 2, column c, element i % 2
            tile[(i / 2) * 32 + c * 2 + i % 2] = (col < n && k0 + i < k) ? src[col * k + k0 + i] : uint16_t(0);
        }
      }
  });
  return packed;
}

#ifdef NA_AMX
struct AmxTileConfig {  // LDTILECFG's 64-byte layout (palette 1)
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Stores accumulator tile `index` (0..3): straight into out when it covers 16 whole rows and
// columns, else through a scratch tile; bias added.
inline void amx_store(int index, float* out, int64_t n, int64_t rows, int64_t cols, const float* bias,
                      float* scratch) {
  const bool whole = rows == 16 && cols == 16;
  float* dst = whole ? out : scratch;
  const int64_t stride = whole ? n * 4 : 64;
  switch (index) {
    case 0: _tile_stored(0, dst, stride); break;
    case 1: _tile_stored(1, dst, stride); break;
    case 2: _tile_stored(2, dst, stride); break;
    default: _tile_stored(3, dst, stride); break;
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + r * n;
    if (!whole) std::memcpy(o, scratch + r * 16, cols * sizeof(float));
    if (bias != nullptr)
      for (int64_t j = 0; j < cols; ++j) o[j] += bias[j];
  }
}

// out rows [0, rows) of panels [first, first + count) (count 1 or 2); a: bf16 rows of kp = 32 * steps
// values, padded with zero rows to a multiple of 16.
void amx_task(const uint16_t* a, int64_t rows, int64_t steps, const uint16_t* packed, int64_t first, int64_t count,
              float* out, int64_t n, const float* bias) {
  alignas(64) float scratch[16 * 16];
  const int64_t a_stride = steps * kAmxDepth * 2;  // bytes per x row
  const char* b0 = reinterpret_cast<const char*>(packed + first * steps * 512);
  const char* b1 = b0 + steps * 1024;
  const bool two = count == 2;
  const int64_t tiles = (rows + 15) / 16;
  for (int64_t g = 0; g < tiles; g += 2) {  // 32 rows at a time
    const bool both_rows = g + 1 < tiles;
    const char* a0 = reinterpret_cast<const char*>(a) + g * 16 * a_stride;
    const char* a1 = a0 + 16 * a_stride;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t s = 0; s < steps; ++s) {
      if (g == 0) {  // the first pass streams the weights from memory: ask 16 tiles ahead
        const int64_t ahead = std::min(s + 16, steps - 1) * 1024;
        _mm_prefetch(b0 + ahead, _MM_HINT_T0);
        _mm_prefetch(b0 + ahead + 512, _MM_HINT_T0);
        if (two) {
          _mm_prefetch(b1 + ahead, _MM_HINT_T0);
          _mm_prefetch(b1 + ahead + 512, _MM_HINT_T0);
        }
      }
      _tile_loadd(4, a0 + s * 64, a_stride);
      _tile_loadd(6, b0 + s * 1024, 64);
      _tile_dpbf16ps(0, 4, 6);
      if (two) {
        _tile_loadd(7, b1 + s * 1024, 64);
        _tile_dpbf16ps(2, 4, 7);
      }
      if (both_rows) {
        _tile_loadd(5, a1 + s * 64, a_stride);
        _tile_dpbf16ps(1, 5, 6);
        if (two) _tile_dpbf16ps(3, 5, 7);
      }
    }
    for (int64_t c = 0; c < count; ++c) {
      const int64_t col = (first + c) * kAmxCols, cols = std::min<int64_t>(kAmxCols, n - col);
      for (int64_t r = 0; r < (both_rows ? 2 : 1); ++r) {
        const int64_t row = (g + r) * 16;
        amx_store(static_cast<int>(c * 2 + r), out + row * n + col, n, std::min<int64_t>(16, rows - row), cols,
                  bias != nullptr ? bias + col : nullptr, scratch);
      }
    }
  }
}
#endif

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(has_amx(), "amx_linear: this build or process has no AMX tiles");
  check_f32_or_bf16(x, "x");  // and contiguous
  TORCH_CHECK(x.dim() >= 1, "amx_linear: x must have at least one dimension");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && packed.dim() == 4 &&
                  packed.size(2) == 16 && packed.size(3) == 32,
              "amx_linear: packed must come from amx_pack");
  const int64_t k = x.size(-1), panels = packed.size(0), steps = packed.size(1);
  TORCH_CHECK(panels * kAmxCols >= n && (panels - 1) * kAmxCols < n && steps * kAmxDepth >= k &&
                  (steps - 1) * kAmxDepth < k,
              "amx_linear: packed matrix does not match x or n");
  const float* b = nullptr;
  if (bias.has_value()) {
    check_f32(*bias, "bias");
    TORCH_CHECK(bias->numel() == n, "amx_linear: bias [N]");
    b = bias->data_ptr<float>();
  }
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options().dtype(at::kFloat));
  if (rows == 0 || n == 0) return out;
  if (k == 0) {  // an empty sum: the bias, or zeros
    out.view({rows, n}).copy_(bias.has_value() ? bias->view({1, n}).expand({rows, n}) : at::zeros({rows, n}, out.options()));
    return out;
  }
#ifdef NA_AMX
  // x as bf16 rows of 32 * steps values, zero-padded to whole tiles (round to nearest even, as torch's
  // cast; denormal inputs become zero)
  const int64_t kp = steps * kAmxDepth, padded_rows = (rows + 15) / 16 * 16;
  at::Tensor a = at::empty({padded_rows, kp}, x.options().dtype(at::kBFloat16));
  uint16_t* ap = reinterpret_cast<uint16_t*>(a.data_ptr<at::BFloat16>());
  const bool is_bf16 = x.scalar_type() == at::kBFloat16;
  const void* xp = x.data_ptr();
  at::parallel_for(0, padded_rows, grain_rows(kp), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      uint16_t* dst = ap + r * kp;
      int64_t i = 0;
      if (r < rows && is_bf16) {
        std::memcpy(dst, static_cast<const uint16_t*>(xp) + r * k, k * 2);
        i = k;
      } else if (r < rows) {
        store_floats(static_cast<const float*>(xp) + r * k, reinterpret_cast<at::BFloat16*>(dst), k);
        i = k;
      }
      std::fill(dst + i, dst + kp, uint16_t(0));
    }
  });
  const uint16_t* pp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, (panels + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    AmxTileConfig config;  // tile state is per thread
    for (int t = 0; t < 8; ++t) {
      config.rows[t] = 16;
      config.bytes_per_row[t] = 64;
    }
    _tile_loadconfig(&config);
    for (int64_t pair = begin; pair < end; ++pair)
      amx_task(ap, rows, steps, pp, 2 * pair, std::min<int64_t>(2, panels - 2 * pair), op, n, b);
    _tile_release();
  });
#endif
  return out;
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                         const c10::optional<at::Tensor>& bias) {
  return packed_gemm(x, false, packed, n, bias, c10::nullopt);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "nemo_aligner fused CPU decode-step kernels (float32)";
  m.def("add_rms_norm", &add_rms_norm, "x += residual; RMSNorm(x) * weight");
  m.def("rope_cache_write", &rope_cache_write, "RoPE on queries and key in place, key/value into the cache");
  m.def("decode_attention", &decode_attention, "one query per row against the KV cache");
  m.def("swiglu", &swiglu, "silu(gate) * up");
  m.def("swiglu_backward", &swiglu_backward, "the gradient of swiglu");
  m.def("rms_norm_forward", &rms_norm_forward, "RMSNorm for training: (output, rstd)");
  m.def("rms_norm_backward", &rms_norm_backward, "the gradient of RMSNorm: (dx, dweight)");
  m.def("pack_linear", &pack_linear, "weight [N, K] -> column panels of weight^T for packed_gemm", py::arg("weight"),
        py::arg("reuse") = py::none(), py::arg("huge_pages") = false);
  m.def("huge_page_zeros", &huge_page_zeros, "a zero-filled CPU tensor on 2 MiB pages where it spans one (Linux)");
  m.def("pack_matrix", &pack_matrix, "b [K, N] -> column panels of b for packed_gemm");
  m.def("packed_linear", &packed_linear, "x @ weight^T (+ bias) through pack_linear's panels");
  m.def("packed_gemm", &packed_gemm, "out (+)= x @ b (+ bias), x row-major or transposed, b packed");
  m.def("packed_gemm_tile", &packed_gemm_tile, "(rows per register block, columns per panel) of packed_gemm");
  m.def("has_packed_linear", &has_packed_linear, "whether packed_linear has a kernel in this build");
  m.def("has_amx", &has_amx, "whether this build and process multiply bf16 on AMX tiles (amx_linear)");
  m.def("amx_pack", &amx_pack, "bf16 weight [N, K] -> the AMX tiles amx_linear reads", py::arg("weight"),
        py::arg("reuse") = py::none(), py::arg("huge_pages") = false);
  m.def("amx_linear", &amx_linear, "x @ weight^T (+ bias) on AMX tiles: float32 sums of bf16 products");
  m.def("has_bf16_gemm", &has_bf16_gemm, "whether packed_gemm multiplies bf16 (AVX512_BF16) in this build");
}
