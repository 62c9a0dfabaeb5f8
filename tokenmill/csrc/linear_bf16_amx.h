// Weight kind 10 (BF16_PRODUCTS) on AMX tiles, where the CPU has AMX-BF16 (Intel Xeon from
// Sapphire Rapids) and Linux grants this process the tile state: the products of
// linear_bf16.h (bf16 weights, x rounded to bf16 once per call, float32 sums) by tdpbf16ps.
//
//   W tile (16 rows of W x 32 k, read where it is stored: row stride 2K bytes)
//   x tile (16 pairs of k x 16 rows of x x 2: x repacked per call, see pack_rows)
//   y^T tile (16 rows of W x 16 rows of x, float32) += W tile . x tile, k = 0, 32, .. K - 32
//
// Each output is one tile element summed over k in that order. Inside one tdpbf16ps the 32
// products reach the sum in the tile unit's own order (measured on a Sapphire Rapids class
// Xeon: neither pair order of vdpbf16ps nor an exact sum reproduces it), the same for every
// element of every tile. So a row of x gets the same bits whatever M, its place in the step,
// the tiling or the threads (batch-invariant), but not the bits of the vdpbf16ps order
// (linear_bf16.h's header), which the tests check on the other paths. Inputs' denormals read
// as zero and outputs' are flushed, as with vdpbf16ps.
//
// Decode steps take the same tiles, configured as narrow as their rows of x (a one-row step's
// x tile is 16 pairs x 4 bytes): per element the same products in the same order as in a
// whole tile (the tests compare a row alone with it among 200), and at one row about
// vdpbf16ps's rate (the x tiles padded to 16 rows had made it half: 16x the x bytes per
// step). From 4 rows the tiles lead, 2.7x at 4 and 4-6x at 16-256 rows (benchmarks/RESULTS.md,
// thirty-third session). A W tile's 16 rows are 16 lines 2K bytes apart, loaded at ~19 cycles
// per KiB from L2 (a tile product ~11); software prefetches and double-buffered tiles did not
// change that.
#pragma once
#include "vec_utils.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__) && defined(__x86_64__) && \
    defined(__linux__)
#define TM_HAVE_AMX_BF16 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace bf16_amx {

constexpr int kRows = 16;       // rows of W, and of x, per tile
constexpr int64_t kStepK = 32;  // k per tile product: 16 pairs, 64 bytes a row

// The CPU's AMX-TILE and AMX-BF16 bits (CPUID 7.0: EDX 24, 22), and Linux's grant of the tile
// state (XTILEDATA, asked once per process: it is off until a process requests it).
// TOKENMILL_AMX=0 declines them (vdpbf16ps instead), as ONEDNN_MAX_CPU_ISA does for oneDNN.
inline bool available() {
  static const bool ok = [] {
    const char* env = std::getenv("TOKENMILL_AMX");
    if (env && std::string(env) == "0") return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!(d & (1u << 24)) || !(d & (1u << 22))) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")
#define TM_AMX_INLINE inline __attribute__((always_inline))

// LDTILECFG's 64 bytes (palette 1): tiles 0-7 of 16 rows; W tiles (4, 5) 64 bytes wide, the
// sums (0-3) and x tiles (6, 7) 4 bytes per row of x they hold (`cols` <= 16).
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static std::array<TileConfig, kRows + 1> tile_configs() {
  std::array<TileConfig, kRows + 1> all{};
  for (int cols = 1; cols <= kRows; ++cols) {
    all[cols].palette = 1;
    for (int t = 0; t < 8; ++t)
      all[cols].rows[t] = kRows, all[cols].colsb[t] = t == 4 || t == 5 ? 64 : 4 * cols;
  }
  return all;
}
// A global, not a local: GCC's _tile_loadconfig tells the compiler it reads 8 bytes, so the
// stores of a local's other 56 were dropped as dead (and the first tile instruction faulted).
static const std::array<TileConfig, kRows + 1> kTileConfigs = tile_configs();

// The tile registers of a thread, configured for its part of one call and x tiles of `cols`
// rows: 0-3 sums, 4-5 W, 6-7 x. The configuration is per thread, so each part sets it.
class Tiles {
 public:
  explicit Tiles(int cols) { _tile_loadconfig(&kTileConfigs[cols]); }
  ~Tiles() { _tile_release(); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
};

// The tile instructions with the tile numbers as template arguments (GCC's macros paste
// literal digits into their assembly). Loads and stores clobber memory, so that the compiler
// keeps them in order with the stores that fill x and the reads of the sums.
template <int T>
static TM_AMX_INLINE void zero() {
  asm volatile("tilezero %%tmm%c0" ::"i"(T));
}
template <int T>
static TM_AMX_INLINE void load(const void* p, int64_t stride) {
  asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(p), "r"(stride), "i"(T) : "memory");
}
template <int T>
static TM_AMX_INLINE void store(void* p, int64_t stride) {
  asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(p), "r"(stride), "i"(T) : "memory");
}
template <int C, int A, int B>  // tile C += tile A . tile B
static TM_AMX_INLINE void dot() {
  asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
}

template <int... I, class F>
static TM_AMX_INLINE void unrolled(std::integer_sequence<int, I...>, F f) {
  (f(std::integral_constant<int, I>{}), ...);
}

// NB (1, 2) tiles of W rows by MB (1, 2) tiles of `cols` rows of x over all of K: the sum of
// (W tile i, x tile j) in tile i * MB + j, stored to out[i * MB + j] ([16][16] float32, y^T,
// `cols` columns written). w[i]: W tile i's first row; x[j]: x tile j's packed rows. W tiles
// in 4, 5, x tiles in 6, 7: at 2 x 2, four products per four loads.
template <int NB, int MB>
static void tile_block(const uint16_t* const* w, int64_t K, const uint16_t* const* x,
                       int64_t cols, float (*out)[kRows * kRows]) {
  static_assert(NB >= 1 && NB <= 2 && MB >= 1 && MB <= 2);
  using Sums = std::make_integer_sequence<int, NB * MB>;
  using WTiles = std::make_integer_sequence<int, NB>;
  unrolled(Sums{}, [](auto c) { zero<c.value>(); });
  const int64_t stride = 2 * K;  // bytes from one row of W to the next
  for (int64_t k = 0; k < K; k += kStepK) {
    // packed x: pair p of the tile's rows at element 2 cols p: the 16 pairs from k / 2 at cols k
    load<6>(x[0] + cols * k, 4 * cols);
    if constexpr (MB > 1) load<7>(x[1] + cols * k, 4 * cols);
    unrolled(WTiles{}, [&](auto i) {
      load<4 + i.value>(w[i.value] + k, stride);
      dot<i.value * MB, 4 + i.value, 6>();
      if constexpr (MB > 1) dot<i.value * MB + 1, 4 + i.value, 7>();
    });
  }
  unrolled(Sums{}, [&](auto c) { store<c.value>(out[c.value], 64); });
}
#pragma GCC pop_options

// xb (M, K) bf16 bits as tiles of 16 rows: tile t holds, for each pair p of k, the pair's two
// values of rows 16 t .. 16 t + cols - 1 (32 bits each; cols = 16 but in a last tile of fewer
// rows, which is that narrow): [K / 2][cols] from uint32 16 t (K / 2).
static void pack_rows(const uint16_t* xb, int64_t M, int64_t K, uint32_t* out) {
  const int64_t pairs = K / 2, tiles = (M + kRows - 1) / kRows;
  const auto* rows = reinterpret_cast<const uint32_t*>(xb);
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t valid = std::min<int64_t>(kRows, M - t * kRows);
    uint32_t* tile = out + t * pairs * kRows;
    for (int64_t p0 = 0; p0 < pairs; p0 += 16) {  // pairs is a multiple of 16: K of 32
      __m512 r[16];
      for (int l = 0; l < 16; ++l)
        r[l] = l < valid ? _mm512_loadu_ps(rows + (t * kRows + l) * pairs + p0)
                         : _mm512_setzero_ps();
      const __mmask16 keep = static_cast<__mmask16>((1u << valid) - 1u);
      transpose16(r, [&](int c, __m512 v) {
        _mm512_mask_storeu_ps(tile + (p0 + c) * valid, keep, v);
      });
    }
  }
}

// y[m, n0 + i] = tile[i][m - m0] (+ bias) for the tile's rows of W (i < n_valid) and of x.
static void store_transposed(const float* tile, int64_t m0, int64_t m_valid, int64_t n0,
                             int64_t n_valid, const float* bias, float* y, int64_t N) {
  if (m_valid <= 2) {  // decode steps: a column or two, cheaper than the transpose
    for (int64_t m = 0; m < m_valid; ++m)
      for (int64_t i = 0; i < n_valid; ++i)
        y[(m0 + m) * N + n0 + i] = bias ? tile[i * kRows + m] + bias[n0 + i] : tile[i * kRows + m];
    return;
  }
  __m512 r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(tile + i * kRows);
  const __mmask16 keep = static_cast<__mmask16>((1u << n_valid) - 1u);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
  transpose16(r, [&](int m, __m512 v) {
    if (m < m_valid)
      _mm512_mask_storeu_ps(y + (m0 + m) * N + n0, keep, bias ? _mm512_add_ps(v, b) : v);
  });
}

// W rows [n0, n0 + 16 * NB) (the last tile may hold fewer: n_valid rows in all, read from
// `w` as given) against the x tiles of rows [m0, m1) (each of `cols` rows), MB at a time.
template <int NB, int MB>
static void rows_of_w(const uint16_t* const* w, int64_t n0, int64_t n_valid, const uint32_t* xp,
                      int64_t M, int64_t K, int64_t m0, int64_t m1, int64_t cols,
                      const float* bias, float* y, int64_t N) {
  alignas(64) float out[4][kRows * kRows];
  const int64_t tile_elems = K / 2 * kRows;  // uint32 from one packed x tile to the next
  for (int64_t m = m0; m < m1; m += MB * kRows) {
    const bool two = MB == 2 && m + kRows < m1;
    const uint32_t* first = xp + m / kRows * tile_elems;
    const uint16_t* x[2] = {reinterpret_cast<const uint16_t*>(first),
                            reinterpret_cast<const uint16_t*>(two ? first + tile_elems : first)};
    if (two) tile_block<NB, MB>(w, K, x, cols, out); else tile_block<NB, 1>(w, K, x, cols, out);
    const int mb = two ? 2 : 1;
    for (int i = 0; i < NB; ++i) {
      const int64_t rows_n = std::min<int64_t>(kRows, n_valid - i * kRows);
      for (int j = 0; j < mb; ++j) {
        const int64_t mt = m + j * kRows;
        store_transposed(out[i * mb + j], mt, std::min<int64_t>(kRows, M - mt), n0 + i * kRows,
                         rows_n, bias, y, N);
      }
    }
  }
}

// y (M, N) = xb (M, K, bf16 bits) @ W^T (+ bias), K a multiple of 32. Threads take ranges of
// 32 rows of W; each output is one thread's, whole. The whole tiles of x are read in blocks of
// ~512 KiB (L2), W once per block; a last tile of fewer rows (a decode step's one row) in a
// pass of its own, its tiles configured that narrow: 4 bytes of x per pair, not 64.
inline void linear(const uint16_t* w, const uint16_t* xb, int64_t M, int64_t K, int64_t N,
                   const float* bias, float* y) {
  const int64_t tiles_m = (M + kRows - 1) / kRows, whole = M / kRows * kRows;
  std::unique_ptr<uint32_t[]> xp(new uint32_t[tiles_m * kRows * (K / 2)]);
  pack_rows(xb, M, K, xp.get());
  const int64_t block_m = std::max<int64_t>(2 * kRows, (int64_t{1} << 19) / (2 * K) / 32 * 32);
  constexpr int64_t kUnit = 2 * kRows;
  const int64_t units = (N + kUnit - 1) / kUnit;
  const int64_t grain = std::max<int64_t>(1, units / std::max<int64_t>(1, at::get_num_threads()));
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    const int64_t n_begin = u0 * kUnit, n_end = std::min(N, u1 * kUnit);
    std::unique_ptr<uint16_t[]> tail;  // W's last rows, zero-padded to a tile
    auto pass = [&](int64_t m0, int64_t m1, int64_t cols) {  // x rows [m0, m1), all of W's
      int64_t n = n_begin;
      for (; n + kUnit <= n_end; n += kUnit) {
        const uint16_t* rows[2] = {w + n * K, w + (n + kRows) * K};
        rows_of_w<2, 2>(rows, n, kUnit, xp.get(), M, K, m0, m1, cols, bias, y, N);
      }
      for (; n < n_end; n += kRows) {
        const int64_t valid = std::min<int64_t>(kRows, n_end - n);
        const uint16_t* rows[1] = {w + n * K};
        if (valid < kRows) {
          if (!tail) {
            tail.reset(new uint16_t[kRows * K]());
            std::memcpy(tail.get(), w + n * K, valid * K * sizeof(uint16_t));
          }
          rows[0] = tail.get();
        }
        rows_of_w<1, 2>(rows, n, valid, xp.get(), M, K, m0, m1, cols, bias, y, N);
      }
    };
    if (whole > 0) {
      const Tiles tiles(kRows);
      for (int64_t m0 = 0; m0 < whole; m0 += block_m)
        pass(m0, std::min(whole, m0 + block_m), kRows);
    }
    if (whole < M) {
      const Tiles tiles(static_cast<int>(M - whole));
      pass(whole, M, M - whole);
    }
  });
}

}  // namespace bf16_amx
#endif
