// Weight-stationary products of a few rows: out (M, N) = x (M, K) @ w (N, K)^T + bias, for the 1 to ~20 rows of a
// batch-1 decode step or verify, with w in bf16 or fp32 and 256-bit FMA (AVX2 + FMA).
//
// Each block of w rows is read from memory once, widened to fp32 in registers (bf16 -> fp32 is exact: a 16-bit
// shift) and multiplied into every row of x, so M rows cost about one pass over the weights plus M times the FMAs,
// instead of M passes. Every output element is computed by the same instruction sequence whatever M is and
// wherever its row falls in a block (8-lane FMA accumulation over k in order from zero, one fixed horizontal sum,
// then the bias, then one rounding to the output dtype): a row's result does not depend on the other rows, so a
// k-token forward reproduces k 1-token forwards bit for bit.
#include "rowkernels.h"

namespace {

using namespace specdraft_rows;

// Weights are stored blocked, (N / 4, K / 16, 4, 16): each step of a block reads one contiguous 128 (bf16) or
// 256 (fp32) bytes, one sequential stream in all. Within a step the 16 values are in k order for bf16 (a 32-bit
// lane holds k = 2j and 2j + 1, split into two fp32 vectors by a shift and a mask) and as 8 even then 8 odd k for
// fp32; x is stored the same way (even then odd), so both dtypes multiply the same pairs in the same order.
inline void widen(const c10::BFloat16* p, __m256& even, __m256& odd) {
  __m256i lanes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(lanes, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(lanes, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

inline void widen(const float* p, __m256& even, __m256& odd) {
  even = _mm256_loadu_ps(p);
  odd = _mm256_loadu_ps(p + 8);
}


// One block of 4 weight rows times MB rows of x (each (Kp,) fp32, even/odd per step): 4 * MB accumulators in
// registers. ``next``: the following block, prefetched step by step.
template <int MB, typename W, typename O>
inline void tile(const W* w, const float* x, int64_t Kp, const float* bias, O* out, int64_t N,
                 const W* next = nullptr) {
  __m256 acc[kRows][MB];
  for (int n = 0; n < kRows; ++n)
    for (int m = 0; m < MB; ++m) acc[n][m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < Kp; k += kStep) {
    const W* ws = w + k * kRows;
    if (next) {  // the next block's same step: the stream stays ahead while this block is read more than once
      const char* line = reinterpret_cast<const char*>(next + k * kRows);
      for (int64_t byte = 0; byte < static_cast<int64_t>(kRows * kStep * sizeof(W)); byte += 64)
        _mm_prefetch(line + byte, _MM_HINT_T0);
    }
    for (int n = 0; n < kRows; ++n) {
      __m256 even, odd;
      widen(ws + n * kStep, even, odd);
      for (int m = 0; m < MB; ++m) {
        acc[n][m] = _mm256_fmadd_ps(even, _mm256_loadu_ps(x + m * Kp + k), acc[n][m]);
        acc[n][m] = _mm256_fmadd_ps(odd, _mm256_loadu_ps(x + m * Kp + k + 8), acc[n][m]);
      }
    }
  }
  for (int n = 0; n < kRows; ++n) {
    for (int m = 0; m < MB; ++m) {
      float s = hsum(acc[n][m]);
      if (bias) s += bias[n];
      out[m * N + n] = static_cast<O>(s);
    }
  }
}

// Every row of x against one block of 4 weight rows (kept in L1 while x's rows pass): 3 rows at a time (12
// accumulators), the last 4 as 2 + 2 (a lone row's 4 chains would wait on FMA latency).
template <typename W, typename O>
void block_rows(const W* w, const float* x, int64_t M, int64_t Kp, const float* b, O* o, int64_t N, const W* next) {
  const W* ahead = next;  // prefetched during the block's first pass
  int64_t m = 0;
  for (; M - m > 4; m += 3, ahead = nullptr) tile<3>(w, x + m * Kp, Kp, b, o + m * N, N, ahead);
  switch (M - m) {
    case 4:
      tile<2>(w, x + m * Kp, Kp, b, o + m * N, N, ahead);
      tile<2>(w, x + (m + 2) * Kp, Kp, b, o + (m + 2) * N, N);
      break;
    case 3: tile<3>(w, x + m * Kp, Kp, b, o + m * N, N, ahead); break;
    case 2: tile<2>(w, x + m * Kp, Kp, b, o + m * N, N, ahead); break;
    default: tile<1>(w, x + m * Kp, Kp, b, o + m * N, N, ahead); break;
  }
}

template <typename W, typename O>
void product(const W* w, const float* x, int64_t M, int64_t N, int64_t Kp, const float* bias, O* out) {
  for_each_block(w, M, N, Kp, bias, out, [&](const W* wb, const W* next, const float* b, O* o, int64_t stride) {
    block_rows(wb, x, M, Kp, b, o, stride, next);
  });
}

// The same blocks with 512-bit FMAs (AVX-512F/BW/DQ, chosen at run time): one weight row's step (16 k) per vector
// against x in the weights' own k order (natural for bf16, even/odd for fp32), 4 x up to 6 accumulators, one fixed
// 16-lane horizontal sum. Row-invariant like the 256-bit kernel (its sums are grouped differently, so the two
// kernels' results differ in the last bits; a process uses one).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl")

inline __m512 widen16(const c10::BFloat16* p) {
  __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

inline __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }

inline float hsum16(__m512 v) {
  __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int MB, typename W, typename O>
inline void tile16(const W* w, const float* x, int64_t Kp, const float* bias, O* out, int64_t N, const W* next) {
  __m512 acc[kRows][MB];
  for (int n = 0; n < kRows; ++n)
    for (int m = 0; m < MB; ++m) acc[n][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < Kp; k += kStep) {
    const W* ws = w + k * kRows;
    if (next) {
      const char* line = reinterpret_cast<const char*>(next + k * kRows);
      for (int64_t byte = 0; byte < static_cast<int64_t>(kRows * kStep * sizeof(W)); byte += 64)
        _mm_prefetch(line + byte, _MM_HINT_T0);
    }
    for (int n = 0; n < kRows; ++n) {
      const __m512 wv = widen16(ws + n * kStep);
      for (int m = 0; m < MB; ++m) acc[n][m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * Kp + k), acc[n][m]);
    }
  }
  for (int n = 0; n < kRows; ++n) {
    for (int m = 0; m < MB; ++m) {
      float s = hsum16(acc[n][m]);
      if (bias) s += bias[n];
      out[m * N + n] = static_cast<O>(s);
    }
  }
}

template <typename W, typename O>
void block_rows16(const W* w, const float* x, int64_t M, int64_t Kp, const float* b, O* out, int64_t N,
                  const W* next) {
  for (int64_t m = 0; m < M; m += 6) {
    const float* xm = x + m * Kp;
    O* om = out + m * N;
    const W* ahead = m ? nullptr : next;
    switch (std::min<int64_t>(6, M - m)) {
      case 1: tile16<1>(w, xm, Kp, b, om, N, ahead); break;
      case 2: tile16<2>(w, xm, Kp, b, om, N, ahead); break;
      case 3: tile16<3>(w, xm, Kp, b, om, N, ahead); break;
      case 4: tile16<4>(w, xm, Kp, b, om, N, ahead); break;
      case 5: tile16<5>(w, xm, Kp, b, om, N, ahead); break;
      default: tile16<6>(w, xm, Kp, b, om, N, ahead); break;
    }
  }
}

template <typename W, typename O>
void product16(const W* w, const float* x, int64_t M, int64_t N, int64_t Kp, const float* bias, O* out) {
  for_each_block(w, M, N, Kp, bias, out, [&](const W* wb, const W* next, const float* b, O* o, int64_t stride) {
    block_rows16(wb, x, M, Kp, b, o, stride, next);
  });
}

#pragma GCC pop_options

// bf16 weights times bf16 rows with AVX-512-BF16's pair dot product (vdpbf16ps: 32 products per instruction, exact
// in fp32, added pair by pair in a fixed order): one vector holds one step of two weight rows, x's step is stored
// twice over, so each lane sums one row's pairs; each row's 8 lanes are then summed in the fixed order of hsum.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")

template <int MB, typename O>
inline void tile_dot(const c10::BFloat16* w, const c10::BFloat16* x, int64_t Kp, const float* bias, O* out,
                     int64_t N, const c10::BFloat16* next) {
  __m512 acc[2][MB];  // [row pair][x row]
  for (int p = 0; p < 2; ++p)
    for (int m = 0; m < MB; ++m) acc[p][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < Kp; k += kStep) {
    const c10::BFloat16* ws = w + k * kRows;
    if (next) {
      const char* line = reinterpret_cast<const char*>(next + k * kRows);
      _mm_prefetch(line, _MM_HINT_T0);
      _mm_prefetch(line + 64, _MM_HINT_T0);
    }
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(ws);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(ws + 2 * kStep);
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (m * Kp + k) * 2);
      acc[0][m] = _mm512_dpbf16_ps(acc[0][m], w0, xv);
      acc[1][m] = _mm512_dpbf16_ps(acc[1][m], w1, xv);
    }
  }
  for (int p = 0; p < 2; ++p) {
    for (int m = 0; m < MB; ++m) {
      const __m256 halves[2] = {_mm512_castps512_ps256(acc[p][m]), _mm512_extractf32x8_ps(acc[p][m], 1)};
      for (int h = 0; h < 2; ++h) {
        float s = hsum(halves[h]);
        if (bias) s += bias[2 * p + h];
        out[m * N + 2 * p + h] = static_cast<O>(s);
      }
    }
  }
}

template <typename O>
void block_rows_dot(const c10::BFloat16* w, const c10::BFloat16* x, int64_t M, int64_t Kp, const float* b, O* out,
                    int64_t N, const c10::BFloat16* next) {
  for (int64_t m = 0; m < M; m += 8) {
    const c10::BFloat16* xm = x + m * Kp * 2;
    O* om = out + m * N;
    const c10::BFloat16* ahead = m ? nullptr : next;
    switch (std::min<int64_t>(8, M - m)) {
      case 1: tile_dot<1>(w, xm, Kp, b, om, N, ahead); break;
      case 2: tile_dot<2>(w, xm, Kp, b, om, N, ahead); break;
      case 3: tile_dot<3>(w, xm, Kp, b, om, N, ahead); break;
      case 4: tile_dot<4>(w, xm, Kp, b, om, N, ahead); break;
      case 5: tile_dot<5>(w, xm, Kp, b, om, N, ahead); break;
      case 6: tile_dot<6>(w, xm, Kp, b, om, N, ahead); break;
      case 7: tile_dot<7>(w, xm, Kp, b, om, N, ahead); break;
      default: tile_dot<8>(w, xm, Kp, b, om, N, ahead); break;
    }
  }
}

template <typename O>
void product_dot(const c10::BFloat16* w, const c10::BFloat16* x, int64_t M, int64_t N, int64_t Kp, const float* bias,
                 O* out) {
  using W = c10::BFloat16;
  for_each_block(w, M, N, Kp, bias, out, [&](const W* wb, const W* next, const float* b, O* o, int64_t stride) {
    block_rows_dot(wb, x, M, Kp, b, o, stride, next);
  });
}

#pragma GCC pop_options

template <typename W, typename O>
void product_on(bool wide, const W* w, const float* x, int64_t M, int64_t N, int64_t Kp, const float* bias, O* out) {
  if (wide)
    product16(w, x, M, N, Kp, bias, out);
  else
    product(w, x, M, N, Kp, bias, out);
}

// (N, K) -> (ceil(N / 4), Kp / 16, 4, 16), zero-padded (Kp = K rounded up to 16).
at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "rowgemm: weight must be an (N, K) matrix");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "rowgemm: weight must be float32 or bfloat16");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t Np = (N + kRows - 1) / kRows * kRows, Kp = (K + kStep - 1) / kStep * kStep;
  at::Tensor padded = at::zeros({Np, Kp}, weight.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(weight);
  at::Tensor steps = padded.view({Np / kRows, kRows, Kp / kStep, kStep});  // (blocks, 4, steps, 16)
  if (weight.scalar_type() == at::kFloat) {  // 8 even then 8 odd k per step
    steps = steps.view({Np / kRows, kRows, Kp / kStep, 8, 2}).transpose(3, 4).reshape({Np / kRows, kRows, Kp / kStep, kStep});
  }
  return steps.transpose(1, 2).contiguous();  // (blocks, steps, 4, 16)
}

// mode: 0 the 256-bit kernel, 1 the 512-bit one, 2 the AVX-512-BF16 pair dot product for bf16 rows and weights
// (else as 1). Fixed per process by the caller, so a row's result never depends on how many rows come with it.
at::Tensor linear(const at::Tensor& input, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                  int64_t N, int64_t mode) {
  const bool wide = mode >= 1;
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kRows && packed.size(3) == kStep && packed.is_contiguous(),
              "rowgemm: weight must come from rowgemm pack");
  TORCH_CHECK(input.scalar_type() == at::kFloat || input.scalar_type() == at::kBFloat16,
              "rowgemm: input must be float32 or bfloat16");
  const int64_t Kp = packed.size(1) * kStep, K = input.size(-1);
  TORCH_CHECK(K <= Kp && Kp - K < kStep && N <= packed.size(0) * kRows, "rowgemm: input does not match the weight");
  at::Tensor rows = input.reshape({-1, K});
  const int64_t M = rows.size(0);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "rowgemm: bias must have N elements");
    b = bias->to(at::kFloat).contiguous();
  }
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty({M, N}, input.options());
  if (mode == 2 && packed.scalar_type() == at::kBFloat16 && input.scalar_type() == at::kBFloat16) {
    at::Tensor xb = at::zeros({M, Kp / kStep, 2, kStep}, rows.options());  // each step's 16 k stored twice
    at::Tensor steps = at::zeros({M, Kp}, rows.options());
    steps.narrow(1, 0, K).copy_(rows);
    xb.copy_(steps.view({M, Kp / kStep, 1, kStep}).expand({M, Kp / kStep, 2, kStep}));
    product_dot(packed.data_ptr<c10::BFloat16>(), xb.data_ptr<c10::BFloat16>(), M, N, Kp, bp,
                out.data_ptr<c10::BFloat16>());
    return out.view(shape);
  }
  at::Tensor x = at::zeros({M, Kp}, rows.options().dtype(at::kFloat));  // (M, Kp) fp32: exact for bf16 input
  x.narrow(1, 0, K).copy_(rows);
  if (!wide || packed.scalar_type() == at::kFloat)  // the weights' k order: 8 even then 8 odd k per step
    x = x.view({M, Kp / kStep, 8, 2}).transpose(2, 3).contiguous();
  const float* xp = x.data_ptr<float>();
  if (packed.scalar_type() == at::kBFloat16) {
    if (out.scalar_type() == at::kBFloat16)
      product_on(wide, packed.data_ptr<c10::BFloat16>(), xp, M, N, Kp, bp, out.data_ptr<c10::BFloat16>());
    else
      product_on(wide, packed.data_ptr<c10::BFloat16>(), xp, M, N, Kp, bp, out.data_ptr<float>());
  } else {
    if (out.scalar_type() == at::kBFloat16)
      product_on(wide, packed.data_ptr<float>(), xp, M, N, Kp, bp, out.data_ptr<c10::BFloat16>());
    else
      product_on(wide, packed.data_ptr<float>(), xp, M, N, Kp, bp, out.data_ptr<float>());
  }
  return out.view(shape);
}
}  // namespace

TORCH_LIBRARY(specdraft_rowgemm, m) {
  m.def("pack(Tensor weight) -> Tensor");
  m.def("linear(Tensor input, Tensor packed, Tensor? bias, int n, int mode) -> Tensor");
  m.def("attention(Tensor queries, Tensor keys, Tensor values, Tensor? mask, float scale, int mode) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdraft_rowgemm, CPU, m) {
  m.impl("pack", &pack);
  m.impl("linear", &linear);
}
