// GGUF block types read in place, as the file stores them: the 5-bit blocks Q5_0 / Q5_1 and
// the K-quant super-blocks Q4_K / Q5_K / Q6_K (llama.cpp's ggml-common.h layouts). A weight is
// its raw block rows, uint8 (N, K / QK * block bytes): nothing is repacked or expanded at load.
//
// `block_values` unpacks the 32 stored values of a (sub-)block, one per byte in weight order:
// the integer row kernels (linear_gguf_rows.h, SIMD builds) multiply them as they are; for
// the dot kernels (linear_dot.h: the portable build, expansions, embedding lookups)
// `gguf_block` adds the float32 scale(s) and offset that give the dequantized weight:
//
//   kind 3  Q5_0  22 B / 32:  d, qh (32 high bits), 16 B nibbles        w = d * (q - 16)
//   kind 4  Q5_1  24 B / 32:  d, m, qh, nibbles                         w = d * q + m
//   kind 5  Q4_K  144 B / 256: d, dmin, 12 B of 6-bit scale/min pairs, 128 B nibbles
//                                                                     w = (d sc) q - dmin mn
//   kind 6  Q5_K  176 B / 256: as Q4_K plus 32 B of high bits           the same, q in 0..31
//   kind 7  Q6_K  210 B / 256: 128 B low nibbles, 64 B 2-bit highs, 16 int8 scales, d
//                                                                     w = (d sc16) (q - 32)
//
// Each weight comes out as the gguf package's dequantize computes it, bit for bit: the
// products d sc and dmin mn are exact in float32 (11 + 8 bits at most), (d sc) q is exact
// for Q4_K / Q5_K (<= 22 bits) and rounded once for Q6_K as in numpy, and the one rounding of
// fma(q, d sc, -dmin mn) is numpy's rounding of the exact product minus dm
// (tests/quantization/test_gguf_kquants.py).
#pragma once
#include "quant_blocks.h"
#include <cstring>

namespace gguf_blocks {

#define TM_GGUF_INLINE inline __attribute__((always_inline))

constexpr int64_t kQ5_0 = 3, kQ5_1 = 4, kQ4_K = 5, kQ5_K = 6, kQ6_K = 7;
constexpr bool is_gguf_kind(int64_t kind) { return kind >= kQ5_0 && kind <= kQ6_K; }
// Weights and bytes per block of the file.
constexpr int64_t block_weights(int64_t kind) { return kind <= kQ5_1 ? 32 : 256; }
constexpr int64_t block_bytes(int64_t kind) {
  return kind == kQ5_0 ? 22 : kind == kQ5_1 ? 24 : kind == kQ4_K ? 144 : kind == kQ5_K ? 176
                                                                                       : 210;
}
constexpr int64_t row_bytes(int64_t kind, int64_t K) {
  return K / block_weights(kind) * block_bytes(kind);
}
// Offsets (Q5_1, Q4_K, Q5_K) or a plain scale; Q6_K's two 16-weight halves have two scales.
constexpr bool has_offset(int64_t kind) { return kind == kQ5_1 || kind == kQ4_K || kind == kQ5_K; }

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

// One 32-weight block, ready to expand: values, scale(s), offset.
struct Block {
  Bytes32 q;
  float d, d2, m;  // d2: Q6_K's second 16 weights; m: the offset (0 where none)
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

#ifndef TM_GGUF_SIMD
// The portable build: the same values, byte by byte.
static inline int nibble(const uint8_t* p, int j, int shift) { return (p[j] >> shift) & 0x0F; }
#endif

// Each kind's zero point: its values are stored as q in 0 .. 2^bits - 1, the weight is
// d (q - zero) (+ an offset for Q5_1, Q4_K, Q5_K).
constexpr int zero_point(int64_t kind) { return kind == kQ5_0 ? 16 : kind == kQ6_K ? 32 : 0; }

// The 32 stored values q of sub-block s of the block at p (Q5_0 / Q5_1: the 32-weight block
// itself, s = 0; K-quants: the super-block, s in 0..7), one byte each in weight order, zero
// point not yet subtracted (0..31, Q4_K 0..15, Q6_K 0..63). The one unpacking of each layout,
// which the float kernels (gguf_block) and the integer ones (linear_gguf_rows.h) share.
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

template <int64_t KIND>
static TM_GGUF_INLINE Block gguf_block(const uint8_t* row, int64_t b) {
  Block blk{};
  if constexpr (KIND == kQ5_0 || KIND == kQ5_1) {
    const uint8_t* p = row + b * block_bytes(KIND);
    blk.d = half_at(p);
    blk.m = KIND == kQ5_1 ? half_at(p + 2) : 0.f;
    blk.q = signed_values<KIND>(p, 0);
    return blk;
  }
  const uint8_t* p = row + (b / 8) * block_bytes(KIND);
  const int s = static_cast<int>(b % 8);  // sub-block of the super-block
  if constexpr (KIND == kQ4_K || KIND == kQ5_K) {
    int sc, mn;
    scale_min(p + 4, s, sc, mn);
    blk.d = half_at(p) * static_cast<float>(sc);
    blk.m = -(half_at(p + 2) * static_cast<float>(mn));
  } else {  // Q6_K
    const float d = half_at(p + 208);
    const int8_t* scales = reinterpret_cast<const int8_t*>(p + 192);
    blk.d = d * static_cast<float>(scales[2 * s]);
    blk.d2 = d * static_cast<float>(scales[2 * s + 1]);
  }
  blk.q = signed_values<KIND>(p, s);
  return blk;
}

// The c-th kV-vector of the block's dequantized weights.
template <int64_t KIND>
static TM_GGUF_INLINE Vec expand(const Block& blk, int c) {
  const Vec q = chunk(blk.q, c);
  if constexpr (KIND == kQ6_K) return q * Vec(c < kChunks / 2 ? blk.d : blk.d2);
  else if constexpr (has_offset(KIND)) return at::vec::fmadd(q, Vec(blk.d), Vec(blk.m));
  else return q * Vec(blk.d);
}

}  // namespace gguf_blocks
