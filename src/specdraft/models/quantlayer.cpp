// One pre-norm Llama decoder layer on block-quantized weights for the T <= 64 new tokens of a batch-1 step, verify or
// tree, in one call: the ~15 eager ops of a layer cost more dispatch than arithmetic at these sizes (a 1-token step of
// SmolLM2 runs 30 layers). Every piece computes each token on its own with a fixed instruction sequence (RMSNorm with
// one left-to-right sum per token, rotary embedding per element, quantgemm's products, rowattention's attention,
// SiLU per element), so a k-token call reproduces k 1-token calls bit for bit, as the layer-by-layer path does.
//
//   x = x + o(attention(rope(q), cache <- (rope(k), v)))      with q, k, v = qkv(rmsnorm(x, attn_norm))
//   x = x + down(silu(gate) * up)                              with gate, up = gate_up(rmsnorm(x, mlp_norm))
#include "quantkernels.h"

#include <ATen/core/dispatch/Dispatcher.h>

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

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& mask,
                     double scale, int64_t mode) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("specdraft_rowgemm::attention", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const c10::optional<at::Tensor>&, double, int64_t)>();
  return op.call(q, k, v, mask, scale, mode);
}

// hidden (1, T, D) fp32 -> (1, T, D); writes this layer's keys and values of the T new positions into slots
// start .. start + T - 1 of keys / values (1, KV, S, hd), fp32, fp16 or bf16 (the model's cache format). weights:
// the packed qkv, o, gate_up, down blocks, kinds their ggml types; cos, sin (T, hd/2); mask (T, start + T) bool or
// None (then every slot is visible). q_norm, k_norm (hd,): Qwen3's per-head norms of the queries and keys (None: a
// Llama layer). kv_only: write the keys and values of the T rows and return `hidden` as it is (the context of a
// drafter whose layers attend features they do not process, as DFlash's).
at::Tensor layer(const at::Tensor& hidden, at::TensorList weights, at::IntArrayRef kinds, const at::Tensor& attn_norm,
                 const at::Tensor& mlp_norm, double eps, const at::Tensor& keys, const at::Tensor& values, int64_t start,
                 const at::Tensor& cos, const at::Tensor& sin, const c10::optional<at::Tensor>& mask, int64_t heads,
                 int64_t kv_heads, int64_t qmode, int64_t amode, const c10::optional<at::Tensor>& q_norm,
                 const c10::optional<at::Tensor>& k_norm, bool kv_only) {
  TORCH_CHECK(hidden.dim() == 3 && hidden.size(0) == 1 && hidden.scalar_type() == at::kFloat,
              "quantlayer: hidden must be (1, T, D) float32");
  TORCH_CHECK(weights.size() == 4 && kinds.size() == 4, "quantlayer: four weights (qkv, o, gate_up, down)");
  const auto kv_type = keys.scalar_type();
  TORCH_CHECK((kv_type == at::kFloat || kv_type == at::kHalf || kv_type == at::kBFloat16) &&
                  values.scalar_type() == kv_type && keys.dim() == 4 && keys.size(0) == 1 && keys.is_contiguous() &&
                  values.is_contiguous() && keys.sizes() == values.sizes(),
              "quantlayer: the cache must be (1, KV, S, hd) float32, float16 or bfloat16");
  const int64_t T = hidden.size(1), D = hidden.size(2), hd = keys.size(3), S = keys.size(2);
  const int64_t width = (heads + 2 * kv_heads) * hd, ffn = weights[3].size(1) * 32;
  TORCH_CHECK(keys.size(1) == kv_heads && start + T <= S && cos.numel() == T * (hd / 2) && sin.numel() == cos.numel(),
              "quantlayer: cache, positions and angles do not match");
  at::Tensor x = hidden.contiguous().clone();  // (1, T, D): the residual stream, updated in place
  float* xp = x.data_ptr<float>();
  const at::Tensor c = cos.to(at::kFloat).contiguous(), s = sin.to(at::kFloat).contiguous();
  const at::Tensor an = attn_norm.to(at::kFloat).contiguous(), mn = mlp_norm.to(at::kFloat).contiguous();
  const bool vnni = qmode >= 1;
  std::vector<float> normed(T * D), qkv(T * width), delta(T * D), gate_up(T * 2 * ffn), act(T * ffn);

  rms_norm(xp, T, D, an.data_ptr<float>(), static_cast<float>(eps), normed.data());
  specdraft_quant::multiply(normed.data(), T, D, weights[0], kinds[0], width, qkv.data(), vnni);
  for (const auto& [norm, first, count] : {std::tuple{&q_norm, int64_t{0}, heads}, std::tuple{&k_norm, heads, kv_heads}})
    if (norm->has_value()) {
      TORCH_CHECK((*norm)->numel() == hd, "quantlayer: q_norm and k_norm hold head_dim weights");
      const at::Tensor w = (*norm)->to(at::kFloat).contiguous();
      head_norm(qkv.data(), T, width, first, count, hd, w.data_ptr<float>(), static_cast<float>(eps));
    }
  rotate(qkv.data(), T, width, 0, heads + kv_heads, hd, c.data_ptr<float>(), s.data_ptr<float>());
  if (kv_type == at::kHalf)
    write_cache(qkv.data(), T, width, heads, kv_heads, hd, S, start, keys.data_ptr<c10::Half>(),
                values.data_ptr<c10::Half>());
  else if (kv_type == at::kBFloat16)
    write_cache(qkv.data(), T, width, heads, kv_heads, hd, S, start, keys.data_ptr<c10::BFloat16>(),
                values.data_ptr<c10::BFloat16>());
  else
    write_cache(qkv.data(), T, width, heads, kv_heads, hd, S, start, keys.data_ptr<float>(), values.data_ptr<float>());
  if (kv_only) return hidden;
  const at::Tensor queries = at::from_blob(qkv.data(), {1, T, heads, hd}, {T * width, width, hd, 1},
                                           at::TensorOptions().dtype(at::kFloat));  // a strided view of the q rows
  const at::Tensor seen = keys.narrow(2, 0, start + T), vals = values.narrow(2, 0, start + T);
  const at::Tensor attended = attention(queries.contiguous(), seen, vals, mask, std::pow(hd, -0.5), amode);
  specdraft_quant::multiply(attended.data_ptr<float>(), T, heads * hd, weights[1], kinds[1], D, delta.data(), vnni);
  for (int64_t i = 0; i < T * D; ++i) xp[i] += delta[i];

  rms_norm(xp, T, D, mn.data_ptr<float>(), static_cast<float>(eps), normed.data());
  specdraft_quant::multiply(normed.data(), T, D, weights[2], kinds[2], 2 * ffn, gate_up.data(), vnni);
  silu_mul(gate_up.data(), T, ffn, act.data());
  specdraft_quant::multiply(act.data(), T, ffn, weights[3], kinds[3], D, delta.data(), vnni);
  for (int64_t i = 0; i < T * D; ++i) xp[i] += delta[i];
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdraft_rowgemm, m) {
  m.def("qlayer(Tensor hidden, Tensor[] weights, int[] kinds, Tensor attn_norm, Tensor mlp_norm, float eps, "
        "Tensor keys, Tensor values, int start, Tensor cos, Tensor sin, Tensor? mask, int heads, int kv_heads, "
        "int qmode, int amode, Tensor? q_norm=None, Tensor? k_norm=None, bool kv_only=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdraft_rowgemm, CPU, m) { m.impl("qlayer", &layer); }
