// Block formats of quantized weights and the vector primitives every CPU linear kernel
// shares (linear_cpu.h, linear_int8_acts.h): the layouts are described in linear_cpu.h and
// tokenmill/quantization/blocks.py. Expanding a block yields its 32 values as float vectors
// (ATen's Vectorized<float>: 8 lanes with AVX2, 16 with AVX-512), in weight order.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Half.h>
#include "vec_utils.h"
#include <algorithm>
#include <cmath>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

constexpr int64_t kV = Vec::size();
constexpr int64_t kBlock = 32;            // weights per quantization block
constexpr int64_t kChunks = kBlock / kV;  // vectors per block (4 with AVX2, 2 with AVX-512)

static void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name,
              " must be a float32 CPU tensor");
}

// ---- expanding quantized blocks into float vectors -----------------------------------------
// 32 int8 weights -> kChunks vectors, in order.
static inline void expand_q8(const int8_t* q, Vec* out) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
  for (int c = 0; c < 2; ++c)
    out[c] = Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * c)))));
#elif defined(CPU_CAPABILITY_AVX2) && defined(__AVX2__)
  for (int c = 0; c < 4; ++c)
    out[c] = Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * c)))));
#else
  float buf[kBlock];
  for (int i = 0; i < kBlock; ++i) buf[i] = static_cast<float>(q[i]);
  for (int c = 0; c < kChunks; ++c) out[c] = Vec::loadu(buf + c * kV);
#endif
}

// 16 bytes of nibbles -> the 32 4-bit values (0..15) as kChunks vectors, in weight order.
static inline void expand_q4(const uint8_t* q, Vec* out) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i mask = _mm_set1_epi8(0x0F);
  out[0] = Vec(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask))));
  out[1] = Vec(_mm512_cvtepi32_ps(
      _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask))));
#elif defined(CPU_CAPABILITY_AVX2) && defined(__AVX2__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(bytes, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  out[0] = Vec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)));
  out[1] = Vec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))));
  out[2] = Vec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)));
  out[3] = Vec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))));
#else
  float buf[kBlock];
  for (int j = 0; j < 16; ++j) {
    buf[j] = static_cast<float>(q[j] & 0x0F);
    buf[j + 16] = static_cast<float>(q[j] >> 4);
  }
  for (int c = 0; c < kChunks; ++c) out[c] = Vec::loadu(buf + c * kV);
#endif
}

// F16C where compiled for it: c10::Half's portable conversion costs more than a block's math.
static inline float half_to_float(const at::Half& h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

#if defined(__AVX2__)
static inline float hsum8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}
#endif

