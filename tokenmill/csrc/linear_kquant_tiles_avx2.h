// Weight kind 19 (Q4_K tiles, linear_kquant_tiles_layout.h) on AVX2 builds (256-bit vectors,
// no vpdpbusd): a chunk's two halves of 8 rows read as int16 lanes, their nibble pairs
// meeting x16 in vpmaddwd; the same bits as the VNNI kernel (linear_kquant_tiles_vnni.h).
#pragma once
#include "linear_kquant_tiles_layout.h"

#if defined(TOKENMILL_GGUF_ROWS) && !defined(TOKENMILL_GGUF_VNNI)
namespace kquant_tiles {
// Rows of x a group's tiles meet at once (four ran at the same rate from 4 to 256 rows).
constexpr int kMaxRows = 2;

// x as kind 5 rounds it on these builds (gguf_rows::split_rows), joined back into x16 in the
// order the products read it: per 4 values (k0, k2, k1, k3), so that one 32-bit broadcast
// meets the weights of k0 and k2 (or k1 and k3) of 8 rows in one vpmaddwd.
struct SplitX {
  AlignedVector<int16_t> x16;  // (M, K)
  Acts acts;
};

inline SplitX split(const gguf_rows::SplitRows& r, int64_t M) {
  TORCH_CHECK(r.XB == kSuper, "weight kind 19 needs K divisible by 256");
  SplitX a;
  a.x16.resize(M * r.K);
  auto run = [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i += 16) {
      const __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(r.hi.data() + i)));
      const __m256i lo = _mm256_cvtepu8_epi16(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(r.lo.data() + i)));
      const __m256i x = _mm256_or_si256(_mm256_slli_epi16(hi, 8), lo);
      constexpr int kOrder = _MM_SHUFFLE(3, 1, 2, 0);  // (0, 1, 2, 3) -> (0, 2, 1, 3)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.x16.data() + i),
                          _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(x, kOrder), kOrder));
    }
  };
  if (M <= 8) {  // a decode step: not worth waking the thread pool
    run(0, M * r.K);
  } else {
    at::parallel_for(0, M * r.K / 16, 512, [&](int64_t b0, int64_t b1) { run(16 * b0, 16 * b1); });
  }
  a.acts = {r.K, nullptr, nullptr, r.d.data(), r.s32.data(), a.x16.data()};
  return a;
}

static TM_KT_INLINE __m256i bcast_pair(const int16_t* p) { return _mm256_set1_epi32(load4(p)); }

// Half h of super-block p (rows 8h .. 8h + 7 of its group: bytes 32h .. 32h + 31 of each
// 64-byte chunk, 4 a row) times rows [m0, m0 + R) of x (super-block sb), into acc, in
// vpmaddwd: AVX2 has no vpdpbusd, and vpmaddubsw on x16's two bytes costs three multiplies
// per 32 weights where this takes two. Read as int16 lanes, a row's bytes (b0, b1 | b2, b3)
// give its four nibble pairs by masks: & 0x000F the low nibbles of k0, k2 (sub-block 2j),
// & 0x0F00 of k1, k3 times 256, & 0x00F0 the high nibbles of k0, k2 (sub-block 2j + 1) times
// 16, >> 12 those of k1, k3. Each meets its pair of x16 in one vpmaddwd into a row's int32
// lane, summed over the sub-block's 8 chunks exactly (the x256 sum, the largest, is at most
// 8 * 2 * 3840 * 32767 < 2^31), then scaled back by exact shifts: the same P as group_rows
// on VNNI, then the same lane-wise float32 operations in the same order, so the same bits.
template <int R>
static TM_KT_INLINE void half_superblock(const uint8_t* p, int h, const Acts& a, int64_t m0,
                                         int64_t sb, __m256 (&acc)[R]) {
  const int64_t K = a.K;
  const __m256i m000f = _mm256_set1_epi16(0x000F), m00f0 = _mm256_set1_epi16(0x00F0),
                m0f00 = _mm256_set1_epi16(0x0F00);
  __m256 fs[R], fm[R];
#pragma GCC unroll 2
  for (int r = 0; r < R; ++r) fs[r] = fm[r] = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {  // sub-blocks 2j (low nibbles) and 2j + 1 (high)
    const uint8_t* chunks = p + 64 * 8 * j + 32 * h;
    const int64_t k0 = sb * kSuper + 64 * j;
    __m256i pa[R], pb[R], pc[R], pd[R];
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) pa[r] = pb[r] = pc[r] = pd[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks + 64 * c));
      const __m256i qa = _mm256_and_si256(v, m000f), qb = _mm256_and_si256(v, m00f0),
                    qc = _mm256_and_si256(v, m0f00), qd = _mm256_srli_epi16(v, 12);
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) {
        const int16_t* x0 = a.x16 + (m0 + r) * K + k0 + 4 * c;  // sub-block 2j
        const int16_t* x1 = x0 + 32;                             // sub-block 2j + 1
        pa[r] = _mm256_add_epi32(pa[r], _mm256_madd_epi16(qa, bcast_pair(x0)));
        pc[r] = _mm256_add_epi32(pc[r], _mm256_madd_epi16(qc, bcast_pair(x0 + 2)));
        pb[r] = _mm256_add_epi32(pb[r], _mm256_madd_epi16(qb, bcast_pair(x1)));
        pd[r] = _mm256_add_epi32(pd[r], _mm256_madd_epi16(qd, bcast_pair(x1 + 2)));
        // GCC reassociates integer sums: it computed all 8 chunks' products first, spilled
        // them and summed them as a tree. This keeps each a running sum in its register.
        __asm__("" : "+x"(pa[r]), "+x"(pb[r]), "+x"(pc[r]), "+x"(pd[r]));
      }
    }
#pragma GCC unroll 2
    for (int t = 0; t < 2; ++t) {
      const int s = 2 * j + t;
      const int64_t at = 16 * s + 8 * h;
      const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + kScOff + at))));
      const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + kMnOff + at))));
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) {
        const __m256i P = t == 0 ? _mm256_add_epi32(pa[r], _mm256_srai_epi32(pc[r], 8))
                                 : _mm256_add_epi32(_mm256_srai_epi32(pb[r], 4), pd[r]);
        fs[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(P), sc, fs[r]);
        fm[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(a.s32[(m0 + r) * (K / 32) + sb * 8 + s]),
                                fm[r]);
      }
    }
  }
  const __m256 d = _mm256_cvtph_ps(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kDOff + 16 * h)));
  const __m256 dmin = _mm256_cvtph_ps(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kDminOff + 16 * h)));
#pragma GCC unroll 2
  for (int r = 0; r < R; ++r) {
    const float dx = a.dx[(m0 + r) * (K / kSuper) + sb];
    acc[r] = _mm256_fmadd_ps(fs[r], _mm256_mul_ps(d, _mm256_set1_ps(dx)), acc[r]);
    acc[r] = _mm256_fmadd_ps(fm[r], _mm256_mul_ps(dmin, _mm256_set1_ps(-dx)), acc[r]);
  }
}

// Rows [m0, m0 + R) of x times the 16 outputs of group g, as on VNNI: each super-block's
// two halves of 8 rows one after the other (the second reads its lines from L1).
template <int R>
static void group_rows(const uint8_t* q, int64_t nsb, const Acts& a, int64_t m0, int64_t g,
                       const float* bias, float* y, int64_t ldy, bool stream) {
  __m256 acc[2][R];
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < R; ++r) acc[h][r] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* p = q + (g * nsb + sb) * kBlockBytes;
    if (stream)  // (asking for them a sub-block at a time, or 4 or 8 ahead: the same rate)
      for (int s = 0; s < 8; ++s) prefetch_ahead(p, s);
    half_superblock<R>(p, 0, a, m0, sb, acc[0]);
    half_superblock<R>(p, 1, a, m0, sb, acc[1]);
  }
  for (int h = 0; h < 2; ++h) {
    const int64_t col = g * kRows + 8 * h;
    for (int r = 0; r < R; ++r) {
      float* yr = y + (m0 + r) * ldy + col;
      _mm256_storeu_ps(yr, bias ? _mm256_add_ps(acc[h][r], _mm256_loadu_ps(bias + col))
                                : acc[h][r]);
    }
  }
}
}  // namespace kquant_tiles
#endif  // AVX2
