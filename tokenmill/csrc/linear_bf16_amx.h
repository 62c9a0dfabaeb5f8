// Weight kind 16 (BF16_TILES): a bf16 checkpoint's weights (kind 10's W) packed once at load
// for AMX tiles, where the CPU has AMX-BF16 (Intel Xeon from Sapphire Rapids) and Linux grants
// this process the tile state; multiplied as kind 10 is (x rounded to bf16 once per call,
// float32 sums) by tdpbf16ps.
//
//   packed W: Wt[g][p][j][e] = W[16 g + j][2 p + e]   ((N / 16, K / 2, 16, 2) bfloat16)
//     so that 16 pairs of k of 16 rows of W are one contiguous KiB: tdpbf16ps's B layout.
//   x tile (rows of x x 32 k: 64 bytes of each row of x, read where they lie)
//   y tile (rows of x x 16 rows of W, float32) += x tile . W tile, k = 0, 32, .. K - 32,
//   stored into y as it is, then + bias.
//
// Each output is one tile element summed over k in that order. Inside one tdpbf16ps the 32
// products reach the sum in the tile unit's own order (measured on a Sapphire Rapids class
// Xeon: neither pair order of vdpbf16ps nor an exact sum reproduces it), the same for every
// element of every tile. So a row of x gets the same bits whatever M, its place in the step,
// the tiling or the threads (batch-invariant), but not the bits of kind 10's vdpbf16ps order
// (linear_bf16.h's header). Inputs' denormals read as zero and outputs' are flushed, as with
// vdpbf16ps. A step's last tile of fewer than 16 rows of x (a decode step's one row) is
// configured that narrow: per element the same products in the same order as in a whole one.
//
// Why packed (thirty-fifth session): the first tile kernel read W where kind 10 stores it (as
// the A operand, 16 rows 2K bytes apart) and repacked x per call into the B layout, so each
// sum tile was y^T. At 256 rows on SmolLM2's shapes, one thread, the transposes into y took
// 9.5% of the time and the serial repack of x 3% (the tile products 76%); with two threads
// the second waited on that repack. With W as the B operand, x is read as rounded and the
// sums are y: 1.13-1.35x the products at 1-1024 rows (benchmarks/RESULTS.md). Tied embedding
// tables packed so are looked up from the tiles (quantization/unquantized.py).
#pragma once
#include "amx_tiles.h"
#include "vec_utils.h"
#include <ATen/Parallel.h>
#include <algorithm>

#if defined(TM_HAVE_AMX)
#define TM_HAVE_AMX_BF16 1

namespace bf16_amx {
using namespace amx;

constexpr int kRows = 16;       // rows of W, and of x, per tile
constexpr int64_t kStepK = 32;  // k per tile product: 16 pairs, 64 bytes a row

// The CPU's AMX-BF16 and Linux's grant of the tile state (amx_tiles.h; TOKENMILL_AMX=0: no).
inline bool available() { return amx::available(amx::kBF16); }

// Per count of x rows (1-16): tiles 0-7, 64 bytes a row; the sums (0-3) and x tiles (4, 5)
// `rows` rows (a step's last tile may hold fewer rows of x), W tiles (6, 7) 16.
static std::array<TileConfig, kRows + 1> tile_configs() {
  std::array<TileConfig, kRows + 1> all{};
  for (int rows = 1; rows <= kRows; ++rows) {
    all[rows].palette = 1;
    for (int t = 0; t < 8; ++t)
      all[rows].rows[t] = t >= 6 ? kRows : rows, all[rows].colsb[t] = 64;
  }
  return all;
}
static const std::array<TileConfig, kRows + 1> kTileConfigs = tile_configs();

template <int C, int A, int B>  // tile C += tile A . tile B
static TM_AMX_INLINE void dot() {
  asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
}

// MB (1, 2) x tiles by NB (1, 2) W tiles over all of K: the sum of (x tile j, W tile i) in
// tile j * NB + i, stored to y[j * NB + i] (row stride ldy floats). x[j]: x tile j's first
// row (row stride K); w[i]: W tile i's packed group. x tiles in 4, 5, W tiles in 6, 7: at
// 2 x 2, four products per four loads.
template <int MB, int NB>
static void tile_block(const uint16_t* const* x, const uint16_t* const* w, int64_t K,
                       float* const* y, int64_t ldy) {
  static_assert(NB >= 1 && NB <= 2 && MB >= 1 && MB <= 2);
  using Sums = std::make_integer_sequence<int, MB * NB>;
  using XTiles = std::make_integer_sequence<int, MB>;
  unrolled(Sums{}, [](auto c) { zero<c.value>(); });
  const int64_t x_stride = 2 * K;  // bytes from one row of x to the next
  for (int64_t k = 0; k < K; k += kStepK) {
    // W tile for k: pairs k / 2 .. k / 2 + 15 of the group, 16 x 2 values each
    load<6>(w[0] + 16 * k, 64);
    if constexpr (NB > 1) load<7>(w[1] + 16 * k, 64);
    unrolled(XTiles{}, [&](auto j) {
      load<4 + j.value>(x[j.value] + k, x_stride);
      dot<j.value * NB, 4 + j.value, 6>();
      if constexpr (NB > 1) dot<j.value * NB + 1, 4 + j.value, 7>();
    });
  }
  unrolled(Sums{}, [&](auto c) { store<c.value>(y[c.value], 4 * ldy); });
}

// W (N, K) bf16 bits into the packed layout of the header (N a multiple of 16, K of 32):
// per group of 16 rows, the (16, K / 2) pairs transposed to (K / 2, 16), 16 x 16 at a time.
inline void pack_weight(const uint16_t* w, int64_t N, int64_t K, uint16_t* out) {
  const int64_t pairs = K / 2;
  const auto* rows = reinterpret_cast<const uint32_t*>(w);
  auto* packed = reinterpret_cast<uint32_t*>(out);
  at::parallel_for(0, N / kRows, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t p0 = 0; p0 < pairs; p0 += 16) {  // pairs is a multiple of 16
        __m512 r[16];
        for (int l = 0; l < 16; ++l)
          r[l] = _mm512_loadu_ps(rows + (g * kRows + l) * pairs + p0);
        transpose16(r, [&](int c, __m512 v) {
          _mm512_storeu_ps(packed + (g * pairs + p0 + c) * kRows, v);
        });
      }
  });
}

// Rows [m0, m1) of x (tiles of 16 rows, or one of the thread's configured narrower rows)
// against W groups [g0, g1), two of each at a time; y's tiles stored as summed, then + bias.
static void rows_of_x(const uint16_t* wt, const uint16_t* xb, int64_t K, int64_t N,
                      int64_t m0, int64_t m1, int64_t g0, int64_t g1, const float* bias,
                      float* y) {
  const int64_t group = K / 2 * 32;  // bf16 values from one packed group of W to the next
  for (int64_t g = g0; g < g1; g += 2) {
    const bool two_w = g + 1 < g1;
    const uint16_t* w[2] = {wt + g * group, wt + (two_w ? g + 1 : g) * group};
    for (int64_t m = m0; m < m1; m += 2 * kRows) {
      const bool two_x = m + kRows < m1;
      const uint16_t* x[2] = {xb + m * K, xb + (two_x ? m + kRows : m) * K};
      float* out = y + m * N + g * kRows;
      float* const sums[4] = {out, out + kRows, out + kRows * N, out + kRows * N + kRows};
      float* const one_w[2] = {out, out + kRows * N};  // tiles (0, 0), (1, 0)
      if (two_x && two_w) tile_block<2, 2>(x, w, K, sums, N);
      else if (two_x) tile_block<2, 1>(x, w, K, one_w, N);
      else if (two_w) tile_block<1, 2>(x, w, K, sums, N);
      else tile_block<1, 1>(x, w, K, sums, N);
    }
    if (bias) {
      const int64_t n0 = g * kRows, cols = (two_w ? 2 : 1) * kRows;
      for (int64_t m = m0; m < m1; ++m)
        for (int64_t c = 0; c < cols; c += 16)
          _mm512_storeu_ps(y + m * N + n0 + c, _mm512_add_ps(_mm512_loadu_ps(y + m * N + n0 + c),
                                                             _mm512_loadu_ps(bias + n0 + c)));
    }
  }
}

// y (M, N) = xb (M, K, bf16 bits) @ W^T (+ bias) for W packed (pack_weight), N a multiple of
// 16, K of 32. Threads take ranges of 32 rows of W; each output is one thread's, whole. The
// whole tiles of x are read in blocks of ~512 KiB (L2), W once per block; a last tile of
// fewer rows (a decode step's one row) in a pass of its own, its tiles configured that narrow.
inline void linear(const uint16_t* wt, const uint16_t* xb, int64_t M, int64_t K, int64_t N,
                   const float* bias, float* y) {
  const int64_t whole = M / kRows * kRows, groups = N / kRows;
  const int64_t block_m = x_block_rows(2 * K, 2 * kRows, 1 << 19);
  const int64_t units = (groups + 1) / 2;  // pairs of groups: 32 rows of W
  const int64_t grain = std::max<int64_t>(1, units / std::max<int64_t>(1, at::get_num_threads()));
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    const int64_t g0 = 2 * u0, g1 = std::min(groups, 2 * u1);
    if (whole > 0) {
      const Tiles tiles(kTileConfigs[kRows]);
      for (int64_t m0 = 0; m0 < whole; m0 += block_m)
        rows_of_x(wt, xb, K, N, m0, std::min(whole, m0 + block_m), g0, g1, bias, y);
    }
    if (whole < M) {
      const Tiles tiles(kTileConfigs[M - whole]);
      rows_of_x(wt, xb, K, N, whole, M, g0, g1, bias, y);
    }
  });
}

}  // namespace bf16_amx
#endif
