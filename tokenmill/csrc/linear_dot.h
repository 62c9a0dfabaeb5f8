// Batch-invariant linear products: y[m, n] = <x[m, :], w[n, :]> (+ bias[n]) summed in ONE
// order per output, whatever the number of rows M, the tiling, the weight format's path or
// the threads:
//
//   acc = 0                                    (one Vec of kV lanes)
//   for j in 0 .. K/kV - 1:  acc = fmadd(x[m, j kV : (j + 1) kV], w_n(j), acc)
//   s = hsum(acc)                              (vec_utils.h: one fixed tree)
//   for k in K/kV kV .. K - 1:  s = fma(x[m, k], w[n, k], s)
//   y[m, n] = s + bias[n]
//
// w_n(j) is the j-th vector of W's row n as float32: a dense row as stored; Q8_0 blocks as
// q * d; 4-bit groups as fma(q, d, m) (one rounding: the dequantized weight). Quantized K is a
// multiple of 32, so only dense rows have a scalar tail. Nothing about the other rows of x
// enters an output, so a row of y is bitwise the same alone or among any others: a request's
// logits do not depend on what shares its step (tests/layers/test_linear_invariance.py).
//
// Speed comes from tiles, not from another order: MR rows of x by NR rows of W, each pair its
// own accumulator, every x and W vector loaded once per tile step (AVX2: 4 x 3 tiles, 12
// accumulators, 7 loads for 12 FMAs). Steps of a few rows stream each weight row once; larger
// ones go in blocks of kMBlock rows of x that stay in L2 while panels of W pass by. Quantized
// weights are expanded to float32 as they are read: in registers for a few rows of x, into a
// panel buffer (the same values) that larger steps reuse across their rows.
#pragma once
#include "linear_gguf.h"
#include "linear_half.h"
#include "quant_blocks.h"
#include <memory>
#include <type_traits>

namespace dot_form {

// The per-block helpers are forced inline: with a kernel per weight kind in one function,
// GCC's inlining budget otherwise left some out of line, their block state passed through
// memory (4-bit steps of 4 rows ran 2x slower).
#define TM_INLINE inline __attribute__((always_inline))

constexpr int kMR = 4;                       // rows of x per tile in larger steps
constexpr int64_t kMBlock = 64;              // rows of x per block (64 x K floats: in L2)
constexpr int64_t kPanel = 48;               // rows of W per panel (a multiple of every NR)

// Rows of W per tile. Steps of a few rows of x stream each weight from memory once: one W row
// at a time (a single sequential stream, which the prefetchers follow best; measured on
// SmolLM2's 30 layers at M = 2..4) with one accumulator chain per row of x, except for one
// row of x, where several W rows keep several FMA chains in flight: eight dense rows, two
// quantized ones (whose expansion in registers already overlaps the loads; four measured
// 0.78x of two on SmolLM2's Q4_1 layers). Larger steps: tiles of kMR x kGemmNR (16 ymm / 32
// zmm registers: the accumulators and one step's vectors).
constexpr int kGemmNR = kV >= 16 ? 6 : 3;
constexpr int small_nr(int mr, bool quantized) {
  if (mr > 1) return 1;
  return quantized ? 2 : 8;
}

// ---- weight vectors as float32 ------------------------------------------------------------
// The c-th kV-vector of a 32-weight block (c < kChunks), in weight order.
static TM_INLINE Vec q8_chunk(const int8_t* q, int c) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * c)))));
#elif defined(CPU_CAPABILITY_AVX2) && defined(__AVX2__)
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * c)))));
#else
  float buf[kV];
  for (int64_t i = 0; i < kV; ++i) buf[i] = static_cast<float>(q[c * kV + i]);
  return Vec::loadu(buf);
#endif
}

// 16 bytes of nibbles hold weights 0..15 (low nibbles) and 16..31 (high ones). The SIMD
// builds mask both halves once per block (Nibbles, loaded by block_of) and take each chunk
// from registers; the portable build reads the bytes.
#if (defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)) || \
    (defined(CPU_CAPABILITY_AVX2) && defined(__AVX2__))
#define TM_Q4_NIBBLES 1
struct Nibbles {
  __m128i lo, hi;  // weights 0..15, 16..31 of the block, one per byte
};

static TM_INLINE Nibbles load_nibbles(const uint8_t* q) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return {_mm_and_si128(b, mask), _mm_and_si128(_mm_srli_epi16(b, 4), mask)};
}

static TM_INLINE Vec q4_chunk(const Nibbles& h, int c) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c ? h.hi : h.lo)));
#else
  __m128i v = c >= 2 ? h.hi : h.lo;
  if (c & 1) v = _mm_unpackhi_epi64(v, v);  // weights 8..15 of the half
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)));
#endif
}
#else
static inline Vec q4_chunk(const uint8_t* q, int c) {
  float buf[kV];
  for (int64_t i = 0; i < kV; ++i) {
    const int64_t k = c * kV + i;  // weight k of the block
    buf[i] = static_cast<float>(k < 16 ? q[k] & 0x0F : q[k - 16] >> 4);
  }
  return Vec::loadu(buf);
}
#endif

// One row of W as the kernels read it: a dense row, or a row of quantized blocks.
struct WeightRows {
  int64_t kind, G, K;
  const float* dense;     // (N, K)
  const void* q;          // Q8_0 (N, K) int8, 4-bit (N, K/2) nibbles, GGUF raw block rows
  const at::Half* d;      // (N, K/32) or (N, K/G)
  const at::Half* m;      // 4-bit offsets (N, K/G)
  int64_t row_bytes = 0;  // GGUF kinds: bytes per row of raw blocks (linear_gguf.h)
};

// Kinds without row kernels of linear_rows.h (GGUF blocks in place, half-precision rows):
// the dot kernels read them at every M (GGUF blocks: on the portable build; SIMD builds
// take linear_gguf_rows.h), and expand them for embedding lookups.
constexpr bool dot_only_kind(int64_t kind) {
  return gguf_blocks::is_gguf_kind(kind) || half_rows::is_half_kind(kind);
}

// The kernels' view of a weight given as (kind, tensors) (linear_cpu.h describes them).
inline WeightRows weight_rows(int64_t kind, int64_t G, int64_t K,
                              const std::vector<torch::Tensor>& t) {
  return {kind, G, K, kind == 0 ? t[0].data_ptr<float>() : nullptr,
          kind == 0 ? nullptr : t[0].data_ptr(),
          kind == 0 || t.size() < 2 ? nullptr : t[1].data_ptr<at::Half>(),
          kind == 2 ? t[2].data_ptr<at::Half>() : nullptr,
          gguf_blocks::is_gguf_kind(kind) ? gguf_blocks::row_bytes(kind, K) : 0};
}

// f(std::integral_constant<int, KIND>) for a kind read block by block (quantized, GGUF,
// half-precision dense): the kernels are instantiated once per kind.
template <class F>
static inline void with_block_kind(int64_t kind, F&& f) {
  switch (kind) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
#define TM_GGUF_CASE(k) \
  case gguf_blocks::k: return f(std::integral_constant<int, gguf_blocks::k>{});
    TM_GGUF_KINDS(TM_GGUF_CASE)
#undef TM_GGUF_CASE
    case half_rows::kBF16: return f(std::integral_constant<int, half_rows::kBF16>{});
    case half_rows::kF16: return f(std::integral_constant<int, half_rows::kF16>{});
    default: TORCH_CHECK(false, "no dot kernel for weight kind ", kind);
  }
}

struct BlockState {  // one block of one row, ready to expand
  const void* q;
  Vec d, m;  // scale; offset (4-bit blocks only)
#ifdef TM_Q4_NIBBLES
  Nibbles nib;  // 4-bit blocks: the block's bytes, masked once
#endif
};

template <int KIND>
static TM_INLINE BlockState block_of(const WeightRows& w, int64_t n, int64_t b) {
  BlockState s;
  if constexpr (KIND == 1) {
    s.q = static_cast<const int8_t*>(w.q) + n * w.K + b * kBlock;
    s.d = Vec(half_to_float(w.d[n * (w.K / kBlock) + b]));
    return s;
  }
  const int64_t g = n * (w.K / w.G) + b * kBlock / w.G;
  const uint8_t* q = static_cast<const uint8_t*>(w.q) + n * (w.K / 2) + b * (kBlock / 2);
  s.q = q, s.d = Vec(half_to_float(w.d[g])), s.m = Vec(half_to_float(w.m[g]));
#ifdef TM_Q4_NIBBLES
  s.nib = load_nibbles(q);
#endif
  return s;
}

template <int KIND>
static TM_INLINE Vec expand(const BlockState& s, int c) {
  if constexpr (KIND == 1) return q8_chunk(static_cast<const int8_t*>(s.q), c) * s.d;
#ifdef TM_Q4_NIBBLES
  else return at::vec::fmadd(q4_chunk(s.nib, c), s.d, s.m);
#else
  else return at::vec::fmadd(q4_chunk(static_cast<const uint8_t*>(s.q), c), s.d, s.m);
#endif
}

// Block b of row n of any quantized kind, and its c-th vector of weights.
template <int KIND>
static TM_INLINE auto load_block(const WeightRows& w, int64_t n, int64_t b) {
  if constexpr (gguf_blocks::is_gguf_kind(KIND))
    return gguf_blocks::gguf_block<KIND>(static_cast<const uint8_t*>(w.q) + n * w.row_bytes, b);
  else if constexpr (half_rows::is_half_kind(KIND))
    return half_rows::half_block(w.q, w.K, n, b);
  else
    return block_of<KIND>(w, n, b);
}

template <int KIND, class B>
static TM_INLINE Vec weights_of(const B& s, int c) {
  if constexpr (gguf_blocks::is_gguf_kind(KIND)) return gguf_blocks::expand<KIND>(s, c);
  else if constexpr (half_rows::is_half_kind(KIND)) return half_rows::expand<KIND>(s, c);
  else return expand<KIND>(s, c);
}

// Rows [n0, n0 + rows) of a quantized W expanded into out (rows, K): w_n(j) exactly.
template <int KIND>
static void expand_rows_into(const WeightRows& w, int64_t n0, int64_t rows, float* out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < w.K / kBlock; ++b) {
      const auto s = load_block<KIND>(w, n0 + r, b);
      for (int c = 0; c < kChunks; ++c)
        weights_of<KIND>(s, c).store(out + r * w.K + b * kBlock + c * kV);
    }
}

// The same for any quantized kind (panels, embedding lookups).
static inline void expand_rows_any(const WeightRows& w, int64_t n0, int64_t rows, float* out) {
  with_block_kind(w.kind, [&](auto k) { expand_rows_into<decltype(k)::value>(w, n0, rows, out); });
}

// Loops over a tile's rows and chunks are unrolled, so that each accumulator is one register
// (left as loops, GCC kept a copy of all of them in memory, stored at every step: 4x slower).
#define TM_UNROLL _Pragma("GCC unroll 16")

// ---- tiles ----------------------------------------------------------------------------------
// acc[i][j] over the whole of K for rows x[i] (stride ldx) and W rows w[j] (float32 rows).
// (The operands of a step are held in registers on whichever side is smaller, the other
// loaded one vector at a time: the same FMAs, so the same sums.)
template <int MR, int NR>
static inline void dense_tile(const float* x, int64_t ldx, const float* const* w, int64_t K,
                              Vec (&acc)[MR][NR]) {
  for (int64_t k = 0; k + kV <= K; k += kV) {
    if constexpr (MR <= NR) {
      Vec xv[MR];
      TM_UNROLL
      for (int i = 0; i < MR; ++i) xv[i] = Vec::loadu(x + i * ldx + k);
      TM_UNROLL
      for (int j = 0; j < NR; ++j) {
        const Vec wv = Vec::loadu(w[j] + k);
        TM_UNROLL
        for (int i = 0; i < MR; ++i) acc[i][j] = at::vec::fmadd(xv[i], wv, acc[i][j]);
      }
    } else {
      Vec wv[NR];
      TM_UNROLL
      for (int j = 0; j < NR; ++j) wv[j] = Vec::loadu(w[j] + k);
      TM_UNROLL
      for (int i = 0; i < MR; ++i) {
        const Vec xv = Vec::loadu(x + i * ldx + k);
        TM_UNROLL
        for (int j = 0; j < NR; ++j) acc[i][j] = at::vec::fmadd(xv, wv[j], acc[i][j]);
      }
    }
  }
}

// The same for quantized rows n0 .. n0 + NR - 1, expanded in registers as they are read.
// AHEAD (stream_rows): half-precision rows ask for their lines half_rows::kAheadValues on
// (the last rows' lines ahead may lie past the weight: a prefetch never faults).
template <int KIND, int MR, int NR, bool AHEAD = false>
static inline void quant_tile(const float* x, int64_t ldx, const WeightRows& w, int64_t n0,
                              Vec (&acc)[MR][NR]) {
  for (int64_t b = 0; b < w.K / kBlock; ++b) {
    decltype(load_block<KIND>(w, 0, 0)) s[NR];
    TM_UNROLL
    for (int j = 0; j < NR; ++j) s[j] = load_block<KIND>(w, n0 + j, b);
    if constexpr (AHEAD && half_rows::is_half_kind(KIND)) {
      TM_UNROLL
      for (int j = 0; j < NR; ++j) prefetch_l2(s[j].p + half_rows::kAheadValues);
    }
    TM_UNROLL
    for (int c = 0; c < kChunks; ++c) {
      Vec wv[NR];
      TM_UNROLL
      for (int j = 0; j < NR; ++j) wv[j] = weights_of<KIND>(s[j], c);
      TM_UNROLL
      for (int i = 0; i < MR; ++i) {
        const Vec xv = Vec::loadu(x + i * ldx + b * kBlock + c * kV);
        TM_UNROLL
        for (int j = 0; j < NR; ++j) acc[i][j] = at::vec::fmadd(xv, wv[j], acc[i][j]);
      }
    }
  }
}

// y[i, n0 + j] from the accumulators: the fixed horizontal sum, a dense row's scalar tail
// (w_tail[j]: row j of W, or nullptr for quantized rows), the bias.
template <int MR, int NR>
static inline void store_tile(const Vec (&acc)[MR][NR], const float* x, int64_t ldx,
                              const float* const* w_tail, int64_t K, const float* bias,
                              int64_t n0, float* y, int64_t ldy) {
  const int64_t k0 = w_tail ? K / kV * kV : K;
  TM_UNROLL
  for (int i = 0; i < MR; ++i)
    TM_UNROLL
    for (int j = 0; j < NR; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t k = k0; k < K; ++k) s = std::fma(x[i * ldx + k], w_tail[j][k], s);
      y[i * ldy + n0 + j] = bias ? s + bias[n0 + j] : s;
    }
}

// MR rows of x (at x, stride K) times W rows [n0, n0 + NR): dense rows read from `dense`
// (W itself or an expanded panel whose row 0 is W's row `panel0`), else quantized in registers.
template <int MR, int NR, bool AHEAD = false>
static inline void tile(const float* x, const WeightRows& w, const float* dense,
                        int64_t panel0, int64_t n0, const float* bias, float* y, int64_t N) {
  Vec acc[MR][NR];
  TM_UNROLL
  for (int i = 0; i < MR; ++i)
    TM_UNROLL
    for (int j = 0; j < NR; ++j) acc[i][j] = Vec(0.f);
  const float* rows[NR];
  if (dense) {
    TM_UNROLL
    for (int j = 0; j < NR; ++j) rows[j] = dense + (n0 - panel0 + j) * w.K;
    dense_tile<MR, NR>(x, w.K, rows, w.K, acc);
  } else {  // a switch, not with_quant_kind: a lambda holding acc kept it in memory
    switch (w.kind) {
      case 1: quant_tile<1, MR, NR>(x, w.K, w, n0, acc); break;
      case 2: quant_tile<2, MR, NR>(x, w.K, w, n0, acc); break;
#define TM_GGUF_CASE(k) \
  case gguf_blocks::k: quant_tile<gguf_blocks::k, MR, NR>(x, w.K, w, n0, acc); break;
      TM_GGUF_KINDS(TM_GGUF_CASE)
#undef TM_GGUF_CASE
      case half_rows::kBF16:
        quant_tile<half_rows::kBF16, MR, NR, AHEAD>(x, w.K, w, n0, acc);
        break;
      default: quant_tile<half_rows::kF16, MR, NR, AHEAD>(x, w.K, w, n0, acc); break;
    }
  }
  store_tile<MR, NR>(acc, x, w.K, dense && w.kind == 0 ? rows : nullptr, w.K, bias, n0, y, N);
}

// MR rows of x times W rows [n0, n1): NR at a time, then one at a time.
template <int MR, int NR, bool AHEAD = false>
static void rows_times(const float* x, const WeightRows& w, const float* dense, int64_t panel0,
                       int64_t n0, int64_t n1, const float* bias, float* y, int64_t N) {
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) tile<MR, NR, AHEAD>(x, w, dense, panel0, n, bias, y, N);
  for (; n < n1; ++n) tile<MR, 1, AHEAD>(x, w, dense, panel0, n, bias, y, N);
}

// A step of mr <= kMR rows streaming W rows [n0, n1) from memory (dense W, or quantized rows
// expanded in registers).
template <int MR>
static void stream_rows(const float* x, const WeightRows& w, int64_t n0, int64_t n1,
                        const float* bias, float* y, int64_t N) {
  if (w.kind == 0)
    return rows_times<MR, small_nr(MR, false)>(x, w, w.dense, 0, n0, n1, bias, y, N);
  rows_times<MR, small_nr(MR, true), true>(x, w, nullptr, 0, n0, n1, bias, y, N);
}

// mr <= kMR rows of x times the float32 W rows [n0, n1) of `rows` (row 0 is W's row panel0).
template <int MR>
static void panel_rows(const float* x, const WeightRows& w, const float* rows, int64_t panel0,
                       int64_t n0, int64_t n1, const float* bias, float* y, int64_t N) {
  rows_times<MR, kGemmNR>(x, w, rows, panel0, n0, n1, bias, y, N);
}

// ---- the product ----------------------------------------------------------------------------
// Rows [n_begin, n_end) of y = x @ W^T (+ bias), on the calling thread (`linear` below); an
// output's sum does not depend on the range it is computed in.
inline void linear_range(const WeightRows& w, const float* x, int64_t M, int64_t N,
                         const float* bias, float* y, int64_t n_begin, int64_t n_end) {
  const int64_t K = w.K;
  switch (M <= kMR ? M : 0) {
    case 1: return stream_rows<1>(x, w, n_begin, n_end, bias, y, N);
    case 2: return stream_rows<2>(x, w, n_begin, n_end, bias, y, N);
    case 3: return stream_rows<3>(x, w, n_begin, n_end, bias, y, N);
    case 4: return stream_rows<4>(x, w, n_begin, n_end, bias, y, N);
    default: break;
  }
  std::unique_ptr<float[]> panel(w.kind == 0 ? nullptr : new float[kPanel * K]);
  for (int64_t m0 = 0; m0 < M; m0 += kMBlock) {
    const int64_t m1 = std::min(M, m0 + kMBlock);
    for (int64_t p0 = n_begin; p0 < n_end; p0 += kPanel) {
      const int64_t p1 = std::min(n_end, p0 + kPanel);
      const float* rows = w.dense;
      int64_t first = 0;
      if (w.kind != 0) {
        expand_rows_any(w, p0, p1 - p0, panel.get());
        rows = panel.get(), first = p0;
      }
      for (int64_t m = m0; m < m1; m += kMR) {
        const float* xm = x + m * K;
        float* ym = y + m * N;
        switch (std::min<int64_t>(kMR, m1 - m)) {
          case 1: panel_rows<1>(xm, w, rows, first, p0, p1, bias, ym, N); break;
          case 2: panel_rows<2>(xm, w, rows, first, p0, p1, bias, ym, N); break;
          case 3: panel_rows<3>(xm, w, rows, first, p0, p1, bias, ym, N); break;
          default: panel_rows<4>(xm, w, rows, first, p0, p1, bias, ym, N); break;
        }
      }
    }
  }
}

// y (M, N) = x (M, K) @ W^T (+ bias) in the order above. Threads take contiguous ranges of W's
// rows (each output is one thread's, whole); within a range, steps of at most kMR rows stream
// each weight row once for all of them (quantized blocks expanded in registers), larger steps
// go block by block of x, a panel of W (expanded once per block when quantized) at a time.
inline void linear(const WeightRows& w, const float* x, int64_t M, int64_t N,
                   const float* bias, float* y) {
  const int64_t threads = at::get_num_threads();
  const int64_t unit = M <= kMR ? 8 : kPanel;  // rows of W a thread's range is made of
  const int64_t units = (N + unit - 1) / unit;
  const int64_t grain = std::max<int64_t>(1, units / std::max<int64_t>(1, threads));
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    linear_range(w, x, M, N, bias, y, u0 * unit, std::min(N, u1 * unit));
  });
}

}  // namespace dot_form
