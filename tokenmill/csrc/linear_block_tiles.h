// Weight kinds 17 (Q8_0_TILES) and 18 (Q4_TILES): kind 1's Q8_0 and kind 2's 4-bit blocks
// packed once at load into tiles of 16 rows (quantization/block_tiles.py packs) on AVX-512
// VNNI builds, multiplied by AMX-INT8's tile unit where the CPU has it (Intel Xeon from
// Sapphire Rapids) and by vpdpbusd elsewhere. x is rounded per 32-block as for kinds 1 and 2
// on these builds: to int16 (float activations) or int8 (`int8_activations`).
//
//   Q8_0:  q tiles (N/16, K/32, 512) int8: [g][b][c][j][e] = q[16g + j][32b + 4c + e]
//          d (N/16, K/32, 16) float16: [g][b][j] = d[16g + j][b]
//   4-bit: q tiles (N/16, K/32, 256) uint8: [g][b][s][j][e] = byte 4s + e of row 16g + j's
//          block b (its low nibble weight 32b + 4s + e, its high one 32b + 16 + 4s + e)
//          d, m (N/16, K/G, 16) float16: [g][h][j] = d, m[16g + j][h]
//   So block b of 16 rows of W is one tdpbssd B tile (8 rows of 4 k x 16 outputs): as
//   stored for Q8_0, its 4-bit nibbles split into chunks 0-3 (low) and 4-7 (high); and each
//   chunk is one vpdpbusd operand, 4 k of 16 outputs.
//
// The arithmetic, per row m of x, output n and block b (K order), with x8 the int8 rounding
// or x16 = 256 hi + lo (hi int8, lo uint8) the int16 one:
//   I = sum_k w_k x8_k  or  256 sum_k w_k hi_k + sum_k w_k lo_k           (exact int32)
//   acc = fma(float(I), d[n, b] * dx[m, b], acc)      4-bit, after a group's last block:
//   acc = fma(m[n, h], xsum[m, h], acc)               (xsum: x's exact float group sum)
//   y = acc (+ bias)
// Two ways to the same integers and the same float32 operations, in `block_term` and
// `offset_term` below, lane for lane (16 outputs a vector), so a row's result is bitwise the
// same at every M, in any step, tiling or thread split (batch-invariant), on any CPU:
// - tiles (AMX-INT8, steps of kTileMinRows rows or more): the tile unit's exact int32 sums,
//   one 16 x 16 tile per block (a whole tile's K is two blocks: their sums must stay apart),
//   stored and scaled by vector ops; a last tile of fewer rows of x configured that narrow;
// - vector rows (decode steps, and every step on CPUs without AMX): the same tiles read by
//   vpdpbusd with 4 bytes of x broadcast, each int32 lane one output's block sum; int8 x
//   int8 needs one unsigned side, so Q8_0's w enter as w + 128 (w ^ 0x80) and 128 * sum(x)
//   over the block comes off, exactly.
// Against kinds 1 and 2 (linear_rows_vnni.h), the same rounding of x and the same integers;
// their float32 sums are ordered differently. The loss against float32 is x's rounding
// (benchmarks/quant_quality.py). Why (thirty-sixth session): on kinds 1 and 2 every step
// multiplied through the row kernels, four rows of x at a time, ~130 GFLOP/s on SmolLM2's
// shapes at any M on a Sapphire Rapids class Xeon; the vector rows here reach 1.7-2.5x that,
// the tiles 2.5-5x (benchmarks/RESULTS.md).
#pragma once
#include "amx_tiles.h"
#include "linear_int8_acts.h"
#include <memory>

#if defined(TM_HAVE_AMX) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TM_HAVE_BLOCK_TILES 1
#endif

namespace block_tiles {
constexpr int64_t kQ8Kind = 17, kQ4Kind = 18;
constexpr int64_t kQ8Source = 1, kQ4Source = 2;  // the stored kinds packed into them
constexpr int64_t kRows = 16;  // rows of W per group (a tile's 16 outputs)
constexpr int64_t kBytes(bool q4) { return q4 ? 256 : 512; }  // stored bytes a block, a group
constexpr bool is_tiles_kind(int64_t kind) { return kind == kQ8Kind || kind == kQ4Kind; }

// Whether the loader packs: an AVX-512 VNNI build and the switch on (cpu_ops.block_tiles;
// off: kinds 1 and 2 stay, their row kernels).
inline bool& use_tiles() {
  static bool on = true;
  return on;
}
inline bool active() {
#if defined(TM_HAVE_BLOCK_TILES)
  return use_tiles();
#else
  return false;
#endif
}

// Row n of a packed weight as float32 (K values): an embedding lookup from a tied table.
static void expand_row(int64_t kind, int64_t G, const std::vector<torch::Tensor>& t, int64_t n,
                       int64_t K, float* out) {
  const bool q4 = kind == kQ4Kind;
  const int64_t nb = K / kBlock, ng = q4 ? K / G : nb, g = n / kRows, j = n % kRows;
  const auto* q = static_cast<const uint8_t*>(t[0].data_ptr()) + g * nb * kBytes(q4);
  const at::Half* d = t[1].data_ptr<at::Half>() + g * ng * kRows + j;
  const at::Half* mn = q4 ? t[2].data_ptr<at::Half>() + g * ng * kRows + j : nullptr;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t h = b * kBlock / (q4 ? G : kBlock);
    const float scale = half_to_float(d[h * kRows]), zero = q4 ? half_to_float(mn[h * kRows]) : 0;
    const uint8_t* blk = q + b * kBytes(q4) + j * 4;
    for (int c = 0; c < (q4 ? 4 : 8); ++c)
      for (int e = 0; e < 4; ++e) {
        const uint8_t v = blk[c * 64 + e];
        if (!q4) {
          out[b * kBlock + 4 * c + e] = scale * static_cast<float>(static_cast<int8_t>(v));
        } else {
          out[b * kBlock + 4 * c + e] = std::fma(scale, static_cast<float>(v & 15), zero);
          out[b * kBlock + 16 + 4 * c + e] = std::fma(scale, static_cast<float>(v >> 4), zero);
        }
      }
  }
}

#if defined(TM_HAVE_BLOCK_TILES)
#define TM_BT_INLINE inline __attribute__((always_inline))
// From this many rows of x a step takes the tiles; fewer take the vector rows (the same bits).
constexpr int64_t kTileMinRows = 5;

// A packed weight's pointers and sizes.
struct Weight {
  bool q4;
  int64_t K, N, nb, ng, gb;  // gb: blocks per group of G (4-bit; Q8_0: 1)
  const uint8_t* q;          // (N/16, nb, kBytes)
  const at::Half* d;         // (N/16, ng, 16)
  const at::Half* m;         // (N/16, ng, 16), 4-bit only
  const uint8_t* block(int64_t g, int64_t b) const { return q + (g * nb + b) * kBytes(q4); }
  __m512 scales(const at::Half* s, int64_t g, int64_t h) const {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
        s + (g * ng + h) * kRows)));
  }
};

// x (M, K) rounded per 32-block as the products take it.
struct Acts {
  bool wide;                         // int16 (float activations) or int8
  std::unique_ptr<int8_t[]> hi;      // (M, K): x8, or x16 >> 8
  std::unique_ptr<uint8_t[]> lo;     // (M, K): x16 & 255 (wide only)
  std::vector<int32_t> hsum;         // (M, nb): 128 * sum of hi over each block (Q8_0's rows)
  std::vector<float> dx;             // (M, nb)
  const float* xsum = nullptr;       // (M, K/G): exact group sums of x (4-bit)
};

// The shared float32 terms of both ways (module doc): acc + float(I) * (d * dx) as one fma,
// and a group's offsets.
static TM_BT_INLINE __m512 block_term(__m512 acc, __m512i I, __m512 d, float dx) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_mul_ps(d, _mm512_set1_ps(dx)), acc);
}
static TM_BT_INLINE __m512 offset_term(__m512 acc, __m512 m, float xsum) {
  return _mm512_fmadd_ps(m, _mm512_set1_ps(xsum), acc);
}
static TM_BT_INLINE void store_row(float* y, __m512 acc, const float* bias) {
  _mm512_storeu_ps(y, bias ? _mm512_add_ps(acc, _mm512_loadu_ps(bias)) : acc);
}

static Acts round_acts(const float* x, int64_t M, int64_t K, const Weight& w, bool int8_acts,
                       const float* xsum_of_groups, bool vector_rows) {
  Acts a;
  a.wide = !int8_acts;
  const int64_t nb = K / kBlock;
  a.hi.reset(new int8_t[M * K]), a.dx.resize(M * nb);  // (uninitialized: every byte is set)
  if (a.wide) a.lo.reset(new uint8_t[M * K]);
  auto round = [&](int64_t b0, int64_t b1) {  // quantize_block's rounding, 32 values a block
    alignas(64) int16_t q16[kBlock];
    for (int64_t b = b0; b < b1; ++b) {
      if (!a.wide) {
        quantize_block<int8_t>(x + b * kBlock, a.hi.get() + b * kBlock, &a.dx[b]);
        continue;
      }
      quantize_block<int16_t>(x + b * kBlock, q16, &a.dx[b]);
      const __m512i v = _mm512_load_si512(q16);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.hi.get() + b * kBlock),
                          _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.lo.get() + b * kBlock),
                          _mm512_cvtepi16_epi8(v));
    }
  };
  if (M < kTileMinRows) round(0, M * nb);  // a decode step: not worth waking the thread pool
  else at::parallel_for(0, M * nb, 256, round);
  if (!w.q4 && vector_rows) {  // the vector rows' Q8_0 correction
    a.hsum.resize(M * nb);
    for (int64_t b = 0; b < M * nb; ++b) {
      int32_t s = 0;
      for (int64_t k = 0; k < kBlock; ++k) s += a.hi[b * kBlock + k];
      a.hsum[b] = 128 * s;
    }
  }
  a.xsum = xsum_of_groups;
  return a;
}

// The packed tensors of kind 17 (q, d) or 18 (q, d, m) for K inputs, checked.
inline Weight weight(int64_t kind, int64_t G, const std::vector<torch::Tensor>& t, int64_t K) {
  const bool q4 = kind == kQ4Kind;
  TORCH_CHECK(K % kBlock == 0 && (!q4 || (G % kBlock == 0 && K % G == 0)),
              "packed blocks need K divisible by 32 (and by the 4-bit group size)");
  const int64_t nb = K / kBlock, ng = q4 ? K / G : nb;
  TORCH_CHECK(t.size() == (q4 ? 3u : 2u) && t[0].dim() == 3, "weight kind ", kind,
              ": q tiles (N/16, K/32, bytes), d", q4 ? ", m" : "", " (N/16, groups, 16)");
  const int64_t groups = t[0].size(0);
  TORCH_CHECK(t[0].scalar_type() == (q4 ? torch::kUInt8 : torch::kInt8) &&
              t[0].sizes() == torch::IntArrayRef({groups, nb, kBytes(q4)}) &&
              t[0].is_contiguous(), "weight kind ", kind, ": q tiles (N/16, K/32, ",
              kBytes(q4), ")");
  for (size_t i = 1; i < t.size(); ++i)
    TORCH_CHECK(t[i].scalar_type() == torch::kHalf && t[i].is_contiguous() &&
                t[i].sizes() == torch::IntArrayRef({groups, ng, kRows}),
                "weight kind ", kind, ": scales (N/16, groups, 16) float16");
  return {q4, K, groups * kRows, nb, ng, q4 ? G / kBlock : 1,
          static_cast<const uint8_t*>(t[0].data_ptr()), t[1].data_ptr<at::Half>(),
          q4 ? t[2].data_ptr<at::Half>() : nullptr};
}

// ---- vector rows ---------------------------------------------------------------------------
static TM_BT_INLINE __m512i bcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// A 4-bit block's 256 stored bytes as its 8 chunks of 4 k x 16 outputs: the low nibbles
// chunks 0-3, the high ones 4-7 (the B tile's rows, and vpdpbusd's operands).
static TM_BT_INLINE void split_nibbles(const uint8_t* p, __m512i* chunks) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int s = 0; s < 4; ++s) {
    const __m512i v = _mm512_loadu_si512(p + 64 * s);
    chunks[s] = _mm512_and_si512(v, nibble);
    chunks[s + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
  }
}

// Block b of group g as 8 vectors of 4 k x 16 outputs: w (signed) and w as vpdpbusd's
// unsigned operand against signed x (4-bit: the same; Q8_0: w + 128).
template <bool Q4>
static TM_BT_INLINE void block_vectors(const Weight& w, int64_t g, int64_t b, __m512i* sw,
                                       __m512i* uw) {
  const uint8_t* p = w.block(g, b);
  if constexpr (Q4) {
    split_nibbles(p, sw);
    for (int c = 0; c < 8; ++c) uw[c] = sw[c];
  } else {
    for (int c = 0; c < 8; ++c) {
      sw[c] = _mm512_loadu_si512(p + 64 * c);
      uw[c] = _mm512_xor_si512(sw[c], _mm512_set1_epi8(static_cast<char>(0x80)));
    }
  }
}

// Rows [m0, m0 + R) of x times W group g (16 outputs) into y. The format (Q4) and the
// rounding of x (WIDE: int16) are template arguments and the rows' loops fully unrolled, so
// that the R accumulators stay in registers across the blocks and a block costs no branch
// or division (a runtime-dispatched build kept them on the stack: a store and a reload per
// row and block; benchmarks/RESULTS.md, fortieth session).
// AHEAD: the group's first rows of x in this block of x, which read its W from memory: each
// block asks for the bytes ahead of it (prefetch_ahead, vec_utils.h; the groups of a
// thread's range are contiguous: one stream), as the GGUF row kernels do. Why:
// with the products of several rows between its loads, the hardware's prefetchers alone kept
// too few misses in flight: the 1B's Q8_0 layers at 4 rows ran 126-131 GFLOP/s with W in
// memory, 250-307 with this; a 1B Q8_0 decode step at batch 4 1.65x, at 16 1.33x faster.
// Not for one row (a decode of one sequence): the prefetchers alone follow its stream
// better (the 1B's gate_up at 57 GB/s without, 43 with; fifty-seventh session, Zen 4).
template <int R, bool Q4, bool WIDE, bool AHEAD>
static void vector_rows(const Weight& w, const Acts& a, int64_t m0, int64_t g,
                        const float* bias, float* y) {
  const int64_t K = w.K, nb = w.nb, gb = Q4 ? w.gb : 1;  // Q8_0: a scale a block
  const int8_t* xh[R];
  const uint8_t* xl[R];
  const float* dx[R];
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    xh[r] = a.hi.get() + (m0 + r) * K;
    xl[r] = WIDE ? a.lo.get() + (m0 + r) * K : nullptr;
    dx[r] = a.dx.data() + (m0 + r) * nb;
    acc[r] = _mm512_setzero_ps();
  }
  for (int64_t h = 0; h < w.ng; ++h) {  // a scale group: gb blocks (Q8_0: one)
    const __m512 d = w.scales(w.d, g, h);
    for (int64_t b = h * gb; b < (h + 1) * gb; ++b) {
      if constexpr (AHEAD) prefetch_ahead(w.block(g, b), kBytes(Q4));
      __m512i sw[8], uw[8];
      block_vectors<Q4>(w, g, b, sw, uw);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int8_t* xb = xh[r] + b * kBlock;
        __m512i ih = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) ih = _mm512_dpbusd_epi32(ih, uw[c], bcast4(xb + 4 * c));
        if constexpr (!Q4)
          ih = _mm512_sub_epi32(ih, _mm512_set1_epi32(a.hsum[(m0 + r) * nb + b]));
        if constexpr (WIDE) {
          const uint8_t* lb = xl[r] + b * kBlock;
          __m512i il = _mm512_setzero_si512();
#pragma GCC unroll 8
          for (int c = 0; c < 8; ++c) il = _mm512_dpbusd_epi32(il, bcast4(lb + 4 * c), sw[c]);
          ih = _mm512_add_epi32(_mm512_slli_epi32(ih, 8), il);
        }
        acc[r] = block_term(acc[r], ih, d, dx[r][b]);
      }
    }
    if constexpr (Q4) {
      const __m512 mn = w.scales(w.m, g, h);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r] = offset_term(acc[r], mn, a.xsum[(m0 + r) * w.ng + h]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    store_row(y + (m0 + r) * w.N + g * kRows, acc[r], bias ? bias + g * kRows : nullptr);
}

// vector_rows, asking for W's bytes ahead or not (a template argument: one row's kernel, the
// prefetchers' alone, is compiled as it was before they were asked for).
template <int R, bool Q4, bool WIDE>
static TM_BT_INLINE void group_rows(const Weight& w, const Acts& a, int64_t m0, int64_t g,
                                    const float* bias, float* y, bool ahead) {
  if (ahead) vector_rows<R, Q4, WIDE, true>(w, a, m0, g, bias, y);
  else vector_rows<R, Q4, WIDE, false>(w, a, m0, g, bias, y);
}

// Every row of x times W groups [g0, g1): eight rows at a time (a block's weight vectors
// decoded once for eight; sixteen outputs of eight rows fill the registers), then four, then
// the rest; a group's blocks stay in L1 for every row of x. Each row's sums are its own, in
// the same order whatever the rows beside it.
template <bool Q4, bool WIDE>
static void vector_groups(const Weight& w, const Acts& a, int64_t M, int64_t g0, int64_t g1,
                          const float* bias, float* y) {
  // x's rows in blocks of ~256 KB (int8 hi and, WIDE, lo per value): with W's rows of the
  // thread (vector rows: no decoded tile) they stay in L2. 2048 rows of SmolLM2's Q8_0
  // 576 x 1536: 115 -> 163 G products/s on two Zen 4 cores; 1 MB blocks: 131.
  const int64_t xblock = x_block_rows(w.K * (WIDE ? 2 : 1), 8, 1 << 18);
  for (int64_t m0 = 0; m0 < M; m0 += xblock) {
    const int64_t m1 = std::min(M, m0 + xblock);
    for (int64_t g = g0; g < g1; ++g) {
      int64_t m = m0;
      const bool ahead = M > 1;  // one row: the hardware's prefetchers alone (above)
      for (; m + 8 <= m1; m += 8) group_rows<8, Q4, WIDE>(w, a, m, g, bias, y, ahead && m == m0);
      for (; m + 4 <= m1; m += 4) group_rows<4, Q4, WIDE>(w, a, m, g, bias, y, ahead && m == m0);
      switch (m1 - m) {
        case 1: group_rows<1, Q4, WIDE>(w, a, m, g, bias, y, ahead && m == m0); break;
        case 2: group_rows<2, Q4, WIDE>(w, a, m, g, bias, y, ahead && m == m0); break;
        case 3: group_rows<3, Q4, WIDE>(w, a, m, g, bias, y, ahead && m == m0); break;
        default: break;
      }
    }
  }
}

// ---- tiles ---------------------------------------------------------------------------------
// Tiles: 0, 5 sums of hi (or x8), 1, 6 sums of lo (two pairs: consecutive blocks alternate,
// so that a block's products need not wait for the sums stored just before), 2 x hi, 3 x lo
// (`rows` rows, 32 bytes each), 4 W (8 rows of 64 bytes). One configuration per count of
// rows of x (1-16).
static std::array<amx::TileConfig, kRows + 1> tile_configs() {
  std::array<amx::TileConfig, kRows + 1> all{};
  for (int rows = 1; rows <= kRows; ++rows) {
    amx::TileConfig& c = all[rows];
    c.palette = 1;
    for (int t : {0, 1, 5, 6}) c.rows[t] = rows, c.colsb[t] = 64;
    for (int t : {2, 3}) c.rows[t] = rows, c.colsb[t] = 32;
    c.rows[4] = 8, c.colsb[4] = 64;
  }
  return all;
}
static const std::array<amx::TileConfig, kRows + 1> kTileConfigs = tile_configs();

template <int C, int A, int B>  // tile C += tile A (int8) . tile B (int8)
static TM_BT_INLINE void dot_ss() {
  asm volatile("tdpbssd %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
}
template <int C, int A, int B>  // tile C += tile A (uint8) . tile B (int8)
static TM_BT_INLINE void dot_us() {
  asm volatile("tdpbusd %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
}

// Groups [c0, c1)'s blocks as B tiles, group after group (nb x 512 bytes each): Q8_0's as
// stored; 4-bit ones' nibbles split into buf.
static const uint8_t* group_tiles(const Weight& w, int64_t c0, int64_t c1, uint8_t* buf) {
  if (!w.q4) return w.block(c0, 0);
  for (int64_t i = 0; i < (c1 - c0) * w.nb; ++i) {
    __m512i chunks[8];
    split_nibbles(w.q + (c0 * w.nb + i) * 256, chunks);
    for (int c = 0; c < 8; ++c) _mm512_storeu_si512(buf + i * 512 + 64 * c, chunks[c]);
  }
  return buf;
}

// Groups of W whose tiles take ~512 KiB (L2): each tile of x is read for all of them in turn
// (from L1), their tiles once per tile of x.
static int64_t chunk_groups(const Weight& w) {
  return std::max<int64_t>(1, (int64_t{1} << 19) / (w.nb * 512));
}

using BlockSums = int32_t[2][kRows][kRows];  // a block's sums of hi (or x8) and of lo

// Block b's sums for the tile of x at row m into out, by the tile unit (tiles CH, CL).
template <int CH, int CL>
static TM_BT_INLINE void block_sums(const Acts& a, const uint8_t* tiles, int64_t m, int64_t b,
                                    int64_t K, BlockSums& out) {
  amx::zero<CH>();
  amx::load<2>(a.hi.get() + m * K + b * kBlock, K);
  amx::load<4>(tiles + b * 512, 64);
  dot_ss<CH, 2, 4>();
  if (a.wide) {
    amx::zero<CL>();
    amx::load<3>(a.lo.get() + m * K + b * kBlock, K);
    dot_us<CL, 3, 4>();
    amx::store<CL>(out[1], 64);
  }
  amx::store<CH>(out[0], 64);
}

// Rows [m0, m1) of x (tiles of `rows` rows: the thread's configuration) times W groups
// [g0, g1) into y, a chunk of groups (chunk_groups) at a time; buf: room for a chunk's
// unpacked 4-bit tiles.
static void tile_rows(const Weight& w, const Acts& a, int64_t m0, int64_t m1, int64_t rows,
                      int64_t g0, int64_t g1, const float* bias, float* y, uint8_t* buf) {
  const int64_t K = w.K, nb = w.nb, chunk = chunk_groups(w);
  alignas(64) BlockSums sums[3];
  for (int64_t c0 = g0; c0 < g1; c0 += chunk) {
    const int64_t c1 = std::min(g1, c0 + chunk);
    const uint8_t* chunk_tiles = group_tiles(w, c0, c1, buf);
    for (int64_t m = m0; m < m1; m += rows)
      for (int64_t g = c0; g < c1; ++g) {
        const uint8_t* tiles = chunk_tiles + (g - c0) * nb * 512;
        __m512 acc[kRows];
        for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
        // Two blocks ahead: a tile's store must retire before vector loads can read it (no
        // forwarding), so the sums scaled now were stored two blocks ago; and scaled before
        // the next tiles are stored (loads behind a tile store wait for it).
        block_sums<0, 1>(a, tiles, m, 0, K, sums[0]);
        if (nb > 1) block_sums<5, 6>(a, tiles, m, 1, K, sums[1]);
        for (int64_t b = 0; b < nb; ++b) {
          if (b + 2 < nb) {
            if (b % 2) block_sums<5, 6>(a, tiles, m, b + 2, K, sums[(b + 2) % 3]);
            else block_sums<0, 1>(a, tiles, m, b + 2, K, sums[(b + 2) % 3]);
          }
          const BlockSums& s = sums[b % 3];
          const __m512 d = w.scales(w.d, g, b / w.gb);
#pragma GCC unroll 16
          for (int r = 0; r < kRows; ++r) {
            if (r >= rows) break;
            __m512i I = _mm512_load_si512(s[0][r]);
            if (a.wide) I = _mm512_add_epi32(_mm512_slli_epi32(I, 8), _mm512_load_si512(s[1][r]));
            acc[r] = block_term(acc[r], I, d, a.dx[(m + r) * nb + b]);
          }
          if (w.q4 && (b + 1) % w.gb == 0) {
            const int64_t h = b / w.gb;
            const __m512 mn = w.scales(w.m, g, h);
#pragma GCC unroll 16
            for (int r = 0; r < kRows; ++r) {
              if (r >= rows) break;
              acc[r] = offset_term(acc[r], mn, a.xsum[(m + r) * w.ng + h]);
            }
          }
        }
        for (int r = 0; r < rows; ++r)
          store_row(y + (m + r) * w.N + g * kRows, acc[r], bias ? bias + g * kRows : nullptr);
      }
  }
}

// y (M, N) = x (M, K) @ W^T (+ bias) for a packed weight; xsum: x's group sums (4-bit).
inline void linear(const Weight& w, const float* x, int64_t M, const float* xsum,
                   bool int8_acts, const float* bias, float* y) {
  const bool tiles = M >= kTileMinRows && amx::available(amx::kInt8);
  const Acts a = round_acts(x, M, w.K, w, int8_acts, xsum, !tiles);
  const int64_t groups = w.N / kRows;
  if (!tiles) {  // a decode step (W streamed once), or a CPU without the tile unit
    at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      if (w.q4 && a.wide) vector_groups<true, true>(w, a, M, g0, g1, bias, y);
      else if (w.q4) vector_groups<true, false>(w, a, M, g0, g1, bias, y);
      else if (a.wide) vector_groups<false, true>(w, a, M, g0, g1, bias, y);
      else vector_groups<false, false>(w, a, M, g0, g1, bias, y);
    });
    return;
  }
  // Whole tiles of x, then a last tile of fewer rows in a pass of its own, configured that
  // narrow.
  const int64_t whole = M / kRows * kRows;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    const std::unique_ptr<uint8_t[]> buf(
        w.q4 ? new uint8_t[std::min(g1 - g0, chunk_groups(w)) * w.nb * 512] : nullptr);
    if (whole > 0) {
      const amx::Tiles tiles(kTileConfigs[kRows]);
      tile_rows(w, a, 0, whole, kRows, g0, g1, bias, y, buf.get());
    }
    if (whole < M) {
      const amx::Tiles tiles(kTileConfigs[M - whole]);
      tile_rows(w, a, whole, M, M - whole, g0, g1, bias, y, buf.get());
    }
  });
}
#endif  // TM_HAVE_BLOCK_TILES

}  // namespace block_tiles
