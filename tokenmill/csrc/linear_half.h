// Dense weights kept in the checkpoint's half precision (bfloat16, float16) and multiplied
// with float32 activations and float32 accumulation: the dot kernels (linear_dot.h) read W
// 32 weights at a time and widen each vector of it to float32 in registers, so no float32
// copy of W exists and a decode step streams half the bytes.
//
//   kind 8  BF16  tensors = {W (N, K) bfloat16}: w = the bfloat16 value (widening is exact:
//                 the 16 bits shifted into a float32's high half)
//   kind 9  F16   tensors = {W (N, K) float16}: w = the float16 value (F16C's vcvtph2ps, exact)
//
// Widening is exact, so a product equals the float32 kernel's on the widened weights bit for
// bit (tests/layers/test_half_weights.py). K is a multiple of 32 (checked by the caller).
#pragma once
#include "quant_blocks.h"
#include <c10/util/BFloat16.h>

namespace half_rows {

constexpr int64_t kBF16 = 8, kF16 = 9;
constexpr bool is_half_kind(int64_t kind) { return kind == kBF16 || kind == kF16; }
// kind 10: the same bfloat16 W multiplied in bfloat16 (linear_bf16.h); read as kind 8 where
// rows are expanded (embedding lookups).
constexpr int64_t kBF16Products = 10;
// kind 16: kind 10's W packed for AMX tiles (linear_bf16_amx.h), multiplied there only.
constexpr int64_t kBF16Tiles = 16;

// How far ahead half-precision rows streamed once (steps of up to 4 rows of x: linear_bf16.h
// and linear_dot.h) ask for their lines into L2, in values (8 KB). One row of SmolLM2's
// layers at a time read 20-28 GB/s of bf16 W from memory without, 34-43 with (float16:
// 17-20, 28-39), at 8 KB better than 4 or 16 (fifty-seventh session, Zen 4): the hardware's
// prefetchers alone keep too few of its misses in flight.
constexpr int64_t kAheadValues = 4096;

struct Block {
  const uint16_t* p;  // 32 weights
};

static inline __attribute__((always_inline)) Block half_block(const void* W, int64_t K,
                                                              int64_t n, int64_t b) {
  return {static_cast<const uint16_t*>(W) + n * K + b * kBlock};
}

template <int64_t KIND>
static inline __attribute__((always_inline)) Vec expand(const Block& blk, int c) {
  const uint16_t* p = blk.p + c * kV;
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (KIND == kBF16)
    return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  else
    return Vec(_mm512_cvtph_ps(h));
#elif defined(CPU_CAPABILITY_AVX2) && defined(__AVX2__)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (KIND == kBF16)
    return Vec(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  else
    return Vec(_mm256_cvtph_ps(h));
#else
  float buf[kV];
  for (int64_t i = 0; i < kV; ++i) {
    if constexpr (KIND == kBF16) buf[i] = static_cast<float>(c10::BFloat16(p[i], c10::BFloat16::from_bits()));
    else buf[i] = static_cast<float>(c10::Half(p[i], c10::Half::from_bits()));
  }
  return Vec::loadu(buf);
#endif
}

}  // namespace half_rows
