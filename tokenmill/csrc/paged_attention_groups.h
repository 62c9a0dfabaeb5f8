// The paged-attention kernel's two inner loops, for the G query heads of one KV head at once
// on AVX-512 builds (paged_attention_rows.h calls them where they apply and its per-row code
// elsewhere). Each computes exactly the per-row code's arithmetic, the same operations in the
// same order for every output, so results are bitwise the same; only loads and reductions are
// shared:
// - scores: 4 keys at a time, their 4 x G accumulators reduced together (vec_utils.h's
//   `hsum4`: each sum in the per-row code's hsum tree) instead of one horizontal sum per
//   score, which cost more than the products at D = 64;
// - the softmax-weighted sum of V: each V row loaded once for the G heads sharing it, not G
//   times.
#pragma once
#include "vec_utils.h"

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
#define TM_ATTENTION_GROUPS 1

namespace attention_groups {

// scores[(h G + g) keys + i] = scale <q_{h,g}, k_{i,h}> for keys [0, keys - keys % 4), D a
// multiple of 16 (the caller scores the rest); returns the first key left.
template <int G>
static int64_t score_keys4(const float* q, const float* const* krows, int64_t heads,
                           int64_t keys, int64_t D, float scale, float* scores) {
  const __m128 sv = _mm_set1_ps(scale);
  int64_t i = 0;
  for (; i + 4 <= keys; i += 4) {
    for (int64_t h = 0; h < heads; ++h) {
      const float* qh = q + h * G * D;
      __m512 acc[G][4];
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < 4; ++j) acc[g][j] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) {
        __m512 kv[4];
        for (int j = 0; j < 4; ++j) kv[j] = _mm512_loadu_ps(krows[i + j] + h * D + d);
        for (int g = 0; g < G; ++g) {
          const __m512 qv = _mm512_loadu_ps(qh + g * D + d);
          for (int j = 0; j < 4; ++j) acc[g][j] = _mm512_fmadd_ps(qv, kv[j], acc[g][j]);
        }
      }
      for (int g = 0; g < G; ++g)
        _mm_storeu_ps(scores + (h * G + g) * keys + i, _mm_mul_ps(sv, hsum4(acc[g])));
    }
  }
  return i;
}

// acc_g (64) = corr_g * acc_g + sum_i p_g[i] * v_i for the G query heads g of one KV head
// (p_g = p + g * stride, acc_g = acc + g * 64), v_i = vrows[i] + offset: D = 64.
template <int G>
static void rescale_accumulate64(const float* p, int64_t stride, const float* const* vrows,
                                 int64_t offset, int64_t n, const float* corr, float* acc) {
  __m512 a[G][4];
  for (int g = 0; g < G; ++g) {
    const __m512 c = _mm512_set1_ps(corr[g]);
    for (int j = 0; j < 4; ++j) a[g][j] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * 64 + 16 * j), c);
  }
  for (int64_t i = 0; i < n; ++i) {
    const float* v = vrows[i] + offset;
    __m512 vv[4];
    for (int j = 0; j < 4; ++j) vv[j] = _mm512_loadu_ps(v + 16 * j);
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(p[g * stride + i]);
      for (int j = 0; j < 4; ++j) a[g][j] = _mm512_fmadd_ps(w, vv[j], a[g][j]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc + g * 64 + 16 * j, a[g][j]);
}

// The two above for a runtime G (1..6; registers: 4 G accumulators + 5); false: not handled.
static inline bool score_group(int64_t G, const float* q, const float* const* krows,
                               int64_t heads, int64_t keys, int64_t D, float scale,
                               float* scores, int64_t* done) {
  if (D % 16 != 0) return false;
  switch (G) {
    case 1: *done = score_keys4<1>(q, krows, heads, keys, D, scale, scores); return true;
    case 2: *done = score_keys4<2>(q, krows, heads, keys, D, scale, scores); return true;
    case 3: *done = score_keys4<3>(q, krows, heads, keys, D, scale, scores); return true;
    case 4: *done = score_keys4<4>(q, krows, heads, keys, D, scale, scores); return true;
    case 5: *done = score_keys4<5>(q, krows, heads, keys, D, scale, scores); return true;
    case 6: *done = score_keys4<6>(q, krows, heads, keys, D, scale, scores); return true;
    default: return false;
  }
}

static inline bool accumulate_group(int64_t G, const float* p, int64_t stride,
                                    const float* const* vrows, int64_t offset, int64_t n,
                                    int64_t D, const float* corr, float* acc) {
  if (D != 64) return false;
  switch (G) {
    case 1: rescale_accumulate64<1>(p, stride, vrows, offset, n, corr, acc); return true;
    case 2: rescale_accumulate64<2>(p, stride, vrows, offset, n, corr, acc); return true;
    case 3: rescale_accumulate64<3>(p, stride, vrows, offset, n, corr, acc); return true;
    case 4: rescale_accumulate64<4>(p, stride, vrows, offset, n, corr, acc); return true;
    case 5: rescale_accumulate64<5>(p, stride, vrows, offset, n, corr, acc); return true;
    case 6: rescale_accumulate64<6>(p, stride, vrows, offset, n, corr, acc); return true;
    default: return false;
  }
}

}  // namespace attention_groups
#endif
