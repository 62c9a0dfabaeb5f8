// Attention scores from a bfloat16 KV cache with the keys transposed (AVX-512 builds, D = 64):
// each tile's K rows are widened into kT (D, 64): d-major, one float per key in a lane, so
// a score is a chain of D fused multiply-adds in d order, 16 keys to a vector, with no
// horizontal sum. With keys along the lanes, the row-major path's per-score reduction (about
// three instructions per score at D = 64, next to its four FMAs) goes, and a tile's widened
// keys serve every query row of a work item (a prefill chunk's rows) as a small GEMM.
//
// The arithmetic of a score: acc = 0; acc = fma(q[d], k[d], acc) for d = 0 .. D-1; score =
// scale * acc. It is the same for every row and every tile (the widening is exact), so a
// row's result still depends on its own keys alone: batch invariance holds as with the
// row-major code, which the other cache formats and head sizes keep.
//
// A row that walks its keys alone (a decode) reads the bf16 rows in place instead
// (score_raw_t, accumulate_raw): the same widening in registers, the same operations in the
// same order, so bitwise the same results as the widened tile (tests/attention: rows alone
// and grouped), without writing and re-reading 32 KB of widened K and V per KV head and tile
// of 64 keys (which a lone row uses once: 1.5x on 64 decodes whose cache sits in L3).
#pragma once
#include "paged_attention_ahead.h"
#include "vec_utils.h"
#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
#define TM_ATTENTION_KEYS_T 1

namespace attention_keys_t {

constexpr int64_t kTileKeys = 64;  // keys of a tile: four vectors of 16
constexpr int64_t kHeadDim = 64;   // the head size this path takes

// The 16 words [16 half, 16 half + 16) of keys [16 b, 16 b + 16) (rows[i]; zeros past
// `keys`), transposed: out[j] holds word 16 half + j of the 16 keys. (Default target: the
// vdpbf16ps path calls it too, and a lambda compiled for avx512bf16 could not be inlined into
// transpose16, an out-of-line call per vector that had made its decodes slower.)
static inline void words_t(const uint16_t* const* rows, int64_t keys, int64_t b, int half,
                           __m512 (&out)[16]) {
  __m512 w[16];
  for (int64_t i = 0; i < 16; ++i)
    w[i] = b * 16 + i < keys
               ? _mm512_loadu_ps(reinterpret_cast<const float*>(rows[b * 16 + i]) + 16 * half)
               : _mm512_setzero_ps();
  transpose16(w, [&](int j, __m512 v) { out[j] = v; });
}

// kT[d * 64 + i] = key i's value d (widened, exact) for keys [0, keys) of one KV head, from
// its bf16 rows rows[i] (64 values each): 16 keys at a time, their rows read as 32-bit words
// (two values each), transposed, and each word split into its two floats (low half: d even).
// Keys [keys, 16 ceil(keys / 16)) are zero; later vectors are not written.
static inline void widen_keys_t(const uint16_t* const* rows, int64_t keys, float* kT) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t b = 0; b * 16 < keys; ++b) {
    for (int half = 0; half < 2; ++half) {  // words [16 half, 16 half + 16): d in 32 half ..
      __m512 t[16];
      words_t(rows, keys, b, half, t);
      for (int j = 0; j < 16; ++j) {  // t[j]: word 16 half + j of the 16 keys
        const __m512i x = _mm512_castps_si512(t[j]);
        const int64_t d = 32 * half + 2 * j;
        _mm512_storeu_ps(kT + d * kTileKeys + 16 * b, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)));
        _mm512_storeu_ps(kT + (d + 1) * kTileKeys + 16 * b,
                         _mm512_castsi512_ps(_mm512_and_si512(x, high)));
      }
    }
  }
}

// scores[g * own + i] = scale * <q_g, k_i> for the G query heads g of one KV head (q_g =
// q + g * 64) and keys i < own (own <= 16 NV), k_i = column i of kT (64, 64).
template <int G, int NV>
static void score_keys_t(const float* q, const float* kT, float scale, int64_t own,
                         float* scores) {
  __m512 acc[G][NV];
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < NV; ++v) acc[g][v] = _mm512_setzero_ps();
  for (int64_t d = 0; d < kHeadDim; ++d) {
    __m512 k[NV];
    for (int v = 0; v < NV; ++v) k[v] = _mm512_loadu_ps(kT + d * kTileKeys + 16 * v);
    for (int g = 0; g < G; ++g) {
      const __m512 qd = _mm512_set1_ps(q[g * kHeadDim + d]);
      for (int v = 0; v < NV; ++v) acc[g][v] = _mm512_fmadd_ps(qd, k[v], acc[g][v]);
    }
  }
  const __m512 sv = _mm512_set1_ps(scale);
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < NV; ++v) {
      const int64_t left = own - 16 * v;
      if (left <= 0) break;
      const __mmask16 m = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
      _mm512_mask_storeu_ps(scores + g * own + 16 * v, m, _mm512_mul_ps(sv, acc[g][v]));
    }
}

template <int G>
static void score_keys_t_any(const float* q, const float* kT, float scale, int64_t own,
                             float* scores) {
  switch ((own + 15) / 16) {
    case 1: return score_keys_t<G, 1>(q, kT, scale, own, scores);
    case 2: return score_keys_t<G, 2>(q, kT, scale, own, scores);
    case 3: return score_keys_t<G, 3>(q, kT, scale, own, scores);
    default: return score_keys_t<G, 4>(q, kT, scale, own, scores);
  }
}

// score_keys_t's scores straight from the bf16 K rows rows[i] (64 values each) of keys i <
// own (own <= 64): each 16 keys' words transposed in registers and split as widen_keys_t
// does, then the same fused multiply-adds in the same d order, so the scores are bitwise
// those of widen_keys_t + score_keys_t. For a query row that walks its keys alone (a
// decode), whose widened tile would serve no other row, this skips writing and re-reading
// the tile (one row: 1.6x).
template <int G>
static void score_raw_t(const float* q, const uint16_t* const* rows, float scale, int64_t own,
                        float* scores) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t b = 0; b * 16 < own; ++b) {
    __m512 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    for (int half = 0; half < 2; ++half) {
      __m512 t[16];
      words_t(rows, own, b, half, t);
      for (int j = 0; j < 16; ++j) {  // d = 32 half + 2 j (low half) and d + 1 (high half)
        const __m512i x = _mm512_castps_si512(t[j]);
        const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(x, high));
        const float* qd = q + 32 * half + 2 * j;
        for (int g = 0; g < G; ++g)
          acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(qd[g * kHeadDim]), lo, acc[g]);
        for (int g = 0; g < G; ++g)
          acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(qd[g * kHeadDim + 1]), hi, acc[g]);
      }
    }
    const int64_t left = own - 16 * b;
    const __mmask16 m = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
    for (int g = 0; g < G; ++g)
      _mm512_mask_storeu_ps(scores + g * own + 16 * b, m, _mm512_mul_ps(sv, acc[g]));
  }
}

// The G heads' accumulators (64 floats each, acc + g * 64) held in registers in another
// order of d: a[g][2k] and a[g][2k + 1] = corr_g times half k's 32 values gathered by the
// permutations first and second (_mm512_permutex2var_ps over the half's two vectors).
template <int G>
static inline void load_split(const float* acc, const float* corr, __m512i first,
                              __m512i second, __m512 (&a)[G][4]) {
  for (int g = 0; g < G; ++g) {
    const __m512 c = _mm512_set1_ps(corr[g]);
    for (int k = 0; k < 2; ++k) {
      const __m512 x = _mm512_loadu_ps(acc + g * 64 + 32 * k);
      const __m512 y = _mm512_loadu_ps(acc + g * 64 + 32 * k + 16);
      a[g][2 * k] = _mm512_mul_ps(_mm512_permutex2var_ps(x, first, y), c);
      a[g][2 * k + 1] = _mm512_mul_ps(_mm512_permutex2var_ps(x, second, y), c);
    }
  }
}

// load_split's inverse: half k's two vectors gathered from a[g][2k], a[g][2k + 1] by the
// permutations first and second.
template <int G>
static inline void store_split(const __m512 (&a)[G][4], __m512i first, __m512i second,
                               float* acc) {
  for (int g = 0; g < G; ++g)
    for (int k = 0; k < 2; ++k) {
      float* o = acc + g * 64 + 32 * k;
      _mm512_storeu_ps(o, _mm512_permutex2var_ps(a[g][2 * k], first, a[g][2 * k + 1]));
      _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(a[g][2 * k], second, a[g][2 * k + 1]));
    }
}

// acc_g (64) = corr_g * acc_g + sum_i p_g[i] * v_i for the G query heads g of one KV head
// (p_g = p + g * stride, acc_g = acc + g * 64), v_i the bf16 V rows rows[i] (64 values)
// widened in registers: attention_groups::rescale_accumulate64's operations, in its order,
// on the same (exactly widened) values. Each 32-value load splits into its even and odd
// values, so the accumulators hold d in that order over the tile (permuted in and out).
// `steps` of the next tile's cache lines (ahead) are asked for a few per key, spread over the
// arithmetic (paged_attention_ahead.h).
template <int G>
static void accumulate_raw(const float* p, int64_t stride, const uint16_t* const* rows,
                           int64_t n, const float* corr, float* acc, LinesAhead& ahead,
                           int64_t steps) {
  AheadShare share(ahead, steps, n);
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                         28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  __m512 a[G][4];  // d of [32 j/2, 32 j/2 + 32): even ones (j even), odd ones (j odd)
  load_split<G>(acc, corr, even, odd, a);
  for (int64_t i = 0; i < n; ++i) {
    share.next();
    __m512 vv[4];
    for (int k = 0; k < 2; ++k) {
      const __m512i x = _mm512_loadu_si512(rows[i] + 32 * k);
      vv[2 * k] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      vv[2 * k + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, high));
    }
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(p[g * stride + i]);
      for (int j = 0; j < 4; ++j) a[g][j] = _mm512_fmadd_ps(w, vv[j], a[g][j]);
    }
  }
  store_split<G>(a, lo, hi, acc);
}

// Whether this path takes a cache of these shapes (bf16 rows of D values, G heads a group).
static inline bool applies(bool bf16, int64_t D, int64_t G) {
  return bf16 && D == kHeadDim && G >= 1 && G <= 6;
}

// The scores of one KV head's G query heads (see score_keys_t).
static inline void score_group_t(int64_t G, const float* q, const float* kT, float scale,
                                 int64_t own, float* scores) {
  with_group_size<6>(G, [&](auto g) { score_keys_t_any<g.value>(q, kT, scale, own, scores); });
}

// One KV head's G query heads against keys read in place (score_raw_t, accumulate_raw).
static inline void score_group_raw(int64_t G, const float* q, const uint16_t* const* rows,
                                   float scale, int64_t own, float* scores) {
  with_group_size<6>(G, [&](auto g) { score_raw_t<g.value>(q, rows, scale, own, scores); });
}

static inline void accumulate_group_raw(int64_t G, const float* p, int64_t stride,
                                        const uint16_t* const* rows, int64_t n,
                                        const float* corr, float* acc, LinesAhead& ahead,
                                        int64_t steps) {
  with_group_size<6>(G, [&](auto g) {
    accumulate_raw<g.value>(p, stride, rows, n, corr, acc, ahead, steps);
  });
}

}  // namespace attention_keys_t
#endif
