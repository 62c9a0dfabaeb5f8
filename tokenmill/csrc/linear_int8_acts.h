// Decode-sized products (M <= 4) of quantized weights with int8 activations, included by
// linear_cpu.h, which dispatches to them.
#pragma once
#include "quant_blocks.h"
#include <limits>

// ---- small M with int8 activations (llama.cpp's Q8 activations) ---------------------------
// Each row of x is quantized per 32-block (xq = round(x / dx), dx = amax / 127), and a block's
// dot product is an integer one: 32 multiply-adds in one or two instructions (AVX-512 VNNI
// vpdpbusd, else AVX2 vpmaddubsw + vpmaddwd) instead of expanding the weights to float32.
// The 4-bit offsets still multiply the exact float32 group sums of x. Lossy: the activations'
// rounding (benchmarks/quant_quality.py measures it); used only where asked for.
template <typename T>
struct BlockRows {  // M rows of x, quantized per 32-block to T (int8_t or int16_t)
  std::vector<T> q;      // (M, K)
  std::vector<float> d;  // (M, K/32)
};
using QuantizedRows = BlockRows<int8_t>;

// Rows [m0, ...) of a BlockRows, as the kernels index them.
template <typename T>
struct BlockRowsView {
  const T* q;       // (rows, K)
  const float* d;   // (rows, K/32)
};
using QRows = BlockRowsView<int8_t>;

template <typename T>
static inline BlockRowsView<T> rows_from(const BlockRows<T>& r, int64_t m0, int64_t K) {
  return {r.q.data() + m0 * K, r.d.data() + m0 * (K / kBlock)};
}

// xq = round-half-even(x / dx), dx = amax / max(T) per 32-block, T int8_t (the int8
// activations) or int16_t (linear_int8_gemm.h's float ones). Vectorized where compiled for
// it; every build rounds the same way (the default rounding mode, as std::nearbyint).
template <typename T>
static void quantize_block(const float* xb, T* q, float* d) {
  constexpr float kLevels = static_cast<float>(std::numeric_limits<T>::max());
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
  const __m512 a0 = _mm512_loadu_ps(xb), a1 = _mm512_loadu_ps(xb + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a0), _mm512_abs_ps(a1)));
  const float dx = amax / kLevels, inv = dx > 0.f ? 1.f / dx : 0.f;
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(a0, vinv));
  const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(a1, vinv));
  if constexpr (sizeof(T) == 1) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(q1));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm512_cvtsepi32_epi16(q0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), _mm512_cvtsepi32_epi16(q1));
  }
  *d = dx;
#else
  float amax = 0.f;
  for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
  const float dx = amax / kLevels, inv = dx > 0.f ? 1.f / dx : 0.f;
  *d = dx;
  for (int i = 0; i < kBlock; ++i) q[i] = static_cast<T>(std::nearbyint(xb[i] * inv));
#endif
}

// x (M, K) quantized per 32-block into q (M, K) and d (M, K/32).
template <typename T>
static void quantize_blocks(const float* x, int64_t M, int64_t K, T* q, float* d) {
  const int64_t nb = M * K / kBlock;
  auto run = [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) quantize_block(x + b * kBlock, q + b * kBlock, d + b);
  };
  if (M <= 4) run(0, nb);  // a decode step: not worth waking the thread pool
  else at::parallel_for(0, nb, 256, run);
}

template <typename T = int8_t>
static BlockRows<T> quantize_rows(const float* x, int64_t M, int64_t K) {
  BlockRows<T> r{std::vector<T>(M * K), std::vector<float>(M * K / kBlock)};
  quantize_blocks(x, M, K, r.q.data(), r.d.data());
  return r;
}

#if defined(__AVX2__)
// Sum of u8 w times s8 x over 32 lanes, as 8 int32 partial sums.
static inline __m256i dot_u8s8(__m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
#endif
}

// The 32 4-bit values of a block as u8 lanes in weight order (low nibbles, then high).
static inline __m256i nibbles_u8(const uint8_t* q) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F));
}
#endif

template <int M>
static void q8_rows_i8(const QRows& xr, const int8_t* Q, const at::Half* D,
                       const float* bias, float* y, int64_t K, int64_t N, int64_t n0,
                       int64_t n1) {
  const int64_t nb = K / kBlock;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* q = Q + n * K;
    const at::Half* d = D + n * nb;
#if defined(__AVX2__)
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * kBlock));
      const __m256i aw = _mm256_sign_epi8(w, w);  // |w| as u8; the sign moves onto x
      const float db = half_to_float(d[b]);
      for (int m = 0; m < M; ++m) {
        const __m256i x = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(xr.q + m * K + b * kBlock));
        const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(aw, _mm256_sign_epi8(x, w)));
        acc[m] = _mm256_fmadd_ps(dot, _mm256_set1_ps(db * xr.d[m * nb + b]), acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = hsum8(acc[m]) + (bias ? bias[n] : 0.f);
#else
    for (int m = 0; m < M; ++m) {
      float s = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t dot = 0;
        for (int i = 0; i < kBlock; ++i)
          dot += q[b * kBlock + i] * xr.q[m * K + b * kBlock + i];
        s += half_to_float(d[b]) * xr.d[m * nb + b] * static_cast<float>(dot);
      }
      y[m * N + n] = s + (bias ? bias[n] : 0.f);
    }
#endif
  }
}

template <int M>
static void q4_rows_i8(const QRows& xr, const float* xsum, const uint8_t* Q,
                       const at::Half* D, const at::Half* Mn, const float* bias, float* y,
                       int64_t K, int64_t N, int64_t G, int64_t n0, int64_t n1) {
  const int64_t nb = K / kBlock, ng = K / G, bpg = G / kBlock;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* q = Q + n * (K / 2);
    const at::Half *d = D + n * ng, *mn = Mn + n * ng;
    float zero_part[M];
    for (int m = 0; m < M; ++m) zero_part[m] = 0.f;
#if defined(__AVX2__)
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; ++g) {
      const float dg = half_to_float(d[g]);
      for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
        const __m256i w = nibbles_u8(q + b * (kBlock / 2));
        for (int m = 0; m < M; ++m) {
          const __m256i x = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(xr.q + m * K + b * kBlock));
          const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(w, x));
          acc[m] = _mm256_fmadd_ps(dot, _mm256_set1_ps(dg * xr.d[m * nb + b]), acc[m]);
        }
      }
      const float mg = half_to_float(mn[g]);
      for (int m = 0; m < M; ++m) zero_part[m] += mg * xsum[m * ng + g];
    }
    for (int m = 0; m < M; ++m)
      y[m * N + n] = hsum8(acc[m]) + zero_part[m] + (bias ? bias[n] : 0.f);
#else
    for (int m = 0; m < M; ++m) {
      float s = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t dot = 0;
        for (int j = 0; j < 16; ++j) {
          const uint8_t byte = q[b * 16 + j];
          dot += (byte & 0x0F) * xr.q[m * K + b * kBlock + j];
          dot += (byte >> 4) * xr.q[m * K + b * kBlock + 16 + j];
        }
        s += half_to_float(d[b * kBlock / G]) * xr.d[m * nb + b] * static_cast<float>(dot);
      }
      for (int64_t g = 0; g < ng; ++g) s += half_to_float(mn[g]) * xsum[m * ng + g];
      y[m * N + n] = s + (bias ? bias[n] : 0.f);
    }
#endif
  }
}
