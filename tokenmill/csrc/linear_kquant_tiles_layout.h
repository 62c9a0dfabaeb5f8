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

// A packed K-quant weight (kind 19 here, 20 in linear_q6k_tiles.h): one contiguous CPU
// tensor (N / 16, K / 256, bytes) uint8 for x's K.
inline void check_tiles(const std::vector<torch::Tensor>& t, int64_t K, int64_t kind,
                        int64_t bytes, const char* type) {
  TORCH_CHECK(t.size() == 1 && t[0].scalar_type() == torch::kUInt8 && t[0].dim() == 3 &&
              t[0].size(2) == bytes && t[0].is_contiguous() && t[0].device().is_cpu(),
              "weight kind ", kind, " (", type, " tiles): q tiles (N / 16, K / 256, ", bytes,
              ") uint8");
  TORCH_CHECK(k_of(t[0]) == K, "weight kind ", kind, ": K is ", k_of(t[0]), ", x has ", K);
}
inline void check(const std::vector<torch::Tensor>& t, int64_t K) {
  check_tiles(t, K, kKind, kBlockBytes, "Q4_K");
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
// Super-blocks ahead a decode step asks for, into L2 (prefetcht1). Into L1 (prefetcht0, at
// 2 ahead until the fifty-second session) a 1B Q4_K_M decode step ran 10-14% slower on Zen 4:
// prefetches to L1 hold its few miss buffers, which the loads need too; 1 ahead into L2 was
// slower still, 2-6 within noise (benchmarks/RESULTS.md).
constexpr int64_t kAhead = 3;

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

// Asks for the five lines of sub-block s's share of the super-block kAhead after p, into L2.
static TM_KT_INLINE void prefetch_ahead(const uint8_t* p, int s) {
  for (int l = 5 * s; l < std::min(5 * s + 5, int{kBlockBytes / 64}); ++l)
    prefetch_l2(p + kAhead * kBlockBytes + 64 * l);
}
#endif

}  // namespace kquant_tiles
