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
#pragma once
#include "vec_utils.h"
#include <cstdint>

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
#define TM_ATTENTION_KEYS_T 1

namespace attention_keys_t {

constexpr int64_t kTileKeys = 64;  // keys of a tile: four vectors of 16
constexpr int64_t kHeadDim = 64;   // the head size this path takes

// kT[d * 64 + i] = key i's value d (widened, exact) for keys [0, keys) of one KV head, from
// its bf16 rows rows[i] (64 values each): 16 keys at a time, their rows read as 32-bit words
// (two values each), transposed, and each word split into its two floats (low half: d even).
// Keys [keys, 16 ceil(keys / 16)) are zero; later vectors are not written.
static inline void widen_keys_t(const uint16_t* const* rows, int64_t keys, float* kT) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t b = 0; b * 16 < keys; ++b) {
    for (int half = 0; half < 2; ++half) {  // words [16 half, 16 half + 16): d in 32 half ..
      __m512 w[16];
      for (int64_t i = 0; i < 16; ++i)
        w[i] = b * 16 + i < keys
                   ? _mm512_loadu_ps(reinterpret_cast<const float*>(rows[b * 16 + i]) + 16 * half)
                   : _mm512_setzero_ps();
      transpose16(w, [&](int j, __m512 v) {  // v: word 16 half + j of the 16 keys
        const __m512i x = _mm512_castps_si512(v);
        const int64_t d = 32 * half + 2 * j;
        _mm512_storeu_ps(kT + d * kTileKeys + 16 * b, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)));
        _mm512_storeu_ps(kT + (d + 1) * kTileKeys + 16 * b,
                         _mm512_castsi512_ps(_mm512_and_si512(x, high)));
      });
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

// Whether this path takes a cache of these shapes (bf16 rows of D values, G heads a group).
static inline bool applies(bool bf16, int64_t D, int64_t G) {
  return bf16 && D == kHeadDim && G >= 1 && G <= 6;
}

// The scores of one KV head's G query heads (see score_keys_t); G as `applies` allows.
static inline void score_group_t(int64_t G, const float* q, const float* kT, float scale,
                                 int64_t own, float* scores) {
  switch (G) {
    case 1: return score_keys_t_any<1>(q, kT, scale, own, scores);
    case 2: return score_keys_t_any<2>(q, kT, scale, own, scores);
    case 3: return score_keys_t_any<3>(q, kT, scale, own, scores);
    case 4: return score_keys_t_any<4>(q, kT, scale, own, scores);
    case 5: return score_keys_t_any<5>(q, kT, scale, own, scores);
    default: return score_keys_t_any<6>(q, kT, scale, own, scores);
  }
}

}  // namespace attention_keys_t
#endif
