// One pre-norm Llama decoder layer on block-quantized weights for the T <= 64 new tokens of a batch-1 step, verify or
// tree, in one call: the ~15 eager ops of a layer cost more dispatch than arithmetic at these sizes (a 1-token step of
// SmolLM2 runs 30 layers). Every piece computes each token on its own with a fixed instruction sequence (RMSNorm with
// one left-to-right sum per token, rotary embedding per element, quantgemm's products, rowattention's attention,
// SiLU per element), so a k-token call reproduces k 1-token calls bit for bit, as the layer-by-layer path does.
//
//   x = x + o(attention(rope(q), cache <- (rope(k), v)))      with q, k, v = qkv(rmsnorm(x, attn_norm))
//   x = x + down(silu(gate) * up)                              with gate, up = gate_up(rmsnorm(x, mlp_norm))
#include "quantkernels.h"

#include <cstring>

namespace {

using specdraft_rows::exp8;

// silu(gate) * up = gate / (1 + e^-gate) * up for each token's F pairs (F a multiple of 8).
void silu_mul(const float* gate_up, int64_t T, int64_t F, float* out) {
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < F; i += 8) {
      const __m256 g = _mm256_loadu_ps(gate_up + t * 2 * F + i), u = _mm256_loadu_ps(gate_up + t * 2 * F + F + i);
      const __m256 e = exp8(_mm256_sub_ps(zero, g));
      _mm256_storeu_ps(out + t * F + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u));
    }
}

// y = x * (1 / sqrt(mean(x^2) + eps)) * w, per row of D; the sum of squares in one order (left to right). Up to 8
// rows run side by side: each row's chain of additions is its own, so their latencies overlap and the sums are those
// of a row alone.
void rms_norm(const float* x, int64_t T, int64_t D, const float* w, float eps, float* y) {
  for (int64_t t0 = 0; t0 < T; t0 += 8) {
    const int64_t n = std::min<int64_t>(8, T - t0);
    float sum[8] = {};
    for (int64_t i = 0; i < D; ++i)
      for (int64_t t = 0; t < n; ++t) {
        const float v = x[(t0 + t) * D + i];
        sum[t] += v * v;
      }
    for (int64_t t = t0; t < t0 + n; ++t) {
      const float* xr = x + t * D;
      const float inv = 1.0f / std::sqrt(sum[t - t0] / static_cast<float>(D) + eps);
      for (int64_t i = 0; i < D; ++i) y[t * D + i] = (xr[i] * inv) * w[i];
    }
  }
}

// Qwen3's per-head RMSNorm of the queries or keys (q_norm, k_norm, weight (hd,)), in place on `count` heads of hd
// starting at head `first` of each token's qkv row, before the rotary embedding; each head one rms_norm row.
void head_norm(float* qkv, int64_t T, int64_t width, int64_t first, int64_t count, int64_t hd, const float* w,
               float eps) {
  for (int64_t t = 0; t < T; ++t) {
    float* heads = qkv + t * width + first * hd;
    rms_norm(heads, count, hd, w, eps, heads);  // each head reads its sum before any of its values is written
  }
}

// transformers' half-split rotary embedding, in place on `heads` heads of hd starting at row offset `first` (in
// units of hd) of each token's qkv row: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
void rotate(float* qkv, int64_t T, int64_t width, int64_t first, int64_t heads, int64_t hd, const float* cos,
            const float* sin) {
  const int64_t half = hd / 2;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      float* v = qkv + t * width + (first + h) * hd;
      const float* c = cos + t * half;
      const float* s = sin + t * half;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = v[i], x2 = v[i + half];
        v[i] = x1 * c[i] - x2 * s[i];
        v[i + half] = x2 * c[i] + x1 * s[i];
      }
    }
}

// Stores n floats as the cache's element type: fp32 as they are, fp16 and bf16 rounded to nearest even (as torch's
// copy_ rounds them, so the layer-by-layer path writes the same cache).
inline void store_row(const float* src, int64_t n, float* dst) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_row(const float* src, int64_t n, c10::Half* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) dst[i] = c10::Half(src[i]);
}
inline void store_row(const float* src, int64_t n, c10::BFloat16* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = c10::BFloat16(src[i]);
}

// This step's keys and values (each token's qkv row holds them after the queries) into slots start .. start + T - 1.
template <typename E>
void write_cache(const float* qkv, int64_t T, int64_t width, int64_t heads, int64_t kv_heads, int64_t hd, int64_t S,
                 int64_t start, E* kp, E* vp) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < kv_heads; ++h) {
      const float* row = qkv + t * width;
      store_row(row + (heads + h) * hd, hd, kp + (h * S + start + t) * hd);
      store_row(row + (heads + kv_heads + h) * hd, hd, vp + (h * S + start + t) * hd);
    }
}

// The layer for B sequences of T new tokens each (rows of a batched cache, padded to a common T): hidden (B, T, D)
// fp32 -> (B, T, D). Sequence b's tokens are written into slots starts[b] .. starts[b] + T - 1 of cache row rows[b]
// of keys / values (R, KV, S, hd), fp32, fp16 or bf16 (the model's cache format), and attend that row's slots up to
// their own under mask[b] (T, >= starts[b] + T) bool, or every one of them (no mask). cos, sin (B * T, hd/2) the
// angles of each token's position. The norms, products, rotary embedding and SiLU run over all B * T tokens at once
// and the attention over each sequence's own cache, each token with the instruction sequence of a 1-token batch-1
// step: a sequence's result does not depend on the others in the batch, bit for bit.
at::Tensor layer_rows(const at::Tensor& hidden, at::TensorList weights, at::IntArrayRef kinds,
                      const at::Tensor& attn_norm, const at::Tensor& mlp_norm, double eps, const at::Tensor& keys,
                      const at::Tensor& values, at::IntArrayRef rows, at::IntArrayRef starts, const at::Tensor& cos,
                      const at::Tensor& sin, const c10::optional<at::Tensor>& mask, int64_t heads, int64_t kv_heads,
                      int64_t qmode, int64_t amode, const c10::optional<at::Tensor>& q_norm,
                      const c10::optional<at::Tensor>& k_norm, bool kv_only) {
  TORCH_CHECK(hidden.dim() == 3 && hidden.scalar_type() == at::kFloat, "quantlayer: hidden must be (B, T, D) float32");
  TORCH_CHECK(weights.size() == 4 && kinds.size() == 4, "quantlayer: four weights (qkv, o, gate_up, down)");
  const auto kv_type = keys.scalar_type();
  TORCH_CHECK((kv_type == at::kFloat || kv_type == at::kHalf || kv_type == at::kBFloat16) &&
                  values.scalar_type() == kv_type && keys.dim() == 4 && keys.is_contiguous() &&
                  values.is_contiguous() && keys.sizes() == values.sizes(),
              "quantlayer: the cache must be (R, KV, S, hd) float32, float16 or bfloat16");
  const int64_t B = hidden.size(0), T = hidden.size(1), D = hidden.size(2), hd = keys.size(3), S = keys.size(2);
  const int64_t R = keys.size(0), N = B * T, width = (heads + 2 * kv_heads) * hd, ffn = weights[3].size(1) * 32;
  TORCH_CHECK(static_cast<int64_t>(rows.size()) == B && static_cast<int64_t>(starts.size()) == B,
              "quantlayer: one cache row and start per sequence");
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(rows[b] >= 0 && rows[b] < R && starts[b] >= 0 && starts[b] + T <= S,
                "quantlayer: a sequence's cache row or positions lie outside the cache");
  TORCH_CHECK(keys.size(1) == kv_heads && cos.numel() == N * (hd / 2) && sin.numel() == cos.numel(),
              "quantlayer: cache, positions and angles do not match");
  if (mask.has_value())
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 3 && mask->size(0) == B && mask->size(1) == T,
                "quantlayer: the mask must be (B, T, S) bool");
  at::Tensor x = hidden.contiguous().clone();  // (B, T, D): the residual stream, updated in place
  float* xp = x.data_ptr<float>();
  const at::Tensor c = cos.to(at::kFloat).contiguous(), s = sin.to(at::kFloat).contiguous();
  const at::Tensor an = attn_norm.to(at::kFloat).contiguous(), mn = mlp_norm.to(at::kFloat).contiguous();
  const bool vnni = qmode >= 1;
  using specdraft_rows::over_rows;
  const auto normed = specdraft_rows::scratch<float>(N * D), qkv = specdraft_rows::scratch<float>(N * width);
  const auto delta = specdraft_rows::scratch<float>(N * D), gate_up = specdraft_rows::scratch<float>(N * 2 * ffn);
  const auto act = specdraft_rows::scratch<float>(N * ffn);
  auto norm_rows = [&](const at::Tensor& weight) {  // normed = rmsnorm(x, weight), row by row
    over_rows(N, [&](int64_t begin, int64_t end) {
      rms_norm(xp + begin * D, end - begin, D, weight.data_ptr<float>(), static_cast<float>(eps),
               normed.get() + begin * D);
    });
  };
  auto add_delta = [&]() {  // the residual stream x += delta
    over_rows(N, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin * D; i < end * D; ++i) xp[i] += delta[i];
    });
  };

  norm_rows(an);
  specdraft_quant::multiply(normed.get(), N, D, weights[0], kinds[0], width, qkv.get(), vnni);
  for (const auto& [norm, first, count] : {std::tuple{&q_norm, int64_t{0}, heads}, std::tuple{&k_norm, heads, kv_heads}})
    if (norm->has_value()) {
      TORCH_CHECK((*norm)->numel() == hd, "quantlayer: q_norm and k_norm hold head_dim weights");
      const at::Tensor w = (*norm)->to(at::kFloat).contiguous();
      over_rows(N, [&](int64_t begin, int64_t end) {
        head_norm(qkv.get() + begin * width, end - begin, width, first, count, hd, w.data_ptr<float>(),
                  static_cast<float>(eps));
      });
    }
  over_rows(N, [&](int64_t begin, int64_t end) {
    rotate(qkv.get() + begin * width, end - begin, width, 0, heads + kv_heads, hd,
           c.data_ptr<float>() + begin * (hd / 2), s.data_ptr<float>() + begin * (hd / 2));
  });
  const int64_t row_elems = kv_heads * S * hd;
  for (int64_t b = 0; b < B; ++b) {
    over_rows(T, [&](int64_t t0, int64_t t1) {
      const float* src = qkv.get() + (b * T + t0) * width;
      const int64_t first = starts[b] + t0;
      if (kv_type == at::kHalf)
        write_cache(src, t1 - t0, width, heads, kv_heads, hd, S, first,
                    keys.data_ptr<c10::Half>() + rows[b] * row_elems, values.data_ptr<c10::Half>() + rows[b] * row_elems);
      else if (kv_type == at::kBFloat16)
        write_cache(src, t1 - t0, width, heads, kv_heads, hd, S, first,
                    keys.data_ptr<c10::BFloat16>() + rows[b] * row_elems,
                    values.data_ptr<c10::BFloat16>() + rows[b] * row_elems);
      else
        write_cache(src, t1 - t0, width, heads, kv_heads, hd, S, first, keys.data_ptr<float>() + rows[b] * row_elems,
                    values.data_ptr<float>() + rows[b] * row_elems);
    });
  }
  if (kv_only) return hidden;
  const auto attended = specdraft_rows::scratch<float>(N * heads * hd);
  at::Tensor visible;  // (B, T, >= S) bool, rows contiguous
  if (mask.has_value()) visible = mask->contiguous();
  const int64_t es = static_cast<int64_t>(keys.element_size());
  const int64_t kv_strides[3] = {row_elems, S * hd, hd};
  for (int64_t b = 0; b < B; ++b) {
    const int64_t seen_slots = starts[b] + T;
    const bool* mp = nullptr;
    if (visible.defined()) {
      TORCH_CHECK(visible.size(2) >= seen_slots, "quantlayer: the mask must cover each sequence's slots");
      mp = visible.data_ptr<bool>() + b * visible.stride(0);
    }
    specdraft_rows::attend_rows(qkv.get() + b * T * width, width,
                                static_cast<const char*>(keys.data_ptr()) + rows[b] * row_elems * es,
                                static_cast<const char*>(values.data_ptr()) + rows[b] * row_elems * es, kv_type,
                                kv_strides, kv_strides, mp, mp ? visible.stride(1) : 0, T, heads, kv_heads,
                                seen_slots, hd, static_cast<float>(std::pow(hd, -0.5)), amode,
                                attended.get() + b * T * heads * hd);
  }
  specdraft_quant::multiply(attended.get(), N, heads * hd, weights[1], kinds[1], D, delta.get(), vnni);
  add_delta();

  norm_rows(mn);
  specdraft_quant::multiply(normed.get(), N, D, weights[2], kinds[2], 2 * ffn, gate_up.get(), vnni);
  over_rows(N, [&](int64_t begin, int64_t end) {
    silu_mul(gate_up.get() + begin * 2 * ffn, end - begin, ffn, act.get() + begin * ffn);
  });
  specdraft_quant::multiply(act.get(), N, ffn, weights[3], kinds[3], D, delta.get(), vnni);
  add_delta();
  return x;
}

// y = rmsnorm(x) * weight over the last dimension of x (..., D) float32, each row with rms_norm's arithmetic (one
// left-to-right sum of squares): the final norm before the LM head, one call where torch's composite makes six small
// ones, and each row's result that of the row alone.
at::Tensor norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1, "quantlayer: norm input must be (..., D) float32");
  const int64_t D = x.size(-1);
  TORCH_CHECK(weight.numel() == D, "quantlayer: norm weight must hold D values");
  const at::Tensor in = x.contiguous(), w = weight.to(at::kFloat).contiguous();
  at::Tensor out = at::empty_like(in);
  const int64_t N = D ? in.numel() / D : 0;
  const float* xp = in.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  specdraft_rows::over_rows(N, [&](int64_t begin, int64_t end) {
    rms_norm(xp + begin * D, end - begin, D, w.data_ptr<float>(), static_cast<float>(eps), yp + begin * D);
  });
  return out;
}

// hidden (1, T, D) fp32 -> (1, T, D); writes this layer's keys and values of the T new positions into slots
// start .. start + T - 1 of keys / values (1, KV, S, hd), fp32, fp16 or bf16 (the model's cache format). weights:
// the packed qkv, o, gate_up, down blocks, kinds their ggml types; cos, sin (T, hd/2); mask (T, start + T) bool or
// None (then every slot is visible). q_norm, k_norm (hd,): Qwen3's per-head norms of the queries and keys (None: a
// Llama layer). kv_only: write the keys and values of the T rows and return `hidden` as it is (the context of a
// drafter whose layers attend features they do not process, as DFlash's). The batch-1 case of layer_rows.
at::Tensor layer(const at::Tensor& hidden, at::TensorList weights, at::IntArrayRef kinds, const at::Tensor& attn_norm,
                 const at::Tensor& mlp_norm, double eps, const at::Tensor& keys, const at::Tensor& values, int64_t start,
                 const at::Tensor& cos, const at::Tensor& sin, const c10::optional<at::Tensor>& mask, int64_t heads,
                 int64_t kv_heads, int64_t qmode, int64_t amode, const c10::optional<at::Tensor>& q_norm,
                 const c10::optional<at::Tensor>& k_norm, bool kv_only) {
  TORCH_CHECK(hidden.dim() == 3 && hidden.size(0) == 1 && hidden.scalar_type() == at::kFloat,
              "quantlayer: hidden must be (1, T, D) float32");
  TORCH_CHECK(keys.dim() == 4 && keys.size(0) == 1, "quantlayer: the cache must be (1, KV, S, hd)");
  TORCH_CHECK(!mask.has_value() || (mask->dim() == 2 && mask->size(0) == hidden.size(1) &&
                                    mask->size(1) >= start + hidden.size(1)),
              "quantlayer: the mask must be (T, start + T) bool");
  const int64_t zero = 0;
  c10::optional<at::Tensor> one_mask;
  if (mask.has_value()) one_mask = mask->unsqueeze(0);
  return layer_rows(hidden, weights, kinds, attn_norm, mlp_norm, eps, keys, values, at::IntArrayRef(&zero, 1),
                    at::IntArrayRef(&start, 1), cos, sin, one_mask, heads, kv_heads, qmode, amode, q_norm, k_norm,
                    kv_only);
}

// Every layer of a batch-1 forward in one call: layer() for layers 0 .. L - 1 in turn, layer l on weights and kinds
// 4 l .. 4 l + 3, the l-th norms and the l-th cache tensors, returning what those calls one by one return, bit for
// bit. One dispatch instead of one per layer (30 for SmolLM2, from Python). q_norms and k_norms: empty (Llama) or one
// per layer (Qwen3).
at::Tensor layers(const at::Tensor& hidden, at::TensorList weights, at::IntArrayRef kinds, at::TensorList attn_norms,
                  at::TensorList mlp_norms, double eps, at::TensorList keys, at::TensorList values, int64_t start,
                  const at::Tensor& cos, const at::Tensor& sin, const c10::optional<at::Tensor>& mask, int64_t heads,
                  int64_t kv_heads, int64_t qmode, int64_t amode, at::TensorList q_norms, at::TensorList k_norms) {
  const size_t L = attn_norms.size();
  TORCH_CHECK(weights.size() == 4 * L && kinds.size() == 4 * L && mlp_norms.size() == L && keys.size() == L &&
                  values.size() == L && (q_norms.empty() || q_norms.size() == L) && k_norms.size() == q_norms.size(),
              "quantlayer: four weights and kinds, two norms and a cache per layer");
  at::Tensor x = hidden;
  for (size_t l = 0; l < L; ++l) {
    c10::optional<at::Tensor> q_norm, k_norm;
    if (!q_norms.empty()) {
      q_norm = q_norms[l];
      k_norm = k_norms[l];
    }
    x = layer(x, weights.slice(4 * l, 4), kinds.slice(4 * l, 4), attn_norms[l], mlp_norms[l], eps, keys[l], values[l],
              start, cos, sin, mask, heads, kv_heads, qmode, amode, q_norm, k_norm, false);
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdraft_rowgemm, m) {
  m.def("qlayer(Tensor hidden, Tensor[] weights, int[] kinds, Tensor attn_norm, Tensor mlp_norm, float eps, "
        "Tensor keys, Tensor values, int start, Tensor cos, Tensor sin, Tensor? mask, int heads, int kv_heads, "
        "int qmode, int amode, Tensor? q_norm=None, Tensor? k_norm=None, bool kv_only=False) -> Tensor");
  m.def("qlayer_rows(Tensor hidden, Tensor[] weights, int[] kinds, Tensor attn_norm, Tensor mlp_norm, float eps, "
        "Tensor keys, Tensor values, int[] rows, int[] starts, Tensor cos, Tensor sin, Tensor? mask, int heads, "
        "int kv_heads, int qmode, int amode, Tensor? q_norm=None, Tensor? k_norm=None, bool kv_only=False) -> Tensor");
  m.def("qnorm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("qlayers(Tensor hidden, Tensor[] weights, int[] kinds, Tensor[] attn_norms, Tensor[] mlp_norms, float eps, "
        "Tensor[] keys, Tensor[] values, int start, Tensor cos, Tensor sin, Tensor? mask, int heads, int kv_heads, "
        "int qmode, int amode, Tensor[] q_norms, Tensor[] k_norms) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdraft_rowgemm, CPU, m) {
  m.impl("qlayer", &layer);
  m.impl("qlayer_rows", &layer_rows);
  m.impl("qlayers", &layers);
  m.impl("qnorm", &norm);
}
