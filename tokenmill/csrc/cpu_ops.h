// Fused float32 CPU ops for the layers' hot path (AVX2 / AVX-512 where compiled for it).
//
// - linear (linear_cpu.h): y = x @ W^T (+ bias) for every CPU weight format.
// - add_rms_norm: s = x + residual; out = weight * s / sqrt(mean(s^2) + eps): one pass
//   instead of an add and a norm.
// - gated_act: [gate | up] (T, 2I) -> act(gate) * up (T, I) in one pass (SiLU, GELU, GELU-tanh).
// - rotary_: rotate_half RoPE applied in place to q (T, Hq, D) and k (T, Hkv, D) (row strides
//   may be those of a fused qkv output) with cos / sin (T, D).
// - store_kv_: this step's k, v (T, Hkv, D) rows (strided views of the qkv output) copied into
//   their cache slots; one call instead of two index_copy_ (about 20 us at T = 1, which a
//   batch-1 decode step pays in every layer).
// - argmax_rows: torch.argmax(x, -1) of a (S, V) matrix (greedy sampling over the vocabulary).
// - apply_token_bitmask_: -inf at the tokens a grammar's bitmask disallows (structured outputs).
// - shm_all_reduce_ (shm_all_reduce.h): tensor-parallel sum between the ranks of one machine.
//
// All math is float32; only the order of summations differs from the PyTorch ops they replace.
#pragma once
#include "kv_formats.h"
#include "linear_cpu.h"
#include "shm_all_reduce.h"
#include <cmath>
#include <limits>

// ---- add_rms_norm --------------------------------------------------------------------------
inline std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual,
                                        torch::Tensor weight, double eps) {
  check_f32(x, "x");
  check_f32(residual, "residual");
  check_f32(weight, "weight");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.size(-1) == weight.size(0), "shape mismatch");
  x = x.contiguous();
  residual = residual.contiguous();
  weight = weight.contiguous();
  const int64_t H = x.size(-1), T = x.numel() / H;
  auto out = torch::empty_like(x);
  auto sum = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *rp = residual.data_ptr<float>(),
              *wp = weight.data_ptr<float>();
  float *op = out.data_ptr<float>(), *sp = sum.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float *xr = xp + t * H, *rr = rp + t * H;
      float *sr = sp + t * H, *orow = op + t * H;
      Vec acc(0.f);
      int64_t i = 0;
      for (; i + kV <= H; i += kV) {
        const Vec s = Vec::loadu(xr + i) + Vec::loadu(rr + i);
        s.store(sr + i);
        acc = at::vec::fmadd(s, s, acc);
      }
      float ss = hsum(acc);
      for (; i < H; ++i) {
        sr[i] = xr[i] + rr[i];
        ss += sr[i] * sr[i];
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
      const Vec inv_v(inv);
      for (i = 0; i + kV <= H; i += kV)
        (Vec::loadu(wp + i) * (Vec::loadu(sr + i) * inv_v)).store(orow + i);
      for (; i < H; ++i) orow[i] = wp[i] * (sr[i] * inv);
    }
  });
  return {out, sum};
}

// ---- gated activations ---------------------------------------------------------------------
// [gate | up] (T, 2I) -> act(gate) * up (T, I) in one pass, act one of the kGatedActs (the
// codes models/cpu_decode.py and layers/activation.py share):
//   0 silu        g / (1 + exp(-g))
//   1 gelu        g / 2 (1 + erf(g / sqrt 2))                     (transformers' "gelu")
//   2 gelu_tanh   g / 2 (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))  ("gelu_pytorch_tanh")
// Each row is computed alone, its vectors and scalar tail at fixed positions: a row's result
// does not depend on the other rows.
constexpr const char* kGatedActs[] = {"silu", "gelu", "gelu_tanh"};

template <int ACT>
static inline Vec gated(const Vec& g) {
  const Vec one(1.f), half(0.5f);
  if constexpr (ACT == 0) return g / (one + g.neg().exp_u20());
  if constexpr (ACT == 1) return half * g * (one + (g * Vec(static_cast<float>(M_SQRT1_2))).erf());
  const Vec inner = Vec(0.7978845608028654f) * (g + Vec(0.044715f) * g * g * g);
  return half * g * (one + inner.tanh());
}

template <int ACT>
static inline float gated(float g) {
  if constexpr (ACT == 0) return g / (1.f + std::exp(-g));
  if constexpr (ACT == 1) return 0.5f * g * (1.f + std::erf(g * static_cast<float>(M_SQRT1_2)));
  return 0.5f * g * (1.f + std::tanh(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

template <int ACT>
static void gated_rows(const float* xp, float* op, int64_t I, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    const float *g = xp + t * 2 * I, *u = g + I;
    float* o = op + t * I;
    int64_t i = 0;
    for (; i + kV <= I; i += kV) (gated<ACT>(Vec::loadu(g + i)) * Vec::loadu(u + i)).store(o + i);
    for (; i < I; ++i) o[i] = gated<ACT>(g[i]) * u[i];
  }
}

inline torch::Tensor gated_act(torch::Tensor x, int64_t act) {
  check_f32(x, "x");
  TORCH_CHECK(act >= 0 && act < 3, "gated_act: unknown activation code ", act);
  x = x.contiguous();
  const int64_t I = x.size(-1) / 2, T = x.numel() / std::max<int64_t>(2 * I, 1);
  auto sizes = x.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)),
                   [&](int64_t t0, int64_t t1) {
    switch (act) {
      case 0: return gated_rows<0>(xp, op, I, t0, t1);
      case 1: return gated_rows<1>(xp, op, I, t0, t1);
      default: return gated_rows<2>(xp, op, I, t0, t1);
    }
  });
  return out;
}


// ---- sigmoid -------------------------------------------------------------------------------
// 1 / (1 + exp(-x)) elementwise with the scalar exp for every element: torch's vectorized
// kernel takes another exp for a tensor's last few elements, so an element's value would
// depend on how many others the tensor holds (Qwen2-MoE's shared-expert gate, one per token).
inline torch::Tensor sigmoid(torch::Tensor x) {
  check_f32(x, "x");
  x = x.contiguous();
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.numel(), 4096, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) op[i] = 1.f / (1.f + std::exp(-xp[i]));
  });
  return out;
}

// ---- rotary_ -------------------------------------------------------------------------------
// x[t, h, :] <- x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1].
static void rotate_rows(float* x, int64_t s0, int64_t s1, int64_t H, int64_t D,
                        const float* cos, const float* sin, int64_t t0, int64_t t1) {
  const int64_t h2 = D / 2;
  for (int64_t t = t0; t < t1; ++t) {
    const float *c = cos + t * D, *s = sin + t * D;
    for (int64_t h = 0; h < H; ++h) {
      float* r = x + t * s0 + h * s1;
      int64_t i = 0;
      for (; i + kV <= h2; i += kV) {
        const Vec x1 = Vec::loadu(r + i), x2 = Vec::loadu(r + h2 + i);
        (x1 * Vec::loadu(c + i) - x2 * Vec::loadu(s + i)).store(r + i);
        (x2 * Vec::loadu(c + h2 + i) + x1 * Vec::loadu(s + h2 + i)).store(r + h2 + i);
      }
      for (; i < h2; ++i) {
        const float x1 = r[i], x2 = r[h2 + i];
        r[i] = x1 * c[i] - x2 * s[i];
        r[h2 + i] = x2 * c[h2 + i] + x1 * s[h2 + i];
      }
    }
  }
}

inline void rotary_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  for (auto* t : {&q, &k}) {
    check_f32(*t, "q/k");
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1, "q/k must be (T, H, D) with unit last stride");
  }
  cos = cos.contiguous();
  sin = sin.contiguous();
  const int64_t T = q.size(0), D = q.size(2);
  TORCH_CHECK(D % 2 == 0 && cos.numel() == T * D && sin.numel() == T * D, "cos/sin must be (T, D)");
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
    rotate_rows(q.data_ptr<float>(), q.stride(0), q.stride(1), q.size(1), D, cp, sp, t0, t1);
    rotate_rows(k.data_ptr<float>(), k.stride(0), k.stride(1), k.size(1), D, cp, sp, t0, t1);
  });
}

// ---- store_kv_ -----------------------------------------------------------------------------
// k_cache / v_cache (num_blocks, bs, Hkv, R) in any row format of kv_formats.h: a float32 row
// is copied, a quantized one quantized in the same pass (kv_scales (2, Hkv): an fp8 cache's).
inline void store_kv_(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v,
               torch::Tensor slot_mapping,
               c10::optional<torch::Tensor> kv_scales = c10::nullopt) {
  for (auto* t : {&k, &v}) check_f32(*t, "k/v");
  const KVFormat fmt = kv_format(k_cache);
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "K and V caches differ in dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "cache must be contiguous");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1 &&
              k.stride(1) == k.size(2) && v.stride(1) == v.size(2),
              "k/v must be (T, Hkv, D) with contiguous rows");
  const int64_t T = k.size(0), Hkv = k.size(1), D = k.size(2);
  const int64_t slot_bytes = Hkv * kv_row_bytes(fmt, D);
  TORCH_CHECK(k_cache.size(-1) * k_cache.element_size() * Hkv == slot_bytes &&
                  v_cache.numel() == k_cache.numel(),
              "cache rows do not match k/v");
  const float* head_scales = kv_head_scales(fmt, kv_scales, Hkv);  // fp8 only: K's, V's
  auto slots = slot_mapping.to(torch::kInt64).contiguous();
  TORCH_CHECK(slots.numel() == T, "one slot per token");
  const int64_t num_slots = k_cache.numel() * k_cache.element_size() / slot_bytes;
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot out of range");
  auto* kc = static_cast<uint8_t*>(k_cache.data_ptr());
  auto* vc = static_cast<uint8_t*>(v_cache.data_ptr());
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const int64_t ks = k.stride(0), vs = v.stride(0), row_bytes = kv_row_bytes(fmt, D);
  at::parallel_for(0, T, 256, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t off = sp[t] * slot_bytes + h * row_bytes;
        kv_store_row(fmt, kp + t * ks + h * D, D, head_scales ? head_scales[h] : 0.f, kc + off);
        kv_store_row(fmt, vp + t * vs + h * D, D, head_scales ? head_scales[Hkv + h] : 0.f,
                     vc + off);
      }
    }
  });
}

// ---- argmax_rows ---------------------------------------------------------------------------
// The first index of each row's largest value, or of its first NaN, as torch.argmax. torch's
// CPU argmax carries an index with every element and runs about 13x slower than a plain max
// reduction at (64, 49152); here a vectorised max pass, then a scan for its first occurrence.
static inline float max_lanes(const Vec& v) {
  float buf[kV];
  v.store(buf);
  float m = buf[0];
  for (int64_t i = 1; i < kV; ++i) {
    if (std::isnan(buf[i]) || buf[i] > m) m = std::isnan(m) ? m : buf[i];  // NaN sticks
  }
  return m;
}

static inline int64_t first_nan(const float* row) {
  int64_t j = 0;
  while (!std::isnan(row[j])) ++j;
  return j;
}

// The first j with row[j] == m (there is one). Eight lanes compared at a time: a scalar scan
// took three times the max pass.
static inline int64_t first_equal(const float* row, int64_t V, float m) {
  int64_t j = 0;
#if defined(__AVX2__)
  const __m256 mv = _mm256_set1_ps(m);
  for (; j + 8 <= V; j += 8) {
    const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + j), mv, _CMP_EQ_OQ));
    if (hits) return j + __builtin_ctz(hits);
  }
#endif
  while (row[j] != m) ++j;
  return j;
}

inline torch::Tensor argmax_rows(torch::Tensor x) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "argmax_rows takes a non-empty (S, V) matrix");
  x = x.contiguous();
  const int64_t S = x.size(0), V = x.size(1);
  auto out = torch::empty({S}, x.options().dtype(torch::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, S, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      const float* row = xp + s * V;
      Vec m0(-INFINITY), m1(-INFINITY);  // at::vec::maximum propagates NaN
      int64_t k = 0;
      for (; k + 2 * kV <= V; k += 2 * kV) {
        m0 = at::vec::maximum(m0, Vec::loadu(row + k));
        m1 = at::vec::maximum(m1, Vec::loadu(row + k + kV));
      }
      float m = max_lanes(at::vec::maximum(m0, m1));
      for (; k < V; ++k) {
        if (std::isnan(row[k]) || row[k] > m) m = std::isnan(m) ? m : row[k];
      }
      op[s] = std::isnan(m) ? first_nan(row) : first_equal(row, V, m);
    }
  });
  return out;
}

// ---- apply_token_bitmask_ ------------------------------------------------------------------
// Rows `rows` of logits (S, V): token 32 i + j keeps its logit when bit j of word i of the
// row's bitmask (R, W) int32 is set, else becomes -inf. A word of all ones is skipped, one of
// all zeros (most of a grammar's mask) is one vector fill, the rest visit their zero bits;
// torch's masked_fill over an unpacked bool mask took ~1.5 ns a token whatever the mask
// (1.8 ms for 16 rows of 49152).
inline void apply_token_bitmask_(torch::Tensor logits, torch::Tensor bitmask,
                                 torch::Tensor rows) {
  check_f32(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "logits must be contiguous (S, V)");
  TORCH_CHECK(bitmask.scalar_type() == torch::kInt32 && bitmask.dim() == 2 &&
              bitmask.is_contiguous() && bitmask.device().is_cpu(), "bitmask: (R, W) int32");
  auto r64 = rows.to(torch::kInt64).contiguous();
  const int64_t S = logits.size(0), V = logits.size(1), R = bitmask.size(0),
                W = bitmask.size(1);
  TORCH_CHECK(r64.numel() == R && W * 32 >= V, "bitmask rows / width do not fit the logits");
  const int64_t* rp = r64.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(rp[r] >= 0 && rp[r] < S, "row out of range");
  const int32_t* mp = bitmask.data_ptr<int32_t>();
  float* lp = logits.data_ptr<float>();
  const float ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int32_t* m = mp + r * W;
      float* row = lp + rp[r] * V;
      for (int64_t w = 0; w < W; ++w) {
        const uint32_t bits = static_cast<uint32_t>(m[w]);
        const int64_t base = w * 32;
        if (bits == 0xFFFFFFFFu) continue;
        if (bits == 0 && base + 32 <= V) {  // most words of a grammar's mask
          std::fill_n(row + base, 32, ninf);
          continue;
        }
        for (uint32_t zeros = ~bits; zeros != 0; zeros &= zeros - 1) {
          const int64_t t = base + __builtin_ctz(zeros);
          if (t < V) row[t] = ninf;
        }
      }
    }
  });
}
