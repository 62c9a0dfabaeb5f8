// GGUF block products (every kind of linear_gguf.h, read in place) on AVX-512
// VNNI builds, at every M. The AVX2 row kernels (linear_gguf_rows.h) meet the stored bytes with
// x split into two bytes: two vpmaddubsw and two vpmaddwd per 32 weights and row of x, 256-bit;
// at 4-128 rows they ran ~96 G products/s on two Zen 5 cores, about a third of llama.cpp's
// prompt rate on the same file. Here each weight is widened once to int16 (a K-quant's
// sub-block scale folded in), and one vpdpwssd multiplies 32 weights by 32 int16 activations
// into 16 int32 lanes: 1.6-2x at 16-128 rows, where vpdpwssd's own throughput (one a cycle
// per Zen 5 core) is the bound (benchmarks/gguf_kernels.py). A step of up to 8 rows of x (a
// decode step: W read once) decodes each block in registers as it reads it; larger steps
// decode a tile of W rows once for every block of rows of x (linear_kind).
//
//   x16 = round-half-even(x / dx), dx = amax / 32767 per XB values of x (XB = 256 where K
//   allows, else 32: the rounding of linear_gguf_rows.h and of gguf_activation_block), S32
//   the exact sums of x16 over 32 values. Per group of XB / 32 (G) blocks of 32 weights:
//   Q4_K, Q5_K: w16 = sc_s q          y += (d dx) I + sum_s (-dmin mn_s) (S32_s dx)
//   Q6_K:       w16 = sc_h (q - 32)   y += (d dx) I
//   Q3_K:       w16 = (sc_h - 32) (q - 4)         y += (d dx) I
//   Q2_K:       w16 = sc_h q          y += (d dx) I + sum_h (-dmin mn_h) (S16_h dx)
//   IQ4_XS:     w16 = (sc_s - 32) v   y += (d dx) I
//   IQ4_NL:     w16 = v               y += dx (sum_b d_b I_b)
//   Q5_0:       w16 = q - 16          y += dx (sum_b d_b I_b)
//   Q5_1:       w16 = q               y += dx (sum_b d_b I_b + sum_b m_b S32_b)
//   I = sum_j w16_j x16_j (K-quants: over the super-block; I_b: over block b), 16 int32
//   lanes, each exact: Q6_K's |w16| <= 32 * 128 = 4096 (IQ4_XS's 32 * 127), so a lane's 16
//   products stay under 16 * 4096 * 32767 < 2^31 (with q unshifted, 63 * 128, they would
//   not); Q5_K's <= 31 * 63.
//
// Per (row of x, row of W), 16 float32 lanes take each group's terms in K order and one fixed
// tree sums them at the end: a row's result is bitwise the same at any M, with any
// neighbours, tiling or threads (tests/quantization/test_gguf_kquants.py). Against the AVX2
// kernels the products are the same exact integers; their float32 sums round differently.
#pragma once
#include "linear_gguf_rows.h"

#if defined(TOKENMILL_GGUF_ROWS) && defined(CPU_CAPABILITY_AVX512) && defined(__AVX512VNNI__)
#define TOKENMILL_GGUF_VNNI 1

namespace gguf_vnni {
using namespace gguf_blocks;

// M rows of x rounded to int16 per XB values.
struct Int16Rows {
  int64_t K = 0, XB = 0;
  AlignedVector<int16_t> x;  // (M, K) x16
  std::vector<float> dx;   // (M, K / XB)
  std::vector<float> s16;  // (M, K / 16) S16, integers held exactly as floats
  std::vector<float> s32;  // (M, K / 32) S32
};

// XB values of a row: x16 into q, its dx, S16 and S32 of its XB / 16 and XB / 32 blocks.
static void round_block(const float* x, int64_t XB, int16_t* q, float* dx_out, float* s16,
                        float* s32) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t i = 0; i < XB; i += 16)
    amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
  const float dx = _mm512_reduce_max_ps(amax) / 32767.f, inv = dx > 0.f ? 1.f / dx : 0.f;
  *dx_out = dx;
  const __m512 vinv = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < XB; i += 32) {  // the default rounding mode: half to even
    const __m512i a = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), vinv));
    const __m512i b = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i + 16), vinv));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), _mm512_cvtepi32_epi16(a));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i + 16), _mm512_cvtepi32_epi16(b));
    const int32_t sa = _mm512_reduce_add_epi32(a), sb = _mm512_reduce_add_epi32(b);
    s16[i / 16] = static_cast<float>(sa), s16[i / 16 + 1] = static_cast<float>(sb);
    s32[i / 32] = static_cast<float>(sa + sb);
  }
}

static Int16Rows round_rows(const float* x, int64_t M, int64_t K) {
  Int16Rows r;
  r.K = K, r.XB = K % 256 == 0 ? 256 : 32;
  r.x.resize(M * K), r.dx.resize(M * K / r.XB), r.s16.resize(M * K / 16);
  r.s32.resize(M * K / 32);
  auto run = [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      round_block(x + b * r.XB, r.XB, r.x.data() + b * r.XB, &r.dx[b], &r.s16[b * r.XB / 16],
                  &r.s32[b * r.XB / 32]);
  };
  if (M <= 4) run(0, M * K / r.XB);  // a decode step: not worth waking the thread pool
  else at::parallel_for(0, M * K / r.XB, 16, run);
  return r;
}

// Offsets per group of G blocks: Q2_K one per 16 weights, else one per block.
constexpr int offsets_per_group(int64_t kind, int G) { return kind == kQ2_K ? 16 : G; }
constexpr __mmask16 offsets_mask(int64_t kind, int G) {
  return static_cast<__mmask16>((1u << offsets_per_group(kind, G)) - 1);
}

// One group of G blocks of 32 weights of a W row (a K-quant super-block: G = 8), decoded:
// int16 weights, the scales (K-quants: d[0]; else each block's d), and the offsets' lanes
// (Q4_K / Q5_K -dmin mn_s, Q2_K -dmin mn_h, Q5_1 m_b; from lane 0, zeros above).
template <int G>
struct Group {
  __m512i w[G];
  float d[G];
  __m512 offs;
};

// The int16 scales of a super-block in every 128-bit lane (per16 kinds: 0..7 in lo, 8..15
// in hi; else 8 in lo), spread to a sub-block's lanes by one in-lane vpshufb (a permute
// across lanes cost more); d and the offsets into g.
template <int64_t KIND>
static TM_GGUF_INLINE void superblock_scales(const uint8_t* p, __m512i& lo, __m512i& hi,
                                             Group<8>& g) {
  g.d[0] = half_at(p + d_offset(KIND));
  g.offs = _mm512_setzero_ps();
  if constexpr (per16(KIND)) {
    const gguf_rows::SuperScales sc = gguf_rows::superblock_scales<KIND>(p);
    lo = _mm512_broadcast_i32x4(_mm256_castsi256_si128(sc.lo));
    hi = _mm512_broadcast_i32x4(_mm256_castsi256_si128(sc.hi));
    if constexpr (KIND == kQ2_K)
      g.offs = _mm512_insertf32x8(_mm512_castps256_ps512(sc.off16[0]), sc.off16[1], 1);
  } else if constexpr (KIND == kIQ4_XS) {
    alignas(16) int16_t sc[8];
    for (int s = 0; s < 8; ++s) sc[s] = static_cast<int16_t>(iq4_xs_scale(p, s) - 32);
    lo = hi = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(sc)));
  } else {
    const gguf_rows::SuperScales sc = gguf_rows::superblock_scales<KIND>(p);
    lo = hi = _mm512_broadcast_i32x4(_mm256_castsi256_si128(sc.lo));
    g.offs = _mm512_zextps256_ps512(sc.mins);
  }
}

// The K-quant super-block at p.
template <int64_t KIND>
static TM_GGUF_INLINE void decode_superblock(const uint8_t* p, Group<8>& g) {
  __m512i lo, hi;
  superblock_scales<KIND>(p, lo, hi, g);
  for (int s = 0; s < 8; ++s) {
    __m512i v;  // the values less their zero point, int16
    if constexpr (KIND == kQ4_K) {  // sub-blocks 2j, 2j + 1: the low and high nibbles
      const __m512i bytes = _mm512_cvtepu8_epi16(load32(p + 16 + 32 * (s / 2)));
      v = s % 2 ? _mm512_srli_epi16(bytes, 4) : _mm512_and_si512(bytes, _mm512_set1_epi16(15));
    } else if constexpr (zero_point(KIND) != 0 || is_iq4(KIND)) {
      v = _mm512_cvtepi8_epi16(signed_values<KIND>(p, s));
    } else {
      v = _mm512_cvtepu8_epi16(block_values<KIND>(p, s));
    }
    // which scale (int16 lane of a 128-bit lane) each lane takes: per16 kinds 2s, 2s + 1
    const __m512i spread = _mm512_load_si512(
        gguf_rows::kSpread.w512[gguf_rows::spread_entry<KIND>(s)]);
    const __m512i scale = _mm512_shuffle_epi8(per16(KIND) && s >= 4 ? hi : lo, spread);
    g.w[s] = _mm512_mullo_epi16(v, scale);
  }
}

// Group `gi` of a raw W row (K-quants: super-block gi; Q5_0 / Q5_1: blocks G gi ..).
template <int64_t KIND, int G>
static TM_GGUF_INLINE void decode_group(const uint8_t* row, int64_t gi, Group<G>& g) {
  if constexpr (is_kquant(KIND)) {
    decode_superblock<KIND>(row + gi * block_bytes(KIND), g);
  } else {
    alignas(64) float m[16] = {};
    for (int b = 0; b < G; ++b) {
      const uint8_t* p = row + (gi * G + b) * block_bytes(KIND);
      g.w[b] = KIND == kQ5_1 ? _mm512_cvtepu8_epi16(block_values<KIND>(p, 0))
                             : _mm512_cvtepi8_epi16(signed_values<KIND>(p, 0));
      g.d[b] = half_at(p);
      if (KIND == kQ5_1) m[b] = half_at(p + 2);
    }
    // lanes from G on meet zeros of S32's masked load: any finite value does
    g.offs = KIND != kQ5_1 ? _mm512_setzero_ps()
             : G == 1      ? _mm512_set1_ps(m[0])
                           : _mm512_load_ps(m);
  }
}

// A tile of W rows decoded: per row K int16 weights, per group its G (K-quants 1) scales and
// its offsets_per_group offsets.
struct DecodedRows {
  AlignedVector<int16_t> w;
  std::vector<float> d, offs;
};

// Scales per group of G blocks: one d per K-quant super-block, else one per block.
constexpr int64_t scales_per_group(int64_t kind, int64_t G) { return is_kquant(kind) ? 1 : G; }

// W rows [n0, n1) (raw rows row_bytes apart) decoded into out (row i at i * K).
template <int64_t KIND, int G>
static void decode_rows(const uint8_t* W, int64_t row_bytes, int64_t K, int64_t n0, int64_t n1,
                        DecodedRows& out) {
  constexpr int64_t S = scales_per_group(KIND, G), O = offsets_per_group(KIND, G);
  const int64_t groups = K / (32 * G), rows = n1 - n0;
  out.w.resize(rows * K), out.d.resize(rows * groups * S), out.offs.resize(rows * groups * O);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t gi = 0; gi < groups; ++gi) {
      Group<G> g;
      decode_group<KIND, G>(W + (n0 + i) * row_bytes, gi, g);
      const int64_t j = i * groups + gi;
      for (int b = 0; b < G; ++b) _mm512_storeu_si512(&out.w[j * 32 * G + 32 * b], g.w[b]);
      for (int64_t b = 0; b < S; ++b) out.d[j * S + b] = g.d[b];
      _mm512_mask_storeu_ps(&out.offs[j * O], offsets_mask(KIND, G), g.offs);
    }
  }
}

// Where `products` takes W's rows: a decoded tile (rows w0 .. of `tile`), or (raw != nullptr,
// one row) the raw row itself, decoded group by group in registers as it is read: a decode
// step reads W once, so a buffer would only add a store and a load.
struct WeightRows {
  const DecodedRows* tile;
  int64_t w0;
  const uint8_t* raw;
};

// One group of C W rows as the sums read it: the raw row's decoded group (RAW), or pointers
// into the tile.
template <int64_t KIND, int G, int C, bool RAW>
struct GroupRows {
  static constexpr int64_t S = scales_per_group(KIND, G);
  const Group<G>* raw;
  const int16_t* w[C];
  const float *d[C], *offs[C];

  GroupRows(const WeightRows& wr, const Group<G>* g, int64_t gi, int64_t K) : raw(g) {
    for (int c = 0; c < C && !RAW; ++c) {
      const DecodedRows& t = *wr.tile;
      w[c] = t.w.data() + (wr.w0 + c) * K + gi * 32 * G;
      d[c] = t.d.data() + ((wr.w0 + c) * (K / (32 * G)) + gi) * S;
      offs[c] = t.offs.data() + ((wr.w0 + c) * (K / (32 * G)) + gi) * offsets_per_group(KIND, G);
    }
  }
  TM_GGUF_INLINE __m512i weights(int c, int b) const {
    return RAW ? raw->w[b] : _mm512_loadu_si512(w[c] + 32 * b);
  }
  TM_GGUF_INLINE float scale(int c, int b) const { return RAW ? raw->d[b] : d[c][b]; }
  TM_GGUF_INLINE __m512 offsets(int c) const {
    return RAW ? raw->offs : _mm512_maskz_loadu_ps(offsets_mask(KIND, G), offs[c]);
  }
};

// A group's sums before dx (fsum) for rows xr of x: K-quants cvt(I), else sum_b d_b cvt(I_b).
// K-quants run A chains of vpdpwssd per output (block b into chain b % A), added at the
// end: one chain of 8 dependent vpdpwssd bound a decode step's single output (integer sums
// are exact: A changes no result).
template <int64_t KIND, int G, int R, int C, bool RAW>
static TM_GGUF_INLINE void group_sums(const int16_t* const (&xr)[R],
                                      const GroupRows<KIND, G, C, RAW>& w,
                                      __m512 (&fsum)[R][C]) {
  if constexpr (is_kquant(KIND)) {
    constexpr int A = R * C >= 4 ? 1 : R * C >= 2 ? 2 : 4;
    __m512i part[R][C][A];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        for (int a = 0; a < A; ++a) part[r][c][a] = _mm512_setzero_si512();
    for (int b = 0; b < G; ++b) {
      __m512i wv[C];
      for (int c = 0; c < C; ++c) wv[c] = w.weights(c, b);
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_loadu_si512(xr[r] + 32 * b);
        for (int c = 0; c < C; ++c)
          part[r][c][b % A] = _mm512_dpwssd_epi32(part[r][c][b % A], xv, wv[c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) {
        __m512i sum = part[r][c][0];
        for (int a = 1; a < A; ++a) sum = _mm512_add_epi32(sum, part[r][c][a]);
        fsum[r][c] = _mm512_cvtepi32_ps(sum);
      }
  } else {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) fsum[r][c] = _mm512_setzero_ps();
    for (int b = 0; b < G; ++b) {
      __m512i wv[C];
      __m512 dv[C];
      for (int c = 0; c < C; ++c)
        wv[c] = w.weights(c, b), dv[c] = _mm512_set1_ps(w.scale(c, b));
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_loadu_si512(xr[r] + 32 * b);
        for (int c = 0; c < C; ++c) {
          const __m512i i = _mm512_dpwssd_epi32(_mm512_setzero_si512(), xv, wv[c]);
          fsum[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), dv[c], fsum[r][c]);
        }
      }
    }
  }
}

// facc += the group's terms (the table at the top) for rows x0 .. of x.
template <int64_t KIND, int G, int R, int C, bool RAW>
static TM_GGUF_INLINE void add_group(const Int16Rows& x, int64_t x0, int64_t gi,
                                     const GroupRows<KIND, G, C, RAW>& w,
                                     __m512 (&fsum)[R][C], __m512 (&facc)[R][C]) {
  constexpr bool kOffsets = has_offset(KIND);
  const int64_t K = x.K, groups = K / (32 * G);
  __m512 offs[C];
  float d0[C];
  for (int c = 0; c < C; ++c)
    offs[c] = kOffsets ? w.offsets(c) : _mm512_setzero_ps(), d0[c] = w.scale(c, 0);
  for (int r = 0; r < R; ++r) {
    const float dx = x.dx[(x0 + r) * groups + gi];
    // the sums the offsets multiply: Q2_K's S16 (16 a group), else S32 (G)
    const __m512 s32 = !kOffsets ? _mm512_setzero_ps()
        : KIND == kQ2_K ? _mm512_loadu_ps(&x.s16[(x0 + r) * (K / 16) + gi * 16])
                        : _mm512_maskz_loadu_ps((1 << G) - 1, &x.s32[(x0 + r) * (K / 32) + gi * G]);
    const __m512 s32dx = _mm512_mul_ps(s32, _mm512_set1_ps(dx));  // K-quants' offsets
    for (int c = 0; c < C; ++c) {
      if constexpr (is_kquant(KIND)) {
        facc[r][c] = _mm512_fmadd_ps(fsum[r][c], _mm512_set1_ps(d0[c] * dx), facc[r][c]);
        if (kOffsets) facc[r][c] = _mm512_fmadd_ps(offs[c], s32dx, facc[r][c]);
      } else {
        if (kOffsets) fsum[r][c] = _mm512_fmadd_ps(offs[c], s32, fsum[r][c]);
        facc[r][c] = _mm512_fmadd_ps(fsum[r][c], _mm512_set1_ps(dx), facc[r][c]);
      }
    }
  }
}

// out[r][c] = row r of x (rows x0 ..) times W row c: R x C outputs, each in its own 16 float
// lanes over the groups in order, then one reduction tree. The same arithmetic whichever way
// W comes (WeightRows).
template <int64_t KIND, int G, int R, int C, bool RAW>
static TM_GGUF_INLINE void products(const Int16Rows& x, int64_t x0, const WeightRows& wr,
                                    float (&out)[R][C]) {
  const int64_t K = x.K, groups = K / (32 * G);
  constexpr int64_t kBytes = is_kquant(KIND) ? block_bytes(KIND) : G * block_bytes(KIND);
  __m512 facc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) facc[r][c] = _mm512_setzero_ps();
  for (int64_t gi = 0; gi < groups; ++gi) {
    Group<G> raw;  // the raw row's group (C == 1), else read from the tile
    if constexpr (RAW) {
      prefetch_ahead(wr.raw + gi * kBytes, kBytes);
      decode_group<KIND, G>(wr.raw, gi, raw);
    }
    const GroupRows<KIND, G, C, RAW> w(wr, &raw, gi, K);
    const int16_t* xr[R];  // (a pointer per row: GCC had kept an offset per load, spilled)
    for (int r = 0; r < R; ++r) xr[r] = &x.x[(x0 + r) * K + gi * 32 * G];
    __m512 fsum[R][C];
    group_sums<KIND, G, R, C, RAW>(xr, w, fsum);
    add_group<KIND, G, R, C, RAW>(x, x0, gi, w, fsum, facc);
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r][c] = _mm512_reduce_add_ps(facc[r][c]);
}

// Rows [x0, x0 + R) of x times W rows [n0, n1) into y: the raw rows one at a time (RAW), or a
// decoded tile (row 0 being W row n0) two rows at a time.
template <int64_t KIND, int G, int R, bool RAW>
static void rows_times(const Int16Rows& x, int64_t x0, const DecodedRows* tile,
                       const uint8_t* W, int64_t row_bytes, int64_t n0, int64_t n1, int64_t K,
                       int64_t N, const float* bias, float* y) {
  auto put = [&](int64_t n, int r, float v) { y[(x0 + r) * N + n] = v + (bias ? bias[n] : 0.f); };
  int64_t n = n0;
  for (; !RAW && n + 2 <= n1; n += 2) {
    float out[R][2];
    products<KIND, G, R, 2, false>(x, x0, {tile, n - n0, nullptr}, out);
    for (int r = 0; r < R; ++r) put(n, r, out[r][0]), put(n + 1, r, out[r][1]);
  }
  for (; n < n1; ++n) {
    float out[R][1];
    if constexpr (RAW) products<KIND, G, R, 1, true>(x, x0, {nullptr, 0, W + n * row_bytes}, out);
    else products<KIND, G, R, 1, false>(x, x0, {tile, n - n0, nullptr}, out);
    for (int r = 0; r < R; ++r) put(n, r, out[r][0]);
  }
}

// Rows of x per products call: a tile's 4 x 2 outputs keep 8 int32 and 8 float32 accumulators
// in registers; raw rows (one W row, its group decoded in 8 registers) take up to 8 rows of x,
// so that a step of up to 8 rows reads and decodes W once.
constexpr int64_t kTileRowsX = 4, kRawRowsX = 8;

// Rows [m, m + R) of x, R <= RAW ? 8 : 4 (a switch over the templates).
template <int64_t KIND, int G, bool RAW>
static void rows_times_any(int64_t R, const Int16Rows& x, int64_t m, const DecodedRows* tile,
                           const uint8_t* W, int64_t row_bytes, int64_t n0, int64_t n1,
                           int64_t K, int64_t N, const float* bias, float* y) {
#define TM_ROWS(r) \
  return rows_times<KIND, G, r, RAW>(x, m, tile, W, row_bytes, n0, n1, K, N, bias, y)
  switch (R) {
    case 1: TM_ROWS(1);
    case 2: TM_ROWS(2);
    case 3: TM_ROWS(3);
    case 4: TM_ROWS(4);
  }
  if constexpr (RAW) {
    switch (R) {
      case 5: TM_ROWS(5);
      case 6: TM_ROWS(6);
      case 7: TM_ROWS(7);
      case 8: TM_ROWS(8);
    }
  }
#undef TM_ROWS
  TORCH_CHECK(false, "gguf_vnni: no kernel for ", R, " rows");
}

// y (M, N) = x @ W^T (+ bias) for a GGUF block kind's raw rows W (N, row_bytes), x (M, K)
// float32. A step of up to 8 rows (decode: W read once) multiplies each raw row as it decodes
// it; larger steps decode a tile of W rows (as many as fit ~128 KB of int16, kept in L2) once
// per block of x (x_block_rows: ~1 MB, kept in L2) for every group of 4 rows of the block.
// Threads take contiguous ranges of tiles. The blocking changes no result: each output's
// lanes take the same terms in the same order.
template <int64_t KIND, int G>
static void linear_kind(const Int16Rows& x, const uint8_t* W, int64_t M, int64_t K, int64_t N,
                        const float* bias, float* y, int64_t ldy) {
  const int64_t row_bytes = gguf_blocks::row_bytes(KIND, K);
  const bool stream = M <= kRawRowsX;
  const int64_t tile = stream ? 8 : std::clamp<int64_t>((65536 / K) & ~int64_t{1}, 2, 16);
  const int64_t tiles = (N + tile - 1) / tile;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  // x in blocks of ~1 MB (512 KB and 2 MB: within 2%), each met by all of a thread's tiles
  const int64_t xblock = stream ? M : x_block_rows(2 * K, kTileRowsX, 1 << 20);
  at::parallel_for(0, tiles, std::max<int64_t>(1, tiles / threads), [&](int64_t t0, int64_t t1) {
    DecodedRows w;
    for (int64_t m0 = 0; m0 < M; m0 += xblock) {
      const int64_t m1 = std::min(M, m0 + xblock);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n0 = t * tile, n1 = std::min(N, n0 + tile);
        if (stream) {
          rows_times_any<KIND, G, true>(M, x, 0, nullptr, W, row_bytes, n0, n1, K, ldy, bias, y);
          continue;
        }
        decode_rows<KIND, G>(W, row_bytes, K, n0, n1, w);  // once per block of x
        for (int64_t m = m0; m < m1; m += kTileRowsX)
          rows_times_any<KIND, G, false>(std::min(kTileRowsX, m1 - m), x, m, &w, W, row_bytes,
                                         n0, n1, K, ldy, bias, y);
      }
    }
  });
}

// K-quants: a group is a super-block; 32-weight kinds: the XB / 32 blocks of one dx.
template <int64_t KIND>
static void linear_of(const Int16Rows& x, const uint8_t* W, int64_t M, int64_t K, int64_t N,
                      const float* bias, float* y, int64_t ldy) {
  if constexpr (is_kquant(KIND)) linear_kind<KIND, 8>(x, W, M, K, N, bias, y, ldy);
  else if (x.XB == 256) linear_kind<KIND, 8>(x, W, M, K, N, bias, y, ldy);
  else linear_kind<KIND, 1>(x, W, M, K, N, bias, y, ldy);
}

// y's N columns (row stride ldy) = x @ W^T (+ bias), x already rounded (round_rows): the
// parts of a merged layer share one rounding and write side by side (linear_cpu.h).
inline void linear_rounded(int64_t kind, const uint8_t* W, const Int16Rows& x, int64_t M,
                           int64_t K, int64_t N, const float* bias, float* y, int64_t ldy) {
  switch (kind) {
#define TM_GGUF_CASE(k) \
  case k: return linear_of<k>(x, W, M, K, N, bias, y, ldy);
    TM_GGUF_KINDS(TM_GGUF_CASE)
#undef TM_GGUF_CASE
  }
  TORCH_CHECK(false, "no GGUF VNNI kernel for weight kind ", kind);
}

inline void linear(int64_t kind, const uint8_t* W, const float* xp, int64_t M, int64_t K,
                   int64_t N, const float* bias, float* y) {
  linear_rounded(kind, W, round_rows(xp, M, K), M, K, N, bias, y, N);
}

}  // namespace gguf_vnni
#endif
