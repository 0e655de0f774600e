// Shared by the row kernels (rowgemm.cpp, rowattention.cpp): their includes, and the two 8-lane helpers of the attention
// whose fixed instruction order makes every result independent of how many rows are computed together.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace specdraft_rows {

inline float hsum(__m256 v) {  // one fixed order: (lo + hi), then pairs, then the last two
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
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

}  // namespace specdraft_rows
