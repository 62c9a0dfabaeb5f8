// GGUF K-quant products with int8 activations (`int8_activations=True`), at every M: the
// arithmetic llama.cpp uses for these files (its Q8_K activations), on the raw super-blocks
// as the file stores them (linear_gguf.h's block_values and scales).
//
// Why: with int16 activations (linear_gguf_vnni.h) a K-quant product costs one vpdpwssd per
// 32 weights and row of x once each weight is widened and scaled; at 16-128 rows that
// instruction's rate bounds the step. Here the stored values (u8, at most 6 bits) meet int8
// activations in one vpmaddubsw per 64 (AVX-512; 32 with AVX2) and the group scales in one
// vpmaddwd, with no per-weight widening or scaling.
//
//   x8 = round-half-even(x / dx), dx = amax / 127 per 256 values of x (one super-block);
//   S16 the exact sums of x8 over 16 values. Per super-block, row of x and row of W:
//     I = sum_g sc_g (sum_{j in g} q_j x8_j - z S16_g)      J = sum_g mn_g S16_g     (int32)
//     acc = fma(float(I), d dx, acc);  then (Q4_K, Q5_K, Q2_K) acc = fma(float(J), -dmin dx, acc)
//   and y = acc + bias after the last super-block (K order). g: the 16 groups of 16 weights;
//   sc_g the group's integer scale (Q4_K / Q5_K its sub-block's; Q6_K int8; Q3_K sc - 32;
//   Q2_K 4-bit), z the zero point (Q6_K 32, Q3_K 4, else 0), mn_g the integer min (Q4_K /
//   Q5_K per sub-block, Q2_K per 16). |I| < 2^30; vpmaddubsw's pair sums stay under
//   2 * 63 * 127 (no saturation).
//
// Two ways to the same integers and the same float32 operations, so a row's result is
// bitwise the same at every M, with any neighbours, chunking or threads
// (tests/quantization/test_gguf_int8.py):
// - raw rows (decode steps: up to raw_max_rows rows of x): a W row's super-block decoded
//   in registers as it is read, lanes along its weights, I and J summed across the lanes;
// - tiles (larger steps): kRowsPerVec W rows decoded once into an interleaved tile, 4 bytes
//   of each row side by side, so that one vpmaddubsw multiplies 4 weights of every row by the
//   same 4 values of x (broadcast; with AVX-512 VNNI one vpdpbusd) and each int32 lane is
//   one output: the float work of a super-block is one vector op for kRowsPerVec outputs
//   (llama.cpp's repacked layouts; linear_gguf_int8_tiles.h).
//
// Lossy: x's rounding to 8 bits per 256 values (benchmarks/quant_quality.py measures it);
// used only where asked for. IQ4's levels (up to 127 in magnitude) and the 32-weight kinds
// have no kernel here: Q5_0 and IQ4_NL are held as Q8_0 blocks of the same weights with int8
// activations (quantization/gguf.py GGUFType.int8_as), Q5_1 and IQ4_XS are refused. The
// AVX-512 and AVX2 builds compute the same integers and the same float32 operations.
#pragma once
#include "linear_gguf_rows.h"

#if defined(TOKENMILL_GGUF_ROWS)
#define TOKENMILL_GGUF_INT8 1

namespace gguf_int8 {
using namespace gguf_blocks;

// The kinds these kernels take: values of at most 6 bits, stored unsigned.
constexpr bool has_kernel(int64_t kind) {
  return kind == kQ2_K || kind == kQ3_K || kind == kQ4_K || kind == kQ5_K || kind == kQ6_K;
}
constexpr int64_t kSuper = 256;  // weights per super-block and values per dx

// M rows of x rounded to int8 per 256 values.
struct Int8Rows {
  int64_t K = 0;
  std::vector<int8_t> x;    // (M, K) x8
  std::vector<float> dx;    // (M, K / 256)
  std::vector<int16_t> s16;  // (M, K / 16) S16
};

// 256 values of a row: x8 into q, dx, and the S16 of its 16 groups. The rounding runs on
// float vectors (round-half-even as std::nearbyint: the default rounding mode).
static void round_block(const float* x, int8_t* q, float* dx_out, int16_t* s16) {
  Vec amax(0.f);
  for (int64_t i = 0; i < kSuper; i += kV) amax = at::vec::maximum(amax, Vec::loadu(x + i).abs());
  alignas(64) float lanes[kV], r[kSuper];
  amax.store(lanes);
  const float dx = *std::max_element(lanes, lanes + kV) / 127.f, inv = dx > 0.f ? 1.f / dx : 0.f;
  *dx_out = dx;
  for (int64_t i = 0; i < kSuper; i += kV) (Vec::loadu(x + i) * Vec(inv)).round().store(r + i);
  for (int64_t g = 0; g < kSuper / 16; ++g) {
    int s = 0;
    for (int j = 0; j < 16; ++j) {
      const int v = static_cast<int>(std::clamp(r[16 * g + j], -127.f, 127.f));
      q[16 * g + j] = static_cast<int8_t>(v);
      s += v;
    }
    s16[g] = static_cast<int16_t>(s);
  }
}

static Int8Rows round_rows(const float* x, int64_t M, int64_t K) {
  Int8Rows r;
  r.K = K;
  r.x.resize(M * K), r.dx.resize(M * K / kSuper), r.s16.resize(M * K / 16);
  auto run = [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      round_block(x + b * kSuper, r.x.data() + b * kSuper, &r.dx[b], &r.s16[b * 16]);
  };
  if (M <= 4) run(0, M * K / kSuper);  // a decode step: not worth waking the thread pool
  else at::parallel_for(0, M * K / kSuper, 16, run);
  return r;
}

// The zero point z (linear_gguf.h zero_point: Q6_K 32, Q3_K 4) as a shift, and the kinds
// with mins (the K-quants with offsets: Q2_K, Q4_K, Q5_K).
constexpr int zero_shift(int64_t kind) { return zero_point(kind) == 32 ? 5 : 2; }
constexpr bool has_mins(int64_t kind) { return is_kquant(kind) && has_offset(kind); }

static TM_GGUF_INLINE int32_t load_i32(const void* p) {  // 4 bytes of x, unaligned
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The vector ops of each build (512-bit with AVX-512BW, else 256-bit AVX2), by one name.
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BW__)
using IVec = __m512i;  // 64 bytes: stored values, int16 pair scales, or int32 sums
using FVec = __m512;
constexpr int kVecs = 4;  // vectors of a super-block's values
static TM_GGUF_INLINE IVec join(__m256i a, __m256i b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}
static TM_GGUF_INLINE IVec maddubs(IVec u8, IVec s8) { return _mm512_maddubs_epi16(u8, s8); }
static TM_GGUF_INLINE IVec madd(IVec a, IVec b) { return _mm512_madd_epi16(a, b); }
static TM_GGUF_INLINE IVec add(IVec a, IVec b) { return _mm512_add_epi32(a, b); }
static TM_GGUF_INLINE IVec sub(IVec a, IVec b) { return _mm512_sub_epi32(a, b); }
static TM_GGUF_INLINE IVec izero() { return _mm512_setzero_si512(); }
static TM_GGUF_INLINE IVec iload(const void* p) { return _mm512_loadu_si512(p); }
static TM_GGUF_INLINE IVec bcast32(const void* p) { return _mm512_set1_epi32(load_i32(p)); }
static TM_GGUF_INLINE IVec shl(IVec a, int bits) {
  return _mm512_sll_epi32(a, _mm_cvtsi32_si128(bits));
}
static TM_GGUF_INLINE __m256i fold8(IVec a) {  // 16 int32 lanes summed pairwise to 8
  return _mm256_add_epi32(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1));
}
static TM_GGUF_INLINE FVec fload(const float* p) { return _mm512_loadu_ps(p); }
static TM_GGUF_INLINE FVec fset1(float v) { return _mm512_set1_ps(v); }
static TM_GGUF_INLINE FVec fzero() { return _mm512_setzero_ps(); }
static TM_GGUF_INLINE FVec fmul(FVec a, FVec b) { return _mm512_mul_ps(a, b); }
static TM_GGUF_INLINE FVec fmadd(FVec a, FVec b, FVec c) { return _mm512_fmadd_ps(a, b, c); }
static TM_GGUF_INLINE FVec to_float(IVec a) { return _mm512_cvtepi32_ps(a); }
static TM_GGUF_INLINE void fstore(float* p, FVec v) { _mm512_storeu_ps(p, v); }
#else
using IVec = __m256i;
using FVec = __m256;
constexpr int kVecs = 8;
static TM_GGUF_INLINE IVec maddubs(IVec u8, IVec s8) { return _mm256_maddubs_epi16(u8, s8); }
static TM_GGUF_INLINE IVec madd(IVec a, IVec b) { return _mm256_madd_epi16(a, b); }
static TM_GGUF_INLINE IVec add(IVec a, IVec b) { return _mm256_add_epi32(a, b); }
static TM_GGUF_INLINE IVec sub(IVec a, IVec b) { return _mm256_sub_epi32(a, b); }
static TM_GGUF_INLINE IVec izero() { return _mm256_setzero_si256(); }
static TM_GGUF_INLINE IVec iload(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
static TM_GGUF_INLINE IVec bcast32(const void* p) { return _mm256_set1_epi32(load_i32(p)); }
static TM_GGUF_INLINE IVec shl(IVec a, int bits) {
  return _mm256_sll_epi32(a, _mm_cvtsi32_si128(bits));
}
static TM_GGUF_INLINE __m256i fold8(IVec a) { return a; }
static TM_GGUF_INLINE FVec fload(const float* p) { return _mm256_loadu_ps(p); }
static TM_GGUF_INLINE FVec fset1(float v) { return _mm256_set1_ps(v); }
static TM_GGUF_INLINE FVec fzero() { return _mm256_setzero_ps(); }
static TM_GGUF_INLINE FVec fmul(FVec a, FVec b) { return _mm256_mul_ps(a, b); }
static TM_GGUF_INLINE FVec fmadd(FVec a, FVec b, FVec c) { return _mm256_fmadd_ps(a, b, c); }
static TM_GGUF_INLINE FVec to_float(IVec a) { return _mm256_cvtepi32_ps(a); }
static TM_GGUF_INLINE void fstore(float* p, FVec v) { _mm256_storeu_ps(p, v); }
#endif
constexpr int64_t kVecWeights = kSuper / kVecs;
constexpr int kRowsPerVec = sizeof(IVec) / 4;  // int32 lanes: W rows of an interleaved tile

// A super-block's integer scales and mins per group of 16 weights (16 int16 each), its d and
// its min factor e (-dmin, or 0).
struct GroupScales {
  __m256i sc, mn;
  float d, e;
};

// From the super-block's SuperScales (one unpacking of each layout), with its d.
template <int64_t KIND>
static TM_GGUF_INLINE GroupScales group_scales(const uint8_t* p,
                                               const gguf_rows::SuperScales& ss) {
  GroupScales g;
  g.d = half_at(p + d_offset(KIND));
  if constexpr (per16(KIND)) {  // lo: groups 0..7 in its low 128 bits, hi: 8..15
    g.sc = _mm256_permute2x128_si256(ss.lo, ss.hi, 0x20);
  } else {
    g.sc = gguf_rows::per_group(_mm256_castsi256_si128(ss.lo));
  }
  g.mn = has_mins(KIND) ? ss.mn16 : _mm256_setzero_si256();
  g.e = has_mins(KIND) ? ss.neg_dmin : 0.f;
  return g;
}

// ---- raw rows: one W row's super-block in registers, lanes along its weights --------------

// Its values and the scale of each int16 pair of their products (gguf_rows::pair_scale).
struct RawSuperBlock {
  IVec v[kVecs], sc[kVecs];
  GroupScales g;
};

template <int64_t KIND>
static TM_GGUF_INLINE void decode_raw(const uint8_t* p, RawSuperBlock& b) {
  const gguf_rows::SuperScales ss = gguf_rows::superblock_scales<KIND>(p);
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BW__)
  for (int k = 0; k < kVecs; ++k) {
    b.v[k] = join(block_values<KIND>(p, 2 * k), block_values<KIND>(p, 2 * k + 1));
    b.sc[k] = join(gguf_rows::pair_scale<KIND>(ss, 2 * k),
                   gguf_rows::pair_scale<KIND>(ss, 2 * k + 1));
  }
#else
  for (int s = 0; s < kVecs; ++s)
    b.v[s] = block_values<KIND>(p, s), b.sc[s] = gguf_rows::pair_scale<KIND>(ss, s);
#endif
  b.g = group_scales<KIND>(p, ss);
}

// acc[r] += super-block sb's terms (the table at the top) for rows x0 .. x0 + R of x: the
// products along the lanes, I and J reduced across them together (the zero point's
// sum_g sc_g S16_g taken off I's lanes first, J's lanes sum_g mn_g S16_g beside them), then
// the two float terms.
template <int64_t KIND, int R>
static TM_GGUF_INLINE void raw_superblock(const RawSuperBlock& b, const Int8Rows& x, int64_t x0,
                                          int64_t sb, float (&acc)[R]) {
  const int64_t K = x.K, nsb = K / kSuper;
  for (int r = 0; r < R; ++r) {
    const int64_t row_sb = (x0 + r) * nsb + sb;
    const int8_t* xr = x.x.data() + row_sb * kSuper;
    IVec part[kVecs];
    for (int k = 0; k < kVecs; ++k)
      part[k] = madd(maddubs(b.v[k], iload(xr + k * kVecWeights)), b.sc[k]);
    for (int w = kVecs / 2; w >= 1; w /= 2)
      for (int k = 0; k < w; ++k) part[k] = add(part[k], part[k + w]);
    const __m256i s16 = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(x.s16.data() + row_sb * 16));
    __m256i i8 = fold8(part[0]), j8 = _mm256_setzero_si256();
    if constexpr (zero_point(KIND) != 0)
      i8 = _mm256_sub_epi32(i8, _mm256_slli_epi32(_mm256_madd_epi16(b.g.sc, s16),
                                                  zero_shift(KIND)));
    if constexpr (has_mins(KIND)) j8 = _mm256_madd_epi16(b.g.mn, s16);
    const __m256i h = _mm256_hadd_epi32(i8, j8);  // per 128 bits: i pairs, then j pairs
    __m128i ij = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    ij = _mm_hadd_epi32(ij, ij);  // I, J, I, J
    const float dx = x.dx[row_sb];
    acc[r] = std::fma(static_cast<float>(_mm_cvtsi128_si32(ij)), b.g.d * dx, acc[r]);
    if constexpr (has_mins(KIND))
      acc[r] = std::fma(static_cast<float>(_mm_extract_epi32(ij, 1)), b.g.e * dx, acc[r]);
  }
}

// Rows [x0, x0 + R) of x times raw W rows [n0, n1) into y, each row read as one stream.
template <int64_t KIND, int R>
static void raw_rows_times(const Int8Rows& x, int64_t x0, const uint8_t* W, int64_t n0,
                           int64_t n1, int64_t N, const float* bias, float* y) {
  const int64_t rb = row_bytes(KIND, x.K), nsb = x.K / kSuper;
  for (int64_t n = n0; n < n1; ++n) {
    float acc[R] = {};
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* p = W + n * rb + sb * block_bytes(KIND);
      prefetch_ahead(p, block_bytes(KIND));
      RawSuperBlock b;
      decode_raw<KIND>(p, b);
      raw_superblock<KIND, R>(b, x, x0, sb, acc);
    }
    for (int r = 0; r < R; ++r) y[(x0 + r) * N + n] = acc[r] + (bias ? bias[n] : 0.f);
  }
}

}  // namespace gguf_int8
#include "linear_gguf_int8_tiles.h"

namespace gguf_int8 {

// Raw W rows meet up to kRawRowsX rows of x a pass: a step of up to raw_max_rows rows (decode
// steps) takes raw passes over each 8 W rows (the second from cache); larger steps decode
// interleaved tiles, each meeting kTileRowsX rows of x at a time. Where tiles start to cost
// less (a 14336 x 4096 layer from memory, two threads, Zen 4; RESULTS.md): Q2_K, Q4_K and
// Q5_K from 6 rows, Q3_K from about 8, Q6_K (whose tiles' decoding costs most) about 12.
constexpr int64_t kRawRowsX = 8, kTileRowsX = 4;
constexpr int64_t raw_max_rows(int64_t kind) {
  return kind == kQ6_K ? 12 : kind == kQ3_K ? 7 : 5;
}

template <int64_t KIND>
static void rows_times_any(int64_t R, const Int8Rows& x, int64_t x0, const uint8_t* W,
                           const TileSuperBlock* tile, int64_t n0, int64_t n1, int64_t N,
                           const float* bias, float* y) {
  if (tile) {
    switch (R) {
#define TM_ROWS(r) \
  case r: return tile_rows_times<KIND, r>(x, x0, tile, n0, n1, N, bias, y);
      TM_ROWS(1) TM_ROWS(2) TM_ROWS(3) TM_ROWS(4)
#undef TM_ROWS
    }
  } else {
    switch (R) {
#define TM_ROWS(r) \
  case r: return raw_rows_times<KIND, r>(x, x0, W, n0, n1, N, bias, y);
      TM_ROWS(1) TM_ROWS(2) TM_ROWS(3) TM_ROWS(4) TM_ROWS(5) TM_ROWS(6) TM_ROWS(7) TM_ROWS(8)
#undef TM_ROWS
    }
  }
  TORCH_CHECK(false, "gguf_int8: no kernel for ", R, " rows");
}

template <int64_t KIND>
static void linear_kind(const Int8Rows& x, const uint8_t* W, int64_t M, int64_t N,
                        const float* bias, float* y, int64_t ldy) {
  const int64_t K = x.K, nsb = K / kSuper;
  const bool raw = M <= raw_max_rows(KIND);
  const int64_t tile = raw ? 8 : kRowsPerVec;
  const int64_t tiles = (N + tile - 1) / tile;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  at::parallel_for(0, tiles, std::max<int64_t>(1, tiles / threads), [&](int64_t t0, int64_t t1) {
    std::vector<TileSuperBlock> decoded(raw ? 0 : nsb);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * tile, n1 = std::min(N, n0 + tile);
      if (raw) {
        for (int64_t m = 0; m < M; m += kRawRowsX)
          rows_times_any<KIND>(std::min(kRawRowsX, M - m), x, m, W, nullptr, n0, n1, ldy, bias,
                               y);
        continue;
      }
      decode_tile<KIND>(W, K, n0, n1, decoded.data());
      for (int64_t m = 0; m < M; m += kTileRowsX)
        rows_times_any<KIND>(std::min(kTileRowsX, M - m), x, m, W, decoded.data(), n0, n1, ldy,
                             bias, y);
    }
  });
}

// y's N columns (row stride ldy) = x @ W^T (+ bias) for a K-quant's raw rows W (N,
// row_bytes), x already rounded to int8 per 256 values (round_rows): the parts of a merged
// layer share one rounding and write side by side (linear_cpu.h).
inline void linear_rounded(int64_t kind, const uint8_t* W, const Int8Rows& x, int64_t M,
                           int64_t N, const float* bias, float* y, int64_t ldy) {
  switch (kind) {
    case kQ2_K: return linear_kind<kQ2_K>(x, W, M, N, bias, y, ldy);
    case kQ3_K: return linear_kind<kQ3_K>(x, W, M, N, bias, y, ldy);
    case kQ4_K: return linear_kind<kQ4_K>(x, W, M, N, bias, y, ldy);
    case kQ5_K: return linear_kind<kQ5_K>(x, W, M, N, bias, y, ldy);
    case kQ6_K: return linear_kind<kQ6_K>(x, W, M, N, bias, y, ldy);
  }
  TORCH_CHECK(false, "int8 activations are not implemented for GGUF weight kind ", kind,
              " (the K-quants Q2_K .. Q6_K have them)");
}

// y (M, N) = x @ W^T (+ bias), x (M, K) float32 rounded to int8 per 256 values.
inline void linear(int64_t kind, const uint8_t* W, const float* xp, int64_t M, int64_t K,
                   int64_t N, const float* bias, float* y) {
  TORCH_CHECK(K % kSuper == 0, "gguf_int8: K must be whole super-blocks");
  linear_rounded(kind, W, round_rows(xp, M, K), M, N, bias, y, N);
}

}  // namespace gguf_int8
#endif
