// Weight kind 19 (Q4_K_TILES): GGUF Q4_K super-blocks packed once at load into tiles of 16
// rows (quantization/block_tiles.py `pack`) on AVX-512 VNNI builds, so that one vpdpbusd
// multiplies 4 weights of 16 rows by 4 bytes of x: each int32 lane is one output, and a
// sub-block's scale, a super-block's d and dmin meet 16 outputs in one vector op.
//
// Why: read as stored (linear_gguf_vnni.h), a row's super-block is widened to int16, its 8
// sub-block scales spread over the lanes and multiplied in (vpmovzxbw, vpshufb, vpmullw per 32
// weights) before the products, ~35 cycles a super-block on a Zen 4 core: one row of x read
// Q4_K at 17-20 GB/s on two cores where the memory gives 22-26, and Q4_K_M decode ran at
// 0.66x llama.cpp (which repacks these tensors the same way). Here a super-block of a row
// costs ~15 cycles (benchmarks/RESULTS.md, forty-seventh session).
//
// Layout: tensors = {q tiles (N / 16, K / 256, kBlockBytes) uint8}; block (g, sb) holds
// super-block sb of rows 16g .. 16g + 15:
//   [0, 2048)     the nibbles: byte (8j + c) * 64 + 4r + e = byte 32j + 4c + e of row r's
//                 qs (Q4_K's 128 bytes: its low nibble weight 64j + 4c + e of the super-block,
//                 in sub-block 2j; its high nibble weight 64j + 32 + 4c + e, sub-block 2j + 1)
//   [2048, 2176)  sc[s][r]: the 6-bit scale of sub-block s of row r, one byte each
//   [2176, 2304)  mn[s][r]: the 6-bit mins
//   [2304, 2336)  d[r] float16;   [2336, 2368) dmin[r] float16
// A permutation of the file's bytes, its packed 6-bit scales spread one a byte (unpack
// restores them bit for bit).
//
// Arithmetic, per row m of x and output n (a lane), x rounded as for kind 5 on these builds
// (linear_gguf_vnni.h round_rows: x16 per 256 values, x16 = 256 hi + lo, hi int8, lo uint8;
// S32 the exact sums of x16 over 32 values):
//   per super-block sb: fs = fm = 0; for s = 0..7:
//     P  = 256 sum_k q_k hi_k + sum_k q_k lo_k            (exact int32, k: sub-block s)
//     fs = fma(float(P), float(sc_s), fs);   fm = fma(float(mn_s), S32_s, fm)
//   acc = fma(fs, d dx, acc);   acc = fma(fm, dmin (-dx), acc);   y = acc (+ bias)
// Every operation is lane-wise (no sum across lanes), so each output's bits are the same at
// any M, rows of x beside it, tile of W or thread split (batch-invariant;
// tests/quantization/test_kquant_tiles.py). Against kind 5 the same rounding of x and the
// same products; the float32 sums differ (per sub-block here, per super-block there).
// |P| <= 32 * 15 * 32767 < 2^24: exact as a float.
#pragma once
#include "linear_gguf_vnni.h"
#include <memory>

namespace kquant_tiles {
constexpr int64_t kKind = 19;
constexpr int64_t kRows = 16, kSuper = 256;
constexpr int64_t kScOff = 2048, kMnOff = 2176, kDOff = 2304, kDminOff = 2336;
constexpr int64_t kBlockBytes = 2368;

inline bool is_kind(int64_t kind) { return kind == kKind; }

// Rows of W a packed weight has, and its K, from the tensor (N / 16, K / 256, kBlockBytes).
inline int64_t rows_of(const torch::Tensor& q) { return q.size(0) * kRows; }
inline int64_t k_of(const torch::Tensor& q) { return q.size(1) * kSuper; }

inline void check(const std::vector<torch::Tensor>& t, int64_t K) {
  TORCH_CHECK(t.size() == 1 && t[0].scalar_type() == torch::kUInt8 && t[0].dim() == 3 &&
              t[0].size(2) == kBlockBytes && t[0].is_contiguous() && t[0].device().is_cpu(),
              "weight kind 19 (Q4_K tiles): q tiles (N / 16, K / 256, 2368) uint8");
  TORCH_CHECK(k_of(t[0]) == K, "weight kind 19: K is ", k_of(t[0]), ", x has ", K);
}

// Row n of the weight as float32 (K values, gguf's dequantization: d sc q - dmin mn): an
// embedding lookup from a tied table.
inline void expand_row(const torch::Tensor& q, int64_t n, float* out) {
  const int64_t nsb = q.size(1), g = n / kRows, r = n % kRows;
  const uint8_t* base = q.data_ptr<uint8_t>() + g * nsb * kBlockBytes;
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* p = base + sb * kBlockBytes;
    const float d = gguf_blocks::half_at(p + kDOff + 2 * r);
    const float dmin = gguf_blocks::half_at(p + kDminOff + 2 * r);
    for (int s = 0; s < 8; ++s) {
      const float scale = d * static_cast<float>(p[kScOff + 16 * s + r]);
      const float offset = dmin * static_cast<float>(p[kMnOff + 16 * s + r]);
      for (int i = 0; i < 32; ++i) {  // weight i of sub-block s: chunk (8j + i / 4), byte i % 4
        const uint8_t byte = p[(8 * (s / 2) + i / 4) * 64 + 4 * r + i % 4];
        const int v = s % 2 ? byte >> 4 : byte & 15;
        out[sb * kSuper + 32 * s + i] = scale * static_cast<float>(v) - offset;
      }
    }
  }
}

#if defined(TOKENMILL_GGUF_VNNI)
#define TM_KT_INLINE inline __attribute__((always_inline))
// Super-blocks ahead a decode step asks for (4 and 8 read a 2048 x 8192 layer from memory
// at the same rate, 23.5-23.9 GB/s on two Zen 4 cores).
constexpr int64_t kAhead = 2;

// x as the products take it: x16's bytes apart, one dx per 256 values, S32 (exact floats).
struct Acts {
  int64_t K = 0;
  std::unique_ptr<int8_t[]> hi;   // (M, K) x16 >> 8
  std::unique_ptr<uint8_t[]> lo;  // (M, K) x16 & 255
  const float* dx = nullptr;      // (M, K / 256)
  const float* s32 = nullptr;     // (M, K / 32)
};

// From kind 5's rounding (shared with a merged layer's raw GGUF parts); `r` must outlive it.
inline Acts split(const gguf_vnni::Int16Rows& r, int64_t M) {
  TORCH_CHECK(r.XB == kSuper, "weight kind 19 needs K divisible by 256");
  Acts a;
  a.K = r.K;
  a.hi.reset(new int8_t[M * r.K]), a.lo.reset(new uint8_t[M * r.K]);
  auto run = [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i += 32) {
      const __m512i v = _mm512_loadu_si512(r.x.data() + i);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.hi.get() + i),
                          _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.lo.get() + i), _mm512_cvtepi16_epi8(v));
    }
  };
  if (M <= 8) {  // a decode step: not worth waking the thread pool
    run(0, M * r.K);
  } else {
    at::parallel_for(0, M * r.K / 32, 256, [&](int64_t b0, int64_t b1) { run(32 * b0, 32 * b1); });
  }
  a.dx = r.dx.data(), a.s32 = r.s32.data();
  return a;
}

static TM_KT_INLINE __m512i bcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Rows [m0, m0 + R) of x times the 16 outputs of group g (tiles q, nsb super-blocks) into
// y (row stride ldy, group g's first column at y + 16 g). `stream`: W is read once (a decode
// step): each super-block asks for the one kAhead ahead.
template <int R>
static void group_rows(const uint8_t* q, int64_t nsb, const Acts& a, int64_t m0, int64_t g,
                       const float* bias, float* y, int64_t ldy, bool stream) {
  const int64_t K = a.K;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* p = q + (g * nsb + sb) * kBlockBytes;
    __m512 fs[R], fm[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) fs[r] = fm[r] = _mm512_setzero_ps();
    for (int s = 0; s < 8; ++s) {
      // 37 lines a block: five of the one kAhead ahead each sub-block
      if (stream)
        for (int l = 5 * s; l < std::min(5 * s + 5, int{kBlockBytes / 64}); ++l)
          _mm_prefetch(reinterpret_cast<const char*>(p + kAhead * kBlockBytes + 64 * l),
                       _MM_HINT_T0);
      const uint8_t* chunks = p + 64 * 8 * (s / 2);
      const int64_t k0 = sb * kSuper + 32 * s;
      __m512i ph[R], pl[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) ph[r] = pl[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        const __m512i v = _mm512_loadu_si512(chunks + 64 * c);
        const __m512i w = s % 2 ? _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble)
                                : _mm512_and_si512(v, nibble);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const int64_t k = (m0 + r) * K + k0 + 4 * c;
          ph[r] = _mm512_dpbusd_epi32(ph[r], w, bcast4(a.hi.get() + k));
          pl[r] = _mm512_dpbusd_epi32(pl[r], bcast4(a.lo.get() + k), w);
        }
      }
      const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kScOff + 16 * s))));
      const __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kMnOff + 16 * s))));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512i P = _mm512_add_epi32(_mm512_slli_epi32(ph[r], 8), pl[r]);
        fs[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(P), sc, fs[r]);
        fm[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.s32[(m0 + r) * (K / 32) + sb * 8 + s]),
                                fm[r]);
      }
    }
    const __m512 d =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kDOff)));
    const __m512 dmin =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kDminOff)));
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const float dx = a.dx[(m0 + r) * (K / kSuper) + sb];
      acc[r] = _mm512_fmadd_ps(fs[r], _mm512_mul_ps(d, _mm512_set1_ps(dx)), acc[r]);
      acc[r] = _mm512_fmadd_ps(fm[r], _mm512_mul_ps(dmin, _mm512_set1_ps(-dx)), acc[r]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    float* yr = y + (m0 + r) * ldy + g * kRows;
    _mm512_storeu_ps(yr, bias ? _mm512_add_ps(acc[r], _mm512_loadu_ps(bias + g * kRows))
                              : acc[r]);
  }
}

// One weight of kind 19 as `linear_split` takes it: its tiles and y's first column for it.
struct Part {
  const uint8_t* q;
  int64_t groups;  // of 16 rows
  float* y;
};
inline Part part_of(const torch::Tensor& qt, float* y) {
  return {qt.data_ptr<uint8_t>(), qt.size(0), y};
}

// Each part's N columns of y (row stride ldy) = x @ W^T (+ bias, one part only), x already
// split (`split`): a merged layer's parts share one rounding and one parallel region, each
// writing its own columns (linear_cpu.h). Threads take contiguous ranges of all the parts'
// groups; a step of more rows takes x in blocks of ~512 KB (hi and lo) that stay in L2 while
// a group's tiles (K / 256 x 2368 bytes) meet all of them from L1.
inline void linear_split(const std::vector<Part>& parts, const Acts& a, int64_t M,
                         const float* bias, int64_t ldy) {
  const int64_t nsb = a.K / kSuper;
  int64_t total = 0;
  for (const Part& w : parts) total += w.groups;
  const bool stream = M <= 4;
  const int64_t xblock = x_block_rows(2 * a.K, 4, 1 << 19);
  auto run = [&](int64_t t0, int64_t t1) {  // groups [t0, t1) of all the parts
    for (int64_t m0 = 0; m0 < M; m0 += xblock) {
      const int64_t m1 = std::min(M, m0 + xblock);
      for (int64_t t = t0; t < t1; ++t) {
        size_t i = 0;
        int64_t g = t;  // part i's group g
        while (g >= parts[i].groups) g -= parts[i++].groups;
        const Part& w = parts[i];
        int64_t m = m0;
        for (; m + 4 <= m1; m += 4) group_rows<4>(w.q, nsb, a, m, g, bias, w.y, ldy, stream);
        switch (m1 - m) {
          case 1: group_rows<1>(w.q, nsb, a, m, g, bias, w.y, ldy, stream); break;
          case 2: group_rows<2>(w.q, nsb, a, m, g, bias, w.y, ldy, stream); break;
          case 3: group_rows<3>(w.q, nsb, a, m, g, bias, w.y, ldy, stream); break;
          default: break;
        }
      }
    }
  };
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  at::parallel_for(0, total, std::max<int64_t>(1, total / threads), run);
}

// y (M, N) = x @ W^T (+ bias), x (M, K) float32.
inline void linear(const torch::Tensor& qt, const float* xp, int64_t M, int64_t K,
                   const float* bias, float* y) {
  const gguf_vnni::Int16Rows r = gguf_vnni::round_rows(xp, M, K);
  linear_split({part_of(qt, y)}, split(r, M), M, bias, rows_of(qt));
}
#endif  // TOKENMILL_GGUF_VNNI

}  // namespace kquant_tiles
