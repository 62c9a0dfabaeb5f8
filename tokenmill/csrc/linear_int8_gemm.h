// Batched products (prefill chunks, decode batches) of quantized weights with activations
// rounded to integers per 32-block: int8 (`int8_gemm`, `q4_int8_gemm_avx2`) or, for float
// activations, int16 (`int16_gemm`); included by linear_cpu.h, which dispatches to them.
//
// The math is the decode-sized kernels' (linear_int8_acts.h): x quantized per 32-block,
// each block's dot product an integer one, scaled by (weight scale x activation scale), the
// 4-bit offsets times the exact float group sums of x. Only the summation order differs.
//
// Speed (AVX-512 VNNI): a row-by-row dot product converts and scales its int32 sum once per
// 32 weights for every (row of x, row of W) pair, as much work as the multiply-adds. Here a
// thread repacks 16 rows of W at a time into vpdpbusd's layout, [block][4 bytes of k][16
// rows], so that one instruction adds 4 k-steps of 16 output rows for one row of x (that row's
// 4 bytes broadcast), and the int32 -> float scaling happens once per block for 16 outputs.
// The repack happens per call, in a thread-local buffer (the weight keeps one layout, shared
// with the decode kernels; the repack costs one pass over W, which M rows amortize): 16 rows'
// bytes transposed in registers, 16 dwords at a time, and their float16 scales (and 4-bit
// offsets) transposed likewise into vectors of 16 rows (`ScaleLanes`). Measured 2.3-2.7x
// oneDNN's prepacked float32 GEMM on SmolLM2's shapes at M = 64-256 (Zen 4, 2 threads); the
// in-register transposes made it 1.15-1.2x faster again at 64 rows and ~1.35x at 24 (they
// replaced per-row copies and 16-lane gathers, which had cost as much as ~20 rows of x).
// AVX2 builds have a GEMM for 4-bit weights only (below); otherwise they run the decode
// kernels four rows at a time (linear_cpu.h).
//
// vpdpbusd multiplies unsigned by signed bytes: Q8_0 weights are signed, so the activations
// enter as u8 (q + 128) and the block's 128 * sum(w) is subtracted (computed at repack);
// 4-bit weights are unsigned (0..15), so they are the u8 side and the activations stay s8.
#pragma once
#include "linear_int8_acts.h"
#include <cstring>
#include <memory>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(CPU_CAPABILITY_AVX512)
#define TOKENMILL_VNNI_GEMM 1
constexpr bool kVnniGemm = true;
#else
constexpr bool kVnniGemm = false;
#endif
#if !defined(TOKENMILL_VNNI_GEMM) && defined(__AVX2__) && defined(CPU_CAPABILITY_AVX2)
// AVX2 without VNNI: 4-bit weights only. A 4-bit x int8 vpmaddubsw pair is at most
// 15 * 127 * 2 = 3810, so a block's 8 results add up in int16 (30480 < 32767) and one
// vpmaddwd per block widens them: ~1.7x fewer instructions than float32 FMAs. Q8_0 weights
// cannot do that (127 * 127 * 2 per pair) and stay on the row kernels.
#define TOKENMILL_AVX2_Q4_GEMM 1
#endif

#if defined(TOKENMILL_VNNI_GEMM)

namespace int8_gemm_detail {
constexpr int kLanes = 16;  // output rows per repacked group (one zmm of int32 / float)
constexpr int kMR = 6;      // rows of x per micro-kernel call
// Per block of one group: the weights as chunks x 16 rows x 4 bytes (8 chunks of 4 bytes for
// 8-bit activations, 16 chunks of 2 int16 for 16-bit ones), then 16 int32 (minus the Q8_0
// offset correction). The rows' scales and 4-bit offsets are lanes of their own (ScaleLanes).
constexpr int64_t chunks(int bits) { return bits == 8 ? 8 : 16; }
constexpr int64_t weight_bytes(int bits) { return chunks(bits) * 64; }
constexpr int64_t block_bytes(int bits) { return weight_bytes(bits) + 64; }

// The weight's tensors as raw pointers (data_ptr<T>() checks cost more than a block's repack).
struct WeightPtrs {
  const uint8_t* q;  // Q8_0: int8 (N, K); 4-bit: nibbles (N, K/2)
  const at::Half* d;
  const at::Half* m;  // 4-bit offsets, else nullptr
};

// Columns [0, cols) of `rows` (<= 16) rows of a float16 matrix (row stride `stride`), from
// row n0, as float32 [cols rounded up to 16][16] (lane l: row n0 + l; missing rows 0).
static void rows_to_lanes(const at::Half* h, int64_t stride, int64_t n0, int64_t rows,
                          int64_t cols, float* out) {
  // the next 16 rows' (the next group this thread reads): a small stream beside W's
  const char* next = reinterpret_cast<const char*>(h + (n0 + kLanes) * stride);
  for (int64_t o = 0; o < kLanes * stride * 2; o += 64) _mm_prefetch(next + o, _MM_HINT_T0);
  for (int64_t c0 = 0; c0 < cols; c0 += 16) {
    const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(16, cols - c0)) - 1u);
    __m512 r[16];
    for (int l = 0; l < 16; ++l)
      r[l] = l < rows ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(
                            mask, reinterpret_cast<const uint16_t*>(h + (n0 + l) * stride + c0)))
                      : _mm512_setzero_ps();
    transpose16(r, [&](int c, __m512 v) { _mm512_store_ps(out + (c0 + c) * 16, v); });
  }
}

// A group's scales (and 4-bit offsets) as lanes, one vector per group of G weights.
struct ScaleLanes {
  int64_t padded = 0;  // vectors per array: K/G rounded up to 16
  std::unique_ptr<float[]> storage;
  float* d = nullptr;
  float* m = nullptr;

  explicit ScaleLanes(int64_t groups_k, bool offsets)
      : padded((groups_k + 15) / 16 * 16), storage(new float[2 * padded * kLanes + 16]) {
    d = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(storage.get()) + 63) & ~uintptr_t(63));
    m = offsets ? d + padded * kLanes : nullptr;
  }
  void fill(const WeightPtrs& wp, int64_t groups_k, int64_t n0, int64_t rows) {
    rows_to_lanes(wp.d, groups_k, n0, rows, groups_k, d);
    if (m) rows_to_lanes(wp.m, groups_k, n0, rows, groups_k, m);
  }
};

// Row n's 64 bytes of weights from block b (Q8_0: blocks b, b + 1 as stored; 4-bit: block b's
// and b + 1's nibbles as u8 in weight order; BITS 16: block b's 32 values as int16).
template <int KIND, int BITS>
static inline __m512 row_chunk(const WeightPtrs& wp, int64_t K, int64_t n, int64_t b, int count) {
  if constexpr (BITS == 16) {
    const __m256i v = KIND == 1
        ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp.q + n * K + b * kBlock))
        : nibbles_u8(wp.q + n * (K / 2) + b * (kBlock / 2));
    return _mm512_castsi512_ps(KIND == 1 ? _mm512_cvtepi8_epi16(v) : _mm512_cvtepu8_epi16(v));
  } else if constexpr (KIND == 1) {
    const __mmask64 k = count == 2 ? ~0ull : 0xFFFFFFFFull;
    return _mm512_castsi512_ps(_mm512_maskz_loadu_epi8(k, wp.q + n * K + b * kBlock));
  } else {
    const uint8_t* q = wp.q + n * (K / 2) + b * (kBlock / 2);
    const __m256i hi = count == 2 ? nibbles_u8(q + kBlock / 2) : _mm256_setzero_si256();
    return _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(nibbles_u8(q)), hi, 1));
  }
}

// Rows [n0, n0 + rows) of W (rows <= 16; missing rows are zeros) into `buf`: 16 rows' bytes
// transposed in registers, 16 dwords (two 8-bit blocks, or one 16-bit block) at a time.
template <int KIND, int BITS>
static void repack_rows(const WeightPtrs& wp, int64_t K, int64_t n0, int64_t rows,
                        uint8_t* buf) {
  const int64_t nb = K / kBlock;
  constexpr int64_t kW = weight_bytes(BITS), kB = block_bytes(BITS);
  constexpr int64_t step = BITS == 8 ? 2 : 1;  // blocks per transpose
  const __m512i c128 = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < nb; b += step) {
    const int count = static_cast<int>(std::min<int64_t>(step, nb - b));
    __m512 r[16];
    for (int l = 0; l < 16; ++l)
      r[l] = l < rows ? row_chunk<KIND, BITS>(wp, K, n0 + l, b, count) : _mm512_setzero_ps();
    transpose16(r, [&](int c, __m512 v) {
      const int64_t blk = b + c / chunks(BITS);
      if (blk < nb)
        _mm512_store_ps(reinterpret_cast<float*>(buf + blk * kB + (c % chunks(BITS)) * 64), v);
    });
    for (int64_t blk = b; blk < b + count; ++blk) {
      __m512i comp = _mm512_setzero_si512();  // Q8_0 x u8: 128 * sum(w) per row
      if (KIND == 1 && BITS == 8)
        for (int c = 0; c < 8; ++c)
          comp = _mm512_dpbusd_epi32(comp, c128, _mm512_load_si512(buf + blk * kB + c * 64));
      _mm512_store_si512(buf + blk * kB + kW, _mm512_sub_epi32(_mm512_setzero_si512(), comp));
    }
  }
}

// y[m0 + i, n0 + 16 j + l] for i < MR, j < NT groups; `valid` rows in the last group.
// xa: activations as BITS-bit integers: int16, or bytes, signed (4-bit weights) or
// offset-unsigned (Q8_0 weights).
template <int KIND, int BITS, int MR, int NT>
static void micro(int64_t bpg, const uint8_t* xa, const float* dx,
                  const float* xsum, const uint8_t* buf, int64_t group_bytes,
                  const ScaleLanes* lanes, float* y, const float* bias, int64_t K,
                  int64_t N, int64_t m0, int64_t n0, int valid) {
  constexpr int64_t kW = weight_bytes(BITS), kB = block_bytes(BITS), kX = BITS / 8;
  const int64_t nb = K / kBlock, ng = nb / bpg;
  __m512 acc[MR][NT];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk[NT];
    for (int j = 0; j < NT; ++j) blk[j] = buf + j * group_bytes + b * kB;
    __m512i s[MR][NT];
    for (int j = 0; j < NT; ++j) {
      const __m512i init = _mm512_load_si512(blk[j] + kW);  // 0 but for Q8_0 x u8
      for (int i = 0; i < MR; ++i) s[i][j] = init;
    }
    for (int c = 0; c < chunks(BITS); ++c) {
      __m512i w[NT];
      for (int j = 0; j < NT; ++j) w[j] = _mm512_load_si512(blk[j] + c * 64);
      for (int i = 0; i < MR; ++i) {
        int32_t four;  // 4 bytes of x: 4 int8 or 2 int16 values
        std::memcpy(&four, xa + ((m0 + i) * K + b * kBlock) * kX + 4 * c, 4);
        const __m512i xb = _mm512_set1_epi32(four);
        for (int j = 0; j < NT; ++j)
          s[i][j] = BITS == 16  ? _mm512_dpwssd_epi32(s[i][j], xb, w[j])
                    : KIND == 1 ? _mm512_dpbusd_epi32(s[i][j], xb, w[j])
                                : _mm512_dpbusd_epi32(s[i][j], w[j], xb);
      }
    }
    const bool group_end = KIND == 2 && (b + 1) % bpg == 0;
    for (int j = 0; j < NT; ++j) {
      const __m512 dw = _mm512_load_ps(lanes[j].d + (b / bpg) * kLanes);
      const __m512 mw = KIND == 2 ? _mm512_load_ps(lanes[j].m + (b / bpg) * kLanes)
                                  : _mm512_setzero_ps();
      for (int i = 0; i < MR; ++i) {
        const __m512 sc = _mm512_mul_ps(dw, _mm512_set1_ps(dx[(m0 + i) * nb + b]));
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i][j]), sc, acc[i][j]);
        if (group_end)
          acc[i][j] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xsum[(m0 + i) * ng + b / bpg]),
                                      acc[i][j]);
      }
    }
  }
  for (int j = 0; j < NT; ++j) {
    const int lanes = j == NT - 1 ? valid : kLanes;
    const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1u);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0 + 16 * j) : _mm512_setzero_ps();
    for (int i = 0; i < MR; ++i)
      _mm512_mask_storeu_ps(y + (m0 + i) * N + n0 + 16 * j, mask, _mm512_add_ps(acc[i][j], bv));
  }
}

template <int KIND, int BITS, int NT>
static void rows_of_x(int64_t bpg, const uint8_t* xa, const float* dx,
                      const float* xsum, const uint8_t* buf, int64_t group_bytes,
                      const ScaleLanes* lanes, float* y, const float* bias, int64_t K,
                      int64_t M, int64_t N, int64_t n0, int valid) {
  int64_t m = 0;
  for (; m + kMR <= M; m += kMR)
    micro<KIND, BITS, kMR, NT>(bpg, xa, dx, xsum, buf, group_bytes, lanes, y, bias, K, N, m, n0,
                               valid);
  switch (M - m) {
#define TM_TAIL(R) \
  case R: micro<KIND, BITS, R, NT>(bpg, xa, dx, xsum, buf, group_bytes, lanes, y, bias, K, N, m, n0, valid); break;
    TM_TAIL(1) TM_TAIL(2) TM_TAIL(3) TM_TAIL(4) TM_TAIL(5)
#undef TM_TAIL
    default: break;
  }
}

// y (M, N) = x @ W^T (+ bias) for a quantized weight, x given as BITS-bit integers xa with
// one scale per 32-block (dx (M, K/32)); xsum (M, K/G): float group sums of x for 4-bit
// weights (else nullptr).
static void gemm(int64_t kind, int64_t G, const std::vector<torch::Tensor>& t,
                 const uint8_t* xa, const float* dx, int bits, const float* xsum,
                 const float* bias, float* y, int64_t M, int64_t K, int64_t N) {
  const WeightPtrs wp{static_cast<const uint8_t*>(t[0].data_ptr()),
                      t[1].data_ptr<at::Half>(), kind == 2 ? t[2].data_ptr<at::Half>() : nullptr};
  const int64_t groups = (N + kLanes - 1) / kLanes;
  const int64_t group_bytes = (K / kBlock) * block_bytes(bits);
  const int64_t bpg = kind == 2 ? G / kBlock : 1;
  const int64_t groups_k = K / kBlock / bpg;
  const auto repack = kind == 1 ? (bits == 8 ? repack_rows<1, 8> : repack_rows<1, 16>)
                                : (bits == 8 ? repack_rows<2, 8> : repack_rows<2, 16>);
  at::parallel_for(0, (groups + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
    // pairs of groups (32 rows) per micro-kernel; the last pair may hold one group
    auto storage = std::make_unique<uint8_t[]>(2 * group_bytes + 64);
    uint8_t* buf = reinterpret_cast<uint8_t*>(
        (reinterpret_cast<uintptr_t>(storage.get()) + 63) & ~uintptr_t(63));
    ScaleLanes lanes[2] = {ScaleLanes(groups_k, kind == 2), ScaleLanes(groups_k, kind == 2)};
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * 2 * kLanes;
      const int64_t rows = std::min<int64_t>(2 * kLanes, N - n0);
      const int nt = rows > kLanes ? 2 : 1;
      for (int j = 0; j < nt; ++j) {
        const int64_t nj = n0 + j * kLanes, rj = std::min<int64_t>(kLanes, rows - j * kLanes);
        lanes[j].fill(wp, groups_k, nj, rj);
        repack(wp, K, nj, rj, buf + j * group_bytes);
      }
      const int v = static_cast<int>(rows - (nt - 1) * kLanes);  // valid rows, last group
      const int variant = (kind == 1 ? 0 : 4) + (bits == 16 ? 2 : 0) + (nt == 2 ? 1 : 0);
      switch (variant) {
#define TM_CASE(I, KIND, BITS, NT)                                                          \
  case I:                                                                                   \
    rows_of_x<KIND, BITS, NT>(bpg, xa, dx, xsum, buf, group_bytes, lanes, y, bias, K, M, N, \
                              n0, v);                                                       \
    break;
        TM_CASE(0, 1, 8, 1) TM_CASE(1, 1, 8, 2) TM_CASE(2, 1, 16, 1) TM_CASE(3, 1, 16, 2)
        TM_CASE(4, 2, 8, 1) TM_CASE(5, 2, 8, 2) TM_CASE(6, 2, 16, 1) TM_CASE(7, 2, 16, 2)
#undef TM_CASE
      }
    }
  });
}
}  // namespace int8_gemm_detail

// int8 activations (xr, as linear_int8_acts.h quantizes them).
static void int8_gemm(int64_t kind, int64_t G, const std::vector<torch::Tensor>& t,
                      const QuantizedRows& xr, const float* xsum, const float* bias, float* y,
                      int64_t M, int64_t K, int64_t N) {
  std::vector<uint8_t> flipped;  // Q8_0: activations as u8 (q + 128)
  const uint8_t* xa = reinterpret_cast<const uint8_t*>(xr.q.data());
  if (kind == 1) {
    flipped.resize(xr.q.size());
    for (size_t i = 0; i < flipped.size(); ++i)
      flipped[i] = static_cast<uint8_t>(xr.q[i]) ^ 0x80;
    xa = flipped.data();
  }
  int8_gemm_detail::gemm(kind, G, t, xa, xr.d.data(), 8, xsum, bias, y, M, K, N);
}

// Float activations, rounded to int16 per 32-block (dx = amax / 32767: a relative error of
// at most 1.5e-5 of the block's largest value, against 4e-3 for int8) so that the products
// are vpdpwssd's integer ones: half vpdpbusd's rate, still above float32 FMAs.
static void int16_gemm(int64_t kind, int64_t G, const std::vector<torch::Tensor>& t,
                       const float* x, const float* xsum, const float* bias, float* y,
                       int64_t M, int64_t K, int64_t N) {
  std::vector<int16_t> xq(M * K);
  std::vector<float> dx(M * K / kBlock);
  quantize_blocks(x, M, K, xq.data(), dx.data());
  int8_gemm_detail::gemm(kind, G, t, reinterpret_cast<const uint8_t*>(xq.data()), dx.data(),
                         16, xsum, bias, y, M, K, N);
}
#endif

#if defined(TOKENMILL_AVX2_Q4_GEMM)
namespace q4_avx2_detail {
constexpr int kLanes = 8;   // output rows per repacked group (one ymm)
constexpr int kMR = 6;      // rows of x per micro-kernel call (6 x 2 of the 16 ymm registers)
// Per block of one group: 8 chunks x 8 rows x 4 weights (u8, 0..15), 8 float scales, 8 offsets.
constexpr int64_t kWeightBytes = 8 * 32;
constexpr int64_t kBlockBytes = kWeightBytes + 2 * 32;

static void repack(const uint8_t* Q, const at::Half* D, const at::Half* Mn, int64_t K,
                   int64_t G, int64_t n0, int64_t rows, uint8_t* buf) {
  const int64_t nb = K / kBlock;
  alignas(32) uint8_t block[kLanes][kBlock];
  if (rows < kLanes) std::memset(block, 0, sizeof(block));
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* o = buf + b * kBlockBytes;
    float* scale = reinterpret_cast<float*>(o + kWeightBytes);
    float* offset = reinterpret_cast<float*>(o + kWeightBytes + 32);
    for (int l = 0; l < kLanes; ++l) {
      if (l >= rows) {
        scale[l] = offset[l] = 0.f;
        continue;
      }
      const int64_t n = n0 + l;
      _mm256_store_si256(reinterpret_cast<__m256i*>(block[l]),
                         nibbles_u8(Q + n * (K / 2) + b * (kBlock / 2)));
      const int64_t g = n * (K / G) + b * kBlock / G;
      scale[l] = half_to_float(D[g]);
      offset[l] = half_to_float(Mn[g]);
    }
    for (int c = 0; c < 8; ++c)  // [chunk][row][4 weights]
      for (int l = 0; l < kLanes; ++l) std::memcpy(o + c * 32 + l * 4, block[l] + 4 * c, 4);
  }
}

template <int MR>
static void micro(int64_t bpg, const int8_t* xq, const float* dx, const float* xsum,
                  const uint8_t* buf, float* y, const float* bias, int64_t K, int64_t N,
                  int64_t m0, int64_t n0, int valid) {
  const int64_t nb = K / kBlock, ng = nb / bpg;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = buf + b * kBlockBytes;
    __m256i s[MR];
    for (int i = 0; i < MR; ++i) s[i] = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      const __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i*>(blk + c * 32));
      for (int i = 0; i < MR; ++i) {
        int32_t four;
        std::memcpy(&four, xq + (m0 + i) * K + b * kBlock + 4 * c, 4);
        s[i] = _mm256_add_epi16(s[i], _mm256_maddubs_epi16(w, _mm256_set1_epi32(four)));
      }
    }
    const __m256 dw = _mm256_load_ps(reinterpret_cast<const float*>(blk + kWeightBytes));
    const bool group_end = (b + 1) % bpg == 0;
    const __m256 mw = _mm256_load_ps(reinterpret_cast<const float*>(blk + kWeightBytes + 32));
    for (int i = 0; i < MR; ++i) {
      const __m256 sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[i], ones));
      acc[i] = _mm256_fmadd_ps(sum, _mm256_mul_ps(dw, _mm256_set1_ps(dx[(m0 + i) * nb + b])),
                               acc[i]);
      if (group_end)
        acc[i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xsum[(m0 + i) * ng + b / bpg]), acc[i]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    alignas(32) float out[kLanes];
    _mm256_store_ps(out, acc[i]);
    for (int l = 0; l < valid; ++l)
      y[(m0 + i) * N + n0 + l] = out[l] + (bias ? bias[n0 + l] : 0.f);
  }
}
}  // namespace q4_avx2_detail

// 4-bit weights (kind 2) x int8 activations (xr), M rows: the AVX2 counterpart of int8_gemm.
static void q4_int8_gemm_avx2(int64_t G, const std::vector<torch::Tensor>& t,
                              const QuantizedRows& xr, const float* xsum, const float* bias,
                              float* y, int64_t M, int64_t K, int64_t N) {
  using namespace q4_avx2_detail;
  const uint8_t* Q = t[0].data_ptr<uint8_t>();
  const at::Half* D = t[1].data_ptr<at::Half>();
  const at::Half* Mn = t[2].data_ptr<at::Half>();
  const int64_t groups = (N + kLanes - 1) / kLanes, bpg = G / kBlock;
  const int64_t group_bytes = (K / kBlock) * kBlockBytes;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    auto storage = std::make_unique<uint8_t[]>(group_bytes + 32);
    uint8_t* buf = reinterpret_cast<uint8_t*>(
        (reinterpret_cast<uintptr_t>(storage.get()) + 31) & ~uintptr_t(31));
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * kLanes;
      const int valid = static_cast<int>(std::min<int64_t>(kLanes, N - n0));
      repack(Q, D, Mn, K, G, n0, valid, buf);
      int64_t m = 0;
      for (; m + kMR <= M; m += kMR)
        micro<kMR>(bpg, xr.q.data(), xr.d.data(), xsum, buf, y, bias, K, N, m, n0, valid);
      switch (M - m) {
#define TM_TAIL(R) \
  case R: micro<R>(bpg, xr.q.data(), xr.d.data(), xsum, buf, y, bias, K, N, m, n0, valid); break;
        TM_TAIL(1) TM_TAIL(2) TM_TAIL(3) TM_TAIL(4) TM_TAIL(5)
#undef TM_TAIL
        default: break;
      }
    }
  });
}
#endif
