// The arithmetic of one query row against a tile of keys, for the paged-attention kernel
// (paged_attention_cpu.h): scores (each K row loaded once for the G query heads sharing it),
// the online softmax's max / exp / rescale, the weighted sum of V rows, and the merge of two
// partial states. On AVX-512 builds paged_attention_groups.h computes the scores and the V
// sums of whole head groups with the same operations in the same order.
#pragma once
#include <ATen/cpu/vec/vec.h>
#include "paged_attention_groups.h"
#include "vec_utils.h"
#include <algorithm>
#include <cmath>
#include <limits>

static inline float dot(const float* a, const float* b, int64_t d) {
  int64_t i = 0;
  Vec acc(0.f);
  for (; i + Vec::size() <= d; i += Vec::size())
    acc = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc);
  float s = hsum(acc);
  for (; i < d; ++i) s += a[i] * b[i];
  return s;
}

// scores[(h * G + g) * keys + i] = scale * <q_{h,g}, k_{i,h}> for `heads` KV heads and the G
// query heads of each. Key-major: each key's row (all its heads, contiguous in the cache) is
// read in one sweep, which memory prefetchers follow; head-major order read a strided part of
// every row per head and ran 1.5x slower once the cache spills out of L3. Each K row is loaded
// once for the G query heads sharing it. G is a template parameter so that the G accumulators
// live in registers (a runtime-sized array went through the stack and cost 5x).
template <int G>
static void score_keys(const float* q, const float* const* krows, int64_t heads, int64_t first,
                       int64_t keys, int64_t D, float scale, float* scores) {
  for (int64_t i = first; i < keys; ++i) {
    for (int64_t h = 0; h < heads; ++h) {
      const float* k = krows[i] + h * D;
      const float* qh = q + h * G * D;
      Vec acc[G];
      for (int g = 0; g < G; ++g) acc[g] = Vec(0.f);
      for (int64_t d = 0; d < D; d += Vec::size()) {
        const Vec kv = Vec::loadu(k + d);
        for (int g = 0; g < G; ++g) acc[g] = at::vec::fmadd(Vec::loadu(qh + g * D + d), kv, acc[g]);
      }
      for (int g = 0; g < G; ++g) scores[(h * G + g) * keys + i] = scale * hsum(acc[g]);
    }
  }
}

static void score_keys_any(const float* q, const float* const* krows, int64_t heads,
                           int64_t keys, int64_t G, int64_t D, float scale, float* scores) {
  int64_t first = 0;  // keys scored four at a time by the grouped loop, where it applies
#ifdef TM_ATTENTION_GROUPS
  if (attention_groups::score_group(G, q, krows, heads, keys, D, scale, scores, &first) &&
      first == keys)
    return;
#endif
  if (D % Vec::size() == 0) {
    switch (G) {
      case 1: return score_keys<1>(q, krows, heads, first, keys, D, scale, scores);
      case 2: return score_keys<2>(q, krows, heads, first, keys, D, scale, scores);
      case 3: return score_keys<3>(q, krows, heads, first, keys, D, scale, scores);
      case 4: return score_keys<4>(q, krows, heads, first, keys, D, scale, scores);
      case 5: return score_keys<5>(q, krows, heads, first, keys, D, scale, scores);
      case 6: return score_keys<6>(q, krows, heads, first, keys, D, scale, scores);
      case 7: return score_keys<7>(q, krows, heads, first, keys, D, scale, scores);
      case 8: return score_keys<8>(q, krows, heads, first, keys, D, scale, scores);
      default: break;
    }
  }
  for (int64_t i = first; i < keys; ++i)
    for (int64_t r = 0; r < heads * G; ++r)
      scores[r * keys + i] = scale * dot(q + r * D, krows[i] + (r / G) * D, D);
}

static inline void axpy(float w, const float* x, float* y, int64_t d) {
  int64_t i = 0;
  Vec wv(w);
  for (; i + Vec::size() <= d; i += Vec::size())
    at::vec::fmadd(wv, Vec::loadu(x + i), Vec::loadu(y + i)).store(y + i);
  for (; i < d; ++i) y[i] += w * x[i];
}

// s[t] = exp(s[t] - m) in place; returns the sum.
static inline float exp_minus_max(float* s, float m, int64_t n) {
  int64_t t = 0;
  Vec mv(m), total(0.f);
  for (; t + Vec::size() <= n; t += Vec::size()) {
    Vec e = (Vec::loadu(s + t) - mv).exp_u20();
    e.store(s + t);
    total = total + e;
  }
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
  // The tail as one masked vector: a scalar expf per key cost 1/5 of a prefill's softmax. Its
  // exp is the accurate one, as expf was: the 20-ulp exp_u20 there flipped SmolLM2's greedy
  // answer on an fp8 cache (tests/engine/test_kv_cache_dtype.py).
  if (t < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - t)) - 1);
    const Vec e = (Vec(_mm512_maskz_loadu_ps(k, s + t)) - mv).exp();
    _mm512_mask_storeu_ps(s + t, k, e);
    total = total + Vec(_mm512_maskz_mov_ps(k, e));
    t = n;
  }
#endif
  float sum = hsum(total);
  for (; t < n; ++t) { s[t] = std::exp(s[t] - m); sum += s[t]; }
  return sum;
}

// acc (D) = corr * acc + sum_i p[i] * v_i over the rows v_i = vrows[i] + offset (one tile of
// keys of the online softmax). D = 64 (the common head size) keeps acc in registers over the
// tile; other sizes go through memory.
static inline void rescale_accumulate(const float* p, const float* const* vrows, int64_t offset,
                                      int64_t n, int64_t D, float corr, float* acc) {
  constexpr int64_t kRegs = 64 / Vec::size();
  if (D == 64 && kRegs <= 16) {
    Vec a[kRegs];
    const Vec c(corr);
    for (int64_t j = 0; j < kRegs; ++j) a[j] = Vec::loadu(acc + j * Vec::size()) * c;
    for (int64_t i = 0; i < n; ++i) {
      const Vec w(p[i]);
      const float* v = vrows[i] + offset;
      for (int64_t j = 0; j < kRegs; ++j)
        a[j] = at::vec::fmadd(w, Vec::loadu(v + j * Vec::size()), a[j]);
    }
    for (int64_t j = 0; j < kRegs; ++j) a[j].store(acc + j * Vec::size());
    return;
  }
  for (int64_t i = 0; i < D; ++i) acc[i] *= corr;
  for (int64_t i = 0; i < n; ++i) axpy(p[i], vrows[i] + offset, acc, D);
}

// The largest of s[0 .. n). Maxima are exact, so any order gives the same value.
static inline float max_of(const float* s, int64_t n) {
  int64_t t = 0;
  float m = -std::numeric_limits<float>::infinity();
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
  // One vector of running maxima, the tail as a masked load, one reduction tree: the scalar
  // chain below (16 maxima of 4 cycles each, then the tail's) ran once per query head and
  // tile: 6% of a prefill chunk's attention (benchmarks/RESULTS.md, thirty-fourth session).
  const __m512 lowest = _mm512_set1_ps(m);
  __m512 mv = lowest;
  for (; t + 16 <= n; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + t));
  if (t < n)
    mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(lowest, static_cast<__mmask16>((1u << (n - t)) - 1),
                                                s + t));
  return _mm512_reduce_max_ps(mv);
#else
  if (n >= Vec::size()) {
    Vec mv = Vec::loadu(s);
    for (t = Vec::size(); t + Vec::size() <= n; t += Vec::size())
      mv = at::vec::maximum(mv, Vec::loadu(s + t));
    float buf[Vec::size()];
    mv.store(buf);
    for (int64_t i = 0; i < Vec::size(); ++i) m = std::max(m, buf[i]);
  }
  for (; t < n; ++t) m = std::max(m, s[t]);
  return m;
#endif
}

// A running softmax state over keys: per query head, the unnormalised output (D), max, sum.
// `merge_into` folds a later range's partial state into it; it is the one rule by which key
// ranges are combined, whichever thread computed them.
static inline void merge_into(float* out, float& mx, float& sum, const float* acc, float m,
                              float s, int64_t D) {
  const float new_max = std::max(mx, m);
  const float a = std::exp(mx - new_max), b = std::exp(m - new_max);
  sum = sum * a + s * b;
  mx = new_max;
  int64_t i = 0;
  const Vec av(a), bv(b);
  for (; i + Vec::size() <= D; i += Vec::size())
    at::vec::fmadd(Vec::loadu(acc + i), bv, Vec::loadu(out + i) * av).store(out + i);
  for (; i < D; ++i) out[i] = std::fma(acc[i], b, out[i] * a);
}
