// Products of GGUF block weights (every kind of linear_gguf.h, read in place)
// with float activations rounded to int16, on the SIMD builds (AVX2; AVX-512 builds run the
// same 256-bit code), at every M. Included by linear_cpu.h, which dispatches to it.
//
// Why integers: expanding each weight to float32 costs a widening, a conversion and an FMA
// with its scale before the FMA with x; at one row of x that held the K-quant layers to 3-4
// GB/s on Zen 3, where llama.cpp (int8 activations, one vpmaddubsw per 32 weights) reads 12.
// Here x is rounded to int16 and split into its two bytes, x16 = 256 hi + lo (hi int8, lo
// uint8), so that the stored values q (unsigned bytes, zero point not subtracted) meet x in
// vpmaddubsw as llama.cpp's do, twice: maddubs(q, hi) and maddubs(lo, q) (pair sums at most
// 2 * 63 * 128 and 2 * 255 * 63 < 2^15: no saturation). vpmaddwd then applies the
// sub-block's integer scale (K-quants) and sums pairs into int32, and a K-quant super-block is
// summed in integers before one conversion:
//
//   x16 = round-half-even(x / dx), dx = amax / 32767 per block of XB values of x: XB = 256
//   where K allows (every K-quant layer; Q5_0 / Q5_1 layers with K % 256 == 0), else 32
//   S16, S32: the (exact, integer) sums of x16 over 16 and 32 values
//   Q5_0:         y += dx d_b (sum_j q_j x16_j - 16 S32_b)
//   Q5_1:         y += dx (d_b sum_j q_j x16_j + m_b S32_b)
//   Q4_K, Q5_K:   y += dx (d sum_s sc_s sum_j q_j x16_j - dmin sum_s mn_s S32_s)
//   Q6_K:         y += dx d (sum_h sc_h sum_j q_j x16_j - 32 sum_h sc_h S16_h)   (h: 16 weights)
//   Q3_K:         the same with sc_h - 32 for sc_h and 4 for 32
//   Q2_K:         y += dx (d sum_h sc_h sum_j q_j x16_j - dmin sum_h mn_h S16_h)
//   IQ4_NL:       y += dx d_b (sum_j v_j x16_j)
//   IQ4_XS:       y += dx d sum_s (sc_s - 32) (sum_j v_j x16_j)
// IQ4's levels v (int8, up to 127 in magnitude) would overflow vpmaddubsw's pair sums, so
// they and x16 are widened to int16 for vpmaddwd (levels_madd), each sub-block's int32 sum
// converted to float before its scale.
//
// That is y = W x^ exactly up to float32 rounding, x^ = dx x16 the rounded activations, W the
// gguf package's dequantization (the same block_values and scales as the float kernels). The
// int32 sums stay below 2^31 (a super-block's: 8 * 2 * 32130 * 128). Error: x's rounding,
// <= 1.5e-5 of the largest |x| of its block (256x finer than llama.cpp's int8 per 256).
//
// Invariants: x's rounding is per row and per block (XB depends on K only), and each (row of
// x, row of W) output has its own accumulators summed in one order, so a row's result is
// bitwise the same at any M, with any neighbours, chunking or threads
// (tests/quantization/test_gguf_kquants.py).
#pragma once
#include "linear_gguf.h"
#include "quant_blocks.h"
#include <cstring>

#if defined(TM_GGUF_SIMD)
#define TOKENMILL_GGUF_ROWS 1
constexpr bool kGgufRows = true;

namespace gguf_rows {
using namespace gguf_blocks;

#define TM_ROWS_UNROLL _Pragma("GCC unroll 8")

// M rows of x rounded to int16 per XB values, as the kernels read them.
struct SplitRows {
  int64_t K = 0, XB = 0;
  AlignedVector<int8_t> hi;    // (M, K) x16 >> 8
  AlignedVector<uint8_t> lo;   // (M, K) x16 & 255
  std::vector<float> d;      // (M, K / XB) dx
  std::vector<float> s16;    // (M, K / 16) sums of x16, integers held exactly as floats
  std::vector<float> s32;    // (M, K / 32)
};

static inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

// Bytes of four vectors of 8 int32 (each fitting a byte), in order.
static TM_GGUF_INLINE __m256i pack_bytes(__m256i a, __m256i b, __m256i c, __m256i e,
                                         bool is_signed) {
  const __m256i ab = _mm256_packs_epi32(a, b), ce = _mm256_packs_epi32(c, e);
  const __m256i bytes = is_signed ? _mm256_packs_epi16(ab, ce) : _mm256_packus_epi16(ab, ce);
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// One block of XB values of one row (x, out index i0 in values).
static void split_block(const float* x, int64_t XB, SplitRows& r, int64_t i0) {
  __m256 amax = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t i = 0; i < XB; i += 8)
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float top = std::max(_mm_cvtss_f32(m4), _mm_cvtss_f32(_mm_shuffle_ps(m4, m4, 1)));
  const float dx = top / 32767.f, inv = dx > 0.f ? 1.f / dx : 0.f;
  r.d[i0 / XB] = dx;
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m256i byte = _mm256_set1_epi32(0xFF);
  for (int64_t i = 0; i < XB; i += 32) {
    __m256i q[4];
    for (int c = 0; c < 4; ++c)  // the default rounding mode: half to even
      q[c] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * c), vinv));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.hi.data() + i0 + i),
                        pack_bytes(_mm256_srai_epi32(q[0], 8), _mm256_srai_epi32(q[1], 8),
                                   _mm256_srai_epi32(q[2], 8), _mm256_srai_epi32(q[3], 8), true));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.lo.data() + i0 + i),
                        pack_bytes(_mm256_and_si256(q[0], byte), _mm256_and_si256(q[1], byte),
                                   _mm256_and_si256(q[2], byte), _mm256_and_si256(q[3], byte),
                                   false));
    const int32_t a = hsum_epi32(_mm256_add_epi32(q[0], q[1]));
    const int32_t b = hsum_epi32(_mm256_add_epi32(q[2], q[3]));
    const int64_t j = (i0 + i) / 16;
    r.s16[j] = static_cast<float>(a), r.s16[j + 1] = static_cast<float>(b);
    r.s32[j / 2] = static_cast<float>(a + b);
  }
}

// x (M, K) float32 rounded and split (K a multiple of 32).
static SplitRows split_rows(const float* x, int64_t M, int64_t K) {
  SplitRows r;
  r.K = K, r.XB = K % 256 == 0 ? 256 : 32;
  r.hi.resize(M * K), r.lo.resize(M * K), r.d.resize(M * K / r.XB);
  r.s16.resize(M * K / 16), r.s32.resize(M * K / 32);
  const int64_t blocks = M * K / r.XB;
  auto run = [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) split_block(x + b * r.XB, r.XB, r, b * r.XB);
  };
  if (M <= 4) run(0, blocks);  // a decode step: not worth waking the thread pool
  else at::parallel_for(0, blocks, 64, run);
  return r;
}

// What the kernels read of one group of M <= 4 rows (row m at offset m * K, m * K / XB, ...).
struct RowsX {
  const int8_t* hi;
  const uint8_t* lo;
  const float *d, *s16, *s32;
  int64_t K, XB;
};

static inline RowsX rows_at(const SplitRows& r, int64_t m) {
  return {r.hi.data() + m * r.K, r.lo.data() + m * r.K, r.d.data() + m * (r.K / r.XB),
          r.s16.data() + m * (r.K / 16), r.s32.data() + m * (r.K / 32), r.K, r.XB};
}

// ih += madd(maddubs(q, hi), sh), il += madd(maddubs(lo, q), sl): sum_j q_j x16_j of 32
// weights in 8 int32 lanes, each int16 pair of products weighed by sh (hi part) and sl (lo).
static TM_GGUF_INLINE void block_madd(__m256i q, const int8_t* hi, const uint8_t* lo,
                                      __m256i sh, __m256i sl, __m256i& ih, __m256i& il) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi));
  const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo));
  ih = _mm256_add_epi32(ih, _mm256_madd_epi16(_mm256_maddubs_epi16(q, h), sh));
  il = _mm256_add_epi32(il, _mm256_madd_epi16(_mm256_maddubs_epi16(l, q), sl));
}

// 256 ih + il as floats.
static TM_GGUF_INLINE __m256 joined(__m256i ih, __m256i il) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(ih), _mm256_set1_ps(256.f), _mm256_cvtepi32_ps(il));
}

// The scales of a K-quant super-block, as the products take them: int16 lanes that one
// vpshufb per sub-block spreads over a vector (pair_scale), and the mins as floats.
struct SuperScales {
  __m256i lo, hi;  // Q4_K / Q5_K: the 8 scales in each 128-bit half of lo; per16 kinds: the
                   // 16 half-sub-block scales, 0..7 in both halves of lo, 8..15 of hi
  __m256 mins;     // Q4_K / Q5_K: the 8 mins times -dmin
  __m256 off16[2];  // per16 kinds: what each 16 weights' S16 adds (16 floats; -zero d sc, or
                    // Q2_K's -dmin mn)
  __m256i mn16;     // Q2_K, Q4_K, Q5_K: the integer mins of the 16 groups of 16 weights
                    // (Q4_K / Q5_K: each sub-block's twice), for linear_gguf_int8.h
  float neg_dmin;   // and their factor, -dmin
};

// 8 int16 (lanes 0..7) each doubled: one per sub-block to one per group of 16 weights.
static TM_GGUF_INLINE __m256i per_group(__m128i eight) {
  return _mm256_set_m128i(_mm_unpackhi_epi16(eight, eight), _mm_unpacklo_epi16(eight, eight));
}

// Lanes 0..7 of an int16 vector as floats.
static TM_GGUF_INLINE __m256 low_floats(__m256i v) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(v)));
}

// The 16 int8 scales of a per16 kind as SuperScales' lo / hi.
static TM_GGUF_INLINE void scales16(__m128i sc, SuperScales& r) {
  r.lo = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(sc));
  r.hi = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_unpackhi_epi64(sc, sc)));
}

// A zero point's part of each 16 weights' offset: the scales times `by` (-zero d).
static TM_GGUF_INLINE void zero_point_offsets(float by, SuperScales& r) {
  r.off16[0] = _mm256_mul_ps(low_floats(r.lo), _mm256_set1_ps(by));
  r.off16[1] = _mm256_mul_ps(low_floats(r.hi), _mm256_set1_ps(by));
}

// Q4_K / Q5_K: llama.cpp's unpacking of the 12 packed bytes of 6-bit (scale, min) pairs
// (scale_min in linear_gguf.h reads the same bits one at a time). Q6_K: its 16 int8 scales;
// Q3_K its 16 6-bit ones (q3_k_scales) less 32; Q2_K its 16 (scale, min) nibble pairs.
template <int64_t KIND>
static TM_GGUF_INLINE SuperScales superblock_scales(const uint8_t* p) {
  SuperScales r{};
  if constexpr (KIND == kQ6_K) {
    scales16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192)), r);
    zero_point_offsets(-32.f * half_at(p + 208), r);
    return r;
  } else if constexpr (KIND == kQ3_K) {
    // q3_k_scales in registers (through memory, its 16 bytes stalled the load that read
    // them back): the low nibbles of bytes 0..7, then their high nibbles; scale i's high
    // bits from byte 8 + i % 4 (the word repeated), shifted by 2 (i / 4)
    const __m128i low8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 96));
    const __m128i nib = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_unpacklo_epi64(_mm_and_si128(low8, nib),
                                           _mm_and_si128(_mm_srli_epi16(low8, 4), nib));
    uint32_t h;
    std::memcpy(&h, p + 104, 4);
    const __m128i high = _mm_srlv_epi32(_mm_set1_epi32(static_cast<int>(h)),
                                        _mm_setr_epi32(0, 2, 4, 6));
    const __m128i sc = _mm_or_si128(low, _mm_slli_epi16(_mm_and_si128(high, _mm_set1_epi8(3)), 4));
    scales16(_mm_sub_epi8(sc, _mm_set1_epi8(32)), r);
    zero_point_offsets(-4.f * half_at(p + 108), r);
    return r;
  } else if constexpr (KIND == kQ2_K) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i nib = _mm_set1_epi8(0x0F);
    scales16(_mm_and_si128(b, nib), r);  // its offsets: the mins times -dmin
    const __m128i mn = _mm_and_si128(_mm_srli_epi16(b, 4), nib);
    r.mn16 = _mm256_cvtepu8_epi16(mn);
    r.neg_dmin = -half_at(p + 82);
    const __m256 by = _mm256_set1_ps(r.neg_dmin);
    r.off16[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn)), by);
    r.off16[1] = _mm256_mul_ps(
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(mn, mn))), by);
    return r;
  }
  constexpr uint32_t k6 = 0x3f3f3f3f, k4 = 0x0f0f0f0f, k2 = 0x03030303;
  uint32_t u[3];
  std::memcpy(u, p + 4, 12);
  const uint32_t scales_hi = (u[2] & k4) | (((u[0] >> 6) & k2) << 4);      // scales 4..7
  const uint32_t mins_hi = ((u[2] >> 4) & k4) | (((u[1] >> 6) & k2) << 4);  // mins 4..7
  const __m128i v = _mm_setr_epi32(static_cast<int>(u[0] & k6), static_cast<int>(scales_hi),
                                   static_cast<int>(u[1] & k6), static_cast<int>(mins_hi));
  r.lo = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(v));
  r.mn16 = per_group(_mm_cvtepu8_epi16(_mm_unpackhi_epi64(v, v)));
  r.neg_dmin = -half_at(p + 2);
  r.mins = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(v, v))),
                         _mm256_set1_ps(r.neg_dmin));
  return r;
}

// vpshufb controls that spread a sub-block's scale(s), int16 lanes of each 128-bit lane of
// SuperScales, over its weights' lanes: entry s (0..7) lane s everywhere; entry 8 + s (per16
// kinds) lane (2s) % 8 over weights 0..15 and (2s + 1) % 8 over 16..31. `w256` for 256-bit
// vectors of int16 pairs (weights 0..15 in the low 128 bits), `w512` for 512-bit ones of
// int16 weights (0..15 in the low 256 bits). Read from memory (one load, folded into the
// shuffle): built in registers they had cost four instructions a sub-block.
struct SpreadTable {
  alignas(64) uint8_t w512[16][64];
  alignas(32) uint8_t w256[16][32];
};
static SpreadTable make_spread_table() {
  SpreadTable t{};
  for (int e = 0; e < 16; ++e) {
    const int s = e % 8, a = e < 8 ? s : (2 * s) % 8, b = e < 8 ? s : (2 * s + 1) % 8;
    for (int j = 0; j < 64; ++j) t.w512[e][j] = static_cast<uint8_t>(2 * (j < 32 ? a : b) + j % 2);
    for (int j = 0; j < 32; ++j) t.w256[e][j] = static_cast<uint8_t>(2 * (j < 16 ? a : b) + j % 2);
  }
  return t;
}
inline const SpreadTable kSpread = make_spread_table();

// The entry of kSpread for sub-block s of a KIND.
template <int64_t KIND>
constexpr int spread_entry(int s) { return per16(KIND) ? 8 + s : s; }

// Sub-block s's scale for each int16 pair of its products: Q4_K / Q5_K one scale; per16
// kinds one per 16 weights (pairs 0..7, 8..15).
template <int64_t KIND>
static TM_GGUF_INLINE __m256i pair_scale(const SuperScales& sc, int s) {
  const __m256i spread =
      _mm256_load_si256(reinterpret_cast<const __m256i*>(kSpread.w256[spread_entry<KIND>(s)]));
  return _mm256_shuffle_epi8(per16(KIND) && s >= 4 ? sc.hi : sc.lo, spread);
}

// IQ4: sum_j v_j x16_j of 32 weights in 8 int32 lanes, v (signed int8 levels) and x16 (its
// bytes rejoined: lo + 256 hi) widened to int16 in the same in-lane order; a lane's four
// products stay under 4 * 127 * 32767.
static TM_GGUF_INLINE __m256i levels_madd(__m256i v, const int8_t* hi, const uint8_t* lo) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi));
  const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo));
  const __m256i sign = _mm256_cmpgt_epi8(_mm256_setzero_si256(), v);
  const __m256i a = _mm256_madd_epi16(_mm256_unpacklo_epi8(v, sign), _mm256_unpacklo_epi8(l, h));
  const __m256i b = _mm256_madd_epi16(_mm256_unpackhi_epi8(v, sign), _mm256_unpackhi_epi8(l, h));
  return _mm256_add_epi32(a, b);
}

// `stream` (below): x is one group of rows (a decode step), so W is read once, as one stream
// whose blocks ask for the bytes ahead of them (prefetch_ahead, vec_utils.h).

// Block b of a 32-weight-block kind (Q5_0, Q5_1, IQ4_NL) times M rows of x, into acc and
// offset.
template <int64_t KIND, int M>
static TM_GGUF_INLINE void small_block(const uint8_t* row, const RowsX& x, int64_t b,
                                       __m256 (&acc)[M], float (&offset)[M], bool stream) {
  const uint8_t* p = row + b * block_bytes(KIND);
  if (stream && b % 4 == 0) prefetch_ahead(p, 4 * block_bytes(KIND));
  const __m256i q = block_values<KIND>(p, 0);
  const float d = half_at(p);
  // Q5_0: the zero point's part, -16 d S32; Q5_1: the offset's, m S32
  const float per_sum = KIND == kQ5_0 ? -16.f * d : KIND == kQ5_1 ? half_at(p + 2) : 0.f;
  // 256 hi + lo in one int32 sum: a block's is at most 32 * 31 * 32767 (exact in float32)
  const __m256i by_hi = _mm256_set1_epi16(256), by_lo = _mm256_set1_epi16(1);
  const int64_t nx = x.K / x.XB, xb = x.XB == 256 ? b >> 3 : b;  // b's block of x
  TM_ROWS_UNROLL
  for (int m = 0; m < M; ++m) {
    const int8_t* hi = x.hi + m * x.K + b * kBlock;
    const uint8_t* lo = x.lo + m * x.K + b * kBlock;
    __m256i sum = _mm256_setzero_si256();
    if constexpr (is_iq4(KIND)) sum = levels_madd(q, hi, lo);
    else block_madd(q, hi, lo, by_hi, by_lo, sum, sum);
    const float dx = x.d[m * nx + xb];
    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(d * dx), acc[m]);
    if constexpr (!is_iq4(KIND))
      offset[m] = std::fma(per_sum * dx, x.s32[m * (x.K / kBlock) + b], offset[m]);
  }
}

// Row `row` of a 32-weight-block kind times M rows of x. Blocks alternate between two sets
// of accumulators: one FMA chain per sum had bound the loop.
template <int64_t KIND, int M>
static TM_GGUF_INLINE void small_block_row(const uint8_t* row, const RowsX& x, float (&out)[M],
                                           bool stream) {
  __m256 acc0[M], acc1[M];
  float off0[M], off1[M];
  TM_ROWS_UNROLL
  for (int m = 0; m < M; ++m)
    acc0[m] = acc1[m] = _mm256_setzero_ps(), off0[m] = off1[m] = 0.f;
  const int64_t nb = x.K / kBlock;
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    small_block<KIND, M>(row, x, b, acc0, off0, stream);
    small_block<KIND, M>(row, x, b + 1, acc1, off1, stream);
  }
  if (b < nb) small_block<KIND, M>(row, x, b, acc0, off0, stream);
  TM_ROWS_UNROLL
  for (int m = 0; m < M; ++m)
    out[m] = hsum8(_mm256_add_ps(acc0[m], acc1[m])) + (off0[m] + off1[m]);
}

// IQ4_XS super-block sb at p times M rows of x, into acc.
template <int M>
static TM_GGUF_INLINE void iq4_xs_superblock(const uint8_t* p, const RowsX& x, int64_t sb,
                                             __m256 (&acc)[M]) {
  __m256 f[M];
  TM_ROWS_UNROLL
  for (int m = 0; m < M; ++m) f[m] = _mm256_setzero_ps();
  TM_ROWS_UNROLL
  for (int s = 0; s < 8; ++s) {
    const __m256i q = block_values<kIQ4_XS>(p, s);
    const __m256 scale = _mm256_set1_ps(static_cast<float>(iq4_xs_scale(p, s) - 32));
    const int64_t k = sb * 256 + s * kBlock;
    TM_ROWS_UNROLL
    for (int m = 0; m < M; ++m)
      f[m] = _mm256_fmadd_ps(
          _mm256_cvtepi32_ps(levels_madd(q, x.hi + m * x.K + k, x.lo + m * x.K + k)), scale,
          f[m]);
  }
  const __m256 dv = _mm256_set1_ps(half_at(p));
  const int64_t nsb = x.K / 256;
  TM_ROWS_UNROLL
  for (int m = 0; m < M; ++m)
    acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(f[m], dv), _mm256_set1_ps(x.d[m * nsb + sb]), acc[m]);
}

// K-quant super-block sb at p (Q2_K .. Q6_K: unsigned values, vpmaddubsw) times M rows of
// x, into acc.
template <int64_t KIND, int M>
static TM_GGUF_INLINE void kquant_superblock(const uint8_t* p, const RowsX& x, int64_t sb,
                                             __m256 (&acc)[M]) {
  const int64_t nsb = x.K / 256;
  const SuperScales sc = superblock_scales<KIND>(p);
  __m256i ih[M], il[M];
  TM_ROWS_UNROLL
  for (int m = 0; m < M; ++m) ih[m] = il[m] = _mm256_setzero_si256();
  TM_ROWS_UNROLL
  for (int s = 0; s < 8; ++s) {
    const __m256i q = block_values<KIND>(p, s);
    const __m256i scale = pair_scale<KIND>(sc, s);
    const int64_t k = sb * 256 + s * kBlock;
    TM_ROWS_UNROLL
    for (int m = 0; m < M; ++m) {
      block_madd(q, x.hi + m * x.K + k, x.lo + m * x.K + k, scale, scale, ih[m], il[m]);
      // Integer sums may be reassociated: GCC computed all eight sub-blocks' products
      // first, spilled them, and summed them as a tree (2x slower at four rows of x). This
      // empty statement keeps each accumulator a running sum in its register.
      __asm__("" : "+x"(ih[m]), "+x"(il[m]));
    }
  }
  const __m256 dv = _mm256_set1_ps(half_at(p + d_offset(KIND)));
  TM_ROWS_UNROLL
  for (int m = 0; m < M; ++m) {
    __m256 f = _mm256_mul_ps(joined(ih[m], il[m]), dv);
    if constexpr (per16(KIND)) {  // + sum_h off16_h S16_h
      const float* s16 = x.s16 + m * (x.K / 16) + sb * 16;
      f = _mm256_fmadd_ps(sc.off16[0], _mm256_loadu_ps(s16), f);
      f = _mm256_fmadd_ps(sc.off16[1], _mm256_loadu_ps(s16 + 8), f);
    } else {  // - dmin sum_s mn_s S32_s
      f = _mm256_fmadd_ps(sc.mins, _mm256_loadu_ps(x.s32 + m * (x.K / kBlock) + sb * 8), f);
    }
    acc[m] = _mm256_fmadd_ps(f, _mm256_set1_ps(x.d[m * nsb + sb]), acc[m]);
  }
}

// Row `row` of a 256-weight kind times M rows of x (XB = 256: one dx a super-block),
// super-block by super-block.
template <int64_t KIND, int M>
static TM_GGUF_INLINE void super_block_row(const uint8_t* row, const RowsX& x, float (&out)[M],
                                           bool stream) {
  __m256 acc[M];
  TM_ROWS_UNROLL
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < x.K / 256; ++sb) {
    const uint8_t* p = row + sb * block_bytes(KIND);
    if (stream) prefetch_ahead(p, block_bytes(KIND));
    if constexpr (is_iq4(KIND)) iq4_xs_superblock<M>(p, x, sb, acc);
    else kquant_superblock<KIND, M>(p, x, sb, acc);
  }
  TM_ROWS_UNROLL
  for (int m = 0; m < M; ++m) out[m] = hsum8(acc[m]);
}

// W rows [n0, n1) (raw block rows, row_bytes apart) times M <= 4 rows of x into y (stride N:
// y's row stride);
// `stream`: x is this one group, so W is read once (prefetched ahead).
template <int64_t KIND, int M>
static void rows_times(const uint8_t* W, int64_t row_bytes, const RowsX& x, const float* bias,
                       float* y, int64_t N, int64_t n0, int64_t n1, bool stream) {
  for (int64_t n = n0; n < n1; ++n) {
    float out[M];
    if constexpr (block_weights(KIND) == 32)
      small_block_row<KIND, M>(W + n * row_bytes, x, out, stream);
    else
      super_block_row<KIND, M>(W + n * row_bytes, x, out, stream);
    for (int m = 0; m < M; ++m) y[m * N + n] = out[m] + (bias ? bias[n] : 0.f);
  }
}

template <int64_t KIND>
static void rows_times_any(int64_t mr, const uint8_t* W, int64_t row_bytes, const RowsX& x,
                           const float* bias, float* y, int64_t N, int64_t n0, int64_t n1,
                           bool stream) {
  switch (mr) {
    case 1: return rows_times<KIND, 1>(W, row_bytes, x, bias, y, N, n0, n1, stream);
    case 2: return rows_times<KIND, 2>(W, row_bytes, x, bias, y, N, n0, n1, stream);
    case 3: return rows_times<KIND, 3>(W, row_bytes, x, bias, y, N, n0, n1, stream);
    default: return rows_times<KIND, 4>(W, row_bytes, x, bias, y, N, n0, n1, stream);
  }
}

// rows_times_any of one kind, chosen once per product.
using RowsTimes = void (*)(int64_t, const uint8_t*, int64_t, const RowsX&, const float*, float*,
                           int64_t, int64_t, int64_t, bool);
static RowsTimes rows_times_of(int64_t kind) {
  switch (kind) {
#define TM_GGUF_CASE(k) \
  case k: return &rows_times_any<k>;
    TM_GGUF_KINDS(TM_GGUF_CASE)
#undef TM_GGUF_CASE
  }
  TORCH_CHECK(false, "no GGUF row kernel for weight kind ", kind);
}

// Rows of W per tile: a tile stays in L2 while every group of four rows of x passes it.
constexpr int64_t kTileRows = 32;

// y's N columns (row stride ldy) = x @ W^T (+ bias) for a GGUF kind's raw block rows W (N,
// row_bytes), x (M, K) already split (split_rows): the parts of a merged layer share one split
// and write side by side (linear_cpu.h). Threads take contiguous ranges of tiles.
inline void linear_split(int64_t kind, const uint8_t* W, const SplitRows& xr, int64_t M,
                         int64_t K, int64_t N, const float* bias, float* y, int64_t ldy) {
  const int64_t row_bytes = gguf_blocks::row_bytes(kind, K);
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const bool stream = M <= 4;
  const RowsTimes rows_times_kind = rows_times_of(kind);
  // x in blocks of ~1 MB (two bytes a value): 2048 rows of a 2048 x 8192 Q4_K layer, AVX2
  // build on Zen 4: 57 -> 65 G products/s; 256 KB blocks 63
  const int64_t xblock = x_block_rows(2 * K, 4, 1 << 20);
  at::parallel_for(0, tiles, std::max<int64_t>(1, tiles / threads), [&](int64_t t0, int64_t t1) {
    for (int64_t m0 = 0; m0 < M; m0 += xblock) {
      const int64_t m1 = std::min(M, m0 + xblock);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n0 = t * kTileRows, n1 = std::min(N, n0 + kTileRows);
        for (int64_t m = m0; m < m1; m += 4) {
          const RowsX x = rows_at(xr, m);
          const int64_t mr = std::min<int64_t>(4, m1 - m);
          float* ym = y + m * ldy;
          rows_times_kind(mr, W, row_bytes, x, bias, ym, ldy, n0, n1, stream);
        }
      }
    }
  });
}

// y (M, N) = x @ W^T (+ bias), x (M, K) float32.
inline void linear(int64_t kind, const uint8_t* W, const float* xp, int64_t M, int64_t K,
                   int64_t N, const float* bias, float* y) {
  linear_split(kind, W, split_rows(xp, M, K), M, K, N, bias, y, N);
}

}  // namespace gguf_rows
#else
constexpr bool kGgufRows = false;
#endif  // TM_GGUF_SIMD
