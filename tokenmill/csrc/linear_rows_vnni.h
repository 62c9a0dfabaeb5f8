// Decode-sized products (M <= 4 rows of x at a time) of quantized weights on AVX-512 VNNI
// builds, where activations enter as integers per 32-block: int8 (`--int8-activations`) or,
// for float activations, int16 (relative error <= 1.5e-5 of the block's largest value, the
// rounding int16_gemm applies to larger M). Included by linear_cpu.h, which dispatches to them.
//
// Why not float32: expanding 4-bit weights to float costs two widenings, two conversions and
// two multiplies per block before its two FMAs; on Zen 4 each 512-bit op takes two cycles, so
// the float kernels streamed 13-16 GB/s of a 33 GB/s machine. Here a block's dot product is one
// or two integer instructions and the int32 -> float scaling is shared by two blocks:
//   4-bit weights: the 32 bytes of blocks b and b + 1 give, as nibbles, 64 weights
//   [b 0..15 | b+1 0..15 | b 16..31 | b+1 16..31] (low nibbles, then high ones: llama.cpp's
//   order). The rows of x are put in that order once per call (`pair_order`), so that one
//   vpdpbusd (int8) or vpmaddwd + vpdpwssd (int16) gives both blocks' partial sums in one zmm;
//   one conversion and one FMA scale them with their two block scales, taken from a vector of
//   16 (weight scale x activation scale) by one permute.
//   Q8_0 weights with int16 activations: one widening, one vpmaddwd, one conversion, one FMA a
//   block. (Q8_0 x int8 keeps linear_int8_acts.h's kernel.)
// The 4-bit offsets multiply the exact float group sums of x, 16 groups per FMA.
// Measured (Zen 4, 2 threads, SmolLM2's shapes in huge pages): 4-bit 15 -> 22 GB/s with float
// activations, 19 -> 23 with int8 ones; the machine reads ~33. Four blocks per vector (one per
// 128-bit lane: a third fewer instructions a block) was no faster: at K = 576 each row's own
// work (its scales, offsets and final reduction) is about as large as its blocks'.
#pragma once
#include "linear_int8_acts.h"
#include <cstring>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(CPU_CAPABILITY_AVX512)
#define TOKENMILL_VNNI_ROWS 1
constexpr bool kVnniRows = true;

// Rows of x (M, K) reordered in place so that each pair of blocks (b, b + 1) reads
// [b 0..15 | b+1 0..15 | b 16..31 | b+1 16..31]; a last odd block keeps its order.
template <typename T>
static void pair_order(T* q, int64_t M, int64_t K) {
  const int64_t nb = K / kBlock;
  constexpr size_t kHalf = 16 * sizeof(T);
  T tmp[2 * kBlock];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b + 1 < nb; b += 2) {
      T* p = q + m * K + b * kBlock;
      std::memcpy(tmp, p, kHalf);
      std::memcpy(tmp + 16, p + 32, kHalf);
      std::memcpy(tmp + 32, p + 16, kHalf);
      std::memcpy(tmp + 48, p + 48, kHalf);
      std::memcpy(p, tmp, 4 * kHalf);
    }
}

static inline __mmask16 first_lanes(int64_t count) {
  return static_cast<__mmask16>((1u << count) - 1);
}

// The weight scales of blocks [b0, b0 + count) (count <= 16) of one row, d in groups of G.
static inline __m512 block_scales(const at::Half* d, int64_t G, int64_t b0, int64_t count) {
  if (G == kBlock) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first_lanes(count), d + b0));
  alignas(64) float s[16] = {};
  for (int64_t i = 0; i < count; ++i) s[i] = half_to_float(d[(b0 + i) * kBlock / G]);
  return _mm512_load_ps(s);
}

// Per row m of x: weight scale x activation scale of blocks [c0, c0 + count) (xd (M, nb)).
template <int M>
static inline void chunk_scales(const at::Half* d, int64_t G, const float* xd, int64_t nb,
                                int64_t c0, int64_t count, __m512* scale) {
  const __m512 wscale = block_scales(d, G, c0, count);
  for (int m = 0; m < M; ++m)
    scale[m] = _mm512_mul_ps(wscale,
                             _mm512_maskz_loadu_ps(first_lanes(count), xd + m * nb + c0));
}

// sum_g m[g] * xsum[g] for each row of x, as 16 lanes to add up (the 4-bit offsets' part).
template <int M>
static inline void offset_parts(const at::Half* mn, const float* xsum, int64_t ng,
                                __m512* out) {
  for (int m = 0; m < M; ++m) out[m] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < ng; g0 += 16) {
    const __mmask16 k = first_lanes(std::min<int64_t>(16, ng - g0));
    const __m512 mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, mn + g0));
    for (int m = 0; m < M; ++m)
      out[m] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(k, xsum + m * ng + g0), out[m]);
  }
}

// The 64 weights of blocks b and b + 1 (their 32 nibble bytes at q) as the vectors pair_dot
// takes: one of u8 [b 0..15 | b+1 0..15 | b 16..31 | b+1 16..31], or that as two of int16.
template <typename T>
static inline void pair_weights(const uint8_t* q, __m512i* w) {
  if constexpr (sizeof(T) == 1) {  // the bytes, then the same bytes >> 4
    const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(q)));
    w[0] = _mm512_and_si512(_mm512_srlv_epi64(v, _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0)),
                            _mm512_set1_epi8(0x0F));
  } else {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    w[0] = _mm512_cvtepu8_epi16(_mm256_and_si256(v, nibble));
    w[1] = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), nibble));
  }
}

// Both blocks' integer dot products for one row of x (pair_order): int8, lanes 0-3 and 8-11
// block b, 4-7 and 12-15 block b + 1; int16, lanes 0-7 block b, 8-15 block b + 1.
template <typename T>
static inline __m512i pair_dot(const __m512i* w, const T* x) {
  if constexpr (sizeof(T) == 1)
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_loadu_si512(x));
  else
    return _mm512_dpwssd_epi32(_mm512_madd_epi16(w[0], _mm512_loadu_si512(x)), w[1],
                               _mm512_loadu_si512(x + 32));
}

// A last odd block (natural order): its dot product as int32 lanes to add up (int8: 8 lanes,
// the rest garbage; the caller masks them).
template <typename T>
static inline __m512i block_dot(const uint8_t* q, const T* x) {
  const __m256i w8 = nibbles_u8(q);
  if constexpr (sizeof(T) == 1)
    return _mm512_castsi256_si512(
        dot_u8s8(w8, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))));
  else
    return _mm512_madd_epi16(_mm512_cvtepu8_epi16(w8), _mm512_loadu_si512(x));
}

// y[m, n] for rows n in [n0, n1) of 4-bit weights and M rows of x in pair_order (xq (M, K),
// xd (M, K/32) their block scales), T int8_t or int16_t.
template <int M, typename T>
static void q4_rows_vnni(const T* xq, const float* xd, const float* xsum, const uint8_t* Q,
                         const at::Half* D, const at::Half* Mn, const float* bias, float* y,
                         int64_t K, int64_t N, int64_t G, int64_t n0, int64_t n1) {
  const int64_t nb = K / kBlock, ng = K / G;
  // which of the two blocks each lane of pair_dot's result belongs to
  const __m512i lane_block = sizeof(T) == 1
      ? _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0)
      : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* q = Q + n * (K / 2);
    const at::Half* d = D + n * ng;
    __m512 acc[M][2], offsets[M];  // two accumulators per row of x: two FMA chains
    offset_parts<M>(Mn + n * ng, xsum, ng, offsets);
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t c0 = 0; c0 < nb; c0 += 16) {  // 16 blocks share one vector of scales
      const int64_t count = std::min<int64_t>(16, nb - c0);
      __m512 scale[M];
      chunk_scales<M>(d, G, xd, nb, c0, count, scale);
      // Blocks i and i + 1 into accumulator A. A is a template argument: with a run-time
      // index the compiler kept the accumulators on the stack (a store and a load per FMA).
      auto pair = [&]<int A>(int64_t i) {
        const int64_t b = c0 + i;
        __m512i w[2];
        pair_weights<T>(q + b * (kBlock / 2), w);
        const __m512i idx = _mm512_add_epi32(lane_block, _mm512_set1_epi32(i));
        for (int m = 0; m < M; ++m) {
          const __m512 dot = _mm512_cvtepi32_ps(pair_dot<T>(w, xq + m * K + b * kBlock));
          acc[m][A] = _mm512_fmadd_ps(dot, _mm512_permutexvar_ps(idx, scale[m]), acc[m][A]);
        }
      };
      int64_t i = 0;
      for (; i + 4 <= count; i += 4) {
        pair.template operator()<0>(i);
        pair.template operator()<1>(i + 2);
      }
      if (i + 2 <= count) {
        pair.template operator()<0>(i);
        i += 2;
      }
      if (i < count) {  // a last odd block
        const int64_t b = c0 + i;
        const __m512i idx = _mm512_set1_epi32(i);
        const __mmask16 lanes = sizeof(T) == 1 ? 0x00FF : 0xFFFF;
        for (int m = 0; m < M; ++m) {
          const __m512 dot = _mm512_cvtepi32_ps(
              block_dot<T>(q + b * (kBlock / 2), xq + m * K + b * kBlock));
          acc[m][0] = _mm512_mask3_fmadd_ps(dot, _mm512_permutexvar_ps(idx, scale[m]),
                                            acc[m][0], lanes);
        }
      }
    }
    for (int m = 0; m < M; ++m)
      y[m * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]),
                                                        offsets[m])) + (bias ? bias[n] : 0.f);
  }
}

// Q8_0 weights with int16 activations (float ones, rounded; natural order).
template <int M>
static void q8_rows_vnni(const int16_t* xq, const float* xd, const int8_t* Q, const at::Half* D,
                         const float* bias, float* y, int64_t K, int64_t N, int64_t n0,
                         int64_t n1) {
  const int64_t nb = K / kBlock;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* q = Q + n * K;
    __m512 acc[M][2];
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t c0 = 0; c0 < nb; c0 += 16) {
      const int64_t count = std::min<int64_t>(16, nb - c0);
      __m512 scale[M];
      chunk_scales<M>(D + n * nb, kBlock, xd, nb, c0, count, scale);
      // block i into accumulator A (a template argument: see q4_rows_vnni)
      auto block = [&]<int A>(int64_t i) {
        const int64_t b = c0 + i;
        const __m512i w = _mm512_cvtepi8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * kBlock)));
        const __m512i idx = _mm512_set1_epi32(static_cast<int>(i));
        for (int m = 0; m < M; ++m) {
          const __m512 dot = _mm512_cvtepi32_ps(
              _mm512_madd_epi16(w, _mm512_loadu_si512(xq + m * K + b * kBlock)));
          acc[m][A] = _mm512_fmadd_ps(dot, _mm512_permutexvar_ps(idx, scale[m]), acc[m][A]);
        }
      };
      int64_t i = 0;
      for (; i + 2 <= count; i += 2) {
        block.template operator()<0>(i);
        block.template operator()<1>(i + 1);
      }
      if (i < count) block.template operator()<0>(i);
    }
    for (int m = 0; m < M; ++m)
      y[m * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1])) +
                     (bias ? bias[n] : 0.f);
  }
}

#else
constexpr bool kVnniRows = false;
#endif  // TOKENMILL_VNNI_ROWS
