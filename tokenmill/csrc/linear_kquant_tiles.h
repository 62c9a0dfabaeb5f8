// Weight kind 19 (Q4_K_TILES): GGUF Q4_K super-blocks packed once at load into tiles of 16
// rows (quantization/block_tiles.py `pack`) on the SIMD builds, so that 4 weights of 16 rows
// meet 4 values of x in one or two vector ops, each int32 lane one output, and a sub-block's
// scale, a super-block's d and dmin meet 8 or 16 outputs in one vector op.
//
// Why: read as stored (linear_gguf_vnni.h), a row's super-block is widened to int16 and its
// 8 sub-block scales spread over the lanes before the products, ~35 cycles a super-block on
// a Zen 4 core; packed, ~15 (1B Q4_K_M decode 0.66x -> 0.94x llama.cpp there). On AVX2
// (Zen 3, one core, from L2) a row's super-block takes 9-12 ns against the raw kernel's
// 15-18 (linear_gguf_rows.h); a decode step reads both at the memory's rate, 2-256 rows of x
// run 1.15-1.5x (benchmarks/RESULTS.md, forty-seventh and forty-eighth sessions).
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
// Arithmetic, per row m of x and output n (a lane), x rounded as for kind 5 (x16 per 256
// values, x16 = 256 hi + lo, hi int8, lo uint8; S32 the exact sums of x16 over 32 values;
// the same on both builds: linear_gguf_vnni.h round_rows, linear_gguf_rows.h split_rows):
//   per super-block sb: fs = fm = 0; for s = 0..7:
//     P  = 256 sum_k q_k hi_k + sum_k q_k lo_k            (exact int32, k: sub-block s)
//     fs = fma(float(P), float(sc_s), fs);   fm = fma(float(mn_s), S32_s, fm)
//   acc = fma(fs, d dx, acc);   acc = fma(fm, dmin (-dx), acc);   y = acc (+ bias)
// Every operation is lane-wise (no sum across lanes), so each output's bits are the same at
// any M, rows of x beside it, tile of W, thread split or build (batch-invariant;
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

#if defined(TOKENMILL_GGUF_ROWS)
#define TOKENMILL_KQUANT_TILES 1
#define TM_KT_INLINE inline __attribute__((always_inline))
// Super-blocks ahead a decode step asks for (4 and 8 read a 2048 x 8192 layer from memory
// at the same rate, 23.5-23.9 GB/s on two Zen 4 cores).
constexpr int64_t kAhead = 2;

// x as the products take it (views into a rounding that must outlive them): x16's bytes
// apart, one dx per 256 values, S32 (exact floats).
struct Acts {
  int64_t K = 0;
  const int8_t* hi = nullptr;   // (M, K) x16 >> 8
  const uint8_t* lo = nullptr;  // (M, K) x16 & 255
  const float* dx = nullptr;    // (M, K / 256)
  const float* s32 = nullptr;   // (M, K / 32)
  const int16_t* x16 = nullptr;  // AVX2 builds: (M, K) x16 in the order their products read
};

static TM_KT_INLINE int32_t load4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Asks for the five lines of sub-block s's share of the super-block kAhead after p.
static TM_KT_INLINE void prefetch_ahead(const uint8_t* p, int s) {
  for (int l = 5 * s; l < std::min(5 * s + 5, int{kBlockBytes / 64}); ++l)
    _mm_prefetch(reinterpret_cast<const char*>(p + kAhead * kBlockBytes + 64 * l), _MM_HINT_T0);
}
#endif

#if defined(TOKENMILL_GGUF_VNNI)
constexpr int kMaxRows = 4;  // rows of x a group's tiles meet at once

// x split from kind 5's rounding on these builds (shared with a merged layer's raw GGUF
// parts; `r` must outlive it): owns the bytes, `acts` views them.
struct SplitX {
  std::unique_ptr<int8_t[]> hi;
  std::unique_ptr<uint8_t[]> lo;
  Acts acts;
};

inline SplitX split(const gguf_vnni::Int16Rows& r, int64_t M) {
  TORCH_CHECK(r.XB == kSuper, "weight kind 19 needs K divisible by 256");
  SplitX a;
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
  a.acts = {r.K, a.hi.get(), a.lo.get(), r.dx.data(), r.s32.data()};
  return a;
}

static TM_KT_INLINE __m512i bcast4(const void* p) { return _mm512_set1_epi32(load4(p)); }

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
      if (stream) prefetch_ahead(p, s);
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
          ph[r] = _mm512_dpbusd_epi32(ph[r], w, bcast4(a.hi + k));
          pl[r] = _mm512_dpbusd_epi32(pl[r], bcast4(a.lo + k), w);
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

#elif defined(TOKENMILL_GGUF_ROWS)  // AVX2 (256-bit vectors, no vpdpbusd)
// Rows of x a group's tiles meet at once (four ran at the same rate from 4 to 256 rows).
constexpr int kMaxRows = 2;

// x as kind 5 rounds it on these builds (gguf_rows::split_rows), joined back into x16 in the
// order the products read it: per 4 values (k0, k2, k1, k3), so that one 32-bit broadcast
// meets the weights of k0 and k2 (or k1 and k3) of 8 rows in one vpmaddwd.
struct SplitX {
  AlignedVector<int16_t> x16;  // (M, K)
  Acts acts;
};

inline SplitX split(const gguf_rows::SplitRows& r, int64_t M) {
  TORCH_CHECK(r.XB == kSuper, "weight kind 19 needs K divisible by 256");
  SplitX a;
  a.x16.resize(M * r.K);
  auto run = [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i += 16) {
      const __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(r.hi.data() + i)));
      const __m256i lo = _mm256_cvtepu8_epi16(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(r.lo.data() + i)));
      const __m256i x = _mm256_or_si256(_mm256_slli_epi16(hi, 8), lo);
      constexpr int kOrder = _MM_SHUFFLE(3, 1, 2, 0);  // (0, 1, 2, 3) -> (0, 2, 1, 3)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.x16.data() + i),
                          _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(x, kOrder), kOrder));
    }
  };
  if (M <= 8) {  // a decode step: not worth waking the thread pool
    run(0, M * r.K);
  } else {
    at::parallel_for(0, M * r.K / 16, 512, [&](int64_t b0, int64_t b1) { run(16 * b0, 16 * b1); });
  }
  a.acts = {r.K, nullptr, nullptr, r.d.data(), r.s32.data(), a.x16.data()};
  return a;
}

static TM_KT_INLINE __m256i bcast_pair(const int16_t* p) { return _mm256_set1_epi32(load4(p)); }

// Half h of super-block p (rows 8h .. 8h + 7 of its group: bytes 32h .. 32h + 31 of each
// 64-byte chunk, 4 a row) times rows [m0, m0 + R) of x (super-block sb), into acc, in
// vpmaddwd: AVX2 has no vpdpbusd, and vpmaddubsw on x16's two bytes costs three multiplies
// per 32 weights where this takes two. Read as int16 lanes, a row's bytes (b0, b1 | b2, b3)
// give its four nibble pairs by masks: & 0x000F the low nibbles of k0, k2 (sub-block 2j),
// & 0x0F00 of k1, k3 times 256, & 0x00F0 the high nibbles of k0, k2 (sub-block 2j + 1) times
// 16, >> 12 those of k1, k3. Each meets its pair of x16 in one vpmaddwd into a row's int32
// lane, summed over the sub-block's 8 chunks exactly (the x256 sum, the largest, is at most
// 8 * 2 * 3840 * 32767 < 2^31), then scaled back by exact shifts: the same P as group_rows
// on VNNI, then the same lane-wise float32 operations in the same order, so the same bits.
template <int R>
static TM_KT_INLINE void half_superblock(const uint8_t* p, int h, const Acts& a, int64_t m0,
                                         int64_t sb, __m256 (&acc)[R]) {
  const int64_t K = a.K;
  const __m256i m000f = _mm256_set1_epi16(0x000F), m00f0 = _mm256_set1_epi16(0x00F0),
                m0f00 = _mm256_set1_epi16(0x0F00);
  __m256 fs[R], fm[R];
#pragma GCC unroll 2
  for (int r = 0; r < R; ++r) fs[r] = fm[r] = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {  // sub-blocks 2j (low nibbles) and 2j + 1 (high)
    const uint8_t* chunks = p + 64 * 8 * j + 32 * h;
    const int64_t k0 = sb * kSuper + 64 * j;
    __m256i pa[R], pb[R], pc[R], pd[R];
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) pa[r] = pb[r] = pc[r] = pd[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks + 64 * c));
      const __m256i qa = _mm256_and_si256(v, m000f), qb = _mm256_and_si256(v, m00f0),
                    qc = _mm256_and_si256(v, m0f00), qd = _mm256_srli_epi16(v, 12);
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) {
        const int16_t* x0 = a.x16 + (m0 + r) * K + k0 + 4 * c;  // sub-block 2j
        const int16_t* x1 = x0 + 32;                             // sub-block 2j + 1
        pa[r] = _mm256_add_epi32(pa[r], _mm256_madd_epi16(qa, bcast_pair(x0)));
        pc[r] = _mm256_add_epi32(pc[r], _mm256_madd_epi16(qc, bcast_pair(x0 + 2)));
        pb[r] = _mm256_add_epi32(pb[r], _mm256_madd_epi16(qb, bcast_pair(x1)));
        pd[r] = _mm256_add_epi32(pd[r], _mm256_madd_epi16(qd, bcast_pair(x1 + 2)));
        // GCC reassociates integer sums: it computed all 8 chunks' products first, spilled
        // them and summed them as a tree. This keeps each a running sum in its register.
        __asm__("" : "+x"(pa[r]), "+x"(pb[r]), "+x"(pc[r]), "+x"(pd[r]));
      }
    }
#pragma GCC unroll 2
    for (int t = 0; t < 2; ++t) {
      const int s = 2 * j + t;
      const int64_t at = 16 * s + 8 * h;
      const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + kScOff + at))));
      const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + kMnOff + at))));
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) {
        const __m256i P = t == 0 ? _mm256_add_epi32(pa[r], _mm256_srai_epi32(pc[r], 8))
                                 : _mm256_add_epi32(_mm256_srai_epi32(pb[r], 4), pd[r]);
        fs[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(P), sc, fs[r]);
        fm[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(a.s32[(m0 + r) * (K / 32) + sb * 8 + s]),
                                fm[r]);
      }
    }
  }
  const __m256 d = _mm256_cvtph_ps(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kDOff + 16 * h)));
  const __m256 dmin = _mm256_cvtph_ps(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kDminOff + 16 * h)));
#pragma GCC unroll 2
  for (int r = 0; r < R; ++r) {
    const float dx = a.dx[(m0 + r) * (K / kSuper) + sb];
    acc[r] = _mm256_fmadd_ps(fs[r], _mm256_mul_ps(d, _mm256_set1_ps(dx)), acc[r]);
    acc[r] = _mm256_fmadd_ps(fm[r], _mm256_mul_ps(dmin, _mm256_set1_ps(-dx)), acc[r]);
  }
}

// Rows [m0, m0 + R) of x times the 16 outputs of group g, as on VNNI: each super-block's
// two halves of 8 rows one after the other (the second reads its lines from L1).
template <int R>
static void group_rows(const uint8_t* q, int64_t nsb, const Acts& a, int64_t m0, int64_t g,
                       const float* bias, float* y, int64_t ldy, bool stream) {
  __m256 acc[2][R];
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < R; ++r) acc[h][r] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* p = q + (g * nsb + sb) * kBlockBytes;
    if (stream)  // (asking for them a sub-block at a time, or 4 or 8 ahead: the same rate)
      for (int s = 0; s < 8; ++s) prefetch_ahead(p, s);
    half_superblock<R>(p, 0, a, m0, sb, acc[0]);
    half_superblock<R>(p, 1, a, m0, sb, acc[1]);
  }
  for (int h = 0; h < 2; ++h) {
    const int64_t col = g * kRows + 8 * h;
    for (int r = 0; r < R; ++r) {
      float* yr = y + (m0 + r) * ldy + col;
      _mm256_storeu_ps(yr, bias ? _mm256_add_ps(acc[h][r], _mm256_loadu_ps(bias + col))
                                : acc[h][r]);
    }
  }
}
#endif

#if defined(TOKENMILL_KQUANT_TILES)
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
  const int64_t xblock = x_block_rows(2 * a.K, kMaxRows, 1 << 19);
  auto run = [&](int64_t t0, int64_t t1) {  // groups [t0, t1) of all the parts
    for (int64_t m0 = 0; m0 < M; m0 += xblock) {
      const int64_t m1 = std::min(M, m0 + xblock);
      for (int64_t t = t0; t < t1; ++t) {
        size_t i = 0;
        int64_t g = t;  // part i's group g
        while (g >= parts[i].groups) g -= parts[i++].groups;
        const Part& w = parts[i];
        int64_t m = m0;
        for (; m + kMaxRows <= m1; m += kMaxRows)
          group_rows<kMaxRows>(w.q, nsb, a, m, g, bias, w.y, ldy, stream);
        switch (m1 - m) {  // fewer than kMaxRows left
          case 1: group_rows<1>(w.q, nsb, a, m, g, bias, w.y, ldy, stream); break;
          case 2: group_rows<std::min(2, kMaxRows)>(w.q, nsb, a, m, g, bias, w.y, ldy, stream);
            break;
          case 3: group_rows<std::min(3, kMaxRows)>(w.q, nsb, a, m, g, bias, w.y, ldy, stream);
            break;
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
#if defined(TOKENMILL_GGUF_VNNI)
  const gguf_vnni::Int16Rows r = gguf_vnni::round_rows(xp, M, K);
  linear_split({part_of(qt, y)}, split(r, M).acts, M, bias, rows_of(qt));
#else
  const gguf_rows::SplitRows r = gguf_rows::split_rows(xp, M, K);
  linear_split({part_of(qt, y)}, split(r, M).acts, M, bias, rows_of(qt));
#endif
}
#endif  // TOKENMILL_KQUANT_TILES

}  // namespace kquant_tiles
