// Dense bfloat16 weights multiplied in bfloat16 (kind 10, BF16_PRODUCTS): AVX512-BF16's
// vdpbf16ps, the products of a bf16 checkpoint served at bf16 speed with float32 sums.
//
//   tensors = {W (N, K) bfloat16}, K a multiple of 32
//   xb = x rounded to bfloat16 (nearest even: torch's x.to(torch.bfloat16)), once per call
//   per output (m, n), 16 float32 lanes, lane l summing the pairs (2l, 2l + 1) of each 32:
//     acc_l = 0
//     for c in 0 .. K/32 - 1:   (k = 32 c + 2 l)
//       acc_l = acc_l + xb[m, k + 1] * w[n, k + 1]     (each product exact in float32;
//       acc_l = acc_l + xb[m, k]     * w[n, k]          one rounding per sum)
//     y[m, n] = tree(acc_0 .. acc_15) (+ bias[n])
//   with tree the sum _mm512_reduce_add_ps makes: t_i = a_i + a_(i+8); u_j = t_j + t_(j+4);
//   (u_0 + u_2) + (u_1 + u_3).
//
// That is vdpbf16ps's definition (Intel SDM: the odd pair's product is added first, then the
// even one's; inputs' denormals read as zero, outputs' flushed), run by the hardware where the
// CPU has AVX512-BF16, and emulated with float32 FMAs elsewhere: the product of two bfloat16
// values is exact in float32, so fma(a, b, acc) rounds once as the instruction does, and both
// give the same bits (tests/layers/test_bf16_products.py checks the kernels against a torch
// transcription of the lines above, and the hardware against the emulation). Each output is
// summed in that one order whatever M, the tiling or the threads: batch-invariant.
//
// Where the CPU has AMX-BF16 (and Linux grants the tile state), the model's loader packs such
// weights for AMX tiles instead (kind 16, `linear_tiles`; linear_bf16_amx.h): the same
// rounding of x, float32 sums, one kernel at every M (batch-invariant), but the tile unit's
// order of sums, not the one above. use_amx() off: the loader keeps kind 10 (vdpbf16ps).
//
// Against float32 on the same weights, the loss is x's rounding to 8 bits of mantissa (the
// weights are bf16 already): benchmarks/quant_quality.py states the agreement.
#pragma once
#include "linear_bf16_amx.h"
#include "linear_half.h"
#include "quant_blocks.h"
#include "vec_utils.h"
#include <c10/util/BFloat16.h>
#include <memory>

namespace bf16_products {

constexpr int64_t kKind = half_rows::kBF16Products;
constexpr int64_t kTilesKind = half_rows::kBF16Tiles;
constexpr int64_t kStep = 32;    // weights per dot step: 16 lanes of 2
constexpr int kLanes = 16;
using half_rows::kAheadValues;  // how far ahead a streamed W is asked for (linear_half.h)
// The widest panel of W (48 rows) whose successor is asked for while it runs (PanelAhead).
constexpr int64_t kAheadPanelBytes = 256 << 10;

#define TM_INLINE_BF inline __attribute__((always_inline))

// The tree of the header, on 16 lane sums.
static TM_INLINE_BF float tree(const float* a) {
  float u[4];
  for (int j = 0; j < 4; ++j) u[j] = (a[j] + a[j + 8]) + (a[j + 4] + a[j + 12]);
  return (u[0] + u[2]) + (u[1] + u[3]);
}

// ---- the emulation: float32 FMAs on the widened pairs (every build) ------------------------
struct Emulated {
  static constexpr int H = kLanes / kV;  // vectors per 16 lanes: 1 (AVX-512), 2 (AVX2)
  struct Acc {
    Vec v[H];
  };
  struct Pairs {  // 32 bf16 values as float32: the odd and even elements of each pair
    Vec odd[H], even[H];
  };

  static TM_INLINE_BF Acc zero() {
    Acc a;
    for (int h = 0; h < H; ++h) a.v[h] = Vec(0.f);
    return a;
  }

  static TM_INLINE_BF Pairs load(const uint16_t* p) {
    Pairs r;
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
    const __m512i d = _mm512_loadu_si512(p);
    r.odd[0] = Vec(_mm512_castsi512_ps(_mm512_and_si512(d, _mm512_set1_epi32(0xFFFF0000))));
    r.even[0] = Vec(_mm512_castsi512_ps(_mm512_slli_epi32(d, 16)));
#elif defined(CPU_CAPABILITY_AVX2) && defined(__AVX2__)
    for (int h = 0; h < H; ++h) {
      const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * h));
      r.odd[h] = Vec(_mm256_castsi256_ps(_mm256_and_si256(d, _mm256_set1_epi32(0xFFFF0000))));
      r.even[h] = Vec(_mm256_castsi256_ps(_mm256_slli_epi32(d, 16)));
    }
#else
    float odd[kLanes], even[kLanes];
    for (int l = 0; l < kLanes; ++l) {
      odd[l] = static_cast<float>(c10::BFloat16(p[2 * l + 1], c10::BFloat16::from_bits()));
      even[l] = static_cast<float>(c10::BFloat16(p[2 * l], c10::BFloat16::from_bits()));
    }
    for (int h = 0; h < H; ++h) r.odd[h] = Vec::loadu(odd + h * kV), r.even[h] = Vec::loadu(even + h * kV);
#endif
    return r;
  }

  // exact products: a * b + c rounds once, as fma does (the portable Vec's fmadd is a * b + c)
  static TM_INLINE_BF void step(Acc& a, const Pairs& x, const Pairs& w) {
    for (int h = 0; h < H; ++h) {
      a.v[h] = at::vec::fmadd(x.odd[h], w.odd[h], a.v[h]);
      a.v[h] = at::vec::fmadd(x.even[h], w.even[h], a.v[h]);
    }
  }

  static TM_INLINE_BF float reduce(const Acc& a) {
    float lanes[kLanes];
    for (int h = 0; h < H; ++h) a.v[h].store(lanes + h * kV);
    return tree(lanes);
  }

  // y[0..3] = the trees of a[0..3] (+ bias[0..3])
  static TM_INLINE_BF void reduce4(const Acc* a, const float* bias, float* y) {
    for (int j = 0; j < 4; ++j) y[j] = bias ? reduce(a[j]) + bias[j] : reduce(a[j]);
  }
};

// The tiles below are compiled for AVX512-BF16 in the AVX-512 build, the hardware's calls
// being inlined into them; the emulation's instantiations use none of its instructions and
// run on any CPU of the build.
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
#define TM_HAVE_BF16_HW 1
#pragma GCC push_options
#pragma GCC target("avx512bf16")
#endif

// Tiles: MR rows of x by NR rows of W, every loaded vector used MR or NR times. AHEAD: each
// of its W rows' lines kAheadValues further on asked for into L2 as it is read (W streamed
// once, `stream_rows`).
template <class D, int MR, int NR, bool AHEAD = false>
static TM_INLINE_BF void tile(const uint16_t* x, int64_t K, const uint16_t* w, int64_t n0,
                              const float* bias, float* y, int64_t ldy) {
  typename D::Acc acc[MR][NR];
  _Pragma("GCC unroll 16") for (int i = 0; i < MR; ++i)
    _Pragma("GCC unroll 16") for (int j = 0; j < NR; ++j) acc[i][j] = D::zero();
  for (int64_t k = 0; k < K; k += kStep) {
    if constexpr (AHEAD) {
      _Pragma("GCC unroll 16") for (int j = 0; j < NR; ++j)
        prefetch_l2(w + (n0 + j) * K + k + kAheadValues);
    }
    typename D::Pairs wv[NR];
    _Pragma("GCC unroll 16") for (int j = 0; j < NR; ++j) wv[j] = D::load(w + (n0 + j) * K + k);
    _Pragma("GCC unroll 16") for (int i = 0; i < MR; ++i) {
      const auto xv = D::load(x + i * K + k);
      _Pragma("GCC unroll 16") for (int j = 0; j < NR; ++j) D::step(acc[i][j], xv, wv[j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    if constexpr (NR % 4 == 0) {
      for (int j = 0; j < NR; j += 4)
        D::reduce4(acc[i] + j, bias ? bias + n0 + j : nullptr, y + i * ldy + n0 + j);
    } else {
      for (int j = 0; j < NR; ++j) {
        const float s = D::reduce(acc[i][j]);
        y[i * ldy + n0 + j] = bias ? s + bias[n0 + j] : s;
      }
    }
  }
}

// The next panel of W (range below) asked for into L2, a few lines a tile, while the current
// panel's products run from L2. Why: a panel's first pass read W from memory at the latency
// of short streams (4 rows of 1,152 bytes a tile), so 64 rows of x ran SmolLM2's shapes at
// 235-315 GFLOP/s with W in memory (as a decode step's weights are: 212 MB of layers)
// against 280-390 with W in cache; with it, 245-390 (fifty-seventh session, Zen 4).
// Prefetches only: no result depends on them.
struct PanelAhead {
  const char* p = nullptr;
  const char* end = nullptr;
  int64_t per_tile = 0;  // lines a tile
  TM_INLINE_BF void tile() {
    for (int64_t i = 0; i < per_tile && p < end; ++i, p += 64) prefetch_l2(p);
  }
};

template <class D, int MR, int NR>
static void rows_times(const uint16_t* x, int64_t K, const uint16_t* w, int64_t n0, int64_t n1,
                       const float* bias, float* y, int64_t ldy, PanelAhead* ahead = nullptr) {
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    if (ahead) ahead->tile();
    tile<D, MR, NR>(x, K, w, n, bias, y, ldy);
  }
  for (; n < n1; ++n) {
    if (ahead) ahead->tile();
    tile<D, MR, 1>(x, K, w, n, bias, y, ldy);
  }
}

// rows_times for steps of up to 4 rows, which read W [n0, n1) once, in address order (W's
// rows are contiguous): the tiles ask for the lines kAheadValues on, but for the last ones,
// whose lines ahead are past the range.
template <class D, int MR, int NR>
static void stream_rows(const uint16_t* x, int64_t K, const uint16_t* w, int64_t n0, int64_t n1,
                        const float* bias, float* y, int64_t ldy) {
  int64_t n = n0;
  for (; (n + NR) * K + kAheadValues <= n1 * K; n += NR)
    tile<D, MR, NR, true>(x, K, w, n, bias, y, ldy);
  rows_times<D, MR, NR>(x, K, w, n, n1, bias, y, ldy);
}

// The rows < R left after a block's whole tiles, in one tile of their number: a step of 64
// rows in tiles of 6 left 4 rows, which one row at a time (x loaded for 4 products, W for 1)
// cost 17% of the step's GEMM time. Each output's sum is the same whatever tile holds it.
template <class D, int R, int NR>
static void left_rows(int64_t rows, const uint16_t* x, int64_t K, const uint16_t* w, int64_t n0,
                      int64_t n1, const float* bias, float* y, int64_t ldy, PanelAhead* ahead) {
  if constexpr (R > 1) {
    if (rows < R) return left_rows<D, R - 1, NR>(rows, x, K, w, n0, n1, bias, y, ldy, ahead);
  }
  rows_times<D, R, NR>(x, K, w, n0, n1, bias, y, ldy, ahead);
}

// W rows [n0, n1) against all M rows of xb: steps of up to 4 rows stream W once; larger ones
// go by panels of 48 rows of W (in L1 / L2), each met by blocks of up to 256 KiB of x (in L2),
// so W is read from memory once per block: once in all for most steps (the LM head of a
// 256-row step: 0.45x the speed with blocks of 60 rows).
template <class D, int NR_SMALL, int MR, int NR>
static void range(const uint16_t* xb, int64_t M, int64_t K, const uint16_t* w, int64_t n0,
                  int64_t n1, const float* bias, float* y, int64_t ldy) {
  switch (M) {
    case 1: return stream_rows<D, 1, NR_SMALL>(xb, K, w, n0, n1, bias, y, ldy);
    case 2: return stream_rows<D, 2, NR_SMALL>(xb, K, w, n0, n1, bias, y, ldy);
    case 3: return stream_rows<D, 3, NR_SMALL>(xb, K, w, n0, n1, bias, y, ldy);
    case 4: return stream_rows<D, 4, NR_SMALL>(xb, K, w, n0, n1, bias, y, ldy);
    default: break;
  }
  constexpr int64_t kPanel = 48;  // a multiple of every NR
  const int64_t block = x_block_rows(2 * K, MR, 1 << 18);  // bf16 x: 2 bytes a value
  for (int64_t m0 = 0; m0 < M; m0 += block) {
    const int64_t m1 = std::min(M, m0 + block);
    for (int64_t p0 = n0; p0 < n1; p0 += kPanel) {
      const int64_t p1 = std::min(n1, p0 + kPanel);
      // the next panel's rows follow this one's in memory: spread over this panel's tiles
      // (not for wide panels: 48 rows of K = 8192 are 768 KB, two of them past L2; the 1B's
      // down_proj at 16 rows ran 0.89x with the next one asked for)
      const int64_t next_bytes =
          kPanel * K * 2 <= kAheadPanelBytes ? (std::min(n1, p1 + kPanel) - p1) * K * 2 : 0;
      const int64_t tiles = ((m1 - m0 + MR - 1) / MR) * ((p1 - p0) / NR + (p1 - p0) % NR);
      PanelAhead ahead{reinterpret_cast<const char*>(w + p1 * K),
                       reinterpret_cast<const char*>(w + p1 * K) + next_bytes,
                       (next_bytes / 64 + tiles - 1) / tiles};
      int64_t m = m0;
      for (; m + MR <= m1; m += MR)
        rows_times<D, MR, NR>(xb + m * K, K, w, p0, p1, bias, y + m * ldy, ldy, &ahead);
      if (m < m1)
        left_rows<D, MR - 1, NR>(m1 - m, xb + m * K, K, w, p0, p1, bias, y + m * ldy, ldy,
                                 &ahead);
    }
  }
}

// ---- the hardware: AVX512-BF16, called only where the CPU reports avx512bf16 -------------
#ifdef TM_HAVE_BF16_HW
struct Hardware {
  using Acc = __m512;
  using Pairs = __m512i;
  static TM_INLINE_BF Acc zero() { return _mm512_setzero_ps(); }
  static TM_INLINE_BF Pairs load(const uint16_t* p) { return _mm512_loadu_si512(p); }
  static TM_INLINE_BF void step(Acc& a, const Pairs& x, const Pairs& w) {
    a = _mm512_dpbf16_ps(a, (__m512bh)x, (__m512bh)w);
  }
  static TM_INLINE_BF float reduce(const Acc& a) {
    float lanes[kLanes];
    _mm512_storeu_ps(lanes, a);
    return tree(lanes);
  }

  // The trees of four accumulators at once, in registers (vec_utils.h: the tree above); a
  // scalar tree per output cost more than a tile's products at K = 576.
  static TM_INLINE_BF void reduce4(const Acc* a, const float* bias, float* y) {
    __m128 out = hsum4(a);
    if (bias) out = _mm_add_ps(out, _mm_loadu_ps(bias));
    _mm_storeu_ps(y, out);
  }
};

// 32 zmm registers: M <= 4 streams 4 W rows (<= 16 accumulators); larger steps 6 x 4 tiles
// (24 accumulators, 4 W vectors, 1 x vector).
static void hardware_range(const uint16_t* xb, int64_t M, int64_t K, const uint16_t* w,
                           int64_t n0, int64_t n1, const float* bias, float* y, int64_t ldy) {
  range<Hardware, 4, 6, 4>(xb, M, K, w, n0, n1, bias, y, ldy);
}

static bool cpu_has_bf16() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}
#else
static bool cpu_has_bf16() { return false; }
#endif

// Whether calls take the instructions (where the CPU has them) or the emulation: a switch for
// the tests that compare the two on one machine.
inline bool& use_hardware() {
  static bool on = true;
  return on;
}

inline bool hardware_active() { return use_hardware() && cpu_has_bf16(); }

// Whether bfloat16 weights are packed for AMX tiles (kind 16, linear_bf16_amx.h: their own
// order of sums) where the CPU has them, rather than kept for vdpbf16ps (kind 10): the
// loader asks (cpu_ops.bf16_products_amx); off for the tests of kind 10 on AMX machines.
inline bool& use_amx() {
  static bool on = true;
  return on;
}

inline bool amx_active() {
#ifdef TM_HAVE_AMX_BF16
  return hardware_active() && use_amx() && bf16_amx::available();
#else
  return false;
#endif
}

// AVX2's 16 registers hold 2 x 2 tiles of two-vector accumulators.
static void emulated_range(const uint16_t* xb, int64_t M, int64_t K, const uint16_t* w,
                           int64_t n0, int64_t n1, const float* bias, float* y, int64_t ldy) {
  constexpr int kNR = Emulated::H == 1 ? 4 : 2;
  range<Emulated, kNR, 2, kNR>(xb, M, K, w, n0, n1, bias, y, ldy);
}
#ifdef TM_HAVE_BF16_HW
#pragma GCC pop_options
#endif

// x (M, K) float32 rounded to bfloat16 bits, as torch rounds (nearest even).
static void round_rows(const float* x, int64_t count, uint16_t* out) {
  auto part = [&](int64_t i0, int64_t i1) {
    int64_t i = i0;
    for (; i + 2 * kV <= i1; i += 2 * kV)
      at::vec::convert_float_bfloat16(Vec::loadu(x + i), Vec::loadu(x + i + kV))
          .store(reinterpret_cast<c10::BFloat16*>(out + i));
    for (; i < i1; ++i) out[i] = c10::BFloat16(x[i]).x;
  };
  if (count <= (1 << 16)) return part(0, count);
  at::parallel_for(0, count / 64, 64, [&](int64_t b0, int64_t b1) {
    part(b0 * 64, b1 == count / 64 ? count : b1 * 64);
  });
}

// x's `count` values rounded to bfloat16 bits (round_rows), once per call: both kinds'.
static std::unique_ptr<uint16_t[]> rounded(const float* x, int64_t count) {
  std::unique_ptr<uint16_t[]> xb(new uint16_t[count]);
  round_rows(x, count, xb.get());
  return xb;
}

// y's N columns (row stride ldy) = xb (M, K, x rounded: `rounded`) @ W^T (+ bias) in the
// order of the header. Threads take contiguous ranges of W's rows; each output is one
// thread's, whole. A merged layer's parts share one rounding of x and write their own
// columns of y (linear_cpu.h): the same bits as one weight of all their rows.
inline void linear_rounded(const uint16_t* w, const uint16_t* xb, int64_t M, int64_t K,
                           int64_t N, const float* bias, float* y, int64_t ldy) {
  [[maybe_unused]] const bool hw = hardware_active();
  const int64_t unit = M <= 4 ? 16 : 48, units = (N + unit - 1) / unit;
  const int64_t grain = std::max<int64_t>(1, units / std::max<int64_t>(1, at::get_num_threads()));
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    const int64_t n0 = u0 * unit, n1 = std::min(N, u1 * unit);
#ifdef TM_HAVE_BF16_HW
    if (hw) return hardware_range(xb, M, K, w, n0, n1, bias, y, ldy);
#endif
    emulated_range(xb, M, K, w, n0, n1, bias, y, ldy);
  });
}

// y (M, N) = x (M, K) @ W^T (+ bias).
inline void linear(const uint16_t* w, const float* x, int64_t M, int64_t K, int64_t N,
                   const float* bias, float* y) {
  linear_rounded(w, rounded(x, M * K).get(), M, K, N, bias, y, N);
}

// Kind 16: y (M, N) = x (M, K) @ W^T (+ bias) for W packed by bf16_amx::pack_weight, on AMX
// tiles (the CPU must have them: packed weights exist only where it does).
inline void linear_tiles(const uint16_t* wt, const float* x, int64_t M, int64_t K, int64_t N,
                         const float* bias, float* y) {
#ifdef TM_HAVE_AMX_BF16
  TORCH_CHECK(bf16_amx::available(), "bfloat16 weights packed for AMX tiles (kind 16) need "
              "a CPU with AMX-BF16 and Linux's grant of the tile state");
  const std::unique_ptr<uint16_t[]> xb = rounded(x, M * K);
  bf16_amx::linear(wt, xb.get(), M, K, N, bias, y);
#else
  (void)wt, (void)x, (void)M, (void)K, (void)N, (void)bias, (void)y;
  TORCH_CHECK(false, "bfloat16 weights packed for AMX tiles (kind 16) need the AVX-512 build");
#endif
}

// W (N, K) bfloat16 packed for kind 16: (N / 16, K / 2, 16, 2) (linear_bf16_amx.h).
inline torch::Tensor pack_tiles(const torch::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16 && w.dim() == 2 && w.is_contiguous() &&
              w.device().is_cpu(), "pack_tiles takes a contiguous (N, K) bfloat16 CPU weight");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % 16 == 0 && K % 32 == 0, "AMX tiles need N divisible by 16 and K by 32; got ",
              N, " x ", K);
  auto out = torch::empty({N / 16, K / 2, 16, 2}, w.options());
#ifdef TM_HAVE_AMX_BF16
  bf16_amx::pack_weight(static_cast<const uint16_t*>(w.data_ptr()), N, K,
                        static_cast<uint16_t*>(out.data_ptr()));
#else
  TORCH_CHECK(false, "AMX tiles need the AVX-512 build");
#endif
  return out;
}

}  // namespace bf16_products
