// attend_fixed, included twice by rowattention.cpp: once with 8-lane vector operations (AVX2 + FMA) and once with
// 16-lane ones (AVX-512, chosen at run time), each in its own namespace that defines V, kLanes, vzero, vload, vstore,
// vfma, vset1, vdiv and vsum. No include guard: that is the point.
//
// The same for a head dimension known at compile time (HD8 = hd / 8), computed a block of cached slots at a time for
// several (query, head) rows that read one KV head: each block of keys and of values is copied (bf16: widened) to
// fp32 once, prefetched a block ahead, and read from L1 by every row. Each row's arithmetic is the one of a row
// alone: its query and output accumulate in registers; a score is vector FMAs over the head dimension in order, then
// vsum (8 slots at a time, 8 independent chains, their 8 sums formed together by vsum8 in vsum's own order); the
// softmax sum is :func:`visible_sum`'s and the values run over the visible slots in slot order. How rows are grouped
// (by thread count, by the number of queries) therefore never changes a result. Token t's queries start at
// q + t * q_row (heads hd apart) and its mask row at mask + t * m_row; the output is (B, Tn, H, hd).
// Values of R rows of one query (the heads that read one KV head: the same visible slots) over one block: each
// output element accumulates p * v in slot order over the visible prefix, then over the visible slots after it
// (``visible``: a tree's mask from the block's first slot, or null), exactly as a row alone does. C vectors of the
// head dimension at a time, so that a value vector loaded once serves all R rows from registers.
template <int R, int C, int NV, int64_t hd>
inline void values_tile(const float* const* sc, float* const* a, const float* vp, int64_t whole, const bool* visible,
                        int64_t n) {
  for (int c0 = 0; c0 < NV; c0 += C) {
    V ar[R][C];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < C; ++i) ar[r][i] = vload(a[r] + (c0 + i) * kLanes);
    auto slot = [&](int64_t j) {
      V p[R];
      for (int r = 0; r < R; ++r) p[r] = vset1(sc[r][j]);
      for (int i = 0; i < C; ++i) {
        const V v = vload(vp + j * hd + (c0 + i) * kLanes);
        for (int r = 0; r < R; ++r) ar[r][i] = vfma(p[r], v, ar[r][i]);
      }
    };
    for (int64_t j = 0; j < whole; ++j) slot(j);
    if (visible)
      for (int64_t j = whole; j < n; ++j)
        if (visible[j]) slot(j);
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < C; ++i) vstore(a[r] + (c0 + i) * kLanes, ar[r][i]);
  }
}

template <int HD8, typename T, typename O>
void attend_fixed(const float* q, int64_t q_row, const T* keys, const T* values, const int64_t* ks, const int64_t* vs,
                  const bool* mask, int64_t m_row, int64_t B, int64_t Tn, int64_t H, int64_t KV, int64_t S, float scale,
                  O* out) {
  constexpr int64_t hd = HD8 * 8;
  constexpr int NV = hd / kLanes;  // vectors per head
  constexpr int64_t kBlock = 64;  // slots per block: 16 KB of fp32 keys (or values), in L1
  const int64_t groups = H / KV, rows = Tn * groups;  // rows of one KV head: (query t, head g), t-major
  // Rows per work item: all of a KV head's on one thread; split only to give every thread work. A thread handed
  // consecutive items of one KV head runs them as one pass over that head's cache (read once, not once per item).
  const int64_t threads = at::get_num_threads();
  int64_t chunks = 1;
  if (threads > 1) chunks = std::min(rows, (2 * threads + B * KV - 1) / (B * KV));
  const int64_t per = (rows + chunks - 1) / chunks;
  chunks = (rows + per - 1) / per;
  // The visible slots of each query: a prefix 0 .. L-1 (a causal chain) is marked by its length, so softmax and values
  // run over whole vectors there; only other masks (token trees) look slot by slot, after their longest prefix.
  std::vector<int64_t> prefix(Tn, S);
  if (mask)
    for (int64_t t = 0; t < Tn; ++t) prefix[t] = visible_prefix(mask + t * m_row, S);
  at::parallel_for(0, B * KV * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kbuf(kBlock * hd), vbuf(kBlock * hd), score, acc, total;
    for (int64_t item = begin; item < end;) {
      const int64_t b = item / (KV * chunks), kvh = item / chunks % KV;
      const int64_t last = std::min(end, (item / chunks + 1) * chunks);  // this KV head's items in the range
      const int64_t r0 = (item % chunks) * per, r1 = std::min(rows, ((last - 1) % chunks + 1) * per);
      item = last;
      const int64_t n_rows = r1 - r0;
      score.assign(n_rows * (S + 8), 0.0f);
      acc.assign(n_rows * hd, 0.0f);
      total.assign(n_rows, 0.0f);
      const T* kb = keys + b * ks[0] + kvh * ks[1];
      const T* vb = values + b * vs[0] + kvh * vs[1];
      auto query = [&](int64_t r) { return q + (b * Tn + r / groups) * q_row + (kvh * groups + r % groups) * hd; };
      auto slot_score = [&](const float* qv, const float* kv) {  // one slot: the FMA chain, vsum, the scale
        V dot = vzero();
        for (int i = 0; i < NV; ++i) dot = vfma(vload(qv + i * kLanes), vload(kv + i * kLanes), dot);
        return vsum(dot) * scale;
      };
      // pass 1: scores of every row, a block of keys at a time: each one FMA chain over the head dimension, then
      // its vsum (formed 8 at a time by vsum8) times the scale; three rows by 4 slots, two rows by 4 slots or one
      // row by 8 slots at a time, each key vector loaded once for the rows of its tile
      for (int64_t s0 = 0; s0 < S; s0 += kBlock) {
        const int64_t n = std::min(kBlock, S - s0);
        const float* kp = block_rows<HD8>(kb, ks[2], s0, n, S, kBlock, kbuf.data());
        for (int64_t r = r0; r < r1;) {
          const float* qa = query(r);
          float* sa = &score[(r - r0) * (S + 8) + s0];
          int64_t j = 0;
          if (r + 2 < r1) {  // three rows at once, 4 slots each: 12 chains, a key vector read once for all three
            const float* qb = query(r + 1);
            const float* qc = query(r + 2);
            float* sb = sa + (S + 8);
            float* sc3 = sb + (S + 8);
            for (; j + 4 <= n; j += 4) {
              V dot[12];
              for (int u = 0; u < 12; ++u) dot[u] = vzero();
              for (int i = 0; i < NV; ++i) {
                const V x = vload(qa + i * kLanes), y = vload(qb + i * kLanes), z = vload(qc + i * kLanes);
                for (int u = 0; u < 4; ++u) {
                  const V k = vload(kp + (j + u) * hd + i * kLanes);
                  dot[u] = vfma(x, k, dot[u]);
                  dot[4 + u] = vfma(y, k, dot[4 + u]);
                  dot[8 + u] = vfma(z, k, dot[8 + u]);
                }
              }
              const __m256 both = _mm256_mul_ps(vsum8(dot), _mm256_set1_ps(scale));  // row r | row r + 1
              const V third[8] = {dot[8], dot[9], dot[10], dot[11], dot[8], dot[9], dot[10], dot[11]};
              const __m256 last = _mm256_mul_ps(vsum8(third), _mm256_set1_ps(scale));  // row r + 2, twice
              _mm_storeu_ps(sa + j, _mm256_castps256_ps128(both));
              _mm_storeu_ps(sb + j, _mm256_extractf128_ps(both, 1));
              _mm_storeu_ps(sc3 + j, _mm256_castps256_ps128(last));
            }
            for (int64_t jj = j; jj < n; ++jj) {
              sa[jj] = slot_score(qa, kp + jj * hd);
              sb[jj] = slot_score(qb, kp + jj * hd);
              sc3[jj] = slot_score(qc, kp + jj * hd);
            }
            r += 3;
            continue;
          }
          if (r + 1 < r1) {  // two rows at once, 4 slots each: every key vector loaded once for both
            const float* qb = query(r + 1);
            float* sb = sa + (S + 8);
            for (; j + 4 <= n; j += 4) {
              V dot[8];
              for (int u = 0; u < 8; ++u) dot[u] = vzero();
              for (int i = 0; i < NV; ++i) {
                const V x = vload(qa + i * kLanes), y = vload(qb + i * kLanes);
                for (int u = 0; u < 4; ++u) {
                  const V k = vload(kp + (j + u) * hd + i * kLanes);
                  dot[u] = vfma(x, k, dot[u]);
                  dot[4 + u] = vfma(y, k, dot[4 + u]);
                }
              }
              const __m256 both = _mm256_mul_ps(vsum8(dot), _mm256_set1_ps(scale));  // row r | row r + 1
              _mm_storeu_ps(sa + j, _mm256_castps256_ps128(both));
              _mm_storeu_ps(sb + j, _mm256_extractf128_ps(both, 1));
            }
            for (int64_t jj = j; jj < n; ++jj) {
              sa[jj] = slot_score(qa, kp + jj * hd);
              sb[jj] = slot_score(qb, kp + jj * hd);
            }
            r += 2;
            continue;
          }
          for (; j + 8 <= n; j += 8) {  // a row alone: 8 slots at once
            V dot[8];
            for (int u = 0; u < 8; ++u) dot[u] = vzero();
            for (int i = 0; i < NV; ++i)
              for (int u = 0; u < 8; ++u) dot[u] = vfma(vload(qa + i * kLanes), vload(kp + (j + u) * hd + i * kLanes), dot[u]);
            _mm256_storeu_ps(sa + j, _mm256_mul_ps(vsum8(dot), _mm256_set1_ps(scale)));
          }
          for (; j < n; ++j) sa[j] = slot_score(qa, kp + j * hd);
          r += 1;
        }
      }
      // the first block of values, read while the softmax runs
      for (int64_t j = 0; j < std::min(kBlock, S); ++j) prefetch_row(vb + j * vs[2], hd);
      // softmax numerators e^(score - max over the visible slots), and their sum (:func:`visible_sum`)
      for (int64_t r = r0; r < r1; ++r) {
        float* sc = &score[(r - r0) * (S + 8)];
        const int64_t t = r / groups, lead = prefix[t];
        const bool* visible = mask && lead < S ? mask + t * m_row : nullptr;
        const __m256 shift = _mm256_set1_ps(visible_max(sc, visible, lead, S));
        const int64_t upto = visible ? S : lead;
        for (int64_t s = 0; s < upto; s += 8) _mm256_storeu_ps(&sc[s], exp8(_mm256_sub_ps(_mm256_loadu_ps(&sc[s]), shift)));
        total[r - r0] = visible_sum(sc, visible, lead, S);
      }
      // pass 2: values, a block at a time, the rows of one query (up to 3 heads) together with their accumulators in
      // registers across the block (values_tile)
      constexpr int C = NV < 4 ? NV : 4;
      for (int64_t s0 = 0; s0 < S; s0 += kBlock) {
        const int64_t n = std::min(kBlock, S - s0);
        const float* vp = block_rows<HD8>(vb, vs[2], s0, n, S, kBlock, vbuf.data());
        for (int64_t r = r0; r < r1;) {
          const int64_t t = r / groups, lead = prefix[t];
          int64_t m = 1;  // rows r .. r + m - 1: the same query t
          while (m < 3 && r + m < r1 && (r + m) / groups == t) ++m;
          const bool* visible = mask && lead < S ? mask + t * m_row + s0 : nullptr;
          const int64_t whole = std::min(n, std::max<int64_t>(0, lead - s0));  // slots of the visible prefix here
          if (visible || whole > 0) {
            const float* sc[3];
            float* a[3];
            for (int64_t u = 0; u < m; ++u) {
              sc[u] = &score[(r + u - r0) * (S + 8) + s0];
              a[u] = &acc[(r + u - r0) * hd];
            }
            if (m == 3)
              values_tile<3, C, NV, hd>(sc, a, vp, whole, visible, n);
            else if (m == 2)
              values_tile<2, C, NV, hd>(sc, a, vp, whole, visible, n);
            else
              values_tile<1, NV, NV, hd>(sc, a, vp, whole, visible, n);
          }
          r += m;
        }
      }
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t t = r / groups, h = kvh * groups + r % groups;
        float row[hd];
        const V sum = vset1(total[r - r0]);
        for (int i = 0; i < NV; ++i) vstore(row + i * kLanes, vdiv(vload(&acc[(r - r0) * hd + i * kLanes]), sum));
        O* o = out + ((b * Tn + t) * H + h) * hd;
        for (int64_t d = 0; d < hd; ++d) o[d] = static_cast<O>(row[d]);
      }
    }
  });
}
