// Shared by the row kernels (rowgemm.cpp, rowattention.cpp, quantlayer.cpp): their includes, and the 8-lane helpers
// whose fixed instruction order makes every result independent of how many rows are computed together.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

namespace specdraft_rows {

// Attention of Tn new queries of one sequence over S cached slots (rowattention.cpp, the kernel behind the
// ``attention`` op, called directly by the fused layer): token t's H query heads at q + t * q_row (hd apart); keys and
// values of the cache's element type (kv_type: float32, float16 or bfloat16) with strides ks, vs (batch, KV head,
// slot); mask (Tn rows m_row apart, S visible flags each) or null; out (Tn, H * hd) float32.
void attend_rows(const float* q, int64_t q_row, const void* keys, const void* values, at::ScalarType kv_type,
                 const int64_t* ks, const int64_t* vs, const bool* mask, int64_t m_row, int64_t Tn, int64_t H,
                 int64_t KV, int64_t S, int64_t hd, float scale, int64_t mode, float* out);

// Work over n independent rows: fn(begin, end) split between the threads when there are more than kRowsGrain rows (a
// prompt's prefill), else run where it is called (a decode step or verify, where waking a thread costs more than the
// work). Each row's arithmetic is its own, so how the rows are split never changes a result.
constexpr int64_t kRowsGrain = 16;
template <typename F>
inline void over_rows(int64_t n, const F& fn) {
  at::parallel_for(0, n, kRowsGrain, fn);
}

// Scratch for n elements, left uninitialized (every caller writes each element before reading it): zeroing the
// buffers of a 64-row chunk costs more than some of the work that fills them.
template <typename T>
inline std::unique_ptr<T[]> scratch(int64_t n) {
  return std::unique_ptr<T[]>(new T[n]);
}

inline float hsum(__m256 v) {  // one fixed order: (lo + hi), then pairs, then the last two
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// hsum of 8 vectors at once: lane u of the result is hsum(d[u]), bit for bit (the same additions in the same tree:
// (v0 + v4, v1 + v5, v2 + v6, v3 + v7), then the first two plus the last two, then those two), in 21 instructions
// instead of 8 x 6.
inline __m256 hsum8(const __m256* d) {
  __m256 s[4];
  for (int u = 0; u < 4; ++u)  // [d_u.lo + d_u.hi | d_{u+4}.lo + d_{u+4}.hi]
    s[u] = _mm256_add_ps(_mm256_permute2f128_ps(d[u], d[u + 4], 0x20), _mm256_permute2f128_ps(d[u], d[u + 4], 0x31));
  // per 128-bit lane: [x0 + x2, x1 + x3] of two vectors side by side
  const __m256 t01 = _mm256_add_ps(_mm256_shuffle_ps(s[0], s[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(s[0], s[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 t23 = _mm256_add_ps(_mm256_shuffle_ps(s[2], s[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(s[2], s[3], _MM_SHUFFLE(3, 2, 3, 2)));
  // (x0 + x2) + (x1 + x3): lanes d0 d1 d2 d3 | d4 d5 d6 d7
  return _mm256_add_ps(_mm256_shuffle_ps(t01, t23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm256_shuffle_ps(t01, t23, _MM_SHUFFLE(3, 1, 3, 1)));
}

template <typename T>
inline __m256 load8(const T* p);
template <>
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
template <>
inline __m256 load8(const c10::BFloat16* p) {
  __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
template <>
inline __m256 load8(const c10::Half* p) {  // F16C: exact
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// e^x, 8 lanes, x clamped to [-87, 88] (cephes expf: Cody-Waite reduction, degree-6 polynomial, about 1 ulp); the same
// instructions for every lane, so a value never depends on its neighbours. Below -87 it returns e^-87 (~1.6e-38),
// which no softmax sum can see.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

}  // namespace specdraft_rows
