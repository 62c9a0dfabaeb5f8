// Linear layers on CPU, one entry point for every weight format: y = x @ W^T (+ bias).
//
// A layer's weight is described by (kind, group, tensors), built by its quantization method
// object (tokenmill/quantization/, `CPULinearKernel`); the modules' forward and the fused
// decode call (decode_layers_cpu.cpp) both call `linear` with it, so a format is written once.
//
//   kind 0  dense float32      tensors = {W (N, K) float32}
//   kind 1  Q8_0 blocks        tensors = {q (N, K) int8, d (N, K/32) float16}
//                              w[n, k] = d[n, k/32] * q[n, k]
//   kind 2  4-bit groups       tensors = {q (N, K/2) uint8, d (N, K/G) float16,
//                                         m (N, K/G) float16}
//                              w[n, k] = d[n, k/G] * q4[n, k] + m[n, k/G]
//           Within each 32 weights (16 bytes), byte j holds weight j in its low nibble and
//           weight j + 16 in its high nibble: llama.cpp's Q4_0 / Q4_1 block order, so GGUF
//           blocks are used bit for bit. G is a multiple of 32 (GGUF 32, AWQ / GPTQ 128).
//   kind 3-7, 11-14 GGUF Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, Q3_K, Q2_K, IQ4_XS, IQ4_NL as the
//                              file stores them:
//                              tensors = {raw block rows (N, K / QK * block bytes) uint8}
//                              (linear_gguf.h); at every M, the integer row kernels of
//                              linear_gguf_rows.h (x rounded to int16) on AVX2 builds,
//                              linear_gguf_vnni.h on AVX-512 VNNI ones, the dot kernels
//                              (exact float32) on the portable one; with int8
//                              activations (Q2_K .. Q6_K, SIMD builds) linear_gguf_int8.h
//   kind 8-9 dense bfloat16 / float16: tensors = {W (N, K)}, widened to float32 in
//                              registers by the dot kernels at every M (linear_half.h)
//   kind 10  dense bfloat16 multiplied in bfloat16: tensors = {W (N, K) bfloat16}; x
//                              rounded to bfloat16, vdpbf16ps's products and float32 sums
//                              at every M (linear_bf16.h; emulated without AVX512-BF16)
//   kind 15  parts             a merged layer (qkv, gate_up) whose parts differ in kind:
//                              tensors = {meta (P, 3) int64: kind, group, tensor count of
//                              each part; then each part's tensors}; y = their outputs side
//                              by side
//   kind 16  kind 10's W packed for AMX tiles at load (where the CPU has AMX-BF16):
//                              tensors = {W tiles (N / 16, K / 2, 16, 2) bfloat16}; x
//                              rounded to bfloat16, tdpbf16ps's products and float32 sums
//                              at every M (linear_bf16_amx.h)
//   kind 17, 18  kinds 1 and 2 packed at load into tiles of 16 rows (AVX-512 VNNI builds;
//                              multiplied on AMX-INT8 where the CPU has it):
//                              tensors = {q tiles (N / 16, K / 32, 512 int8 | 256 uint8),
//                                         d (, m) (N / 16, K / G, 16) float16}; x rounded
//                              per 32-block as for kinds 1 and 2 (int16, or int8 with int8
//                              activations), exact int32 block sums, one arithmetic at every
//                              M (linear_block_tiles.h)
//   kind 19  kind 5's Q4_K super-blocks packed at load into tiles of 16 rows (AVX2 and
//                              AVX-512 builds): tensors = {q tiles (N / 16, K / 256, 2368) uint8};
//                              x rounded as for kind 5, one arithmetic at every M
//                              (linear_kquant_tiles.h)
//
// How a call multiplies (`choose_path`):
// - GGUF block kinds (3-7, 11-14), whatever the mode: one kernel at every M (above), so a row's
//   result never depends on M.
// - batch-invariant (the engine's default on CPU): every row of y is summed in one order
//   whatever M is. Dense weights and quantized weights with float activations take the dot
//   kernels of linear_dot.h (tiles of rows; small steps stream each weight once, larger ones
//   reuse a panel of W across blocks of rows); on AVX-512 VNNI builds quantized weights meet
//   float activations rounded to int16 per 32-block (relative error <= 1.5e-5 of the block's
//   largest value) in the row kernels of linear_rows_vnni.h, four rows of x at a time, at
//   every M; int8 activations take their row kernels (linear_int8_acts.h, linear_rows_vnni.h)
//   at every M. Each row's rounding and sums are its own, so any M gives it bitwise.
// - otherwise the fastest kernel for M: 1-4 rows (a decode step) stream the weight once
//   through the row kernels (linear_rows.h; for 4-bit, sum_k (d q + m) x = d sum q x + m sum x
//   with x's group sums computed once), four rows at a time up to 16 rows; beyond, dense
//   weights go through oneDNN (Python side), quantized ones with float activations expand
//   tiles of W to float32 for one GEMM per tile (AVX2); on AVX-512 VNNI builds quantized
//   weights take the GEMMs of linear_int8_gemm.h from 10 rows (int16-rounded float
//   activations or int8 ones), on AVX2 4-bit weights with int8 activations from 12.
#pragma once
#include "linear_bf16.h"
#include "linear_block_tiles.h"
#include "linear_dot.h"
#include "linear_gguf_rows.h"
#include "linear_gguf_vnni.h"
#include "linear_gguf_int8.h"
#include "linear_int8_gemm.h"
#include "linear_kquant_tiles.h"
#include "linear_q6k_tiles.h"
#include "linear_rows.h"

// Up to this many rows of x, float activations go through the row kernels below, four rows
// at a time: expanding tiles for a GEMM (the larger-M path) cost 2-3x more at 5-16 rows.
constexpr int64_t kRowKernelMaxRows = 16;
// From this many rows, quantized weights on AVX-512 VNNI builds (int8 activations, and float
// ones rounded to int16) go through the GEMMs of linear_int8_gemm.h when a step need not be
// batch-invariant: below it, their per-call repack of W costs more than the row kernels'
// conversions (SmolLM2's 30 layers, Zen 4: the GEMMs 0.94-1.16x the row kernels' time at 8
// rows, 0.72-0.91x at 12, 0.60-0.80x at 16).
constexpr int64_t kVnniGemmMinRows = 10;
// AVX2's 4-bit int8 GEMM (its repack copies rows; measured at 5-8 rows on the LM head).
constexpr int64_t kAvx2Q4GemmMinRows = 12;

// How one call multiplies: the batch-invariant dot kernels (linear_dot.h), the row kernels
// four rows of x at a time, or a batched GEMM (each has its own summation order: only the
// first two keep a row's result independent of M).
enum class LinearPath {
  kDot, kRows, kGgufRows, kInt8Gemm, kInt16Gemm, kQ4Int8GemmAvx2, kFloatTiles
};

// Invariant calls: dense and float-activation weights take the dot kernels, except on VNNI
// builds, whose quantized weights meet int16-rounded activations in the row kernels at every
// M (their rounding is per row: the same at any M); int8 activations take the row kernels.
// Otherwise the fastest kernel for M (benchmarks/batch_invariance.py compares the two).
static LinearPath choose_path(int64_t kind, bool int8_path, int64_t M, bool invariant) {
  // GGUF blocks and half-precision rows have one kernel each, used at every M
  if (gguf_blocks::is_gguf_kind(kind) && kGgufRows) return LinearPath::kGgufRows;
  if (dot_form::dot_only_kind(kind)) return LinearPath::kDot;
  if (invariant) {
    if (kind == 0 || (!int8_path && !kVnniRows)) return LinearPath::kDot;
    return LinearPath::kRows;
  }
  if (kind == 0) return M <= 4 ? LinearPath::kRows : LinearPath::kDot;
  if (kVnniGemm && int8_path && M >= kVnniGemmMinRows) return LinearPath::kInt8Gemm;
  if (kVnniGemm && !int8_path && M >= kVnniGemmMinRows) return LinearPath::kInt16Gemm;
#if defined(TOKENMILL_AVX2_Q4_GEMM)
  if (int8_path && kind == 2 && M >= kAvx2Q4GemmMinRows) return LinearPath::kQ4Int8GemmAvx2;
#endif
  if (M <= kRowKernelMaxRows || int8_path) return LinearPath::kRows;
  return LinearPath::kFloatTiles;
}

// Tiles of rows expanded to float32 (<= 256 KiB each) and one GEMM per tile, run
// single-threaded inside the parallel region; y's columns [n0, n1) come from tile n0.
static void float_tiles(const torch::Tensor& x, int64_t kind, int64_t G,
                        const std::vector<torch::Tensor>& t, torch::Tensor& y) {
  const int64_t K = x.size(1), N = y.size(1);
  const int64_t tile = std::max<int64_t>(16, std::min<int64_t>(256, (65536 / K) / 16 * 16));
  at::parallel_for(0, (N + tile - 1) / tile, 1, [&](int64_t t0, int64_t t1) {
    // OpenMP workers do not inherit the caller's inference mode; without it, writing into y
    // (an inference tensor when the engine made it) would be refused.
    c10::InferenceMode inference;
    auto w = torch::empty({tile, K}, x.options());
    for (int64_t ti = t0; ti < t1; ++ti) {
      const int64_t n0 = ti * tile, rows = std::min(tile, N - n0);
      std::vector<int64_t> ids(rows);
      for (int64_t i = 0; i < rows; ++i) ids[i] = n0 + i;
      expand_rows(kind, G, t, ids.data(), rows, K, w.data_ptr<float>());
      auto part = at::mm(x, w.narrow(0, 0, rows).t());  // (M, rows)
      y.narrow(1, n0, rows).copy_(part);
    }
  });
}

// The row kernels, four rows of x at a time; one contiguous range of W's rows per thread, so
// each core streams its own part of W once per four rows. i8 / i16: the rows quantized where
// the kernels multiply integers; xs: the group sums of x (4-bit offsets).
static void rows_of_x(int64_t kind, int64_t G, const std::vector<torch::Tensor>& t,
                      const float* xp, const float* xs, const QuantizedRows* i8,
                      const BlockRows<int16_t>* i16, const float* b, float* yp, int64_t M,
                      int64_t K, int64_t N) {
  const int64_t threads = at::get_num_threads();
  const int64_t grain = std::max<int64_t>(16, (N + threads - 1) / threads);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; m += 4) {
      const QRows r8 = i8 ? rows_from(*i8, m, K) : QRows{};
      const BlockRowsView<int16_t> r16 = i16 ? rows_from(*i16, m, K) : BlockRowsView<int16_t>{};
      const RowInputs in{xp + m * K, xs ? xs + m * (K / G) : nullptr, i8 ? &r8 : nullptr,
                         i16 ? &r16 : nullptr};
      float* ym = yp + m * N;
      switch (std::min<int64_t>(4, M - m)) {
        case 1: small_m_range<1>(kind, G, t, in, b, ym, K, N, n0, n1); break;
        case 2: small_m_range<2>(kind, G, t, in, b, ym, K, N, n0, n1); break;
        case 3: small_m_range<3>(kind, G, t, in, b, ym, K, N, n0, n1); break;
        default: small_m_range<4>(kind, G, t, in, b, ym, K, N, n0, n1); break;
      }
    }
  });
}

// (M, K/G) group sums of x for the 4-bit offsets (a plain loop: a torch op here cost about
// 4 us a call, a fifth of a small layer's time)
static std::vector<float> group_sums(const float* xp, int64_t M, int64_t K, int64_t G) {
  std::vector<float> xsum(M * (K / G));
  auto sums = [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* xg = xp + i * G;
      float s = 0.f;
      for (int64_t j = 0; j < G; ++j) s += xg[j];
      xsum[i] = s;
    }
  };
  if (M <= 4) sums(0, xsum.size());
  else at::parallel_for(0, xsum.size(), 1024, sums);
  return xsum;
}

// y = x @ W^T + bias for x (M, K) float32 and the weight (kind, G, tensors). int8_acts: a
// quantized weight multiplies int8-quantized activations (any M).
// input_scale (K,): x is multiplied by it first (activation-aware 4-bit weights store W / s
// per input channel and take x * s; quantization/awq_search.py).
// invariant: every row of y is summed in an order that does not depend on M (choose_path).
constexpr int64_t kPartsKind = 15;

inline torch::Tensor linear(torch::Tensor x, int64_t kind, int64_t G,
                            const std::vector<torch::Tensor>& t,
                            c10::optional<torch::Tensor> bias, bool int8_acts = false,
                            c10::optional<torch::Tensor> input_scale = c10::nullopt,
                            bool invariant = false);

#if defined(TOKENMILL_GGUF_ROWS)
// Whether every part of a merged layer is GGUF blocks on the SIMD builds' kernels (with int8
// activations, the K-quants' int8 ones): then x is rounded once for all of them and each part
// writes its own columns of y (linear_gguf_parts), the same kernels and rounding as a part
// alone, so the same bits, without a rounding per part and the outputs' concatenation.
static bool gguf_parts_share_x(const std::vector<std::pair<int64_t, torch::Tensor>>& parts,
                               bool int8_acts) {
  for (const auto& [kind, w] : parts) {
#if defined(TOKENMILL_KQUANT_TILES)
    if ((kquant_tiles::is_kind(kind) || q6k_tiles::is_kind(kind)) && !int8_acts) continue;
#endif
    if (!gguf_blocks::is_gguf_kind(kind)) return false;
    if (int8_acts && !gguf_int8::has_kernel(kind)) return false;
  }
  return true;
}

// y (M, sum of the parts' N) = x @ [W_0; W_1; ...]^T for parts of GGUF kinds (above).
static torch::Tensor linear_gguf_parts(torch::Tensor x,
                                       const std::vector<std::pair<int64_t, torch::Tensor>>& parts,
                                       bool int8_acts) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2, "linear takes x (M, K) and a weight");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  auto rows = [](int64_t kind, const torch::Tensor& w) {  // a part's N
    return kquant_tiles::is_kind(kind) ? kquant_tiles::rows_of(w)
           : q6k_tiles::is_kind(kind)  ? q6k_tiles::rows_of(w)
                                       : w.size(0);
  };
  int64_t ldy = 0;
  for (const auto& [kind, w] : parts) {
    if (kquant_tiles::is_kind(kind)) kquant_tiles::check({w}, K);
    else if (q6k_tiles::is_kind(kind)) q6k_tiles::check({w}, K);
    else check_weight(kind, 32, {w}, K);
    ldy += rows(kind, w);
  }
  auto y = torch::empty({M, ldy}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  auto each = [&](auto&& product) {  // product(kind, weight, N, y's first column)
    int64_t col = 0;
    for (const auto& [kind, w] : parts) {
      const int64_t N = rows(kind, w);
      product(kind, w, N, yp + col);
      col += N;
    }
  };
  if (int8_acts) {
    TORCH_CHECK(K % gguf_int8::kSuper == 0, "gguf_int8: K must be whole super-blocks");
    const auto xr = gguf_int8::round_rows(xp, M, K);
    each([&](int64_t kind, const torch::Tensor& w, int64_t N, float* yc) {
      gguf_int8::linear_rounded(kind, w.data_ptr<uint8_t>(), xr, M, N, nullptr, yc, ldy);
    });
    return y;
  }
  // x rounded once (the build's int16 rounding), a raw part's product from it
#if defined(TOKENMILL_GGUF_VNNI)
  const auto xr = gguf_vnni::round_rows(xp, M, K);
  auto raw_part = [&](int64_t kind, const uint8_t* w, int64_t N, float* yc) {
    gguf_vnni::linear_rounded(kind, w, xr, M, K, N, nullptr, yc, ldy);
  };
#else
  const auto xr = gguf_rows::split_rows(xp, M, K);
  auto raw_part = [&](int64_t kind, const uint8_t* w, int64_t N, float* yc) {
    gguf_rows::linear_split(kind, w, xr, M, K, N, nullptr, yc, ldy);
  };
#endif
  // kind 19's parts: one parallel region for all; kind 20's likewise
  std::vector<kquant_tiles::Part> tiles, q6_tiles;
  each([&](int64_t kind, const torch::Tensor& w, int64_t N, float* yc) {
    if (kquant_tiles::is_kind(kind)) tiles.push_back(kquant_tiles::part_of(w, yc));
    else if (q6k_tiles::is_kind(kind)) q6_tiles.push_back(kquant_tiles::part_of(w, yc));
    else raw_part(kind, w.data_ptr<uint8_t>(), N, yc);
  });
  if (tiles.empty() && q6_tiles.empty()) return y;
  const auto split = kquant_tiles::split(xr, M);
  if (!tiles.empty()) kquant_tiles::linear_split(tiles, split.acts, M, nullptr, ldy);
  if (!q6_tiles.empty()) {
#if defined(TOKENMILL_Q6K_TILES)
    q6k_tiles::linear_split(q6_tiles, split.acts, xr.s16.data(), M, nullptr, ldy);
#else
    TORCH_CHECK(false, "weights packed into Q6_K tiles (kind 20) need the AVX-512 VNNI build");
#endif
  }
  return y;
}
#endif

// y (M, sum of the parts' N) = x @ [W_0; W_1; ...]^T for parts of dense bfloat16 weights
// multiplied in bfloat16 (a bf16 checkpoint's qkv and gate_up, held as the file stores each
// part: quantization/unquantized.py): x rounded to bf16 once, each part writing its own
// columns of y, so the same bits as one weight of all their rows.
static torch::Tensor linear_bf16_parts(torch::Tensor x, const std::vector<torch::Tensor>& parts) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2, "linear takes x (M, K) and a weight");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  int64_t ldy = 0;
  for (const auto& w : parts) {
    check_weight(bf16_products::kKind, 0, {w}, K);
    ldy += w.size(0);
  }
  auto y = torch::empty({M, ldy}, x.options());
  if (M == 0) return y;
  const auto xb = bf16_products::rounded(x.data_ptr<float>(), M * K);
  int64_t col = 0;
  for (const auto& w : parts) {
    bf16_products::linear_rounded(static_cast<const uint16_t*>(w.data_ptr()), xb.get(), M, K,
                                  w.size(0), nullptr, y.data_ptr<float>() + col, ldy);
    col += w.size(0);
  }
  return y;
}

// A merged layer of parts of different kinds: each part's product, side by side (+ bias).
inline torch::Tensor linear_parts(const torch::Tensor& x, const std::vector<torch::Tensor>& t,
                                  const c10::optional<torch::Tensor>& bias, bool int8_acts,
                                  const c10::optional<torch::Tensor>& input_scale,
                                  bool invariant) {
  TORCH_CHECK(!t.empty() && t[0].scalar_type() == torch::kInt64 && t[0].dim() == 2 &&
              t[0].size(1) == 3, "parts: a (P, 3) int64 description first");
  auto meta = t[0].accessor<int64_t, 2>();
  std::vector<std::vector<torch::Tensor>> tensors;
  size_t next = 1;
  for (int64_t p = 0; p < t[0].size(0); ++p) {
    const size_t count = static_cast<size_t>(meta[p][2]);
    TORCH_CHECK(meta[p][0] != kPartsKind && next + count <= t.size(), "parts: bad description");
    tensors.emplace_back(t.begin() + next, t.begin() + next + count);
    next += count;
  }
  TORCH_CHECK(next == t.size(), "parts: tensors left over");
#if defined(TOKENMILL_GGUF_ROWS)
  std::vector<std::pair<int64_t, torch::Tensor>> raw;  // (kind, blocks) of one-tensor parts
  for (int64_t p = 0; p < t[0].size(0); ++p)
    if (tensors[p].size() == 1 && meta[p][1] == 32) raw.emplace_back(meta[p][0], tensors[p][0]);
  if (!input_scale.has_value() && raw.size() == tensors.size() &&
      gguf_parts_share_x(raw, int8_acts)) {
    auto y = linear_gguf_parts(x, raw, int8_acts);
    if (bias.has_value()) y.add_(*bias);
    return y;
  }
#endif
  bool bf16 = !int8_acts && !input_scale.has_value();
  for (int64_t p = 0; p < t[0].size(0); ++p)
    bf16 = bf16 && meta[p][0] == bf16_products::kKind && tensors[p].size() == 1;
  if (bf16) {
    std::vector<torch::Tensor> ws;
    for (const auto& ts : tensors) ws.push_back(ts[0]);
    auto y = linear_bf16_parts(x, ws);
    if (bias.has_value()) y.add_(*bias);
    return y;
  }
  std::vector<torch::Tensor> outs;
  for (int64_t p = 0; p < t[0].size(0); ++p)
    outs.push_back(linear(x, meta[p][0], meta[p][1], tensors[p], c10::nullopt, int8_acts,
                          input_scale, invariant));
  auto y = at::cat(outs, 1);
  if (bias.has_value()) y.add_(*bias);
  return y;
}

inline torch::Tensor linear(torch::Tensor x, int64_t kind, int64_t G,
                            const std::vector<torch::Tensor>& t,
                            c10::optional<torch::Tensor> bias, bool int8_acts,
                            c10::optional<torch::Tensor> input_scale, bool invariant) {
  if (kind == kPartsKind) return linear_parts(x, t, bias, int8_acts, input_scale, invariant);
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2 && !t.empty(), "linear takes x (M, K) and a weight");
  const int64_t M = x.size(0), K = x.size(1);
  const bool tiles = kind == bf16_products::kTilesKind || block_tiles::is_tiles_kind(kind) ||
                     kquant_tiles::is_kind(kind) || q6k_tiles::is_kind(kind);
  const int64_t N = t[0].size(0) * (tiles ? 16 : 1);
  if (kquant_tiles::is_kind(kind)) kquant_tiles::check(t, K);
  else if (q6k_tiles::is_kind(kind)) q6k_tiles::check(t, K);
  else if (!block_tiles::is_tiles_kind(kind)) check_weight(kind, G, t, K);
  if (input_scale.has_value()) {
    check_f32(*input_scale, "input_scale");
    TORCH_CHECK(input_scale->numel() == K, "input_scale must have one value per input");
    x = x * input_scale->view({1, K});
  }
  x = x.contiguous();
  const float* b = nullptr;
  torch::Tensor bias_c;
  if (bias.has_value()) {
    bias_c = bias->contiguous();
    check_f32(bias_c, "bias");
    TORCH_CHECK(bias_c.numel() == N, "bias size");
    b = bias_c.data_ptr<float>();
  }
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (int8_acts && gguf_blocks::is_gguf_kind(kind)) {  // K-quants: x rounded to int8
#if defined(TOKENMILL_GGUF_INT8)
    if (gguf_int8::has_kernel(kind)) {
      gguf_int8::linear(kind, static_cast<const uint8_t*>(t[0].data_ptr()), xp, M, K, N, b, yp);
      return y;
    }
#endif
    TORCH_CHECK(false, "int8 activations are not implemented for GGUF weight kind ", kind,
                " on this build (Q2_K .. Q6_K have them on AVX2 and AVX-512 CPUs)");
  }
  TORCH_CHECK(!(int8_acts && (dot_form::dot_only_kind(kind) ||
                               kind == bf16_products::kKind ||
                               kind == bf16_products::kTilesKind)),
              "int8 activations are not implemented for weight kind ", kind);
  if (kquant_tiles::is_kind(kind)) {  // one arithmetic at every M
    TORCH_CHECK(!int8_acts, "weight kind 19 (Q4_K tiles) multiplies int16-rounded "
                "activations; int8 activations read the raw blocks (kind 5)");
#if defined(TOKENMILL_KQUANT_TILES)
    kquant_tiles::linear(t[0], xp, M, K, b, yp);
    return y;
#else
    TORCH_CHECK(false, "weights packed into Q4_K tiles (kind 19) need an AVX2 or AVX-512 build");
#endif
  }
  if (q6k_tiles::is_kind(kind)) {  // one arithmetic at every M
    TORCH_CHECK(!int8_acts, "weight kind 20 (Q6_K tiles) multiplies int16-rounded "
                "activations; int8 activations read the raw blocks (kind 7)");
#if defined(TOKENMILL_Q6K_TILES)
    q6k_tiles::linear(t[0], xp, M, K, b, yp);
    return y;
#else
    TORCH_CHECK(false, "weights packed into Q6_K tiles (kind 20) need the AVX-512 VNNI build");
#endif
  }
  if (block_tiles::is_tiles_kind(kind)) {  // one arithmetic at every M
#if defined(TM_HAVE_BLOCK_TILES)
    const block_tiles::Weight w = block_tiles::weight(kind, G, t, K);
    const std::vector<float> xsum = w.q4 ? group_sums(xp, M, K, G) : std::vector<float>();
    block_tiles::linear(w, xp, M, xsum.data(), int8_acts, b, yp);
    return y;
#else
    TORCH_CHECK(false, "weights packed into block tiles (kinds 17, 18) need the AVX-512 VNNI "
                "build");
#endif
  }
  if (kind == bf16_products::kTilesKind) {  // one kernel at every M
    bf16_products::linear_tiles(static_cast<const uint16_t*>(t[0].data_ptr()), xp, M, K, N, b,
                                yp);
    return y;
  }
  if (kind == bf16_products::kKind) {  // one kernel at every M
    bf16_products::linear(static_cast<const uint16_t*>(t[0].data_ptr()), xp, M, K, N, b, yp);
    return y;
  }
  const bool int8_path = int8_acts && kind != 0;
  const LinearPath path = choose_path(kind, int8_path, M, invariant);
  if (path == LinearPath::kDot) {
    dot_form::linear(dot_form::weight_rows(kind, G, K, t), xp, M, N, b, yp);
    return y;
  }
#if defined(TOKENMILL_GGUF_ROWS)
  if (path == LinearPath::kGgufRows) {  // x rounded to int16, at every M
#if defined(TOKENMILL_GGUF_VNNI)  // AVX-512 VNNI: int16 weights, vpdpwssd
    gguf_vnni::linear(kind, static_cast<const uint8_t*>(t[0].data_ptr()), xp, M, K, N, b, yp);
#else
    gguf_rows::linear(kind, static_cast<const uint8_t*>(t[0].data_ptr()), xp, M, K, N, b, yp);
#endif
    return y;
  }
#endif
  if (path == LinearPath::kFloatTiles) {
    float_tiles(x, kind, G, t, y);
    if (b) y.add_(bias_c);
    return y;
  }
  const std::vector<float> xsum = kind == 2 ? group_sums(xp, M, K, G) : std::vector<float>();
  const float* xs = xsum.empty() ? nullptr : xsum.data();
  QuantizedRows xq;
  if (int8_path) xq = quantize_rows(xp, M, K);
  // VNNI builds round float activations to int16 for quantized weights: per 32-block, the
  // same at every M (linear_rows_vnni.h here, int16_gemm below).
  BlockRows<int16_t> xw;
  const bool wide_rows = kVnniRows && kind != 0 && !int8_path && path == LinearPath::kRows;
  if (wide_rows) xw = quantize_rows<int16_t>(xp, M, K);
#if defined(TOKENMILL_VNNI_ROWS)
  // the 4-bit row kernels read x in pairs of blocks; the int8 GEMM does not
  if (kind == 2 && path == LinearPath::kRows) {
    if (wide_rows) pair_order(xw.q.data(), M, K);
    else if (int8_path) pair_order(xq.q.data(), M, K);
  }
#endif
  switch (path) {
#if defined(TOKENMILL_VNNI_GEMM)
    case LinearPath::kInt8Gemm: int8_gemm(kind, G, t, xq, xs, b, yp, M, K, N); return y;
    case LinearPath::kInt16Gemm: int16_gemm(kind, G, t, xp, xs, b, yp, M, K, N); return y;
#endif
#if defined(TOKENMILL_AVX2_Q4_GEMM)
    case LinearPath::kQ4Int8GemmAvx2:
      q4_int8_gemm_avx2(G, t, xq, xs, b, yp, M, K, N);
      return y;
#endif
    case LinearPath::kRows:
      rows_of_x(kind, G, t, xp, xs, int8_path ? &xq : nullptr, wide_rows ? &xw : nullptr, b,
                yp, M, K, N);
      return y;
    default: TORCH_CHECK(false, "linear: no kernel for this path in this build");
  }
  return y;
}

// Rows `ids` of a quantized weight as float32 (ids.size(), K): embedding lookups.
inline torch::Tensor gather_rows(torch::Tensor ids, int64_t kind, int64_t G,
                                 const std::vector<torch::Tensor>& t) {
  TORCH_CHECK(kind != 0 && kind != bf16_products::kTilesKind && !t.empty(),
              "gather_rows is for quantized weights (kind 16's tiles: look rows up in Python)");
  // a tied Q4_K or Q6_K table packed for its head
  const bool kquant = kquant_tiles::is_kind(kind), q6 = q6k_tiles::is_kind(kind);
  const bool tiles = block_tiles::is_tiles_kind(kind) || kquant || q6;
  const int64_t K = gguf_blocks::is_gguf_kind(kind)  // raw blocks; 4-bit: two weights a byte
      ? t[0].size(1) / gguf_blocks::block_bytes(kind) * gguf_blocks::block_weights(kind)
      : kquant || q6 ? kquant_tiles::k_of(t[0])
      : tiles ? t[0].size(1) * kBlock : t[0].size(1) * (kind == 2 ? 2 : 1);
  if (kquant) kquant_tiles::check(t, K);
  else if (q6) q6k_tiles::check(t, K);
  else if (!tiles) check_weight(kind, G, t, K);
  else TORCH_CHECK(t[0].dim() == 3 && t.size() == (kind == block_tiles::kQ4Kind ? 3u : 2u),
                   "weight kind ", kind, ": packed q tiles and scales");
  auto idx = ids.to(torch::kInt64).contiguous().view({-1});
  const int64_t count = idx.numel(), N = t[0].size(0) * (tiles ? block_tiles::kRows : 1);
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < N, "row out of range");
  auto out = torch::empty({count, K}, torch::dtype(torch::kFloat32));
  float* op = out.data_ptr<float>();
  at::parallel_for(0, count, 16, [&](int64_t i0, int64_t i1) {
    if (kquant)
      for (int64_t i = i0; i < i1; ++i) kquant_tiles::expand_row(t[0], ip[i], op + i * K);
    else if (q6)
      for (int64_t i = i0; i < i1; ++i) q6k_tiles::expand_row(t[0], ip[i], op + i * K);
    else if (tiles)
      for (int64_t i = i0; i < i1; ++i) block_tiles::expand_row(kind, G, t, ip[i], K, op + i * K);
    else expand_rows(kind, G, t, ip + i0, i1 - i0, K, op + i0 * K);
  });
  return out;
}
