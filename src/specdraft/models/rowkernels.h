// Shared by the row kernels (rowgemm.cpp, rowattention.cpp): the blocking constants and the two 8-lane helpers
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

constexpr int64_t kRows = 4;    // weight rows per block
constexpr int64_t kStep = 16;   // k per step: one 256-bit load of 16 bf16, two of 8 fp32

inline float hsum(__m256 v) {  // one fixed order: (lo + hi), then pairs, then the last two
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Every block of kRows weight rows of packed (ceil(N / kRows), Kp, ...) weights, blocks split across threads:
// block(its weights, the next block of the thread's range to prefetch or nullptr, its bias or nullptr, its first
// output column, the output row stride). The last block, when N is not a multiple of kRows, is computed whole into a
// buffer (its bias padded with zeros) and only its live columns are copied out.
template <typename W, typename O, typename Block>
void for_each_block(const W* w, int64_t M, int64_t N, int64_t Kp, const float* bias, O* out, Block&& block) {
  const int64_t blocks = (N + kRows - 1) / kRows;
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const W* wb = w + i * kRows * Kp;
      const W* next = i + 1 < end ? wb + kRows * Kp : nullptr;
      const int64_t n0 = i * kRows, live = std::min<int64_t>(kRows, N - n0);
      if (live == kRows) {
        block(wb, next, bias ? bias + n0 : nullptr, out + n0, N);
        continue;
      }
      std::vector<O> full(M * kRows);
      std::vector<float> b(kRows, 0.0f);
      if (bias) std::copy(bias + n0, bias + n0 + live, b.begin());
      block(wb, next, bias ? b.data() : nullptr, full.data(), kRows);
      for (int64_t m = 0; m < M; ++m) std::copy(&full[m * kRows], &full[m * kRows] + live, out + m * N + n0);
    }
  });
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
