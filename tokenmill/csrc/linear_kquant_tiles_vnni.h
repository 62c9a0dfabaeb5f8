// Weight kind 19 (Q4_K tiles, linear_kquant_tiles_layout.h) on AVX-512 VNNI builds: a
// group's 16 rows meet x's two bytes in two vpdpbusd per 4 weights, each int32 lane one
// output's exact sub-block sum.
#pragma once
#include "linear_kquant_tiles_layout.h"

#if defined(TOKENMILL_GGUF_VNNI)
namespace kquant_tiles {
constexpr int kMaxRows = 4;  // rows of x a group's tiles meet at once

// x split from kind 5's rounding on these builds (shared with a merged layer's raw GGUF
// parts; `r` must outlive it): owns the bytes, `acts` views them.
struct SplitX {
  std::unique_ptr<int8_t[]> hi;
  std::unique_ptr<uint8_t[]> lo;
  Acts acts;
};

inline SplitX split(const gguf_vnni::Int16Rows& r, int64_t M) {
  TORCH_CHECK(r.XB == kSuper, "weight kind 19 needs K divisible by 256");
  SplitX a;
  a.hi.reset(new int8_t[M * r.K]), a.lo.reset(new uint8_t[M * r.K]);
  auto run = [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i += 32) {
      const __m512i v = _mm512_loadu_si512(r.x.data() + i);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.hi.get() + i),
                          _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.lo.get() + i), _mm512_cvtepi16_epi8(v));
    }
  };
  if (M <= 8) {  // a decode step: not worth waking the thread pool
    run(0, M * r.K);
  } else {
    at::parallel_for(0, M * r.K / 32, 256, [&](int64_t b0, int64_t b1) { run(32 * b0, 32 * b1); });
  }
  a.acts = {r.K, a.hi.get(), a.lo.get(), r.dx.data(), r.s32.data()};
  return a;
}

static TM_KT_INLINE __m512i bcast4(const void* p) { return _mm512_set1_epi32(load4(p)); }

// Rows [m0, m0 + R) of x times the 16 outputs of group g (tiles q, nsb super-blocks) into
// y (row stride ldy, group g's first column at y + 16 g). `stream`: W is read once (a decode
// step): each super-block asks for the one kAhead ahead.
template <int R>
static void group_rows(const uint8_t* q, int64_t nsb, const Acts& a, int64_t m0, int64_t g,
                       const float* bias, float* y, int64_t ldy, bool stream) {
  const int64_t K = a.K;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* p = q + (g * nsb + sb) * kBlockBytes;
    __m512 fs[R], fm[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) fs[r] = fm[r] = _mm512_setzero_ps();
    for (int s = 0; s < 8; ++s) {
      // 37 lines a block: five of the one kAhead ahead each sub-block
      if (stream) prefetch_ahead(p, s);
      const uint8_t* chunks = p + 64 * 8 * (s / 2);
      const int64_t k0 = sb * kSuper + 32 * s;
      __m512i ph[R], pl[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) ph[r] = pl[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        const __m512i v = _mm512_loadu_si512(chunks + 64 * c);
        const __m512i w = s % 2 ? _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble)
                                : _mm512_and_si512(v, nibble);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const int64_t k = (m0 + r) * K + k0 + 4 * c;
          ph[r] = _mm512_dpbusd_epi32(ph[r], w, bcast4(a.hi + k));
          pl[r] = _mm512_dpbusd_epi32(pl[r], bcast4(a.lo + k), w);
        }
      }
      const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kScOff + 16 * s))));
      const __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kMnOff + 16 * s))));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512i P = _mm512_add_epi32(_mm512_slli_epi32(ph[r], 8), pl[r]);
        fs[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(P), sc, fs[r]);
        fm[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.s32[(m0 + r) * (K / 32) + sb * 8 + s]),
                                fm[r]);
      }
    }
    const __m512 d =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kDOff)));
    const __m512 dmin =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kDminOff)));
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const float dx = a.dx[(m0 + r) * (K / kSuper) + sb];
      acc[r] = _mm512_fmadd_ps(fs[r], _mm512_mul_ps(d, _mm512_set1_ps(dx)), acc[r]);
      acc[r] = _mm512_fmadd_ps(fm[r], _mm512_mul_ps(dmin, _mm512_set1_ps(-dx)), acc[r]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    float* yr = y + (m0 + r) * ldy + g * kRows;
    _mm512_storeu_ps(yr, bias ? _mm512_add_ps(acc[r], _mm512_loadu_ps(bias + g * kRows))
                              : acc[r]);
  }
}
}  // namespace kquant_tiles
#endif  // TOKENMILL_GGUF_VNNI
