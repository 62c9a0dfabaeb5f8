// Weight kind 19 (Q4_K tiles): a product over the tiles' groups (layout and arithmetic:
// linear_kquant_tiles_layout.h; the kernels: linear_kquant_tiles_vnni.h on AVX-512 VNNI,
// linear_kquant_tiles_avx2.h on AVX2), a merged layer's packed parts in one parallel region.
#pragma once
#include "linear_kquant_tiles_avx2.h"
#include "linear_kquant_tiles_vnni.h"

namespace kquant_tiles {
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

// Every part's groups times the M rows of x, in one parallel region: threads take contiguous
// ranges of all the parts' groups; a step of more rows takes x in blocks of ~512 KB (hi and
// lo) that stay in L2 while a group's tiles meet all of them from L1. rows(part, g, m, R):
// rows [m, m + R) of x (R a std::integral_constant, 1 .. kMax) times group g of part.
// (Shared by the Q4_K and Q6_K tiles: linear_q6k_tiles.h.)
template <int kMax, class Rows>
inline void for_each_group(const std::vector<Part>& parts, int64_t M, int64_t K,
                           const Rows& rows) {
  int64_t total = 0;
  for (const Part& w : parts) total += w.groups;
  const int64_t xblock = x_block_rows(2 * K, kMax, 1 << 19);
  auto run = [&](int64_t t0, int64_t t1) {  // groups [t0, t1) of all the parts
    for (int64_t m0 = 0; m0 < M; m0 += xblock) {
      const int64_t m1 = std::min(M, m0 + xblock);
      for (int64_t t = t0; t < t1; ++t) {
        size_t i = 0;
        int64_t g = t;  // part i's group g
        while (g >= parts[i].groups) g -= parts[i++].groups;
        for (int64_t m = m0; m < m1; m += kMax)
          with_group_size<kMax>(std::min<int64_t>(kMax, m1 - m),
                                [&](auto R) { rows(parts[i], g, m, R); });
      }
    }
  };
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  at::parallel_for(0, total, std::max<int64_t>(1, total / threads), run);
}

// Each part's N columns of y (row stride ldy) = x @ W^T (+ bias, one part only), x already
// split (`split`): a merged layer's parts share one rounding and one parallel region, each
// writing its own columns (linear_cpu.h); a group's tiles are K / 256 x 2368 bytes.
inline void linear_split(const std::vector<Part>& parts, const Acts& a, int64_t M,
                         const float* bias, int64_t ldy) {
  const int64_t nsb = a.K / kSuper;
  const bool stream = M <= 4;
  for_each_group<kMaxRows>(parts, M, a.K, [&](const Part& w, int64_t g, int64_t m, auto R) {
    group_rows<decltype(R)::value>(w.q, nsb, a, m, g, bias, w.y, ldy, stream);
  });
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
