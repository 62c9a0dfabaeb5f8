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
//
// Small M (1-4 rows, a decode step): bound by reading the weight once. Each weight row is
// streamed once for all rows of x (which stay in L1); rows of W are split in one contiguous
// range per thread. For 4-bit, sum_k (d q + m) x = d sum q x + m sum x, with the group sums
// of x computed once per call. On AVX-512 VNNI builds the activations are rounded to int16
// per 32-block and each block's product is an integer one (linear_rows_vnni.h: ~1.5x the
// float kernels' speed; relative error <= 1.5e-5 of the block's largest value); elsewhere
// quantized weights are expanded to float32 in registers and the result equals the dense
// float32 product of the dequantized weight up to summation order. 5-16 rows: the same
// kernels, four rows at a time.
// With int8_acts, products round the activations instead: the row kernels of
// linear_int8_acts.h, and from 12 rows the GEMMs of linear_int8_gemm.h where the build has
// them (AVX-512 VNNI: every kind; AVX2: 4-bit weights) (same math, other summation order).
// Larger M with float activations (prefill, batches): each thread expands a tile of rows to
// float32 and multiplies it with one single-threaded GEMM (the tile stays in cache).
#pragma once
#include "linear_int8_gemm.h"
#include "linear_rows_vnni.h"
#include "linear_dot.h"
#include "quant_blocks.h"

// Up to this many rows of x, float activations go through the row kernels below, four rows
// at a time: expanding tiles for a GEMM (the larger-M path) cost 2-3x more at 5-16 rows.
constexpr int64_t kRowKernelMaxRows = 16;
// From this many rows, int8 activations go through the GEMMs of linear_int8_gemm.h: below it,
// their per-call repack of W costs more than the row kernels' conversions (measured at 5-8
// rows on the 49152-row LM head).
constexpr int64_t kVnniGemmMinRows = 12;

// ---- small M: one row range [n0, n1) of y ---------------------------------------------------
// Dense: each W row is streamed once for all rows of x (which stay in L1), in passes of at
// most two x rows (two accumulators each: two FMA chains in flight); the second pass reads
// the W row again from L1. Measured on SmolLM2's 30 layers of weights (Zen 4, AVX-512, 2
// cores, interleaved): one pass of 4 rows 21.0 ms, of 3 rows 14.8, of 1 row 11.7; passes of
// 2 + 2 rows 16.1 ms, 2 + 1 13.8. A y entry's sum is the same whatever M (and as before).
template <int M>
static inline void dense_dot(const float* x, const float* w, int64_t K, float* out) {
  Vec a0[M], a1[M];  // two accumulators per x row hide the FMA latency
  for (int m = 0; m < M; ++m) a0[m] = a1[m] = Vec(0.f);
  int64_t k = 0;
  for (; k + 2 * kV <= K; k += 2 * kV) {
    const Vec w0 = Vec::loadu(w + k), w1 = Vec::loadu(w + k + kV);
    for (int m = 0; m < M; ++m) {
      a0[m] = at::vec::fmadd(w0, Vec::loadu(x + m * K + k), a0[m]);
      a1[m] = at::vec::fmadd(w1, Vec::loadu(x + m * K + k + kV), a1[m]);
    }
  }
  for (int m = 0; m < M; ++m) {
    float s = hsum(a0[m] + a1[m]);
    for (int64_t j = k; j < K; ++j) s += w[j] * x[m * K + j];
    out[m] = s;
  }
}

template <int M>
static void dense_rows(const float* x, const float* W, const float* bias, float* y,
                       int64_t K, int64_t N, int64_t n0, int64_t n1) {
  float s[M];
  for (int64_t n = n0; n < n1; ++n) {
    const float* w = W + n * K;
    if constexpr (M <= 2) {
      dense_dot<M>(x, w, K, s);
    } else {
      dense_dot<2>(x, w, K, s);
      dense_dot<M - 2>(x + 2 * K, w, K, s + 2);
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = bias ? s[m] + bias[n] : s[m];
  }
}

// Two partial dot products per x row (even and odd vectors of a block) keep two FMA chains
// in flight: one chain per block ran at half the speed (FMA latency bound).
template <int M>
static void q8_rows(const float* x, const int8_t* Q, const at::Half* D, const float* bias,
                    float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t nb = K / kBlock;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* q = Q + n * K;
    const at::Half* d = D + n * nb;
    Vec acc[M][2];
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = Vec(0.f);
    for (int64_t b = 0; b < nb; ++b) {
      Vec w[kChunks];
      expand_q8(q + b * kBlock, w);
      const Vec scale(half_to_float(d[b]));
      for (int c = 0; c < kChunks; ++c) w[c] = w[c] * scale;
      for (int m = 0; m < M; ++m) {
        const float* xb = x + m * K + b * kBlock;
        for (int c = 0; c < kChunks; ++c)
          acc[m][c & 1] = at::vec::fmadd(w[c], Vec::loadu(xb + c * kV), acc[m][c & 1]);
      }
    }
    for (int m = 0; m < M; ++m)
      y[m * N + n] = hsum(acc[m][0] + acc[m][1]) + (bias ? bias[n] : 0.f);
  }
}

// xsum (M, K/G): the group sums of x, which the 4-bit zero points multiply.
template <int M>
static void q4_rows(const float* x, const float* xsum, const uint8_t* Q, const at::Half* D,
                    const at::Half* Mn, const float* bias, float* y, int64_t K, int64_t N,
                    int64_t G, int64_t n0, int64_t n1) {
  const int64_t ng = K / G, bpg = G / kBlock;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* q = Q + n * (K / 2);
    const at::Half *d = D + n * ng, *mn = Mn + n * ng;
    Vec acc[M][2];
    float zero_part[M];
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = Vec(0.f), zero_part[m] = 0.f;
    for (int64_t g = 0; g < ng; ++g) {
      const Vec scale(half_to_float(d[g]));
      for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
        Vec w[kChunks];
        expand_q4(q + b * (kBlock / 2), w);
        for (int c = 0; c < kChunks; ++c) w[c] = w[c] * scale;
        for (int m = 0; m < M; ++m) {
          const float* xb = x + m * K + b * kBlock;
          for (int c = 0; c < kChunks; ++c)
            acc[m][c & 1] = at::vec::fmadd(w[c], Vec::loadu(xb + c * kV), acc[m][c & 1]);
        }
      }
      const float mg = half_to_float(mn[g]);
      for (int m = 0; m < M; ++m) zero_part[m] += mg * xsum[m * ng + g];
    }
    for (int m = 0; m < M; ++m)
      y[m * N + n] = hsum(acc[m][0] + acc[m][1]) + zero_part[m] + (bias ? bias[n] : 0.f);
  }
}

// ---- expanding rows of a quantized weight into float32 (the large-M path, embeddings) ------
static void expand_rows(int64_t kind, int64_t G, const std::vector<torch::Tensor>& t,
                        const int64_t* rows, int64_t count, int64_t K, float* out) {
  // pointers taken once: data_ptr<T>()'s checks cost more than expanding a short row
  const void* q_base = t[0].data_ptr();
  const at::Half* d_base = t[1].data_ptr<at::Half>();
  const at::Half* m_base = kind == 2 ? t[2].data_ptr<at::Half>() : nullptr;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t n = rows ? rows[i] : i;
    float* o = out + i * K;
    if (kind == 1) {
      const int8_t* q = static_cast<const int8_t*>(q_base) + n * K;
      const at::Half* d = d_base + n * (K / kBlock);
      for (int64_t b = 0; b < K / kBlock; ++b) {
        Vec w[kChunks];
        expand_q8(q + b * kBlock, w);
        const Vec scale(half_to_float(d[b]));
        for (int c = 0; c < kChunks; ++c) (w[c] * scale).store(o + b * kBlock + c * kV);
      }
    } else {
      const uint8_t* q = static_cast<const uint8_t*>(q_base) + n * (K / 2);
      const at::Half* d = d_base + n * (K / G);
      const at::Half* mn = m_base + n * (K / G);
      for (int64_t b = 0; b < K / kBlock; ++b) {
        Vec w[kChunks];
        expand_q4(q + b * (kBlock / 2), w);
        const int64_t g = b * kBlock / G;
        const Vec scale(half_to_float(d[g])), zero(half_to_float(mn[g]));
        for (int c = 0; c < kChunks; ++c)
          at::vec::fmadd(w[c], scale, zero).store(o + b * kBlock + c * kV);
      }
    }
  }
}

static void check_weight(int64_t kind, int64_t G, const std::vector<torch::Tensor>& t,
                         int64_t K) {
  if (kind == 0) {
    TORCH_CHECK(t.size() == 1, "dense weight: one tensor");
    check_f32(t[0], "W");
    TORCH_CHECK(t[0].dim() == 2 && t[0].size(1) == K && t[0].is_contiguous(),
                "W must be a contiguous (N, K) matrix");
    return;
  }
  TORCH_CHECK(K % kBlock == 0, "quantized weights need K divisible by 32");
  const int64_t N = t[0].size(0);
  if (kind == 1) {
    TORCH_CHECK(t.size() == 2 && t[0].scalar_type() == torch::kInt8 &&
                t[1].scalar_type() == torch::kHalf, "Q8_0 weight: int8 q, float16 d");
    TORCH_CHECK(t[0].sizes() == torch::IntArrayRef({N, K}) &&
                t[1].sizes() == torch::IntArrayRef({N, K / kBlock}), "Q8_0 shapes");
  } else {
    TORCH_CHECK(kind == 2, "unknown weight kind ", kind);
    TORCH_CHECK(G % kBlock == 0 && K % G == 0, "4-bit group size must be a multiple of 32 "
                "dividing K");
    TORCH_CHECK(t.size() == 3 && t[0].scalar_type() == torch::kUInt8 &&
                t[1].scalar_type() == torch::kHalf && t[2].scalar_type() == torch::kHalf,
                "4-bit weight: uint8 q, float16 d and m");
    TORCH_CHECK(t[0].sizes() == torch::IntArrayRef({N, K / 2}) &&
                t[1].sizes() == torch::IntArrayRef({N, K / G}) &&
                t[2].sizes() == t[1].sizes(), "4-bit shapes");
  }
  for (const auto& x : t) TORCH_CHECK(x.is_contiguous() && x.device().is_cpu(),
                                      "quantized tensors must be contiguous CPU tensors");
}

// What one call of the row kernels reads for rows [m, m + 4) of x: the float rows, and where
// the product rounds them, the same rows quantized per block.
struct RowInputs {
  const float* x;                         // (rows, K)
  const float* xsum;                      // (rows, K/G) group sums, for 4-bit offsets
  const QRows* i8;                        // int8 activations, or nullptr
  const BlockRowsView<int16_t>* i16;      // VNNI builds' float activations, or nullptr
};

template <int M>
static void small_m_range(int64_t kind, int64_t G, const std::vector<torch::Tensor>& t,
                          const RowInputs& in, const float* b, float* y, int64_t K, int64_t N,
                          int64_t n0, int64_t n1) {
  if (kind == 0) {
    dense_rows<M>(in.x, t[0].data_ptr<float>(), b, y, K, N, n0, n1);
    return;
  }
  const at::Half* d = t[1].data_ptr<at::Half>();
  if (kind == 1) {
    const int8_t* q = t[0].data_ptr<int8_t>();
    if (in.i8) q8_rows_i8<M>(*in.i8, q, d, b, y, K, N, n0, n1);
#if defined(TOKENMILL_VNNI_ROWS)
    else if (in.i16) q8_rows_vnni<M>(in.i16->q, in.i16->d, q, d, b, y, K, N, n0, n1);
#endif
    else q8_rows<M>(in.x, q, d, b, y, K, N, n0, n1);
    return;
  }
  const uint8_t* q = t[0].data_ptr<uint8_t>();
  const at::Half* mn = t[2].data_ptr<at::Half>();
#if defined(TOKENMILL_VNNI_ROWS)
  if (in.i8) q4_rows_vnni<M>(in.i8->q, in.i8->d, in.xsum, q, d, mn, b, y, K, N, G, n0, n1);
  else if (in.i16) q4_rows_vnni<M>(in.i16->q, in.i16->d, in.xsum, q, d, mn, b, y, K, N, G, n0, n1);
#else
  if (in.i8) q4_rows_i8<M>(*in.i8, in.xsum, q, d, mn, b, y, K, N, G, n0, n1);
#endif
  else q4_rows<M>(in.x, in.xsum, q, d, mn, b, y, K, N, G, n0, n1);
}

// How one call multiplies: the batch-invariant dot kernels (linear_dot.h), the row kernels
// four rows of x at a time, or a batched GEMM (each has its own summation order: only the
// first two keep a row's result independent of M).
enum class LinearPath { kDot, kRows, kInt8Gemm, kInt16Gemm, kQ4Int8GemmAvx2, kFloatTiles };

// Invariant calls: dense and float-activation weights take the dot kernels, except on VNNI
// builds, whose quantized weights meet int16-rounded activations in the row kernels at every
// M (their rounding is per row: the same at any M); int8 activations take the row kernels.
// Otherwise the fastest kernel for M (benchmarks/batch_invariance.py compares the two).
static LinearPath choose_path(int64_t kind, bool int8_path, int64_t M, bool invariant) {
  if (invariant) {
    if (kind == 0 || (!int8_path && !kVnniRows)) return LinearPath::kDot;
    return LinearPath::kRows;
  }
  if (kind == 0) return M <= 4 ? LinearPath::kRows : LinearPath::kDot;
  if (kVnniGemm && int8_path && M >= kVnniGemmMinRows) return LinearPath::kInt8Gemm;
  if (kVnniGemm && !int8_path && M > kRowKernelMaxRows) return LinearPath::kInt16Gemm;
#if defined(TOKENMILL_AVX2_Q4_GEMM)
  if (int8_path && kind == 2 && M >= kVnniGemmMinRows) return LinearPath::kQ4Int8GemmAvx2;
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
inline torch::Tensor linear(torch::Tensor x, int64_t kind, int64_t G,
                            const std::vector<torch::Tensor>& t,
                            c10::optional<torch::Tensor> bias, bool int8_acts = false,
                            c10::optional<torch::Tensor> input_scale = c10::nullopt,
                            bool invariant = false) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2 && !t.empty(), "linear takes x (M, K) and a weight");
  const int64_t M = x.size(0), K = x.size(1), N = t[0].size(0);
  check_weight(kind, G, t, K);
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
  const bool int8_path = int8_acts && kind != 0;
  const LinearPath path = choose_path(kind, int8_path, M, invariant);
  if (path == LinearPath::kDot) {
    const dot_form::WeightRows w{kind, G, K, kind == 0 ? t[0].data_ptr<float>() : nullptr,
                            kind == 0 ? nullptr : t[0].data_ptr(),
                            kind == 0 ? nullptr : t[1].data_ptr<at::Half>(),
                            kind == 2 ? t[2].data_ptr<at::Half>() : nullptr};
    dot_form::linear(w, xp, M, N, b, yp);
    return y;
  }
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
  TORCH_CHECK(kind != 0 && !t.empty(), "gather_rows is for quantized weights");
  const int64_t K = t[0].size(1) * (kind == 2 ? 2 : 1);  // 4-bit: two weights a byte
  check_weight(kind, G, t, K);
  auto idx = ids.to(torch::kInt64).contiguous().view({-1});
  const int64_t count = idx.numel(), N = t[0].size(0);
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < N, "row out of range");
  auto out = torch::empty({count, K}, torch::dtype(torch::kFloat32));
  float* op = out.data_ptr<float>();
  at::parallel_for(0, count, 16, [&](int64_t i0, int64_t i1) {
    expand_rows(kind, G, t, ip + i0, i1 - i0, K, op + i0 * K);
  });
  return out;
}
