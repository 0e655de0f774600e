// Attention of T new queries over S cached keys, one (query, head) at a time, the same instruction sequence for
// every one whatever T is: a score per slot (FMAs over the head dimension in order, one fixed horizontal sum),
// softmax over the visible slots with their maximum and a sum whose order depends only on the visible values in slot
// order (visible_sum), values accumulated in slot order over the visible slots.
// A query's output is the same whether it comes alone (a plain step) or among others (a chain, or a tree whose
// ancestors precede it in slot order), so a k-token forward reproduces k 1-token forwards bit for bit.
#include "rowkernels.h"

#include <cstring>
#include <type_traits>

namespace {

using namespace specdraft_rows;

// How many slots from the first are visible (all S without a mask): a causal chain's query sees a prefix.
inline int64_t visible_prefix(const bool* visible, int64_t S) {
  const void* hidden = std::memchr(visible, 0, S);
  return hidden ? static_cast<const bool*>(hidden) - visible : S;
}

// The largest score over the visible slots: the first `lead` slots, then (with a mask) the visible ones after them.
// 8 lanes, then across them. A maximum is exact in any order, so this equals a slot-by-slot scan.
inline float visible_max(const float* sc, const bool* visible, int64_t lead, int64_t S) {
  __m256 top = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t s = 0;
  for (; s + 8 <= lead; s += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(sc + s));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  float best = *std::max_element(lanes, lanes + 8);
  for (; s < lead; ++s) best = std::max(best, sc[s]);
  if (visible)
    for (s = lead; s < S; ++s)
      if (visible[s]) best = std::max(best, sc[s]);
  return best;
}

// The sum of the visible slots' values, in one fixed order that depends only on the visible values in slot order:
// the i-th visible value goes to lane i mod 8 (8 running sums, so no chain of dependent additions), then the lanes
// are summed by hsum. A query among others (visible: its prefix, or its ancestors in a tree) sums exactly what it
// sums alone (visible: every slot), so the invariance of the kernel holds. The first `lead` slots are all visible
// (rank = slot): whole blocks of 8 as vectors there; after them (a tree's mask) rank by rank.
inline float visible_sum(const float* sc, const bool* visible, int64_t lead, int64_t S) {
  alignas(32) float lanes[8];
  __m256 sum = _mm256_setzero_ps();
  int64_t s = 0;
  for (; s + 8 <= lead; s += 8) sum = _mm256_add_ps(sum, _mm256_loadu_ps(sc + s));
  _mm256_store_ps(lanes, sum);
  for (; s < lead; ++s) lanes[s & 7] += sc[s];
  if (visible) {
    int64_t rank = lead;
    for (s = lead; s < S; ++s)
      if (visible[s]) lanes[rank++ & 7] += sc[s];
  }
  return hsum(_mm256_load_ps(lanes));
}

// Asks for the cache lines of one cached key or value row (hd elements) ahead of their use: the cache of a layer is
// cold when its attention starts (the weights passed through since), and each block waits on memory without it.
template <typename T>
inline void prefetch_row(const T* p, int64_t hd) {
  const char* line = reinterpret_cast<const char*>(p);
  for (int64_t byte = 0; byte < hd * static_cast<int64_t>(sizeof(T)); byte += 64) _mm_prefetch(line + byte, _MM_HINT_T0);
}

// Slots s0 .. s0 + n of one KV head's cached keys or values (rows ``stride`` apart) copied to ``buf`` as fp32 (bf16
// widened, exact), (n, HD8 * 8), asking for the next block's rows (``block`` slots on) as it goes.
template <int HD8, typename T>
inline void widen_block(const T* rows, int64_t stride, int64_t s0, int64_t n, int64_t S, int64_t block, float* buf) {
  constexpr int64_t hd = HD8 * 8;
  for (int64_t j = 0; j < n; ++j) {
    if (s0 + block + j < S) prefetch_row(rows + (s0 + block + j) * stride, hd);
    for (int i = 0; i < HD8; ++i) _mm256_storeu_ps(buf + j * hd + i * 8, load8(rows + (s0 + j) * stride + i * 8));
  }
}

// Slots s0 .. s0 + n of one KV head's keys or values as fp32 rows (n, HD8 * 8): the cache itself where it holds
// contiguous fp32 rows (the next block prefetched), else a widened copy in `buf`.
template <int HD8, typename T>
inline const float* block_rows(const T* rows, int64_t stride, int64_t s0, int64_t n, int64_t S, int64_t block,
                               float* buf) {
  if constexpr (std::is_same_v<T, float>) {
    if (stride == HD8 * 8) {
      for (int64_t j = s0 + block; j < std::min(S, s0 + block + n); ++j) prefetch_row(rows + j * stride, HD8 * 8);
      return rows + s0 * stride;
    }
  }
  widen_block<HD8>(rows, stride, s0, n, S, block, buf);
  return buf;
}

namespace lanes8 {  // 256-bit: the kernel on every CPU with AVX2 and FMA
using V = __m256;
constexpr int kLanes = 8;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 vsum8(const V* d) { return hsum8(d); }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vset1(float x) { return _mm256_set1_ps(x); }
inline V vdiv(V a, V b) { return _mm256_div_ps(a, b); }
inline float vsum(V v) { return hsum(v); }
#include "rowattention_fixed.h"
}  // namespace lanes8

// The same with 512-bit vectors where torch dispatches to AVX-512 (rowgemm.mode() >= 1): half the FMAs per score and
// per value. Its sums are grouped differently from the 256-bit kernel's, so the two differ in the last bits; a
// process uses one, and within it a k-token forward still reproduces k 1-token forwards.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl")
namespace lanes16 {
using V = __m512;
constexpr int kLanes = 16;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vset1(float x) { return _mm512_set1_ps(x); }
inline V vdiv(V a, V b) { return _mm512_div_ps(a, b); }
inline __m256 half_sum(V v) { return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)); }
inline float vsum(V v) { return hsum(half_sum(v)); }  // (lo + hi) halves down to one lane, one fixed order
inline __m256 vsum8(const V* d) {  // vsum of 8 vectors: lane u is vsum(d[u])
  __m256 s[8];
  for (int u = 0; u < 8; ++u) s[u] = half_sum(d[u]);
  return hsum8(s);
}
#include "rowattention_fixed.h"
}  // namespace lanes16
#pragma GCC pop_options

// Any head dimension that is a multiple of 8, one score and one slot at a time (the fallback of attend_fixed).
template <typename T, typename O>
void attend(const float* q, int64_t q_row, const T* keys, const T* values, const int64_t* ks, const int64_t* vs,
            const bool* mask, int64_t m_row, int64_t B, int64_t Tn, int64_t H, int64_t KV, int64_t S, int64_t hd,
            float scale, O* out) {
  const int64_t groups = H / KV;
  at::parallel_for(0, B * Tn * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> score(S), acc(hd);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (Tn * H), t = item / H % Tn, h = item % H, kvh = h / groups;
      const float* qv = q + (item / H) * q_row + h * hd;
      const T* kb = keys + b * ks[0] + kvh * ks[1];
      const T* vb = values + b * vs[0] + kvh * vs[1];
      const bool* visible = mask ? mask + t * m_row : nullptr;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < S; ++s) {
        if (visible && !visible[s]) continue;
        __m256 dot = _mm256_setzero_ps();
        for (int64_t d = 0; d < hd; d += 8) dot = _mm256_fmadd_ps(_mm256_loadu_ps(qv + d), load8(kb + s * ks[2] + d), dot);
        score[s] = hsum(dot) * scale;
        top = std::max(top, score[s]);
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      float total = 0.0f;
      for (int64_t s = 0; s < S; ++s) {
        if (visible && !visible[s]) continue;
        const float p = std::exp(score[s] - top);
        total += p;
        const __m256 pv = _mm256_set1_ps(p);
        for (int64_t d = 0; d < hd; d += 8)
          _mm256_storeu_ps(&acc[d], _mm256_fmadd_ps(pv, load8(vb + s * vs[2] + d), _mm256_loadu_ps(&acc[d])));
      }
      O* o = out + item * hd;
      for (int64_t d = 0; d < hd; ++d) o[d] = static_cast<O>(acc[d] / total);
    }
  });
}

// The kernel for head dimension hd (16-lane where `wide`), fixed per model and process: the variant never depends on
// the number of queries.
template <typename T, typename O>
void dispatch(const float* q, int64_t q_row, const T* k, const T* v, const int64_t* ks, const int64_t* vs,
              const bool* mask, int64_t m_row, int64_t B, int64_t Tn, int64_t H, int64_t KV, int64_t S, int64_t hd,
              float scale, bool wide, O* out) {
  if (wide) switch (hd) {
      case 16: return lanes16::attend_fixed<2>(q, q_row, k, v, ks, vs, mask, m_row, B, Tn, H, KV, S, scale, out);
      case 32: return lanes16::attend_fixed<4>(q, q_row, k, v, ks, vs, mask, m_row, B, Tn, H, KV, S, scale, out);
      case 64: return lanes16::attend_fixed<8>(q, q_row, k, v, ks, vs, mask, m_row, B, Tn, H, KV, S, scale, out);
      case 128: return lanes16::attend_fixed<16>(q, q_row, k, v, ks, vs, mask, m_row, B, Tn, H, KV, S, scale, out);
      default: break;
    }
  switch (hd) {
    case 8: return lanes8::attend_fixed<1>(q, q_row, k, v, ks, vs, mask, m_row, B, Tn, H, KV, S, scale, out);
    case 16: return lanes8::attend_fixed<2>(q, q_row, k, v, ks, vs, mask, m_row, B, Tn, H, KV, S, scale, out);
    case 32: return lanes8::attend_fixed<4>(q, q_row, k, v, ks, vs, mask, m_row, B, Tn, H, KV, S, scale, out);
    case 64: return lanes8::attend_fixed<8>(q, q_row, k, v, ks, vs, mask, m_row, B, Tn, H, KV, S, scale, out);
    case 128: return lanes8::attend_fixed<16>(q, q_row, k, v, ks, vs, mask, m_row, B, Tn, H, KV, S, scale, out);
    default: return attend(q, q_row, k, v, ks, vs, mask, m_row, B, Tn, H, KV, S, hd, scale, out);
  }
}

at::Tensor attention(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
                     const c10::optional<at::Tensor>& mask, double scale, int64_t mode) {
  TORCH_CHECK(queries.dim() == 4 && keys.dim() == 4 && values.dim() == 4, "rowgemm: attention takes 4-d tensors");
  const int64_t B = queries.size(0), Tn = queries.size(1), H = queries.size(2), hd = queries.size(3);
  const int64_t KV = keys.size(1), S = keys.size(2);
  TORCH_CHECK(hd % 8 == 0 && H % KV == 0 && keys.sizes() == values.sizes() && keys.size(3) == hd &&
                  keys.size(0) == B && keys.scalar_type() == values.scalar_type() && keys.stride(3) == 1 &&
                  values.stride(3) == 1,
              "rowgemm: attention shapes do not match");
  TORCH_CHECK(keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kBFloat16 ||
                  keys.scalar_type() == at::kHalf,
              "rowgemm: keys must be float32, bfloat16 or float16");
  TORCH_CHECK(queries.scalar_type() == at::kFloat || queries.scalar_type() == at::kBFloat16,
              "rowgemm: queries must be float32 or bfloat16");
  at::Tensor q = queries.to(at::kFloat).contiguous();  // (B, T, H, hd)
  at::Tensor m;
  if (mask.has_value() && mask->defined()) {
    m = mask->to(at::kBool).contiguous();
    TORCH_CHECK(m.dim() == 2 && m.size(0) == Tn && m.size(1) == S, "rowgemm: mask must be (T, S)");
  }
  at::Tensor out = at::empty({B, Tn, H, hd}, queries.options());
  const int64_t ks[3] = {keys.stride(0), keys.stride(1), keys.stride(2)};
  const int64_t vs[3] = {values.stride(0), values.stride(1), values.stride(2)};
  const bool* mp = m.defined() ? m.data_ptr<bool>() : nullptr;
  const float sc = static_cast<float>(scale);
  const float* qp = q.data_ptr<float>();
  auto run = [&](auto* k, auto* v) {
    if (out.scalar_type() == at::kBFloat16)
      dispatch(qp, H * hd, k, v, ks, vs, mp, S, B, Tn, H, KV, S, hd, sc, mode >= 1, out.data_ptr<c10::BFloat16>());
    else
      dispatch(qp, H * hd, k, v, ks, vs, mp, S, B, Tn, H, KV, S, hd, sc, mode >= 1, out.data_ptr<float>());
  };
  if (keys.scalar_type() == at::kBFloat16)
    run(keys.data_ptr<c10::BFloat16>(), values.data_ptr<c10::BFloat16>());
  else if (keys.scalar_type() == at::kHalf)
    run(keys.data_ptr<c10::Half>(), values.data_ptr<c10::Half>());
  else
    run(keys.data_ptr<float>(), values.data_ptr<float>());
  return out.view({B, Tn, H * hd});
}

}  // namespace

namespace specdraft_rows {

void attend_rows(const float* q, int64_t q_row, const void* keys, const void* values, at::ScalarType kv_type,
                 const int64_t* ks, const int64_t* vs, const bool* mask, int64_t m_row, int64_t Tn, int64_t H,
                 int64_t KV, int64_t S, int64_t hd, float scale, int64_t mode, float* out) {
  TORCH_CHECK(hd % 8 == 0 && H % KV == 0, "rowgemm: attention shapes do not match");
  const bool wide = mode >= 1;
  if (kv_type == at::kBFloat16)
    dispatch(q, q_row, static_cast<const c10::BFloat16*>(keys), static_cast<const c10::BFloat16*>(values), ks, vs,
             mask, m_row, 1, Tn, H, KV, S, hd, scale, wide, out);
  else if (kv_type == at::kHalf)
    dispatch(q, q_row, static_cast<const c10::Half*>(keys), static_cast<const c10::Half*>(values), ks, vs, mask,
             m_row, 1, Tn, H, KV, S, hd, scale, wide, out);
  else
    dispatch(q, q_row, static_cast<const float*>(keys), static_cast<const float*>(values), ks, vs, mask, m_row, 1,
             Tn, H, KV, S, hd, scale, wide, out);
}

}  // namespace specdraft_rows

TORCH_LIBRARY_IMPL(specdraft_rowgemm, CPU, m) { m.impl("attention", &attention); }
