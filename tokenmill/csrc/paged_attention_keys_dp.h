// Attention from a bfloat16 KV cache on AVX512-BF16's vdpbf16ps (CPUs with the instruction
// and no AMX tile unit: AMD Zen 4 / Zen 5, Intel Cooper Lake), for the shapes the transposed
// keys take (paged_attention_keys_t.h: heads of 64, G = 1..6 query heads per KV head).
//
// Per tile of up to 64 keys, one KV head and its G query heads:
//   qp[g][c] = q_g rounded to bf16 (nearest even), pairs (d = 2c, 2c + 1) as 32-bit words
//   kP[c][i] = key i's word c (its values d = 2c, 2c + 1) as stored: 16 keys' rows loaded as
//              words and transposed, so a vector holds one pair of 16 keys
//   s_g[i]   = scale * acc, acc = 0; acc = dpbf16(acc, kP[c][i], qp[g][c]) for c = 0 .. 31
//   p_g[i]   = the online softmax's exp(s - max) (float32, its sum in float32 as before),
//              rounded to bf16 for the products below
//   o_g[d]   = corr_g * o_g[d] (o's carried state, float32), then for key pairs u = 0, 1, ..:
//              o_g[d] = dpbf16(o_g[d], (V[2u][d], V[2u + 1][d]), (p_g[2u], p_g[2u + 1]))
//              (an odd last key pairs with a zero row and p = 0: nothing is added)
// Every word is vdpbf16ps's exact products summed in its one order (linear_bf16.h), the
// same for each lane whatever tile, row count or thread: a query row read alone (a decode:
// keys transposed in registers, score_raw) and one of a group (keys transposed once into
// kP, score_pairs) get the same bits, and V is read in place by both (accumulate).
//
// Against the float32 path (paged_attention_keys_t.h), q and p are rounded to bf16, as on
// the AMX tile unit (paged_attention_amx.h) and in vLLM's and flash attention's bf16 kernels;
// K and V are the cache's own values. Why (thirty-ninth session, a Zen 5): the float32 path
// widened every bf16 value before its FMAs, and read the cache at ~15 GB/s against ~21 GB/s
// for a float32 cache; one vdpbf16ps does the work of two FMAs and needs no widening.
#pragma once
#include "paged_attention_ahead.h"
#include "paged_attention_keys_t.h"
#include "vec_utils.h"
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(TM_ATTENTION_KEYS_T) && defined(__AVX512BW__)
#define TM_ATTENTION_KEYS_DP 1

namespace attention_keys_dp {

using attention_keys_t::kHeadDim;   // the shapes keys_t takes, its tiles
using attention_keys_t::kTileKeys;
using attention_keys_t::words_t;
constexpr int64_t kPairs = kHeadDim / 2;  // words of a row

// Whether calls take this path where the CPU has the instruction: on by default,
// TOKENMILL_BF16_DOT_ATTENTION=0 (or the binding's switch, for tests) declines it.
inline bool& use_dot() {
  static bool on = [] {
    const char* v = std::getenv("TOKENMILL_BF16_DOT_ATTENTION");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return on;
}

inline bool cpu_has_dot() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}

inline bool active() { return use_dot() && cpu_has_dot(); }

// kP[c * 64 + i] = word c of key i (keys [0, keys); zeros up to a multiple of 16).
static void pair_keys_t(const uint16_t* const* rows, int64_t keys, uint32_t* kP) {
  for (int64_t b = 0; b * 16 < keys; ++b)
    for (int half = 0; half < 2; ++half) {
      __m512 t[16];
      words_t(rows, keys, b, half, t);
      for (int j = 0; j < 16; ++j)
        _mm512_storeu_ps(reinterpret_cast<float*>(kP + (16 * half + j) * kTileKeys + 16 * b),
                         t[j]);
    }
}

#pragma GCC push_options
#pragma GCC target("avx512bf16")

// qp[g * 32 + c] = the bf16 pair (q_g[2c], q_g[2c + 1]) of the G heads' q (64 floats each).
static inline void round_q(const float* q, int64_t G, uint32_t* qp) {
  for (int64_t g = 0; g < G; ++g)
    for (int k = 0; k < 2; ++k) {
      const float* x = q + g * kHeadDim + 32 * k;
      const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x));
      _mm512_storeu_si512(qp + g * kPairs + 16 * k, (__m512i)b);
    }
}

static inline void store_scores(const __m512& acc, float scale, int64_t left, float* out) {
  const __mmask16 m = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
  _mm512_mask_storeu_ps(out, m, _mm512_mul_ps(_mm512_set1_ps(scale), acc));
}

// scores[g * own + i] = s_g[i] for keys i < own from kP (the header's arithmetic).
template <int G>
static void score_pairs(const uint32_t* qp, const uint32_t* kP, float scale, int64_t own,
                        float* scores) {
  for (int64_t b = 0; b * 16 < own; ++b) {
    __m512 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    for (int64_t c = 0; c < kPairs; ++c) {
      const __m512bh k = (__m512bh)_mm512_loadu_si512(kP + c * kTileKeys + 16 * b);
      for (int g = 0; g < G; ++g)
        acc[g] = _mm512_dpbf16_ps(acc[g], k, (__m512bh)_mm512_set1_epi32(qp[g * kPairs + c]));
    }
    for (int g = 0; g < G; ++g) store_scores(acc[g], scale, own - 16 * b, scores + g * own + 16 * b);
  }
}

// score_pairs' scores from the K rows read in place, transposed in registers (a row alone).
template <int G>
static void score_raw(const uint32_t* qp, const uint16_t* const* rows, float scale, int64_t own,
                      float* scores) {
  for (int64_t b = 0; b * 16 < own; ++b) {
    __m512 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    for (int half = 0; half < 2; ++half) {
      __m512 t[16];
      words_t(rows, own, b, half, t);
      for (int j = 0; j < 16; ++j) {
        const __m512bh k = (__m512bh)_mm512_castps_si512(t[j]);
        for (int g = 0; g < G; ++g)
          acc[g] = _mm512_dpbf16_ps(
              acc[g], k, (__m512bh)_mm512_set1_epi32(qp[g * kPairs + 16 * half + j]));
      }
    }
    for (int g = 0; g < G; ++g) store_scores(acc[g], scale, own - 16 * b, scores + g * own + 16 * b);
  }
}

// o's layout in registers: the even-pair unpack of two rows' 32 values gives, in 128-bit
// lane L, d = 8L + 0..3 (lo) and the odd one d = 8L + 4..7 (hi), per half k of the row.
// accumulate's load_lo / load_hi gather natural d order into (lo, hi); store0 / store1 back.
static inline __m512i idx(int a, int b, int c, int d) {  // four runs of 4 from a, b, c, d
  return _mm512_setr_epi32(a, a + 1, a + 2, a + 3, b, b + 1, b + 2, b + 3, c, c + 1, c + 2,
                           c + 3, d, d + 1, d + 2, d + 3);
}

// acc_g (64 floats) = corr_g * acc_g + the p-weighted sum of V's rows rows[0 .. n) (the
// header's o), p_g = p + g * stride (float32, rounded here). `steps` of the next tile's cache
// lines (ahead) are asked for a few per key pair, spread over the arithmetic.
template <int G>
static void accumulate(const float* p, int64_t stride, const uint16_t* const* rows, int64_t n,
                       const float* corr, float* acc, LinesAhead& ahead, int64_t steps) {
  alignas(64) uint32_t pp[G][kTileKeys / 2];
  for (int g = 0; g < G; ++g)
    for (int64_t k0 = 0; k0 < n; k0 += 32) {
      const int64_t left = n - k0;
      const __mmask16 m0 = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
      const __mmask16 m1 = left >= 32 ? 0xFFFF
                           : left > 16 ? static_cast<__mmask16>((1u << (left - 16)) - 1) : 0;
      const float* x = p + g * stride + k0;
      const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(m1, x + 16),
                                             _mm512_maskz_loadu_ps(m0, x));
      _mm512_storeu_si512(&pp[g][k0 / 2], (__m512i)b);
    }
  const __m512i load_lo = idx(0, 8, 16, 24), load_hi = idx(4, 12, 20, 28);
  const __m512i store0 = idx(0, 16, 4, 20), store1 = idx(8, 24, 12, 28);
  __m512 a[G][4];  // [2k]: half k's lo words, [2k + 1]: its hi words
  attention_keys_t::load_split<G>(acc, corr, load_lo, load_hi, a);
  const int64_t pairs = (n + 1) / 2;
  AheadShare share(ahead, steps, pairs);
  for (int64_t u = 0; u < pairs; ++u) {
    share.next();
    const bool second = 2 * u + 1 < n;
    for (int k = 0; k < 2; ++k) {
      const __m512i x0 = _mm512_loadu_si512(rows[2 * u] + 32 * k);
      const __m512i x1 = second ? _mm512_loadu_si512(rows[2 * u + 1] + 32 * k)
                                : _mm512_setzero_si512();
      const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x0, x1);
      const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
      for (int g = 0; g < G; ++g) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(pp[g][u]);
        a[g][2 * k] = _mm512_dpbf16_ps(a[g][2 * k], lo, w);
        a[g][2 * k + 1] = _mm512_dpbf16_ps(a[g][2 * k + 1], hi, w);
      }
    }
  }
  attention_keys_t::store_split<G>(a, store0, store1, acc);
}

// One KV head's G query heads: scores from kP (a group's tile) or from rows read in place.
static void score_group(int64_t G, const uint32_t* qp, const uint32_t* kP,
                        const uint16_t* const* rows, float scale, int64_t own, float* scores) {
  with_group_size<6>(G, [&](auto g) {  // G = 1 .. 6: keys_t's `applies`
    if (kP != nullptr)
      score_pairs<g.value>(qp, kP, scale, own, scores);
    else
      score_raw<g.value>(qp, rows, scale, own, scores);
  });
}

static void accumulate_group(int64_t G, const float* p, int64_t stride,
                             const uint16_t* const* rows, int64_t n, const float* corr,
                             float* acc, LinesAhead& ahead, int64_t steps) {
  with_group_size<6>(
      G, [&](auto g) { accumulate<g.value>(p, stride, rows, n, corr, acc, ahead, steps); });
}

#pragma GCC pop_options

}  // namespace attention_keys_dp
#endif
