// attend_fixed, included twice by rowattention.cpp: once with 8-lane vector operations (AVX2 + FMA) and once with
// 16-lane ones (AVX-512, chosen at run time), each in its own namespace that defines V, kLanes, vzero, vload, vstore,
// vfma, vset1, vdiv and vsum. No include guard: that is the point.
//
// The same for a head dimension known at compile time (HD8 = hd / 8), computed a block of cached slots at a time for
// several (query, head) rows that read one KV head: each block of keys and of values is copied (bf16: widened) to
// fp32 once, prefetched a block ahead, and read from L1 by every row. Each row's arithmetic is the one of a row
// alone: its query and output accumulate in registers; a score is 8-lane FMAs over the head dimension in order, then
// hsum (4 slots at a time, 4 independent chains); the softmax sum is :func:`visible_sum`'s and the values run over
// the visible slots in slot order. How rows are grouped (by thread count, by the number of queries) therefore never changes a result.
template <int HD8, typename T, typename O>
void attend_fixed(const float* q, const T* keys, const T* values, const int64_t* ks, const int64_t* vs,
                  const bool* mask, int64_t B, int64_t Tn, int64_t H, int64_t KV, int64_t S, float scale, O* out) {
  constexpr int64_t hd = HD8 * 8;
  constexpr int NV = hd / kLanes;  // vectors per head
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
        widen_block<HD8>(kb, ks[2], s0, n, S, kBlock, kbuf.data());
        const float* kp = kbuf.data();
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t t = r / groups, h = kvh * groups + r % groups;
          const float* qv = q + ((b * Tn + t) * H + h) * hd;
          float* sc = &score[(r - r0) * (S + 8) + s0];
          V qr[NV];
          for (int i = 0; i < NV; ++i) qr[i] = vload(qv + i * kLanes);
          int64_t j = 0;
          for (; j + 4 <= n; j += 4) {
            V dot[4] = {vzero(), vzero(), vzero(), vzero()};
            for (int i = 0; i < NV; ++i)
              for (int u = 0; u < 4; ++u) dot[u] = vfma(qr[i], vload(kp + (j + u) * hd + i * kLanes), dot[u]);
            for (int u = 0; u < 4; ++u) sc[j + u] = vsum(dot[u]) * scale;
          }
          for (; j < n; ++j) {
            V dot = vzero();
            for (int i = 0; i < NV; ++i) dot = vfma(qr[i], vload(kp + j * hd + i * kLanes), dot);
            sc[j] = vsum(dot) * scale;
          }
        }
      }
      // the first block of values, read while the softmax runs
      for (int64_t j = 0; j < std::min(kBlock, S); ++j) prefetch_row(vb + j * vs[2], hd);
      // softmax numerators e^(score - max over the visible slots), and their sum (:func:`visible_sum`)
      for (int64_t r = r0; r < r1; ++r) {
        float* sc = &score[(r - r0) * (S + 8)];
        const bool* visible = mask ? mask + (r / groups) * S : nullptr;
        const __m256 shift = _mm256_set1_ps(visible_max(sc, visible, S));
        for (int64_t s = 0; s < S; s += 8) _mm256_storeu_ps(&sc[s], exp8(_mm256_sub_ps(_mm256_loadu_ps(&sc[s]), shift)));
        total[r - r0] = visible_sum(sc, visible, S);
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      // pass 2: values, a block at a time, each row's accumulators in registers across the block
      for (int64_t s0 = 0; s0 < S; s0 += kBlock) {
        const int64_t n = std::min(kBlock, S - s0);
        widen_block<HD8>(vb, vs[2], s0, n, S, kBlock, vbuf.data());
        const float* vp = vbuf.data();
        for (int64_t r = r0; r < r1; ++r) {
          const float* sc = &score[(r - r0) * (S + 8) + s0];
          const bool* visible = mask ? mask + (r / groups) * S + s0 : nullptr;
          float* a = &acc[(r - r0) * hd];
          V ar[NV];
          for (int i = 0; i < NV; ++i) ar[i] = vload(a + i * kLanes);
          for (int64_t j = 0; j < n; ++j) {
            if (visible && !visible[j]) continue;
            const V p = vset1(sc[j]);
            for (int i = 0; i < NV; ++i) ar[i] = vfma(p, vload(vp + j * hd + i * kLanes), ar[i]);
          }
          for (int i = 0; i < NV; ++i) vstore(a + i * kLanes, ar[i]);
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
