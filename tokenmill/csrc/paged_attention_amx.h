// Attention on the AMX tile unit (AMX-BF16) from a bfloat16 cache with heads of 64 or 128:
// on such CPUs every query row of every step takes this path (attend_keys hands it a work
// item's rows: paged_attention_tiles.h), so a row gets the same bits alone (a decode), among
// a prefill chunk's rows, under any chunking or after a prefix-cache hit.
//
// Per KV head, the item's (query row, query head) pairs are the columns j, up to 16 at a time:
//   qT: q rounded to bf16 (nearest even), as tdpbf16ps's B operand (pairs of d x columns)
//   sT (16 keys, j) = K . qT: K's rows are the A operand as they lie in the cache (16 keys
//     of one block, 64 bytes of each), tdpbf16ps over d in steps of 32, in d order
//   s (j, key) = scale * sT transposed; each row's online softmax over its own keys of the
//     tile (max, exp_u20, sum in registers), p = 0 past them
//   o (j, d) = p . V: V's rows are the B operand as they lie (16 keys x 32 d); p enters as
//     two A operands, (p, 0) and (0, p) per key, whose sums are o's even d and odd d
//   acc = fma(acc, corr, o)
// A tile's walk over an item's columns, in phases: paged_attention_amx_walk.h.
// Inside one tdpbf16ps the products reach an element's sum in the tile unit's own order, the
// same for every element of every tile, whatever the tiles' row and column counts
// (linear_bf16_amx.h). A tile's 16 keys not in one block, or past the tile's last key, are
// copied first (those past the last as zeros); a row's keys past its own have p = 0, and a
// zero product adds nothing: so a row's sums are the same whatever rows share its tiles.
//
// Against the float32 path (paged_attention_keys_t.h), q and p are rounded to bf16 (8 bits
// of mantissa), as the bf16 attention of vLLM and of flash attention does (q is bf16 there
// already); K and V are the cache's own values. benchmarks/quant_quality.py states the loss.
// Why (thirty-eighth session): with float32 FMAs (~120 GFLOP/s hot on two cores) a bf16
// prefill step's attention took as long as all of its GEMMs; here prefill chunks take
// 0.5-0.6x the time, decodes 0.85-1.0x (benchmarks/attention_kernel.py, RESULTS.md).
// TOKENMILL_AMX=0 turns the tile unit off for the GEMMs and this path alike.
#pragma once
#include "amx_tiles.h"
#include "vec_utils.h"
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <vector>

#if defined(TM_HAVE_AMX) && defined(__AVX512BW__)
#define TM_ATTENTION_AMX 1

namespace attention_amx {

constexpr int kCols = 16;       // columns (query row x query head) per tile
constexpr int64_t kKeys = 64;   // keys of a tile of the online softmax
constexpr int64_t kMaxD = 128;  // head sizes: 64 and 128

// Whether a bf16 cache with heads of D values is attended here: the CPU's AMX-BF16 and
// Linux's grant of the tile state (TOKENMILL_AMX=0 declines: amx_tiles.h).
inline bool applies(bool bf16, int64_t D) {
  return bf16 && (D == 64 || D == kMaxD) && amx::available(amx::kBF16);
}

// Per column count n (1-16): 0 K (16 keys x 32 d), 1 qT (16 pairs of d x n), 2 sT (16 keys
// x n), 3 and 4 p as (p, 0) and (0, p) (n x 16 keys), 5 V (16 keys x 32 d), 6 and 7 o's
// even and odd d (n x 16).
static std::array<amx::TileConfig, kCols + 1> tile_configs() {
  std::array<amx::TileConfig, kCols + 1> all{};
  for (int n = 1; n <= kCols; ++n) {
    amx::TileConfig& c = all[n];
    c.palette = 1;
    const int rows[8] = {16, 16, 16, n, n, 16, n, n};
    const int bytes[8] = {64, 4 * n, 4 * n, 64, 64, 64, 64, 64};
    for (int t = 0; t < 8; ++t) c.rows[t] = rows[t], c.colsb[t] = bytes[t];
  }
  return all;
}
static const std::array<amx::TileConfig, kCols + 1> kConfigs = tile_configs();

// A thread's tile configuration over a scope, loaded again only when the column count changes.
class Config {
 public:
  Config() = default;
  Config(const Config&) = delete;
  Config& operator=(const Config&) = delete;
  void cols(int64_t n) {
    if (n == cols_) return;
    asm volatile("ldtilecfg %0" ::"m"(kConfigs[n]) : "memory");
    cols_ = n;
  }
  ~Config() {
    if (cols_) asm volatile("tilerelease" ::: "memory");
  }

 private:
  int64_t cols_ = 0;
};

template <int C, int A, int B>  // tile C += tile A . tile B (bf16 pairs, float32 sums)
static TM_AMX_INLINE void dot() {
  asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
}

// qT for columns [0, n) (column j: the D floats at q[j]): qT[(dh * 16 + p) * n + j] = the
// bf16 pair (d = 32 dh + 2 p, d + 1) of column j as one 32-bit word (low half: d even).
static inline void q_tiles(const float* const* q, int64_t n, int64_t D, uint32_t* qT) {
  alignas(64) uint16_t row[kMaxD];
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t d = 0; d < D; d += 32)
      at::vec::convert_float_bfloat16(Vec::loadu(q[j] + d), Vec::loadu(q[j] + d + 16))
          .store(reinterpret_cast<c10::BFloat16*>(row + d));
    const uint32_t* words = reinterpret_cast<const uint32_t*>(row);
    for (int64_t w = 0; w < D / 2; ++w) qT[w * n + j] = words[w];
  }
}

// Where a tile's 16 keys [i0, i0 + 16) of one head lie: in place (consecutive rows of one
// block, all before the tile's end: rows `stride` bytes apart from the returned address), or
// copied into buf (D values each; keys at or past `keys` zero) with stride 2 D.
static inline const uint8_t* key_rows16(const uint8_t* base, const int64_t* rows, int64_t i0,
                                        int64_t keys, int64_t h, int64_t row_bytes,
                                        int64_t Hkv, int64_t D, uint16_t* buf,
                                        int64_t* stride) {
  if (i0 + 16 <= keys && rows[i0 + 15] == rows[i0] + 15 * Hkv) {
    *stride = Hkv * row_bytes;
    return base + (rows[i0] + h) * row_bytes;
  }
  for (int64_t i = 0; i < 16; ++i) {
    if (i0 + i < keys) std::copy_n(reinterpret_cast<const uint16_t*>(
                                       base + (rows[i0 + i] + h) * row_bytes), D, buf + i * D);
    else std::fill_n(buf + i * D, D, uint16_t{0});
  }
  *stride = 2 * D;
  return reinterpret_cast<const uint8_t*>(buf);
}

// Each row j < n's softmax over its own[j] keys of the tile, from its scaled scores s[j]
// (64 floats): the running max mx[j] and sum sum[j] updated, corr[j] the factor of its old
// sums (0 on its first tile); its p rounded to bf16 into pe / po (per 16 keys kb, n rows of
// 16 words: pe[(kb * n + j) * 16 + i] = p_(16 kb + i) in the low half, po in the high half).
// Rows with no keys here (own <= 0) get p = 0 and corr = 1.
static inline void softmax_rows(float* s, int64_t n, const int64_t* own, float* const* mx,
                                float* const* sum, float* corr, uint32_t* pe, uint32_t* po) {
  for (int64_t j = 0; j < n; ++j) {
    float* row = s + j * kKeys;
    __mmask16 valid[4];
    for (int v = 0; v < 4; ++v) {
      const int64_t left = std::clamp<int64_t>(own[j] - 16 * v, 0, 16);
      valid[v] = static_cast<__mmask16>((1u << left) - 1);
    }
    __m512 e[4];
    if (own[j] > 0) {
      const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      __m512 m = lowest;
      for (int v = 0; v < 4; ++v)
        m = _mm512_mask_max_ps(m, valid[v], m, _mm512_loadu_ps(row + 16 * v));
      const float top = std::max(*mx[j], _mm512_reduce_max_ps(m));
      corr[j] = std::exp(*mx[j] - top);
      const Vec tv(top);
      __m512 total = _mm512_setzero_ps();
      for (int v = 0; v < 4; ++v) {
        e[v] = _mm512_maskz_mov_ps(valid[v], (Vec(_mm512_loadu_ps(row + 16 * v)) - tv).exp_u20());
        total = _mm512_add_ps(total, e[v]);
      }
      *sum[j] = *sum[j] * corr[j] + _mm512_reduce_add_ps(total);
      *mx[j] = top;
    } else {
      for (int v = 0; v < 4; ++v) e[v] = _mm512_setzero_ps();
      corr[j] = 1.f;
    }
    for (int v = 0; v < 4; v += 2) {
      alignas(64) uint16_t b[32];
      at::vec::convert_float_bfloat16(Vec(e[v]), Vec(e[v + 1]))
          .store(reinterpret_cast<c10::BFloat16*>(b));
      for (int h = 0; h < 2; ++h) {
        const __m512i w = _mm512_cvtepu16_epi32(_mm256_load_si256(
            reinterpret_cast<const __m256i*>(b + 16 * h)));
        _mm512_storeu_si512(pe + ((v + h) * n + j) * 16, w);
        _mm512_storeu_si512(po + ((v + h) * n + j) * 16, _mm512_slli_epi32(w, 16));
      }
    }
  }
}

}  // namespace attention_amx
#endif
