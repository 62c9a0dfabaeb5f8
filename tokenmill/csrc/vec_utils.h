// Helpers shared by the CPU kernels in this folder (float32, ATen's Vectorized<float>).
#pragma once
#include <ATen/cpu/vec/vec.h>

using Vec = at::vec::Vectorized<float>;

// Horizontal sum. NOTE: at::vec::vec_reduce_all goes through memory and costs several times
// more, which dominated the attention kernel (three reductions per cached token).
static inline float hsum(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
  return _mm512_reduce_add_ps(v);
#elif defined(CPU_CAPABILITY_AVX2) && defined(__AVX2__)
  __m256 x = v;
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
#else
  float buf[Vec::size()];
  v.store(buf);
  float total = 0.f;
  for (int64_t i = 0; i < Vec::size(); ++i) total += buf[i];
  return total;
#endif
}
