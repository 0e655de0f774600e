// Attention of T new queries over S cached keys, one (query, head) at a time, the same instruction sequence for
// every one whatever T is: a score per slot (8-lane FMAs over the head dimension in order, one fixed horizontal
// sum), softmax over the visible slots with their maximum, values accumulated in slot order over the visible slots.
// A query's output is the same whether it comes alone (a plain step) or among others (a chain, or a tree whose
// ancestors precede it in slot order), so a k-token forward reproduces k 1-token forwards bit for bit.
#include "rowkernels.h"

namespace {

using namespace specdraft_rows;

// e^x for x <= 0, 8 lanes (cephes expf: Cody-Waite reduction, degree-6 polynomial, about 1 ulp), the same
// instructions for every lane; below -87 it returns e^-87 (~1.6e-38), which no softmax sum can see.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
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

// Asks for the cache lines of one cached key or value row (hd elements) ahead of their use: the cache of a layer is
// cold when its attention starts (the weights passed through since), and each block waits on memory without it.
template <typename T>
inline void prefetch_row(const T* p, int64_t hd) {
  const char* line = reinterpret_cast<const char*>(p);
  for (int64_t byte = 0; byte < hd * static_cast<int64_t>(sizeof(T)); byte += 64) _mm_prefetch(line + byte, _MM_HINT_T0);
}

// The same for a head dimension known at compile time (HD8 = hd / 8), computed a block of cached slots at a time for
// several (query, head) rows that read one KV head: each block of keys and of values is copied (bf16: widened) to
// fp32 once, prefetched a block ahead, and read from L1 by every row. Each row's arithmetic is the one of a row
// alone: its query and output accumulate in registers; a score is 8-lane FMAs over the head dimension in order, then
// hsum (4 slots at a time, 4 independent chains); the softmax and the values run over the visible slots in slot
// order. How rows are grouped (by thread count, by the number of queries) therefore never changes a result.
template <int HD8, typename T, typename O>
void attend_fixed(const float* q, const T* keys, const T* values, const int64_t* ks, const int64_t* vs,
                  const bool* mask, int64_t B, int64_t Tn, int64_t H, int64_t KV, int64_t S, float scale, O* out) {
  constexpr int64_t hd = HD8 * 8;
  constexpr int64_t kBlock = 64;  // slots per block: 16 KB of fp32 keys (or values), in L1
  const int64_t groups = H / KV, rows = Tn * groups;  // rows of one KV head: (query t, head g), t-major
  // Rows per work item: all of a KV head's on one thread; split only to give every thread work.
  const int64_t threads = at::get_num_threads();
  int64_t chunks = 1;
  if (threads > 1) chunks = std::min(rows, (2 * threads + B * KV - 1) / (B * KV));
  const int64_t per = (rows + chunks - 1) / chunks;
  chunks = (rows + per - 1) / per;
  at::parallel_for(0, B * KV * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kbuf(kBlock * hd), vbuf(kBlock * hd);
    std::vector<float> score(per * (S + 8), 0.0f), acc(per * hd), total(per);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (KV * chunks), kvh = item / chunks % KV, c = item % chunks;
      const int64_t r0 = c * per, r1 = std::min(rows, r0 + per);
      const T* kb = keys + b * ks[0] + kvh * ks[1];
      const T* vb = values + b * vs[0] + kvh * vs[1];
      // pass 1: scores of every row, a block of keys at a time
      for (int64_t s0 = 0; s0 < S; s0 += kBlock) {
        const int64_t n = std::min(kBlock, S - s0);
        for (int64_t j = 0; j < n; ++j) {
          if (s0 + kBlock + j < S) prefetch_row(kb + (s0 + kBlock + j) * ks[2], hd);  // the next block's row j
          for (int i = 0; i < HD8; ++i) _mm256_storeu_ps(&kbuf[j * hd + i * 8], load8(kb + (s0 + j) * ks[2] + i * 8));
        }
        const float* kp = kbuf.data();
        constexpr int64_t kst = hd;
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t t = r / groups, h = kvh * groups + r % groups;
          const float* qv = q + ((b * Tn + t) * H + h) * hd;
          float* sc = &score[(r - r0) * (S + 8) + s0];
          __m256 qr[HD8];
          for (int i = 0; i < HD8; ++i) qr[i] = _mm256_loadu_ps(qv + i * 8);
          int64_t j = 0;
          for (; j + 4 <= n; j += 4) {
            __m256 dot[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
            for (int i = 0; i < HD8; ++i)
              for (int u = 0; u < 4; ++u) dot[u] = _mm256_fmadd_ps(qr[i], _mm256_loadu_ps(kp + (j + u) * kst + i * 8), dot[u]);
            for (int u = 0; u < 4; ++u) sc[j + u] = hsum(dot[u]) * scale;
          }
          for (; j < n; ++j) {
            __m256 dot = _mm256_setzero_ps();
            for (int i = 0; i < HD8; ++i) dot = _mm256_fmadd_ps(qr[i], _mm256_loadu_ps(kp + j * kst + i * 8), dot);
            sc[j] = hsum(dot) * scale;
          }
        }
      }
      // the first block of values, read while the softmax runs
      for (int64_t j = 0; j < std::min(kBlock, S); ++j) prefetch_row(vb + j * vs[2], hd);
      // softmax numerators: e^(score - max over the visible slots)
      for (int64_t r = r0; r < r1; ++r) {
        float* sc = &score[(r - r0) * (S + 8)];
        const bool* visible = mask ? mask + (r / groups) * S : nullptr;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t s = 0; s < S; ++s)
          if (!visible || visible[s]) top = std::max(top, sc[s]);
        const __m256 shift = _mm256_set1_ps(top);
        for (int64_t s = 0; s < S; s += 8) _mm256_storeu_ps(&sc[s], exp8(_mm256_sub_ps(_mm256_loadu_ps(&sc[s]), shift)));
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(total.begin(), total.end(), 0.0f);
      // pass 2: values, a block at a time, each row's accumulators in registers across the block
      for (int64_t s0 = 0; s0 < S; s0 += kBlock) {
        const int64_t n = std::min(kBlock, S - s0);
        for (int64_t j = 0; j < n; ++j) {
          if (s0 + kBlock + j < S) prefetch_row(vb + (s0 + kBlock + j) * vs[2], hd);  // the next block's row j
          for (int i = 0; i < HD8; ++i) _mm256_storeu_ps(&vbuf[j * hd + i * 8], load8(vb + (s0 + j) * vs[2] + i * 8));
        }
        const float* vp = vbuf.data();
        constexpr int64_t vst = hd;
        for (int64_t r = r0; r < r1; ++r) {
          const float* sc = &score[(r - r0) * (S + 8) + s0];
          const bool* visible = mask ? mask + (r / groups) * S + s0 : nullptr;
          float* a = &acc[(r - r0) * hd];
          __m256 ar[HD8];
          for (int i = 0; i < HD8; ++i) ar[i] = _mm256_loadu_ps(a + i * 8);
          float sum = total[r - r0];
          for (int64_t j = 0; j < n; ++j) {
            if (visible && !visible[j]) continue;
            sum += sc[j];
            const __m256 p = _mm256_set1_ps(sc[j]);
            for (int i = 0; i < HD8; ++i) ar[i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vp + j * vst + i * 8), ar[i]);
          }
          total[r - r0] = sum;
          for (int i = 0; i < HD8; ++i) _mm256_storeu_ps(a + i * 8, ar[i]);
        }
      }
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t t = r / groups, h = kvh * groups + r % groups;
        float row[hd];
        const __m256 sum = _mm256_set1_ps(total[r - r0]);
        for (int i = 0; i < HD8; ++i) _mm256_storeu_ps(row + i * 8, _mm256_div_ps(_mm256_loadu_ps(&acc[(r - r0) * hd + i * 8]), sum));
        O* o = out + ((b * Tn + t) * H + h) * hd;
        for (int64_t d = 0; d < hd; ++d) o[d] = static_cast<O>(row[d]);
      }
    }
  });
}

// Any head dimension that is a multiple of 8, one score and one slot at a time (the fallback of attend_fixed).
template <typename T, typename O>
void attend(const float* q, const T* keys, const T* values, const int64_t* ks, const int64_t* vs, const bool* mask,
            int64_t B, int64_t Tn, int64_t H, int64_t KV, int64_t S, int64_t hd, float scale, O* out) {
  const int64_t groups = H / KV;
  at::parallel_for(0, B * Tn * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> score(S), acc(hd);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (Tn * H), t = item / H % Tn, h = item % H, kvh = h / groups;
      const float* qv = q + item * hd;
      const T* kb = keys + b * ks[0] + kvh * ks[1];
      const T* vb = values + b * vs[0] + kvh * vs[1];
      const bool* visible = mask ? mask + t * S : nullptr;
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

at::Tensor attention(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
                     const c10::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(queries.dim() == 4 && keys.dim() == 4 && values.dim() == 4, "rowgemm: attention takes 4-d tensors");
  const int64_t B = queries.size(0), Tn = queries.size(1), H = queries.size(2), hd = queries.size(3);
  const int64_t KV = keys.size(1), S = keys.size(2);
  TORCH_CHECK(hd % 8 == 0 && H % KV == 0 && keys.sizes() == values.sizes() && keys.size(3) == hd &&
                  keys.size(0) == B && keys.scalar_type() == values.scalar_type() && keys.stride(3) == 1 &&
                  values.stride(3) == 1,
              "rowgemm: attention shapes do not match");
  TORCH_CHECK(keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kBFloat16,
              "rowgemm: keys must be float32 or bfloat16");
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
  auto run = [&](auto* k, auto* v) {
    auto to = [&](auto* o) {
      const float* qp = q.data_ptr<float>();
      switch (hd) {  // fixed per model: the variant never depends on the number of queries
        case 8: return attend_fixed<1>(qp, k, v, ks, vs, mp, B, Tn, H, KV, S, sc, o);
        case 16: return attend_fixed<2>(qp, k, v, ks, vs, mp, B, Tn, H, KV, S, sc, o);
        case 32: return attend_fixed<4>(qp, k, v, ks, vs, mp, B, Tn, H, KV, S, sc, o);
        case 64: return attend_fixed<8>(qp, k, v, ks, vs, mp, B, Tn, H, KV, S, sc, o);
        case 128: return attend_fixed<16>(qp, k, v, ks, vs, mp, B, Tn, H, KV, S, sc, o);
        default: return attend(qp, k, v, ks, vs, mp, B, Tn, H, KV, S, hd, sc, o);
      }
    };
    if (out.scalar_type() == at::kBFloat16)
      to(out.data_ptr<c10::BFloat16>());
    else
      to(out.data_ptr<float>());
  };
  if (keys.scalar_type() == at::kBFloat16)
    run(keys.data_ptr<c10::BFloat16>(), values.data_ptr<c10::BFloat16>());
  else
    run(keys.data_ptr<float>(), values.data_ptr<float>());
  return out.view({B, Tn, H * hd});
}

}  // namespace

TORCH_LIBRARY_IMPL(specdraft_rowgemm, CPU, m) { m.impl("attention", &attention); }
