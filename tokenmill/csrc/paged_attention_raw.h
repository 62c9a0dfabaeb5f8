// A lone query row's attention straight from a bfloat16 or float16 KV cache, for the rows that
// walk their keys alone (a decode: paged_attention_tiles.h `direct`): each K and V row read
// where it lies in the cache and widened in registers (F16: F16C's vcvtph2ps). AVX2 builds
// take every such cache; AVX-512 builds every float16 one and the bfloat16 ones the
// transposed-key path (paged_attention_keys_t.h: D = 64, G <= 6) does not, Llama-3.1-8B's
// D = 128 among them.
//
// Why: the widened path (load_tile) writes every tile's K and V rows of all the item's KV
// heads as floats (64 keys x 8 heads x 64 values: 128 KB each for Llama-3.2-1B, past L1 and
// a quarter of Zen 3's L2) and reads them back, for a row that uses them once; the
// forty-ninth session's perf put that widening and its waits on memory at 15% of a
// long-context decode step's samples against the arithmetic's 5.6%.
//
// The arithmetic is the widened path's (paged_attention_rows.h, and on AVX-512 builds
// paged_attention_groups.h, whose hsum4 gives each sum hsum's tree), the same operations in the
// same order on the same values (widening bf16 or fp16 is exact), so a row read here and the same row
// in a group (widened once for all) get the same bits; L = Vec::size() (8 or 16):
//   score_g[i] = scale * hsum(acc), acc = 0; acc = fma(q_g[d:d+L], k_i[d:d+L], acc) for
//                d = 0, L, .. D - L (score_keys<G>); hsum as vec_utils.h's;
//   o_g[d]     = corr_g * o_g[d], then o_g[d] = fma(p_g[i], v_i[d], o_g[d]) for i in order
//                (rescale_accumulate), here NV vectors of d at a time over the tile so that
//                the G heads' accumulators stay in registers: each value's chain is its
//                own, so the cut of d changes nothing.
// D a multiple of 16 (each vector of d whole on both widths), G = 1 .. 8 (score_keys<G>'s
// range).
#pragma once
#include "paged_attention_ahead.h"
#include "vec_utils.h"
#include <algorithm>
#include <cstdint>
#include <type_traits>

#if (defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)) || \
    (defined(CPU_CAPABILITY_AVX2) && defined(__AVX2__))
#define TM_ATTENTION_RAW 1

namespace attention_raw {

// Whether this path takes a cache of these shapes (half rows of D values: bf16 or fp16, G heads
// a group).
static inline bool applies(bool half, int64_t D, int64_t G) {
  return half && D % 16 == 0 && D > 0 && G >= 1 && G <= 8;
}

constexpr int64_t kLanes = Vec::size();

// The Vec::size() half values at p as floats (exact), bf16_load_row's or (F16)
// fp16_load_row's widening, in registers.
template <bool F16>
static inline Vec widen(const uint16_t* p) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
  const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (F16) return _mm512_cvtph_ps(u);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(u), 16));
#else
  const __m128i u = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (F16) return _mm256_cvtph_ps(u);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(u), 16));
#endif
}

// scores[(h G + g) own + i] = scale <q_{h,g}, k_{i,h}> for `heads` KV heads and the G query
// heads of each (q_{h,g} = q + (h G + g) D) and keys i < own, k_{i,h} the half row of head h
// of key i: kb + (key_rows[i] + h) row_bytes (D values). Key-major, as score_keys: a key's
// rows of the item's heads (contiguous in the cache) are read in one sweep, in address order,
// and its V rows (at the same offset in vb) asked for into L2 meanwhile, for accumulate_raw's
// walk head by head. Head by head here too, a short item's first tile (64 decodes over 80
// keys) waited on 64 scattered lines per head: 1.45x slower than the widened path, which
// reads whole rows; key-major with V asked for, 1.45x faster than it.
template <int G, bool F16>
static void score_raw(const float* q, const uint8_t* kb, const uint8_t* vb,
                      const int64_t* key_rows, int64_t row_bytes, int64_t heads, int64_t D,
                      float scale, int64_t own, float* scores) {
  for (int64_t i = 0; i < own; ++i) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t at = (key_rows[i] + h) * row_bytes;
      const auto* k = reinterpret_cast<const uint16_t*>(kb + at);
      for (int64_t o = 0; o < row_bytes; o += 64) prefetch_l2(vb + at + o);
      const float* qh = q + h * G * D;
      Vec acc[G];
      for (int g = 0; g < G; ++g) acc[g] = Vec(0.f);
      for (int64_t d = 0; d < D; d += kLanes) {
        const Vec kv = widen<F16>(k + d);
        for (int g = 0; g < G; ++g)
          acc[g] = at::vec::fmadd(Vec::loadu(qh + g * D + d), kv, acc[g]);
      }
      for (int g = 0; g < G; ++g) scores[(h * G + g) * own + i] = scale * hsum(acc[g]);
    }
  }
}

// acc_g (D) = corr_g * acc_g + sum_i p_g[i] * v_i for the G query heads g of one KV head
// (p_g = p + g * stride, acc_g = acc + g * D), v_i the half rows rows[i] (D values), over
// chunks of NV vectors of d (D a multiple of kLanes NV). `steps` of the next tile's cache
// lines (ahead) are asked for a few per key, spread over the whole walk
// (paged_attention_ahead.h).
template <int G, bool F16, int NV>
static void accumulate_raw(const float* p, int64_t stride, const uint16_t* const* rows,
                           int64_t n, int64_t D, const float* corr, float* acc,
                           LinesAhead& ahead, int64_t steps) {
  constexpr int64_t kChunk = kLanes * NV;
  AheadShare share(ahead, steps, n * (D / kChunk));  // over the (key, chunk) pairs walked
  for (int64_t d0 = 0; d0 < D; d0 += kChunk) {
    Vec a[G][NV];
    for (int g = 0; g < G; ++g) {
      const Vec c(corr[g]);
      for (int v = 0; v < NV; ++v) a[g][v] = Vec::loadu(acc + g * D + d0 + kLanes * v) * c;
    }
    for (int64_t i = 0; i < n; ++i) {
      share.next();
      Vec vv[NV];
      for (int v = 0; v < NV; ++v) vv[v] = widen<F16>(rows[i] + d0 + kLanes * v);
      for (int g = 0; g < G; ++g) {
        const Vec w(p[g * stride + i]);
        for (int v = 0; v < NV; ++v) a[g][v] = at::vec::fmadd(w, vv[v], a[g][v]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int v = 0; v < NV; ++v) a[g][v].store(acc + g * D + d0 + kLanes * v);
  }
}

// accumulate_raw with the most vectors of d a chunk that divide D and leave the G x NV
// accumulators, NV values and a weight in the registers (16 on AVX2, 32 on AVX-512).
template <int G, bool F16, int NV = (kLanes == 16 ? (G <= 4 ? 4 : 2) : (G <= 4 ? 2 : 1))>
static void accumulate_chunks(const float* p, int64_t stride, const uint16_t* const* rows,
                              int64_t n, int64_t D, const float* corr, float* acc,
                              LinesAhead& ahead, int64_t steps) {
  if constexpr (NV > 1) {
    if (D % (kLanes * NV) != 0)
      return accumulate_chunks<G, F16, NV / 2>(p, stride, rows, n, D, corr, acc, ahead, steps);
  }
  accumulate_raw<G, F16, NV>(p, stride, rows, n, D, corr, acc, ahead, steps);
}

// f(std::integral_constant<int, G>{}, std::bool_constant<f16>{}) for a runtime G (1 .. 8)
// and half kind (f16: the cache's rows are float16, else bfloat16).
template <class F>
static inline void with_group_and_kind(int64_t G, bool f16, F&& f) {
  with_group_size<8>(G, [&](auto g) {
    if (f16) return f(g, std::true_type{});
    f(g, std::false_type{});
  });
}

// The scores of `heads` KV heads' G query heads against keys read in place (score_raw);
// one KV head's weighted V sums (accumulate_raw).
static inline void score_heads_raw(bool f16, int64_t G, const float* q, const uint8_t* kb,
                                   const uint8_t* vb, const int64_t* key_rows,
                                   int64_t row_bytes, int64_t heads, int64_t D, float scale,
                                   int64_t own, float* scores) {
  with_group_and_kind(G, f16, [&](auto g, auto half) {
    score_raw<g.value, half.value>(q, kb, vb, key_rows, row_bytes, heads, D, scale, own,
                                   scores);
  });
}

static inline void accumulate_group_raw(bool f16, int64_t G, const float* p, int64_t stride,
                                        const uint16_t* const* rows, int64_t n, int64_t D,
                                        const float* corr, float* acc,
                                        LinesAhead& ahead, int64_t steps) {
  with_group_and_kind(G, f16, [&](auto g, auto half) {
    accumulate_chunks<g.value, half.value>(p, stride, rows, n, D, corr, acc, ahead, steps);
  });
}

}  // namespace attention_raw
#endif
