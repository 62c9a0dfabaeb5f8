// Weight kind 20 (Q6_K_TILES): GGUF Q6_K super-blocks packed once at load into tiles of 16
// rows (quantization/q6k_tiles.py `pack`) on AVX-512 VNNI builds, so that 4 weights of 16
// rows meet 4 values of x in two vpdpbusd, each int32 lane one output.
//
// Why: read as stored (linear_gguf_vnni.h), each 32 weights of a row are unpacked, widened to
// int16 and scaled before one vpdpwssd: one Zen 4 core read a decode step's Q6_K layers at
// 13-15 GB/s, from L3 as from memory (the arithmetic's bound), where the Q4_K tiles ran
// 16-18 from memory (benchmarks/RESULTS.md, fifty-second session).
//
// Layout: tensors = {q tiles (N / 16, K / 256, kBlockBytes) uint8}; block (g, sb) holds
// super-block sb of rows 16g .. 16g + 15 (Q6_K: ql 128 bytes, qh 64, 16 int8 scales, d):
//   [0, 2048)     (8j + c) * 64 + 4r + e = ql byte 32j + 4c + e of row r (j 0..3, c 0..7)
//   [2048, 3072)  (8i + c) * 64 + 4r + e = qh byte 32i + 4c + e of row r (i 0..1)
//   [3072, 3328)  sc[h][r]: the int8 scale of sub-block h (16 weights) of row r
//   [3328, 3360)  d[r] float16
// A permutation of the file's bytes. Weight w = 128 t + u (t the half, u < 128) of the
// super-block is q = (ql nibble) | (qh 2 bits) << 4 with ql byte 64 t + u % 64 (its high
// nibble for u >= 64) and bits 2 (u / 32) of qh byte 32 t + u % 32: so the 32 weights of
// unit S (sub-blocks 2S, 2S + 1) read nibble chunks j = 2 (S / 4) + S % 2 (high nibbles for
// S % 4 >= 2) and qh chunks i = S / 4, bits 2 (S % 4).
//
// Arithmetic, per row m of x and output n (a lane), x rounded as for the raw kinds
// (linear_gguf_vnni.h round_rows: x16 per 256 values, x16 = 256 hi + lo, S16 the exact sums
// of x16 over 16 values):
//   per super-block sb: fs = 0; for h = 0..15:
//     P' = 256 sum_k q_k hi_k + sum_k q_k lo_k - 32 S16_h   (exact int32, k: sub-block h)
//     fs = fma(float(P'), float(sc_h), fs)
//   acc = fma(fs, d dx, acc);   y = acc (+ bias)
// |P'| = |sum_k (q_k - 32) x16_k| <= 16 * 32 * 32767 < 2^24: exact as a float. Every
// operation is lane-wise, so each output's bits are the same at any M, rows of x beside it,
// tile of W or thread split (batch-invariant; tests/quantization/test_q6k_tiles.py). Against
// kind 7 the same rounding of x and the same products; the float32 sums differ.
#pragma once
#include "linear_kquant_tiles.h"

namespace q6k_tiles {
constexpr int64_t kKind = 20;
using kquant_tiles::kRows;
using kquant_tiles::kSuper;
constexpr int64_t kQhOff = 2048, kScOff = 3072, kDOff = 3328;
constexpr int64_t kBlockBytes = 3360;

inline bool is_kind(int64_t kind) { return kind == kKind; }

// Rows of W a packed weight has, and its K: as kind 19's (N / 16, K / 256, its bytes).
using kquant_tiles::k_of;
using kquant_tiles::rows_of;

inline void check(const std::vector<torch::Tensor>& t, int64_t K) {
  kquant_tiles::check_tiles(t, K, kKind, kBlockBytes, "Q6_K");
}

// The stored value q (0..63) of weight w of row r in the block at p (the layout above).
inline int value_at(const uint8_t* p, int r, int w) {
  const int t = w / 128, u = w % 128, l = 64 * t + u % 64, hb = 32 * t + u % 32;
  const uint8_t nib = p[(8 * (l / 32) + (l % 32) / 4) * 64 + 4 * r + l % 4];
  const uint8_t high = p[kQhOff + (8 * (hb / 32) + (hb % 32) / 4) * 64 + 4 * r + hb % 4];
  return ((u >= 64 ? nib >> 4 : nib) & 15) | (((high >> (2 * (u / 32))) & 3) << 4);
}

// Row n of the weight as float32 (K values, gguf's dequantization: d sc (q - 32)): an
// embedding lookup from a tied table.
inline void expand_row(const torch::Tensor& q, int64_t n, float* out) {
  const int64_t nsb = q.size(1), g = n / kRows;
  const int r = static_cast<int>(n % kRows);
  const uint8_t* base = q.data_ptr<uint8_t>() + g * nsb * kBlockBytes;
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* p = base + sb * kBlockBytes;
    const float d = gguf_blocks::half_at(p + kDOff + 2 * r);
    for (int w = 0; w < kSuper; ++w) {
      const float scale = d * static_cast<float>(static_cast<int8_t>(p[kScOff + 16 * (w / 16) + r]));
      out[sb * kSuper + w] = scale * static_cast<float>(value_at(p, r, w) - 32);
    }
  }
}

#if defined(TOKENMILL_GGUF_VNNI) && defined(TOKENMILL_KQUANT_TILES)
#define TOKENMILL_Q6K_TILES 1
using kquant_tiles::Acts;
constexpr int kMaxRows = 4;  // rows of x a group's tiles meet at once
// super-blocks ahead a decode step asks for, into L2: 6.7 KB, about kind 19's distance (3 x
// 2368 bytes; not swept for this kind on its own)
constexpr int64_t kAhead = 2;

// Unit S's 4 weights of 16 rows in chunk c: the nibbles of chunk j (low or high) with the
// 2 bits of qh chunk i moved to bits 4 and 5.
template <int S>
static TM_KT_INLINE __m512i unit_values(const uint8_t* p, int c) {
  constexpr int j = 2 * (S / 4) + S % 2, i = S / 4, k = S % 4;
  const __m512i v = _mm512_loadu_si512(p + (8 * j + c) * 64);
  const __m512i hq = _mm512_loadu_si512(p + kQhOff + (8 * i + c) * 64);
  const __m512i lo4 = (S / 2) % 2 ? _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15))
                                  : _mm512_and_si512(v, _mm512_set1_epi8(15));
  const __m512i two = _mm512_set1_epi8(0x30);
  const __m512i h2 = k == 0   ? _mm512_and_si512(_mm512_slli_epi16(hq, 4), two)
                     : k == 1 ? _mm512_and_si512(_mm512_slli_epi16(hq, 2), two)
                     : k == 2 ? _mm512_and_si512(hq, two)
                              : _mm512_and_si512(_mm512_srli_epi16(hq, 2), two);
  return _mm512_or_si512(lo4, h2);
}

using kquant_tiles::bcast4;

// Unit S (sub-blocks 2S, 2S + 1) of super-block sb for rows [m0, m0 + R) into fs.
template <int S, int R>
static TM_KT_INLINE void unit(const uint8_t* p, const Acts& a, const float* s16, int64_t m0,
                              int64_t sb, __m512 (&fs)[R]) {
  const int64_t K = a.K;
#pragma GCC unroll 2
  for (int half = 0; half < 2; ++half) {
    __m512i ph[R], pl[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) ph[r] = pl[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int c = 4 * half; c < 4 * half + 4; ++c) {
      const __m512i w = unit_values<S>(p, c);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int64_t k = (m0 + r) * K + sb * kSuper + 32 * S + 4 * c;
        ph[r] = _mm512_dpbusd_epi32(ph[r], w, bcast4(a.hi + k));
        pl[r] = _mm512_dpbusd_epi32(pl[r], bcast4(a.lo + k), w);
      }
    }
    const int h = 2 * S + half;
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kScOff + 16 * h))));
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const int32_t zero = 32 * static_cast<int32_t>(s16[(m0 + r) * (K / 16) + sb * 16 + h]);
      const __m512i P = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(ph[r], 8), pl[r]),
                                         _mm512_set1_epi32(zero));
      fs[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(P), sc, fs[r]);
    }
  }
}

template <int R, int S = 0>
static TM_KT_INLINE void units(const uint8_t* p, const Acts& a, const float* s16, int64_t m0,
                               int64_t sb, __m512 (&fs)[R], bool stream) {
  if constexpr (S < 8) {
    // 53 lines a block: seven of the one kAhead ahead each unit
    if (stream)
      for (int l = 7 * S; l < std::min(7 * S + 7, int{(kBlockBytes + 63) / 64}); ++l)
        prefetch_l2(p + kAhead * kBlockBytes + 64 * l);
    unit<S, R>(p, a, s16, m0, sb, fs);
    units<R, S + 1>(p, a, s16, m0, sb, fs, stream);
  }
}

// Rows [m0, m0 + R) of x times the 16 outputs of group g (tiles q, nsb super-blocks) into
// y (row stride ldy, group g's first column at y + 16 g).
template <int R>
static void group_rows(const uint8_t* q, int64_t nsb, const Acts& a, const float* s16,
                       int64_t m0, int64_t g, const float* bias, float* y, int64_t ldy,
                       bool stream) {
  __m512 acc[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* p = q + (g * nsb + sb) * kBlockBytes;
    __m512 fs[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) fs[r] = _mm512_setzero_ps();
    units<R>(p, a, s16, m0, sb, fs, stream);
    const __m512 d =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kDOff)));
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const float dx = a.dx[(m0 + r) * (a.K / kSuper) + sb];
      acc[r] = _mm512_fmadd_ps(fs[r], _mm512_mul_ps(d, _mm512_set1_ps(dx)), acc[r]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    float* yr = y + (m0 + r) * ldy + g * kRows;
    _mm512_storeu_ps(yr, bias ? _mm512_add_ps(acc[r], _mm512_loadu_ps(bias + g * kRows))
                              : acc[r]);
  }
}

// Each part's N columns of y (row stride ldy) = x @ W^T (+ bias, one part only), x split as
// for kind 19 (kquant_tiles::split) with its S16 (round_rows): a merged layer's parts share
// one parallel region (kquant_tiles::for_each_group).
inline void linear_split(const std::vector<kquant_tiles::Part>& parts, const Acts& a,
                         const float* s16, int64_t M, const float* bias, int64_t ldy) {
  const int64_t nsb = a.K / kSuper;
  const bool stream = M <= 4;
  kquant_tiles::for_each_group<kMaxRows>(
      parts, M, a.K, [&](const kquant_tiles::Part& w, int64_t g, int64_t m, auto R) {
        group_rows<decltype(R)::value>(w.q, nsb, a, s16, m, g, bias, w.y, ldy, stream);
      });
}

// y (M, N) = x @ W^T (+ bias), x (M, K) float32.
inline void linear(const torch::Tensor& qt, const float* xp, int64_t M, int64_t K,
                   const float* bias, float* y) {
  const gguf_vnni::Int16Rows r = gguf_vnni::round_rows(xp, M, K);
  TORCH_CHECK(r.XB == kSuper, "weight kind 20 needs K divisible by 256");
  linear_split({kquant_tiles::part_of(qt, y)}, kquant_tiles::split(r, M).acts, r.s16.data(), M,
               bias, rows_of(qt));
}
#endif
}  // namespace q6k_tiles
