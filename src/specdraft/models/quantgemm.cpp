// Products of a few rows with GGUF block-quantized weights (Q4_0, Q4_1, Q8_0), read as they ship: out (M, N) =
// x (M, K) @ w (N, K)^T for the 1 to ~64 rows of a batch-1 decode step, verify or token tree, and (more slowly
// per row) a prompt's prefill.
//
// As in llama.cpp (ggml's vec_dot_q4_1_q8_1 and friends), each row of x is quantized to int8 per block of 32, with
// one fp32 scale dx per block (dx = max|x| / 127, q = round(x / dx)) and the block's integer sum s = sum(q); a weight
// block of 32 is (dw, mw, 4-bit q) for Q4_1 (w = dw q + mw), (dw, 4-bit q) for Q4_0 (w = dw (q - 8)) and (dw, int8 q)
// for Q8_0 (w = dw q). A block's dot product is an exact integer, sumi = sum(qw qx), and the output element is
// accumulated in fp32 block by block in order from zero:
//   Q4_1: acc = fma(float(sumi) * dx, dw, acc); acc = fma(mw, dx * float(s), acc)
//   Q4_0: acc = fma(float(sumi - 8 s) * dx, dw, acc)
//   Q8_0: acc = fma(float(sumi) * dx, dw, acc)
// The integer part is exact in any order, and the float part is the same instruction sequence for every element
// whatever the number of rows, the tile they are grouped in, the thread that computes them or the CPU's vector width:
// a k-token forward reproduces k 1-token forwards bit for bit, and the AVX-512 VNNI kernel (vpdpbusd, u8 x s8 into
// int32) and the AVX2 one (vpmaddubsw + vpmaddwd) give identical results.
//
// Packed layout (pack_blocks in quantized.py): groups of 16 output columns; for each group and block of 32, the 16
// scales dw as fp16, (Q4_1) the 16 minima mw as fp16, then the quants, one 32-bit lane per column: lane j of the
// 64-byte chunk t holds column j's weights k = 4t .. 4t + 3 (Q8_0: 8 chunks, bytes biased by +128 to u8) or (Q4: 4
// chunks) k = 4t .. 4t + 3 in the low nibbles and k = 16 + 4t .. 16 + 4t + 3 in the high ones. A broadcast of 4
// bytes of x then multiplies 16 columns at once. A group's blocks are one sequential stream.
#include "quantkernels.h"

#include <atomic>
#include <cstring>

namespace {

constexpr int64_t kGroup = 16;  // output columns per group
constexpr int64_t kBlock = 32;  // weights per block
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;  // ggml's type ids

constexpr int64_t block_bytes(int64_t kind) {  // one group's block: scales (and minima), then quants
  return kind == kQ4_1 ? 64 + 256 : kind == kQ4_0 ? 32 + 256 : 32 + 512;
}
constexpr int64_t quant_offset(int64_t kind) { return kind == kQ4_1 ? 64 : 32; }

// x quantized per block of 32 (row-major, nb = K / 32 blocks a row).
struct Rows {
  const int8_t* q;    // (M, K)
  const float* d;     // (M, nb) scale dx
  const float* ds;    // (M, nb) dx * float(s), Q4_1's minimum term
  const int32_t* s;   // (M, nb) integer sum of the block's quants
  int64_t K, nb;
};

// Each row's blocks: dx = max|x| / 127, q = round-to-nearest-even(x / dx) (as x * (1 / dx)), the same for any
// grouping of rows. 8 lanes at a time: a maximum and an integer sum are exact in any order, and each quant is one
// product and one conversion under the default rounding mode, as std::nearbyint would give.
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* ds, int32_t* s) {
  const int64_t nb = K / kBlock;
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * K + b * kBlock;
      __m256 v[4], top = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        top = _mm256_max_ps(top, _mm256_and_ps(v[i], magnitude));
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, top);
      const float amax = *std::max_element(lanes, lanes + 8);
      const float dx = amax / 127.0f, inv = dx != 0.0f ? 1.0f / dx : 0.0f;
      const __m256 scale = _mm256_set1_ps(inv);
      const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
      __m256i sum = _mm256_setzero_si256();
      alignas(32) int32_t ints[kBlock];
      for (int i = 0; i < 4; ++i) {
        __m256i n = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], scale));
        n = _mm256_min_epi32(_mm256_max_epi32(n, lo), hi);
        sum = _mm256_add_epi32(sum, n);
        _mm256_store_si256(reinterpret_cast<__m256i*>(ints + 8 * i), n);
      }
      int8_t* qb = q + r * K + b * kBlock;
      for (int64_t i = 0; i < kBlock; ++i) qb[i] = static_cast<int8_t>(ints[i]);
      alignas(32) int32_t parts[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(parts), sum);
      int32_t total = 0;
      for (int i = 0; i < 8; ++i) total += parts[i];
      d[r * nb + b] = dx;
      s[r * nb + b] = total;
      ds[r * nb + b] = dx * static_cast<float>(total);
    }
  }
}

inline int32_t four(const int8_t* p) {  // 4 bytes of x as one 32-bit lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// ---- AVX2 (vpmaddubsw + vpmaddwd), register-blocked over the R <= 6 rows of a tile: a group's 16 columns are two
// vectors of 8, each 64-byte chunk of quants is loaded and its nibbles unpacked once for all R rows, and each row's 4
// bytes of x are broadcast once for both halves. The group's stream is prefetched kPrefetch blocks ahead (the next
// group follows in memory), so the loads of the next blocks overlap the products of this one.
constexpr int64_t kPrefetch = 8;

template <typename V>
inline void pin(V& v) {  // keeps GCC from reassociating a row's int16 sums into one wide tree (it spills registers)
  asm("" : "+x"(v));
}

inline void prefetch_ahead(const uint8_t* blk, int64_t bytes) {  // one block's lines, kPrefetch blocks on
  for (int64_t line = 0; line < bytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetch * bytes + line), _MM_HINT_T0);
}

template <int R, int64_t KIND>
__attribute__((noinline)) void tile4_avx2(const uint8_t* w, const Rows& a, int64_t r0, float* out, int64_t N, int64_t n0) {
  constexpr int64_t BB = block_bytes(KIND), QO = quant_offset(KIND);
  const int64_t nb = a.nb, K = a.K;
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const int8_t* xq = a.q + r0 * K;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * BB;
    prefetch_ahead(blk, BB);  // past the last group's end: harmless
    // 4-bit weights (<= 15) times int8 (|x| <= 127): a pair is at most 3810, so the 8 pair sums of a block add up
    // in 16 bits (<= 30480) before one widening to 32 bits per row
    __m256i p0[R], p1[R];
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + QO + 64 * t));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + QO + 64 * t + 32));
      const __m256i lo0 = _mm256_and_si256(w0, low4), hi0 = _mm256_and_si256(_mm256_srli_epi16(w0, 4), low4);
      const __m256i lo1 = _mm256_and_si256(w1, low4), hi1 = _mm256_and_si256(_mm256_srli_epi16(w1, 4), low4);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = xq + r * K + b * kBlock;
        const __m256i xl = _mm256_set1_epi32(four(xr + 4 * t)), xh = _mm256_set1_epi32(four(xr + 16 + 4 * t));
        __m256i s0 = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, xl), _mm256_maddubs_epi16(hi0, xh));
        __m256i s1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo1, xl), _mm256_maddubs_epi16(hi1, xh));
        if (t) {
          s0 = _mm256_add_epi16(p0[r], s0);
          s1 = _mm256_add_epi16(p1[r], s1);
        }
        pin(s0);
        pin(s1);
        p0[r] = s0;
        p1[r] = s1;
      }
    }
    const __m256 dw0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    const __m256 dw1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
    __m256 mw0 = _mm256_setzero_ps(), mw1 = mw0;
    if constexpr (KIND == kQ4_1) {
      mw0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32)));
      mw1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 48)));
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * nb + b;
      __m256i t0 = _mm256_madd_epi16(p0[r], ones), t1 = _mm256_madd_epi16(p1[r], ones);
      if constexpr (KIND == kQ4_0) {
        const __m256i s8 = _mm256_set1_epi32(8 * a.s[at]);
        t0 = _mm256_sub_epi32(t0, s8);
        t1 = _mm256_sub_epi32(t1, s8);
      }
      const __m256 dx = _mm256_set1_ps(a.d[at]);
      acc[r][0] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(t0), dx), dw0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(t1), dx), dw1, acc[r][1]);
      if constexpr (KIND == kQ4_1) {
        const __m256 ds = _mm256_set1_ps(a.ds[at]);
        acc[r][0] = _mm256_fmadd_ps(mw0, ds, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(mw1, ds, acc[r][1]);
      }
    }
  }
  const int64_t live = std::min<int64_t>(kGroup, N - n0);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    alignas(32) float lanes[16];
    _mm256_store_ps(lanes, acc[r][0]);
    _mm256_store_ps(lanes + 8, acc[r][1]);
    std::memcpy(out + (r0 + r) * N + n0, lanes, live * sizeof(float));
  }
}

// Q8_0 the same way: |w| u8 times sign(x, w) s8 in pairs (|pair| <= 2 * 128 * 127 fits int16), widened per chunk.
template <int R>
__attribute__((noinline)) void tile8_avx2(const uint8_t* w, const Rows& a, int64_t r0, float* out, int64_t N, int64_t n0) {
  constexpr int64_t BB = block_bytes(kQ8_0), QO = quant_offset(kQ8_0);
  const int64_t nb = a.nb, K = a.K;
  const __m256i ones = _mm256_set1_epi16(1), bias8 = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const int8_t* xq = a.q + r0 * K;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * BB;
    prefetch_ahead(blk, BB);  // past the last group's end: harmless
    __m256i i0[R], i1[R];
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      const __m256i ws0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + QO + 64 * t)), bias8);
      const __m256i ws1 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + QO + 64 * t + 32)), bias8);
      const __m256i wa0 = _mm256_abs_epi8(ws0), wa1 = _mm256_abs_epi8(ws1);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256i xb = _mm256_set1_epi32(four(xq + r * K + b * kBlock + 4 * t));
        __m256i s0 = _mm256_madd_epi16(_mm256_maddubs_epi16(wa0, _mm256_sign_epi8(xb, ws0)), ones);
        __m256i s1 = _mm256_madd_epi16(_mm256_maddubs_epi16(wa1, _mm256_sign_epi8(xb, ws1)), ones);
        if (t) {
          s0 = _mm256_add_epi32(i0[r], s0);
          s1 = _mm256_add_epi32(i1[r], s1);
        }
        pin(s0);
        pin(s1);
        i0[r] = s0;
        i1[r] = s1;
      }
    }
    const __m256 dw0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    const __m256 dw1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 dx = _mm256_set1_ps(a.d[(r0 + r) * nb + b]);
      acc[r][0] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(i0[r]), dx), dw0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(i1[r]), dx), dw1, acc[r][1]);
    }
  }
  const int64_t live = std::min<int64_t>(kGroup, N - n0);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    alignas(32) float lanes[16];
    _mm256_store_ps(lanes, acc[r][0]);
    _mm256_store_ps(lanes + 8, acc[r][1]);
    std::memcpy(out + (r0 + r) * N + n0, lanes, live * sizeof(float));
  }
}

template <int R, int64_t KIND>
inline void tile_avx2(const uint8_t* w, const Rows& a, int64_t r0, float* out, int64_t N, int64_t n0) {
  if constexpr (KIND == kQ8_0)
    tile8_avx2<R>(w, a, r0, out, N, n0);
  else
    tile4_avx2<R, KIND>(w, a, r0, out, N, n0);
}

// ---- AVX-512 VNNI: 16 columns a vector, vpdpbusd (u8 weights x s8 x, 4 products a lane into int32).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c,fma")
template <int R, int64_t KIND>
void tile_vnni(const uint8_t* w, const Rows& a, int64_t r0, float* out, int64_t N, int64_t n0) {
  constexpr int64_t BB = block_bytes(KIND), QO = quant_offset(KIND);
  const int64_t nb = a.nb, K = a.K;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * BB;
    _mm_prefetch(reinterpret_cast<const char*>(blk + 8 * BB), _MM_HINT_T0);  // past the group's end: harmless
    _mm_prefetch(reinterpret_cast<const char*>(blk + 8 * BB + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(blk + 8 * BB + 128), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(blk + 8 * BB + 192), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(blk + 8 * BB + 256), _MM_HINT_T0);
    __m512i isum[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    if constexpr (KIND == kQ8_0) {
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
        const __m512i wu = _mm512_loadu_si512(blk + QO + 64 * t);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
          isum[r] = _mm512_dpbusd_epi32(isum[r], wu, _mm512_set1_epi32(four(a.q + (r0 + r) * K + b * kBlock + 4 * t)));
      }
    } else {
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {
        const __m512i wq = _mm512_loadu_si512(blk + QO + 64 * t);
        const __m512i lo = _mm512_and_si512(wq, low4), hi = _mm512_and_si512(_mm512_srli_epi16(wq, 4), low4);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = a.q + (r0 + r) * K + b * kBlock;
          isum[r] = _mm512_dpbusd_epi32(isum[r], lo, _mm512_set1_epi32(four(xr + 4 * t)));
          isum[r] = _mm512_dpbusd_epi32(isum[r], hi, _mm512_set1_epi32(four(xr + 16 + 4 * t)));
        }
      }
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
    __m512 mw = _mm512_setzero_ps();
    if constexpr (KIND == kQ4_1) mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * nb + b;
      __m512i total = isum[r];
      if constexpr (KIND == kQ4_0) total = _mm512_sub_epi32(total, _mm512_set1_epi32(8 * a.s[at]));
      if constexpr (KIND == kQ8_0) total = _mm512_sub_epi32(total, _mm512_set1_epi32(128 * a.s[at]));  // the +128 bias
      const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(total), _mm512_set1_ps(a.d[at]));
      acc[r] = _mm512_fmadd_ps(f, dw, acc[r]);
      if constexpr (KIND == kQ4_1) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.ds[at]), acc[r]);
    }
  }
  const int64_t live = std::min<int64_t>(kGroup, N - n0);
  const __mmask16 keep = static_cast<__mmask16>((1u << live) - 1u);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + (r0 + r) * N + n0, keep, acc[r]);
}
#pragma GCC pop_options

// Every row against one group, in as few tiles of at most 6 rows as it takes, as even as they come (a later tile
// reads the group from cache).
template <int64_t KIND>
void group_rows(const uint8_t* w, const Rows& a, int64_t M, float* out, int64_t N, int64_t n0, bool vnni) {
  for (int64_t m = 0; m < M;) {
    const int64_t left = M - m, tiles = (left + 5) / 6, mb = (left + tiles - 1) / tiles;
#define SPECDRAFT_TILE(R)                                  \
  if (vnni)                                                \
    tile_vnni<R, KIND>(w, a, m, out, N, n0);               \
  else                                                     \
    tile_avx2<R, KIND>(w, a, m, out, N, n0);               \
  break;
    switch (mb) {
      case 1: SPECDRAFT_TILE(1)
      case 2: SPECDRAFT_TILE(2)
      case 3: SPECDRAFT_TILE(3)
      case 4: SPECDRAFT_TILE(4)
      case 5: SPECDRAFT_TILE(5)
      default: SPECDRAFT_TILE(6)
    }
#undef SPECDRAFT_TILE
    m += mb;
  }
}

// The groups one thread has yet to compute, [next, end), in one word: its owner takes them from the front, a thread
// that has finished its own run takes them from the back, one group at a time.
struct alignas(64) Span {
  std::atomic<uint64_t> word;
  static uint64_t pack(int64_t next, int64_t end) {
    return static_cast<uint64_t>(next) | static_cast<uint64_t>(end) << 32;
  }
  // Up to n groups from the front (the owner) or the back (another thread) into [*g0, *g1); false when none is left.
  bool take(int64_t n, bool front, int64_t* g0, int64_t* g1) {
    uint64_t seen = word.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t next = static_cast<int64_t>(seen & 0xffffffffu), end = static_cast<int64_t>(seen >> 32);
      if (next >= end) return false;
      const int64_t cut = front ? std::min(end, next + n) : std::max(next, end - n);
      if (word.compare_exchange_weak(seen, front ? pack(cut, end) : pack(next, cut), std::memory_order_relaxed)) {
        *g0 = front ? next : cut;
        *g1 = front ? cut : end;
        return true;
      }
    }
  }
};

constexpr int kMaxThreads = 64;  // threads that take part in one product's balancing (more run static runs)
constexpr int64_t kMinGroups = 4;  // groups a thread gets at least: fewer run on fewer threads

// Each thread computes one contiguous run of groups (its stream of weight blocks read in order). With several rows
// (a verify, a tree, a prefill chunk) the arithmetic outweighs the stream and equal runs finish apart (a 5-token
// forward's products on a 2-core AMD EPYC Zen 3: one thread idle at the end for 15% of a product's time, on average),
// so there a thread that has finished its run goes on with the other runs' last groups (Span). A group is computed
// whole by one thread, with the instructions it always has, so results do not depend on who computes it.
template <int64_t KIND>
void product(const uint8_t* w, const Rows& a, int64_t M, int64_t N, float* out, bool vnni) {
  const int64_t groups = (N + kGroup - 1) / kGroup, stride = a.nb * block_bytes(KIND);
  auto run = [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) group_rows<KIND>(w + g * stride, a, M, out, N, g * kGroup, vnni);
  };
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (groups + kMinGroups - 1) / kMinGroups);
  if (M == 1 || threads <= 1 || threads > kMaxThreads) {  // one row: the stream is the cost, static runs measure best
    at::parallel_for(0, groups, kMinGroups, [&](int64_t begin, int64_t end) { run(begin, end); });
    return;
  }
  Span spans[kMaxThreads];
  for (int64_t t = 0; t < threads; ++t)
    spans[t].word.store(Span::pack(groups * t / threads, groups * (t + 1) / threads), std::memory_order_relaxed);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    int64_t g0, g1;
    for (int64_t t = begin; t < end; ++t) {
      while (spans[t].take(2, true, &g0, &g1)) run(g0, g1);
      for (int64_t o = 1; o < threads; ++o)
        while (spans[(t + o) % threads].take(1, false, &g0, &g1)) run(g0, g1);
    }
  });
}

void check_packed(const at::Tensor& packed, int64_t kind, int64_t K, int64_t N) {
  TORCH_CHECK(kind == kQ4_0 || kind == kQ4_1 || kind == kQ8_0, "quantgemm: kind must be Q4_0 (2), Q4_1 (3) or Q8_0 (8)");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous() &&
                  packed.size(2) == block_bytes(kind),
              "quantgemm: weight must come from quantized.pack_blocks");
  TORCH_CHECK(K % kBlock == 0 && packed.size(1) * kBlock == K && N >= 1 && N <= packed.size(0) * kGroup,
              "quantgemm: input does not match the weight");
}

}  // namespace

namespace specdraft_quant {

void multiply(const float* x, int64_t M, int64_t K, const at::Tensor& packed, int64_t kind, int64_t N, float* out,
              bool vnni) {
  check_packed(packed, kind, K, N);
  const int64_t nb = K / kBlock;
  const auto q = specdraft_rows::scratch<int8_t>(M * K);
  const auto d = specdraft_rows::scratch<float>(M * nb), ds = specdraft_rows::scratch<float>(M * nb);
  const auto s = specdraft_rows::scratch<int32_t>(M * nb);
  specdraft_rows::over_rows(M, [&](int64_t begin, int64_t end) {
    quantize_rows(x + begin * K, end - begin, K, q.get() + begin * K, d.get() + begin * nb, ds.get() + begin * nb,
                  s.get() + begin * nb);
  });
  const Rows a{q.get(), d.get(), ds.get(), s.get(), K, nb};
  const uint8_t* w = packed.data_ptr<uint8_t>();
  if (kind == kQ4_1)
    product<kQ4_1>(w, a, M, N, out, vnni);
  else if (kind == kQ4_0)
    product<kQ4_0>(w, a, M, N, out, vnni);
  else
    product<kQ8_0>(w, a, M, N, out, vnni);
}

}  // namespace specdraft_quant

namespace {

// x (..., K) -> (..., N) fp32.
at::Tensor linear(const at::Tensor& input, const at::Tensor& packed, int64_t kind, int64_t N, int64_t mode) {
  TORCH_CHECK(input.scalar_type() == at::kFloat || input.scalar_type() == at::kBFloat16,
              "quantgemm: input must be float32 or bfloat16");
  const int64_t K = input.size(-1);
  check_packed(packed, kind, K, N);
  const at::Tensor x = input.reshape({-1, K}).to(at::kFloat).contiguous();  // (M, K)
  const int64_t M = x.size(0);
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty({M, N}, input.options().dtype(at::kFloat));
  if (M == 0) return out.view(shape);
  specdraft_quant::multiply(x.data_ptr<float>(), M, K, packed, kind, N, out.data_ptr<float>(), mode >= 1);
  return out.view(shape);
}

// Rows `ids` of the weight, dequantized to fp32 exactly (w = dw q + mw, dw (q - 8) or dw q, each one rounding):
// (T,) -> (T, K). An embedding lookup in a quantized table, and the dense copy tests compare with.
at::Tensor rows(const at::Tensor& packed, int64_t kind, int64_t K, int64_t N, const at::Tensor& ids) {
  check_packed(packed, kind, K, N);
  const at::Tensor index = ids.reshape({-1}).to(at::kLong).contiguous();
  const int64_t T = index.size(0), nb = K / kBlock, BB = block_bytes(kind), QO = quant_offset(kind);
  at::Tensor out = at::empty({T, K}, packed.options().dtype(at::kFloat));
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const int64_t* idp = index.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(idp[t] >= 0 && idp[t] < N, "quantgemm: row index out of range");
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = idp[t], j = n % kGroup;
      const uint8_t* g = w + (n / kGroup) * nb * BB;
      float* o = out.data_ptr<float>() + t * K;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = g + b * BB;
        uint16_t half;
        std::memcpy(&half, blk + 2 * j, 2);
        const float dw = c10::detail::fp16_ieee_to_fp32_value(half);
        float mw = 0.0f;
        if (kind == kQ4_1) {
          std::memcpy(&half, blk + 32 + 2 * j, 2);
          mw = c10::detail::fp16_ieee_to_fp32_value(half);
        }
        for (int64_t k = 0; k < kBlock; ++k) {
          float v;
          if (kind == kQ8_0) {
            v = dw * static_cast<float>(static_cast<int>(blk[QO + 64 * (k / 4) + 4 * j + k % 4]) - 128);
          } else {
            const int64_t kk = k % 16;
            const uint8_t byte = blk[QO + 64 * (kk / 4) + 4 * j + kk % 4];
            const int qv = k < 16 ? (byte & 0x0F) : (byte >> 4);
            v = kind == kQ4_1 ? dw * static_cast<float>(qv) + mw : dw * static_cast<float>(qv - 8);  // as ggml: two roundings
          }
          o[b * kBlock + k] = v;
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdraft_rowgemm, m) {
  m.def("qlinear(Tensor input, Tensor packed, int kind, int n, int mode) -> Tensor");
  m.def("qrows(Tensor packed, int kind, int k, int n, Tensor ids) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdraft_rowgemm, CPU, m) {
  m.impl("qlinear", &linear);
  m.impl("qrows", &rows);
}
