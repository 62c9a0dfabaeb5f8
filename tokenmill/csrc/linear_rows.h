// The row kernels of float activations (and the dispatch to the integer-activation ones): a
// few rows of x against a range of W's rows, each weight row streamed once for all of them.
// Included by linear_cpu.h, which calls them four rows of x at a time (`small_m_range`);
// their per-row arithmetic is the same whatever rows come with it (no term of one row enters
// another), so they are batch-invariant where linear_cpu.h runs them at every M. Also the
// weight checks and the expansion of quantized rows to float32 that linear_cpu.h shares.
#pragma once
#include "linear_dot.h"
#include "linear_int8_acts.h"
#include "linear_rows_vnni.h"
#include "quant_blocks.h"

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
  if (kind == half_rows::kBF16Products) kind = half_rows::kBF16;  // the same W, widened
  if (dot_form::dot_only_kind(kind)) {  // the dot kernels' expansion of their kinds
    const dot_form::WeightRows w = dot_form::weight_rows(kind, G, K, t);
    for (int64_t i = 0; i < count; ++i)
      dot_form::expand_rows_any(w, rows ? rows[i] : i, 1, out + i * K);
    return;
  }
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
  if (kind == half_rows::kBF16Tiles) {
    TORCH_CHECK(t.size() == 1 && t[0].scalar_type() == torch::kBFloat16 && t[0].dim() == 4 &&
                t[0].size(1) == K / 2 && t[0].size(2) == 16 && t[0].size(3) == 2 &&
                t[0].is_contiguous() && t[0].device().is_cpu(),
                "bfloat16 tiles: W packed (N / 16, K / 2, 16, 2) bfloat16 (kind 16)");
    return;
  }
  const int64_t N = t[0].size(0);
  if (half_rows::is_half_kind(kind) || kind == half_rows::kBF16Products) {
    TORCH_CHECK(t.size() == 1 && t[0].scalar_type() == (kind == half_rows::kF16
                                                           ? torch::kHalf : torch::kBFloat16) &&
                t[0].sizes() == torch::IntArrayRef({N, K}) && t[0].is_contiguous(),
                "half-precision weight: W (N, K) in bfloat16 (kinds 8, 10) or float16 (9)");
  } else if (gguf_blocks::is_gguf_kind(kind)) {
    TORCH_CHECK(K % gguf_blocks::block_weights(kind) == 0, "GGUF weight kind ", kind,
                " needs K divisible by ", gguf_blocks::block_weights(kind));
    TORCH_CHECK(t.size() == 1 && t[0].scalar_type() == torch::kUInt8 &&
                t[0].sizes() == torch::IntArrayRef({N, gguf_blocks::row_bytes(kind, K)}),
                "GGUF weight: its raw block rows, uint8 (N, K / QK * block bytes)");
  } else if (kind == 1) {
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
