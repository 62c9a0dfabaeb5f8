// GGUF K-quant products with int8 activations (`int8_activations=True`), at every M: the
// arithmetic llama.cpp uses for these files (its Q8_K activations), on the raw super-blocks
// as the file stores them (linear_gguf.h's block_values and scales).
//
// Why: with int16 activations (linear_gguf_vnni.h) a K-quant product costs one vpdpwssd per
// 32 weights and row of x once each weight is widened and scaled, and at 16-128 rows that
// instruction's rate (one a cycle per Zen 5 core) bounds the step. Here the stored values
// (u8, at most 6 bits) meet int8 activations in one vpmaddubsw per 64 (AVX-512; 32 with
// AVX2) and the sub-block scales in one vpmaddwd: the same products in half the
// multiply instructions, and no per-weight widening or scaling.
//
//   x8 = round-half-even(x / dx), dx = amax / 127 per 256 values of x (one super-block);
//   S16 the exact sums of x8 over 16 values, held as S16 dx. Per super-block and row of x:
//     I  = sum_g sc_g sum_{j in g} q_j x8_j       (g: the 16 groups of 16 weights; int32)
//     y += (d dx) I + sum_g off_g (S16_g dx)
//   sc_g: the group's integer scale (Q4_K / Q5_K its sub-block's 6-bit one; Q6_K int8;
//   Q3_K (sc - 32); Q2_K 4-bit); off_g: -dmin mn (Q4_K, Q5_K per sub-block; Q2_K per 16),
//   -zero d sc_g (Q6_K zero 32, Q3_K zero 4): gguf_rows::superblock_scales, exact per kind.
// vpmaddubsw's int16 pair sums stay under 2 * 63 * 127 (no saturation), and I is converted
// to float in int32 lanes of 16 weights each (under 16 * 63 * 127 * 128 < 2^24: exactly).
//
// Lossy: x's rounding to 8 bits per 256 values (benchmarks/quant_quality.py measures it);
// used only where asked for. IQ4's levels (up to 127 in magnitude) and the 32-weight kinds
// keep the int16 kernels: GGUFBlockMethod refuses them with int8 activations.
//
// Invariants: x's rounding is per row and per super-block; each (row of x, row of W) output
// sums its super-blocks' terms in K order in its own float lanes and reduces them by one
// fixed tree; a super-block's terms are the same whether its W row was decoded in
// registers (steps of up to 16 rows) or into a tile (more rows). A
// row's result is bitwise the same at any M, with any neighbours, chunking or threads
// (tests/quantization/test_gguf_int8.py). The AVX-512 and AVX2 builds compute the same
// integers; their float32 lanes sum in different orders.
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
  std::vector<int8_t> x;      // (M, K) x8
  std::vector<float> dx;      // (M, K / 256)
  std::vector<float> s16dx;   // (M, K / 16) S16 dx
};

// 256 values of a row: x8 into q, dx, and S16 dx of its 16 groups. The rounding runs on
// float vectors (round-half-even as std::nearbyint: the default rounding mode).
static void round_block(const float* x, int8_t* q, float* dx_out, float* s16dx) {
  Vec amax(0.f);
  for (int64_t i = 0; i < kSuper; i += kV) amax = at::vec::maximum(amax, Vec::loadu(x + i).abs());
  alignas(64) float lanes[kV], r[kSuper];
  amax.store(lanes);
  const float dx = *std::max_element(lanes, lanes + kV) / 127.f, inv = dx > 0.f ? 1.f / dx : 0.f;
  *dx_out = dx;
  for (int64_t i = 0; i < kSuper; i += kV) (Vec::loadu(x + i) * Vec(inv)).round().store(r + i);
  for (int64_t g = 0; g < kSuper / 16; ++g) {
    float s = 0.f;  // integers below 2^11: exact
    for (int j = 0; j < 16; ++j) {
      const float v = std::clamp(r[16 * g + j], -127.f, 127.f);
      q[16 * g + j] = static_cast<int8_t>(v);
      s += v;
    }
    s16dx[g] = s * dx;
  }
}

static Int8Rows round_rows(const float* x, int64_t M, int64_t K) {
  Int8Rows r;
  r.K = K;
  r.x.resize(M * K), r.dx.resize(M * K / kSuper), r.s16dx.resize(M * K / 16);
  auto run = [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      round_block(x + b * kSuper, r.x.data() + b * kSuper, &r.dx[b], &r.s16dx[b * 16]);
  };
  if (M <= 4) run(0, M * K / kSuper);  // a decode step: not worth waking the thread pool
  else at::parallel_for(0, M * K / kSuper, 16, run);
  return r;
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BW__)
using IVec = __m512i;  // 64 stored values (two sub-blocks), or 32 int16 pair scales
using FVec = __m512;   // a row's float lanes
constexpr int kVecs = 4;
static TM_GGUF_INLINE IVec join(__m256i a, __m256i b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}
static TM_GGUF_INLINE IVec pair_sums(IVec v, IVec sc, const int8_t* x) {
  return _mm512_madd_epi16(_mm512_maddubs_epi16(v, _mm512_loadu_si512(x)), sc);
}
static TM_GGUF_INLINE IVec add(IVec a, IVec b) { return _mm512_add_epi32(a, b); }
static TM_GGUF_INLINE FVec fzero() { return _mm512_setzero_ps(); }
static TM_GGUF_INLINE FVec fadd(FVec a, FVec b) { return _mm512_add_ps(a, b); }
static TM_GGUF_INLINE FVec fmadd(FVec a, FVec b, FVec c) { return _mm512_fmadd_ps(a, b, c); }
static TM_GGUF_INLINE FVec to_float(IVec a) { return _mm512_cvtepi32_ps(a); }
static TM_GGUF_INLINE FVec fset1(float v) { return _mm512_set1_ps(v); }
static TM_GGUF_INLINE float reduce(FVec a) { return _mm512_reduce_add_ps(a); }
#else
using IVec = __m256i;  // 32 stored values (one sub-block), or 16 int16 pair scales
using FVec = __m256;
constexpr int kVecs = 8;
static TM_GGUF_INLINE IVec pair_sums(IVec v, IVec sc, const int8_t* x) {
  const IVec xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(v, xv), sc);
}
static TM_GGUF_INLINE IVec add(IVec a, IVec b) { return _mm256_add_epi32(a, b); }
static TM_GGUF_INLINE FVec fzero() { return _mm256_setzero_ps(); }
static TM_GGUF_INLINE FVec fadd(FVec a, FVec b) { return _mm256_add_ps(a, b); }
static TM_GGUF_INLINE FVec fmadd(FVec a, FVec b, FVec c) { return _mm256_fmadd_ps(a, b, c); }
static TM_GGUF_INLINE FVec to_float(IVec a) { return _mm256_cvtepi32_ps(a); }
static TM_GGUF_INLINE FVec fset1(float v) { return _mm256_set1_ps(v); }
static TM_GGUF_INLINE float reduce(FVec a) { return hsum8(a); }
#endif
constexpr int64_t kVecWeights = kSuper / kVecs;
// Integer sums converted to float per 16 weights a lane (exact): AVX-512's 4 vectors sum
// into one, AVX2's 8 into two.
constexpr int kLaneParts = kVecs / 4;
constexpr int kOffVecs = 16 / (sizeof(FVec) / 4);  // float vectors of the 16 group offsets

// One super-block decoded: its values and the scale of each int16 pair of their products,
// d, and the 16 groups' offsets.
struct SuperBlock {
  IVec v[kVecs], sc[kVecs];
  FVec off[kOffVecs];
  float d;
};

// The 16 groups' offsets as 16 floats: per16 kinds' off16; Q4_K / Q5_K's 8 mins, each over
// its sub-block's two groups.
template <int64_t KIND>
static TM_GGUF_INLINE void group_offsets(const gguf_rows::SuperScales& sc, __m256 (&o)[2]) {
  if constexpr (per16(KIND)) {
    o[0] = sc.off16[0], o[1] = sc.off16[1];
  } else {
    o[0] = _mm256_permutevar8x32_ps(sc.mins, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
    o[1] = _mm256_permutevar8x32_ps(sc.mins, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7));
  }
}

template <int64_t KIND>
static TM_GGUF_INLINE void decode(const uint8_t* p, SuperBlock& b) {
  const gguf_rows::SuperScales sc = gguf_rows::superblock_scales<KIND>(p);
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BW__)
  for (int k = 0; k < kVecs; ++k) {
    b.v[k] = join(block_values<KIND>(p, 2 * k), block_values<KIND>(p, 2 * k + 1));
    b.sc[k] = join(gguf_rows::pair_scale<KIND>(sc, 2 * k),
                   gguf_rows::pair_scale<KIND>(sc, 2 * k + 1));
  }
  __m256 o[2];
  group_offsets<KIND>(sc, o);
  b.off[0] = _mm512_insertf32x8(_mm512_castps256_ps512(o[0]), o[1], 1);
#else
  for (int s = 0; s < kVecs; ++s)
    b.v[s] = block_values<KIND>(p, s), b.sc[s] = gguf_rows::pair_scale<KIND>(sc, s);
  group_offsets<KIND>(sc, b.off);
#endif
  b.d = half_at(p + d_offset(KIND));
}

// Super-block `sb`'s terms for rows x0 .. x0 + R of x: the integer sum I (a tree over the
// vectors: exact, any order; kLaneParts of them) times d dx into facc[r], the offsets times
// S16 dx into oacc[r] (two accumulators: two short dependency chains a super-block).
template <int R>
static TM_GGUF_INLINE void add_superblock(const SuperBlock& b, const Int8Rows& x, int64_t x0,
                                          int64_t sb, FVec (&facc)[R], FVec (&oacc)[R]) {
  const int64_t K = x.K, nsb = K / kSuper;
  IVec v[kVecs], sc[kVecs];  // read once for all R rows (a tile's from memory: loads bound)
  for (int k = 0; k < kVecs; ++k) v[k] = b.v[k], sc[k] = b.sc[k];
  for (int r = 0; r < R; ++r) {
    const int8_t* xr = x.x.data() + (x0 + r) * K + sb * kSuper;
    IVec part[kVecs];
    for (int k = 0; k < kVecs; ++k) part[k] = pair_sums(v[k], sc[k], xr + k * kVecWeights);
    for (int w = kVecs / 2; w >= kLaneParts; w /= 2)
      for (int k = 0; k < w; ++k) part[k] = add(part[k], part[k + w]);
    const FVec ddx = fset1(b.d * x.dx[(x0 + r) * nsb + sb]);
    for (int k = 0; k < kLaneParts; ++k) facc[r] = fmadd(to_float(part[k]), ddx, facc[r]);
    const float* s16 = x.s16dx.data() + ((x0 + r) * nsb + sb) * 16;
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BW__)
    oacc[r] = fmadd(b.off[0], _mm512_loadu_ps(s16), oacc[r]);
#else
    for (int o = 0; o < kOffVecs; ++o)
      oacc[r] = fmadd(b.off[o], _mm256_loadu_ps(s16 + 8 * o), oacc[r]);
#endif
  }
}

// The float lanes of R outputs (rows of x against one W row), kept between runs of
// super-blocks.
template <int R>
struct Lanes {
  FVec f[R], o[R];
};

// Super-blocks [sb0, sb1) of one W row into acc: its raw bytes decoded in registers as they
// are read (RAW), or a row of decoded tile: the same terms either way (separate loops, so
// that neither's registers spill the other's accumulators).
template <int64_t KIND, int R, bool RAW>
static TM_GGUF_INLINE void add_superblocks(const Int8Rows& x, int64_t x0, const uint8_t* raw,
                                           const SuperBlock* tile, int64_t sb0, int64_t sb1,
                                           Lanes<R>& acc) {
  FVec facc[R], oacc[R];
  for (int r = 0; r < R; ++r) facc[r] = acc.f[r], oacc[r] = acc.o[r];
  for (int64_t sb = sb0; sb < sb1; ++sb) {
    if constexpr (RAW) {
      const uint8_t* p = raw + sb * block_bytes(KIND);
      gguf_rows::prefetch_ahead(p, block_bytes(KIND));
      SuperBlock b;
      decode<KIND>(p, b);
      add_superblock<R>(b, x, x0, sb, facc, oacc);
    } else {
      add_superblock<R>(tile[sb], x, x0, sb, facc, oacc);
    }
  }
  for (int r = 0; r < R; ++r) acc.f[r] = facc[r], acc.o[r] = oacc[r];
}

template <int R>
static TM_GGUF_INLINE void zero(Lanes<R>& acc) {
  for (int r = 0; r < R; ++r) acc.f[r] = fzero(), acc.o[r] = fzero();
}

// y[x0 + r, n] from its lanes (one fixed reduction).
template <int R>
static TM_GGUF_INLINE void put(const Lanes<R>& acc, int64_t x0, int64_t n, int64_t N,
                               const float* bias, float* y) {
  for (int r = 0; r < R; ++r)
    y[(x0 + r) * N + n] = reduce(fadd(acc.f[r], acc.o[r])) + (bias ? bias[n] : 0.f);
}

// Rows [x0, x0 + R) of x times W rows [n0, n1) into y: the raw rows, or (tile != nullptr,
// row 0 being W row n0) the decoded tile's.
template <int64_t KIND, int R>
static void rows_times(const Int8Rows& x, int64_t x0, const uint8_t* W, const SuperBlock* tile,
                       int64_t n0, int64_t n1, int64_t N, const float* bias, float* y) {
  const int64_t rb = row_bytes(KIND, x.K), nsb = x.K / kSuper;
  for (int64_t n = n0; n < n1; ++n) {
    Lanes<R> acc;
    zero(acc);
    if (tile) add_superblocks<KIND, R, false>(x, x0, nullptr, tile + (n - n0) * nsb, 0, nsb, acc);
    else add_superblocks<KIND, R, true>(x, x0, W + n * rb, nullptr, 0, nsb, acc);
    put(acc, x0, n, N, bias, y);
  }
}

template <int64_t KIND>
static void rows_times_any(int64_t R, const Int8Rows& x, int64_t x0, const uint8_t* W,
                           const SuperBlock* tile, int64_t n0, int64_t n1, int64_t N,
                           const float* bias, float* y) {
  switch (R) {
#define TM_ROWS(r) \
  case r: return rows_times<KIND, r>(x, x0, W, tile, n0, n1, N, bias, y);
    TM_ROWS(1) TM_ROWS(2) TM_ROWS(3) TM_ROWS(4) TM_ROWS(5) TM_ROWS(6) TM_ROWS(7) TM_ROWS(8)
#undef TM_ROWS
  }
  TORCH_CHECK(false, "gguf_int8: no kernel for ", R, " rows");
}

// Raw W rows meet up to kRawRowsX rows of x a pass, decoded in registers as they are read:
// a step of up to kRawMaxRows rows (decode steps) takes raw passes over each tile of 8 W
// rows (the second from cache), which cost less than decoding a tile below 16 rows
// (benchmarks/gguf_kernels.py); larger steps decode a tile of W rows once for every group
// of kTileRowsX rows of x.
constexpr int64_t kRawRowsX = 8, kRawMaxRows = 16, kTileRowsX = 4;

template <int64_t KIND>
static void linear_kind(const Int8Rows& x, const uint8_t* W, int64_t M, int64_t N,
                        const float* bias, float* y) {
  const int64_t K = x.K, nsb = K / kSuper;
  const bool stream = M <= kRawMaxRows;
  // a tile: ~96 KB of decoded super-blocks (kept in L2 while every row of x passes)
  const int64_t tile = stream ? 8 : std::clamp<int64_t>(
      98304 / (nsb * static_cast<int64_t>(sizeof(SuperBlock))), 1, 16);
  const int64_t tiles = (N + tile - 1) / tile;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  at::parallel_for(0, tiles, std::max<int64_t>(1, tiles / threads), [&](int64_t t0, int64_t t1) {
    std::vector<SuperBlock> decoded;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * tile, n1 = std::min(N, n0 + tile);
      if (stream) {
        for (int64_t m = 0; m < M; m += kRawRowsX)
          rows_times_any<KIND>(std::min(kRawRowsX, M - m), x, m, W, nullptr, n0, n1, N, bias, y);
        continue;
      }
      decoded.resize((n1 - n0) * nsb);
      const int64_t rb = row_bytes(KIND, K);
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t sb = 0; sb < nsb; ++sb)
          decode<KIND>(W + n * rb + sb * block_bytes(KIND), decoded[(n - n0) * nsb + sb]);
      for (int64_t m = 0; m < M; m += kTileRowsX)
        rows_times_any<KIND>(std::min(kTileRowsX, M - m), x, m, W, decoded.data(), n0, n1, N,
                             bias, y);
    }
  });
}

// y (M, N) = x @ W^T (+ bias) for a K-quant's raw rows W (N, row_bytes), x (M, K) float32
// rounded to int8 per 256 values.
inline void linear(int64_t kind, const uint8_t* W, const float* xp, int64_t M, int64_t K,
                   int64_t N, const float* bias, float* y) {
  TORCH_CHECK(K % kSuper == 0, "gguf_int8: K must be whole super-blocks");
  const Int8Rows x = round_rows(xp, M, K);
  switch (kind) {
    case kQ2_K: return linear_kind<kQ2_K>(x, W, M, N, bias, y);
    case kQ3_K: return linear_kind<kQ3_K>(x, W, M, N, bias, y);
    case kQ4_K: return linear_kind<kQ4_K>(x, W, M, N, bias, y);
    case kQ5_K: return linear_kind<kQ5_K>(x, W, M, N, bias, y);
    case kQ6_K: return linear_kind<kQ6_K>(x, W, M, N, bias, y);
  }
  TORCH_CHECK(false, "int8 activations are not implemented for GGUF weight kind ", kind,
              " (the K-quants Q2_K .. Q6_K have them)");
}

}  // namespace gguf_int8
#endif
