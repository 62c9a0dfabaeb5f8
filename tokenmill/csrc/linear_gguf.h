// GGUF block types read in place, as the file stores them: the 32-weight blocks Q5_0 / Q5_1 /
// IQ4_NL and the K-quant super-blocks Q2_K .. Q6_K and IQ4_XS (llama.cpp's ggml-common.h
// layouts). A weight is its raw block rows, uint8 (N, K / QK * block bytes): nothing is
// repacked or expanded at load.
//
// `block_values` unpacks the 32 stored values of a (sub-)block, one per byte in weight order:
// the integer row kernels (linear_gguf_rows.h, SIMD builds) multiply them as they are; for
// the dot kernels (linear_dot.h: the portable build, expansions, embedding lookups)
// `gguf_block` adds the float32 scale(s) and offset that give the dequantized weight:
//
//   kind 3   Q5_0   22 B / 32:  d, qh (32 high bits), 16 B nibbles      w = d * (q - 16)
//   kind 4   Q5_1   24 B / 32:  d, m, qh, nibbles                       w = d * q + m
//   kind 14  IQ4_NL 18 B / 32:  d, 16 B nibbles indexing kIQ4Values      w = d * v[q]
//   kind 5   Q4_K  144 B / 256: d, dmin, 12 B of 6-bit scale/min pairs, 128 B nibbles
//                                                                     w = (d sc) q - dmin mn
//   kind 6   Q5_K  176 B / 256: as Q4_K plus 32 B of high bits           the same, q in 0..31
//   kind 7   Q6_K  210 B / 256: 128 B low nibbles, 64 B 2-bit highs, 16 int8 scales, d
//                                                                     w = (d sc16) (q - 32)
//   kind 11  Q3_K  110 B / 256: 32 B high bits, 64 B 2-bit lows, 12 B of 16 6-bit scales, d
//                                                                     w = (d (sc16 - 32)) (q - 4)
//   kind 12  Q2_K   84 B / 256: 16 B of 4-bit scale/min pairs, 64 B 2-bit values, d, dmin
//                                                                     w = (d sc16) q - dmin mn16
//   kind 13  IQ4_XS 136 B / 256: d, 2 B + 4 B of 8 6-bit scales, 128 B nibbles
//                                                                     w = (d (sc - 32)) v[q]
// (sc16, mn16: one per 16 weights; v: IQ4's 16 non-linear int8 levels.)
//
// Each weight comes out as the gguf package's dequantize computes it, bit for bit: the
// products d sc and dmin mn are exact in float32 (11 + 8 bits at most), (d sc) q is exact
// for the 2-5 bit kinds (<= 22 bits) and rounded once for Q6_K and IQ4 as in numpy, and the
// one rounding of fma(q, d sc, -dmin mn) is numpy's rounding of the exact product minus dm
// (tests/quantization/test_gguf_kquants.py).
#pragma once
#include "quant_blocks.h"
#include <cstring>

namespace gguf_blocks {

#define TM_GGUF_INLINE inline __attribute__((always_inline))

constexpr int64_t kQ5_0 = 3, kQ5_1 = 4, kQ4_K = 5, kQ5_K = 6, kQ6_K = 7, kQ3_K = 11,
                  kQ2_K = 12, kIQ4_XS = 13, kIQ4_NL = 14;
// X(kind) for every kind above: the switches that instantiate a kernel per kind.
#define TM_GGUF_KINDS(X) X(kQ5_0) X(kQ5_1) X(kQ4_K) X(kQ5_K) X(kQ6_K) X(kQ3_K) X(kQ2_K) \
  X(kIQ4_XS) X(kIQ4_NL)
constexpr bool is_gguf_kind(int64_t kind) {
  return (kind >= kQ5_0 && kind <= kQ6_K) || (kind >= kQ3_K && kind <= kIQ4_NL);
}
// Weights and bytes per block of the file.
constexpr int64_t block_weights(int64_t kind) {
  return kind == kQ5_0 || kind == kQ5_1 || kind == kIQ4_NL ? 32 : 256;
}
constexpr bool is_kquant(int64_t kind) { return block_weights(kind) == 256; }
constexpr int64_t block_bytes(int64_t kind) {
  switch (kind) {
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    case kIQ4_NL: return 18;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    case kQ3_K: return 110;
    case kQ2_K: return 84;
    default: return 136;  // IQ4_XS
  }
}
constexpr int64_t row_bytes(int64_t kind, int64_t K) {
  return K / block_weights(kind) * block_bytes(kind);
}
// Where a block's float16 scale d sits.
constexpr int64_t d_offset(int64_t kind) {
  return kind == kQ6_K ? 208 : kind == kQ3_K ? 108 : kind == kQ2_K ? 80 : 0;
}
// Offsets (Q5_1, Q4_K, Q5_K, Q2_K) or a plain scale.
constexpr bool has_offset(int64_t kind) {
  return kind == kQ5_1 || kind == kQ4_K || kind == kQ5_K || kind == kQ2_K;
}
// Kinds with a scale (and Q2_K an offset) per 16 weights: two per 32-weight sub-block.
constexpr bool per16(int64_t kind) { return kind == kQ6_K || kind == kQ3_K || kind == kQ2_K; }
// IQ4's values are levels of a table, signed int8 in -127..113, not integers from zero.
constexpr bool is_iq4(int64_t kind) { return kind == kIQ4_XS || kind == kIQ4_NL; }
alignas(16) constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                               1,    13,   25,  38,  53,  69,  89,  113};

#if (defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)) || \
    (defined(CPU_CAPABILITY_AVX2) && defined(__AVX2__))
#define TM_GGUF_SIMD 1
using Bytes32 = __m256i;  // 32 quantized values, int8, weight order

static TM_GGUF_INLINE __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
static TM_GGUF_INLINE __m256i shift_right16(__m256i v, int bits) {  // per 16-bit lane
  return _mm256_srl_epi16(v, _mm_cvtsi32_si128(bits));
}
// Bit j of the 32-bit word at p → 0x10 in byte j (the fifth bit of weight j).
static TM_GGUF_INLINE __m256i fifth_bits(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  // byte j takes the byte of `bits` holding its bit, then keeps that one bit
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i select = _mm256_set1_epi64x(0x8040201008040201);
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}
// 16 bytes of nibbles (weight j low, j + 16 high) → 32 values.
static TM_GGUF_INLINE __m256i split_nibbles(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), mask), _mm_and_si128(b, mask));
}
static TM_GGUF_INLINE __m256i bits_at(const uint8_t* p, int shift, int mask) {  // (p[j] >> s) & mask
  return _mm256_and_si256(shift_right16(load32(p), shift), _mm256_set1_epi8(mask));
}

// The c-th kV-vector of the 32 values as float32.
static TM_GGUF_INLINE Vec chunk(const Bytes32& v, int c) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
  const __m128i half = c ? _mm256_extracti128_si256(v, 1) : _mm256_castsi256_si128(v);
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(half)));
#else
  __m128i half = c >= 2 ? _mm256_extracti128_si256(v, 1) : _mm256_castsi256_si128(v);
  if (c & 1) half = _mm_unpackhi_epi64(half, half);
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(half)));
#endif
}
#else
struct Bytes32 {
  int8_t b[32];
};
static inline Vec chunk(const Bytes32& v, int c) {
  float buf[kV];
  for (int64_t i = 0; i < kV; ++i) buf[i] = static_cast<float>(v.b[c * kV + i]);
  return Vec::loadu(buf);
}
#endif

// One 32-weight block, ready to expand: values, scale(s), offset(s).
struct Block {
  Bytes32 q;
  float d, d2, m, m2;  // per16 kinds: d2 / m2 the second 16 weights'; m: offset (0 where none)
};

static TM_GGUF_INLINE float half_at(const uint8_t* p) {
  at::Half h;
  std::memcpy(&h, p, 2);
  return half_to_float(h);
}

// Q4_K / Q5_K: the 6-bit scale and min of sub-block s (0..7) from the 12 packed bytes.
static TM_GGUF_INLINE void scale_min(const uint8_t* s12, int s, int& sc, int& mn) {
  if (s < 4) {
    sc = s12[s] & 63, mn = s12[s + 4] & 63;
  } else {
    sc = (s12[s + 4] & 0x0F) | ((s12[s - 4] >> 6) << 4);
    mn = (s12[s + 4] >> 4) | ((s12[s] >> 6) << 4);
  }
}

// Q3_K: its 16 6-bit scales (0..63, before - 32) from the 12 packed bytes: low nibbles of
// scales 0..7 in bytes 0..7, of 8..15 in their high nibbles, the two high bits of scale i at
// bits 2 (i / 4) of byte 8 + i % 4 (llama.cpp's kmask unpacking, four scales a word).
static TM_GGUF_INLINE void q3_k_scales(const uint8_t* s12, uint8_t (&out)[16]) {
  constexpr uint32_t k4 = 0x0f0f0f0f, k2 = 0x03030303;
  uint32_t a[3], r[4];
  std::memcpy(a, s12, 12);
  r[0] = (a[0] & k4) | ((a[2] & k2) << 4);
  r[1] = (a[1] & k4) | (((a[2] >> 2) & k2) << 4);
  r[2] = ((a[0] >> 4) & k4) | (((a[2] >> 4) & k2) << 4);
  r[3] = ((a[1] >> 4) & k4) | (((a[2] >> 6) & k2) << 4);
  std::memcpy(out, r, 16);
}

// IQ4_XS: the 6-bit scale of sub-block s (0..63, before - 32).
static TM_GGUF_INLINE int iq4_xs_scale(const uint8_t* p, int s) {
  const int high = (p[2] | (p[3] << 8)) >> (2 * s) & 3;
  return ((p[4 + s / 2] >> (4 * (s % 2))) & 0x0F) | (high << 4);
}

#ifndef TM_GGUF_SIMD
// The portable build: the same values, byte by byte.
static inline int nibble(const uint8_t* p, int j, int shift) { return (p[j] >> shift) & 0x0F; }
#endif

// Each kind's zero point: its values are stored as q in 0 .. 2^bits - 1, the weight is
// d (q - zero) (+ an offset for Q5_1, Q4_K, Q5_K, Q2_K). IQ4's values are signed already.
constexpr int zero_point(int64_t kind) {
  return kind == kQ5_0 ? 16 : kind == kQ6_K ? 32 : kind == kQ3_K ? 4 : 0;
}

// IQ4: 16 bytes of nibbles → the 32 table levels, weight order.
#ifdef TM_GGUF_SIMD
static TM_GGUF_INLINE __m256i iq4_levels(const uint8_t* p) {
  const __m256i table = _mm256_broadcastsi128_si256(
      _mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4Values)));
  return _mm256_shuffle_epi8(table, split_nibbles(p));
}
#endif

// The 32 stored values q of sub-block s of the block at p (32-weight kinds: the block itself,
// s = 0; K-quants: the super-block, s in 0..7), one byte each in weight order, zero point not
// yet subtracted (Q5_x 0..31, Q4_K 0..15, Q6_K 0..63, Q3_K 0..7, Q2_K 0..3; IQ4: the signed
// levels). The one unpacking of each layout, which the float kernels (gguf_block) and the
// integer ones (linear_gguf_rows.h, linear_gguf_vnni.h) share.
template <int64_t KIND>
static TM_GGUF_INLINE Bytes32 block_values(const uint8_t* p, int s) {
  Bytes32 q;
  if constexpr (KIND == kQ5_0 || KIND == kQ5_1) {
    const int off = KIND == kQ5_1 ? 4 : 2;  // d (, m), then qh, then the nibbles
#ifdef TM_GGUF_SIMD
    q = _mm256_or_si256(split_nibbles(p + off + 4), fifth_bits(p + off));
#else
    uint32_t qh;
    std::memcpy(&qh, p + off, 4);
    for (int j = 0; j < 32; ++j) {
      q.b[j] = static_cast<int8_t>(nibble(p + off + 4, j % 16, j < 16 ? 0 : 4) |
                                   (((qh >> j) & 1) << 4));
    }
#endif
  } else if constexpr (is_iq4(KIND)) {  // IQ4_NL: d, nibbles; IQ4_XS: 8 B, then 16 B a sub-block
    const uint8_t* qs = KIND == kIQ4_NL ? p + 2 : p + 8 + 16 * s;
#ifdef TM_GGUF_SIMD
    q = iq4_levels(qs);
#else
    for (int j = 0; j < 32; ++j) q.b[j] = kIQ4Values[nibble(qs, j % 16, j < 16 ? 0 : 4)];
#endif
  } else if constexpr (KIND == kQ4_K || KIND == kQ5_K) {
    const uint8_t* qs = p + (KIND == kQ4_K ? 16 : 48) + 32 * (s / 2);
#ifdef TM_GGUF_SIMD
    q = bits_at(qs, 4 * (s & 1), 0x0F);
    if constexpr (KIND == kQ5_K)
      q = _mm256_or_si256(q, _mm256_slli_epi16(bits_at(p + 16, s, 0x01), 4));
#else
    for (int j = 0; j < 32; ++j)
      q.b[j] = static_cast<int8_t>(
          nibble(qs, j, 4 * (s & 1)) | (KIND == kQ5_K ? ((p[16 + j] >> s) & 1) << 4 : 0));
#endif
  } else if constexpr (KIND == kQ3_K || KIND == kQ2_K) {
    // 2-bit values: 32 bytes per 128 weights, sub-block s at bits 2 (s % 4); Q3_K's third bit
    // of sub-block s is bit s of the 32 high-bit bytes
    const uint8_t* qs = p + (KIND == kQ3_K ? 32 : 16) + 32 * (s / 4);
#ifdef TM_GGUF_SIMD
    q = bits_at(qs, 2 * (s % 4), 0x03);
    if constexpr (KIND == kQ3_K) q = _mm256_or_si256(q, _mm256_slli_epi16(bits_at(p, s, 0x01), 2));
#else
    for (int j = 0; j < 32; ++j)
      q.b[j] = static_cast<int8_t>(((qs[j] >> (2 * (s % 4))) & 3) |
                                   (KIND == kQ3_K ? ((p[j] >> s) & 1) << 2 : 0));
#endif
  } else {  // Q6_K: 128 weights per half h; sub-block u of a half
    const int h = s / 4, u = s % 4;
    const uint8_t* ql = p + 64 * h + 32 * (u % 2);
    const uint8_t* qh = p + 128 + 32 * h;
#ifdef TM_GGUF_SIMD
    const __m256i low = bits_at(ql, 4 * (u / 2), 0x0F);
    const __m256i high = _mm256_slli_epi16(bits_at(qh, 2 * u, 0x03), 4);
    q = _mm256_or_si256(low, high);
#else
    for (int j = 0; j < 32; ++j)
      q.b[j] = static_cast<int8_t>(nibble(ql, j, 4 * (u / 2)) | (((qh[j] >> (2 * u)) & 3) << 4));
#endif
  }
  return q;
}

// q - zero point, int8 (the float kernels' values).
template <int64_t KIND>
static TM_GGUF_INLINE Bytes32 signed_values(const uint8_t* p, int s) {
  Bytes32 q = block_values<KIND>(p, s);
  if constexpr (zero_point(KIND) != 0) {
#ifdef TM_GGUF_SIMD
    q = _mm256_sub_epi8(q, _mm256_set1_epi8(zero_point(KIND)));
#else
    for (int j = 0; j < 32; ++j) q.b[j] = static_cast<int8_t>(q.b[j] - zero_point(KIND));
#endif
  }
  return q;
}

// The scales (and offsets) of 32-weight sub-block s of the super-block at p.
template <int64_t KIND>
static TM_GGUF_INLINE void superblock_part(const uint8_t* p, int s, Block& blk) {
  if constexpr (KIND == kQ4_K || KIND == kQ5_K) {
    int sc, mn;
    scale_min(p + 4, s, sc, mn);
    blk.d = half_at(p) * static_cast<float>(sc);
    blk.m = -(half_at(p + 2) * static_cast<float>(mn));
  } else if constexpr (KIND == kQ6_K) {
    const float d = half_at(p + 208);
    const int8_t* scales = reinterpret_cast<const int8_t*>(p + 192);
    blk.d = d * static_cast<float>(scales[2 * s]);
    blk.d2 = d * static_cast<float>(scales[2 * s + 1]);
  } else if constexpr (KIND == kQ3_K) {
    uint8_t sc[16];
    q3_k_scales(p + 96, sc);
    const float d = half_at(p + 108);
    blk.d = d * static_cast<float>(sc[2 * s] - 32);
    blk.d2 = d * static_cast<float>(sc[2 * s + 1] - 32);
  } else if constexpr (KIND == kQ2_K) {
    const float d = half_at(p + 80), dmin = half_at(p + 82);
    blk.d = d * static_cast<float>(p[2 * s] & 0x0F);
    blk.d2 = d * static_cast<float>(p[2 * s + 1] & 0x0F);
    blk.m = -(dmin * static_cast<float>(p[2 * s] >> 4));
    blk.m2 = -(dmin * static_cast<float>(p[2 * s + 1] >> 4));
  } else {  // IQ4_XS
    blk.d = half_at(p) * static_cast<float>(iq4_xs_scale(p, s) - 32);
  }
}

template <int64_t KIND>
static TM_GGUF_INLINE Block gguf_block(const uint8_t* row, int64_t b) {
  Block blk{};
  if constexpr (!is_kquant(KIND)) {
    const uint8_t* p = row + b * block_bytes(KIND);
    blk.d = half_at(p);
    blk.m = KIND == kQ5_1 ? half_at(p + 2) : 0.f;
    blk.q = signed_values<KIND>(p, 0);
    return blk;
  }
  const uint8_t* p = row + (b / 8) * block_bytes(KIND);
  const int s = static_cast<int>(b % 8);  // sub-block of the super-block
  superblock_part<KIND>(p, s, blk);
  blk.q = signed_values<KIND>(p, s);
  return blk;
}

// The c-th kV-vector of the block's dequantized weights.
template <int64_t KIND>
static TM_GGUF_INLINE Vec expand(const Block& blk, int c) {
  const Vec q = chunk(blk.q, c);
  if constexpr (per16(KIND)) {
    const bool first = c < kChunks / 2;
    if constexpr (has_offset(KIND))
      return at::vec::fmadd(q, Vec(first ? blk.d : blk.d2), Vec(first ? blk.m : blk.m2));
    else return q * Vec(first ? blk.d : blk.d2);
  } else if constexpr (has_offset(KIND)) {
    return at::vec::fmadd(q, Vec(blk.d), Vec(blk.m));
  } else {
    return q * Vec(blk.d);
  }
}

}  // namespace gguf_blocks
