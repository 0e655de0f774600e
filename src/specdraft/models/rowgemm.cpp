// Weight-stationary products of a few rows: out (M, N) = x (M, K) @ w (N, K)^T + bias, for the 1 to ~20 rows of a
// batch-1 decode step or verify, with w in bf16 or fp32 and 256-bit FMA (AVX2 + FMA; the same kernel on AVX-512
// CPUs, where it measured faster than 512-bit block and AVX-512-BF16 dot-product kernels over SmolLM2's weights).
//
// w is stored in panels of 16 output columns, (ceil(N / 16), K, 16): the panels are one sequential stream, one
// 32-byte (bf16) or 64-byte (fp32) row per k, prefetched ahead. Each row of w is widened to fp32 in registers
// (bf16 -> fp32 is exact: a 16-bit shift) and multiplied into every row of x, broadcast one element at a time, so
// M rows cost one pass over the weights plus two FMAs per row, k and panel. Each output element is one FMA chain
// over k in order from zero (acc = w[k] * x[k] + acc), then the bias, then one rounding to the output dtype,
// whatever M is and however the rows and panels are grouped: a row's result does not depend on the other rows, so
// a k-token forward reproduces k 1-token forwards bit for bit. In a bf16 panel the 32-bit lane j of a row holds
// columns j (low half) and j + 8 (high half), split into two fp32 vectors by a shift and a mask.
#include "rowkernels.h"

namespace {

using namespace specdraft_rows;

constexpr int64_t kPanel = 16;   // output columns per panel: two 256-bit vectors
constexpr int64_t kAhead = 128;  // panel rows prefetched ahead (2-4 KB)

inline void widen(const c10::BFloat16* p, __m256& lo, __m256& hi) {
  __m256i lanes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(lanes, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(lanes, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

inline void widen(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}

template <typename O>
inline void store16(__m256 lo, __m256 hi, const float* bias, O* out, int64_t live) {
  alignas(32) float s[kPanel];
  if (bias) {  // the bias after the whole sum, as a scalar add would
    lo = _mm256_add_ps(lo, _mm256_loadu_ps(bias));
    hi = _mm256_add_ps(hi, _mm256_loadu_ps(bias + 8));
  }
  _mm256_store_ps(s, lo);
  _mm256_store_ps(s + 8, hi);
  for (int64_t j = 0; j < live; ++j) out[j] = static_cast<O>(s[j]);
}

// One panel (K rows of 16) times MB rows of x (each (K,) fp32): 2 * MB accumulators in registers. The next rows of
// the stream are prefetched, so that memory keeps streaming while the FMAs of several rows run.
template <int MB, typename W, typename O>
inline void panel_tile(const W* w, int64_t K, const float* x, const float* bias, O* out, int64_t N, int64_t n0) {
  __m256 lo_acc[MB], hi_acc[MB];  // columns 0-7 and 8-15 of the panel, per row of x
#pragma GCC unroll 6
  for (int m = 0; m < MB; ++m) lo_acc[m] = hi_acc[m] = _mm256_setzero_ps();
  int64_t k = 0;
  do {  // K >= 1; a do-while (and fully unrolled loops over m) keep the accumulators in registers
    __m256 lo, hi;
    const W* row = w + k * kPanel;
    _mm_prefetch(reinterpret_cast<const char*>(row + kAhead * kPanel), _MM_HINT_T0);  // past the end: harmless
    widen(row, lo, hi);
#pragma GCC unroll 6
    for (int m = 0; m < MB; ++m) {
      const __m256 xv = _mm256_broadcast_ss(x + m * K + k);
      lo_acc[m] = _mm256_fmadd_ps(lo, xv, lo_acc[m]);
      hi_acc[m] = _mm256_fmadd_ps(hi, xv, hi_acc[m]);
    }
  } while (++k < K);
  const int64_t live = std::min<int64_t>(kPanel, N - n0);
#pragma GCC unroll 6
  for (int m = 0; m < MB; ++m) store16(lo_acc[m], hi_acc[m], bias ? bias + n0 : nullptr, out + m * N + n0, live);
}

// Every row of x against one panel, in tiles of at most 6 rows (a second tile reads the panel from cache).
template <typename W, typename O>
void panel_rows(const W* w, int64_t K, const float* x, int64_t M, const float* bias, O* out, int64_t N, int64_t n0) {
  for (int64_t m = 0; m < M;) {
    const int64_t left = M - m, mb = left <= 6 ? left : (left <= 8 ? 4 : 6);  // 7 -> 4 + 3, 8 -> 4 + 4
    const float* xm = x + m * K;
    O* om = out + m * N;
    switch (mb) {
      case 1: panel_tile<1>(w, K, xm, bias, om, N, n0); break;
      case 2: panel_tile<2>(w, K, xm, bias, om, N, n0); break;
      case 3: panel_tile<3>(w, K, xm, bias, om, N, n0); break;
      case 4: panel_tile<4>(w, K, xm, bias, om, N, n0); break;
      case 5: panel_tile<5>(w, K, xm, bias, om, N, n0); break;
      default: panel_tile<6>(w, K, xm, bias, om, N, n0); break;
    }
    m += mb;
  }
}

template <typename W, typename O>
void panel_product(const W* w, int64_t K, const float* x, int64_t M, int64_t N, const float* bias, O* out) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 8, [&](int64_t begin, int64_t end) {  // each thread one contiguous run of panels
    for (int64_t p = begin; p < end; ++p) panel_rows(w + p * K * kPanel, K, x, M, bias, out, N, p * kPanel);
  });
}

template <typename W>
void product_to(const W* w, int64_t K, const float* x, int64_t M, int64_t N, const float* bias, at::Tensor& out) {
  if (out.scalar_type() == at::kBFloat16)
    panel_product(w, K, x, M, N, bias, out.data_ptr<c10::BFloat16>());
  else
    panel_product(w, K, x, M, N, bias, out.data_ptr<float>());
}

// (N, K) -> (ceil(N / 16), K, 16), zero-padded columns (bf16: columns j and j + 8 in one 32-bit lane).
at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) >= 1, "rowgemm: weight must be an (N, K) matrix, K >= 1");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "rowgemm: weight must be float32 or bfloat16");
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + kPanel - 1) / kPanel;
  at::Tensor padded = at::zeros({P * kPanel, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  at::Tensor panels = padded.view({P, kPanel, K}).transpose(1, 2);  // (P, K, 16)
  if (weight.scalar_type() == at::kBFloat16)  // (P, K, 2, 8) -> (P, K, 8, 2): lane j = (column j, column j + 8)
    panels = panels.reshape({P, K, 2, 8}).transpose(2, 3);
  return panels.contiguous().view({P, K, kPanel});
}

at::Tensor linear(const at::Tensor& input, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                  int64_t N) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(),
              "rowgemm: weight must come from rowgemm pack");
  TORCH_CHECK(input.scalar_type() == at::kFloat || input.scalar_type() == at::kBFloat16,
              "rowgemm: input must be float32 or bfloat16");
  const int64_t K = input.size(-1);
  TORCH_CHECK(packed.size(1) == K && N <= packed.size(0) * kPanel, "rowgemm: input does not match the weight");
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
  if (M == 0) return out.view(shape);
  const at::Tensor x = rows.to(at::kFloat).contiguous();  // (M, K) fp32: exact for bf16 input
  if (packed.scalar_type() == at::kBFloat16)
    product_to(packed.data_ptr<c10::BFloat16>(), K, x.data_ptr<float>(), M, N, bp, out);
  else
    product_to(packed.data_ptr<float>(), K, x.data_ptr<float>(), M, N, bp, out);
  return out.view(shape);
}

// Each row's first largest entry (torch.argmax's rule) and whether every entry of every row is finite, in one pass
// over the rows: the check and the choice of a greedy step read its logits, which the LM head's weight stream has
// pushed out of the caches, from memory once instead of twice. logits (R, V) float32 -> ((R,) int64, all finite).
// 8 lanes, each keeping its first strictly larger entry, then the lanes' largest value at its smallest index: the
// first largest entry of the row (equal values, -0 and +0 included, keep the earlier index). Non-finite: an
// exponent of all ones (inf or NaN); the indices are then unspecified.
std::tuple<at::Tensor, bool> argmax_finite(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "rowgemm: argmax_finite takes (R, V) float32");
  const at::Tensor x = logits.contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  TORCH_CHECK(V >= 1, "rowgemm: argmax_finite needs at least one column");
  at::Tensor out = at::empty({R}, x.options().dtype(at::kLong));
  const __m256i exponent = _mm256_set1_epi32(0x7f800000), step = _mm256_set1_epi32(8);
  __m256i bad = _mm256_setzero_si256();
  bool bad_tail = false;
  for (int64_t r = 0; r < R; ++r) {
    const float* row = x.data_ptr<float>() + r * V;
    __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    __m256i where = _mm256_set1_epi32(-1), at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    int64_t i = 0;
    for (; i + 8 <= V; i += 8) {
      const __m256 v = _mm256_loadu_ps(row + i);
      bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(v), exponent), exponent));
      const __m256 larger = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
      best = _mm256_blendv_ps(best, v, larger);
      where = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(where), _mm256_castsi256_ps(at), larger));
      at = _mm256_add_epi32(at, step);
    }
    alignas(32) float values[8];
    alignas(32) int32_t places[8];
    _mm256_store_ps(values, best);
    _mm256_store_si256(reinterpret_cast<__m256i*>(places), where);
    float top = -std::numeric_limits<float>::infinity();
    int64_t index = -1;
    for (int lane = 0; lane < 8; ++lane)
      if (places[lane] >= 0 && (values[lane] > top || (values[lane] == top && places[lane] < index)))
        top = values[lane], index = places[lane];
    for (; i < V; ++i) {
      bad_tail = bad_tail || !std::isfinite(row[i]);
      if (row[i] > top || index < 0) top = row[i], index = i;
    }
    if (index < 0) index = 0;  // every entry -inf (non-finite: reported below)
    out.data_ptr<int64_t>()[r] = index;
  }
  const bool finite = !bad_tail && _mm256_testz_si256(bad, bad);
  return {out, finite};
}
}  // namespace

TORCH_LIBRARY(specdraft_rowgemm, m) {
  m.def("pack(Tensor weight) -> Tensor");
  m.def("linear(Tensor input, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("attention(Tensor queries, Tensor keys, Tensor values, Tensor? mask, float scale, int mode) -> Tensor");
  m.def("argmax_finite(Tensor logits) -> (Tensor, bool)");
}

TORCH_LIBRARY_IMPL(specdraft_rowgemm, CPU, m) {
  m.impl("pack", &pack);
  m.impl("linear", &linear);
  m.impl("argmax_finite", &argmax_finite);
}
