// LoRA deltas of one linear layer on CPU, every adapter of a step in one call (lora/layers.py
// LinearLoRA; Punica's shrink / expand, gathered per adapter).
//
// The layer holds max_loras slots: slot s's A for all P parts of the layer stacked, rank r
// leading rows first (a (L, P R K), flat per slot: A_s = (P r, K), as the adapter's file holds
// it), each part's B transposed in column blocks (b[p] (L, R n_p), flat per slot: B_sp^T =
// (r, n_p) cut into blocks of kCols columns, each block's (r, width) values contiguous), and
// its scaling (alpha / r, or alpha / sqrt(r)). For the rows of each slot, in ascending row order:
//
//     h = (x[rows] @ A_s^T) * scaling_s        (n, P r)     shrink: the dot kernels
//     y[rows, part p] += h[:, p r:(p+1) r] @ B_sp^T        expand: r fused multiply-adds
//                                                          per output, k ascending
//
// The shrink goes through the batch-invariant dot kernels (linear_dot.h), which sum each row
// in one order at every number of rows; the expand's inner dimension is the rank (8-64: too
// short for a dot product's vectors), so it runs along the outputs instead, each output's r
// products summed in one order whatever its place. A row's delta depends on that row and its
// adapter only, and is the same whichever rows share its step.
//
// Slots kept in bfloat16 / float16 (--lora-dtype) are widened exactly as they are read (A by
// the half-precision kernels of linear_half.h where its rows are whole blocks, else through a
// float32 buffer; B in the expand's loads): the result equals float32 slots holding the same
// values, bit for bit.
//
// Slots run side by side on the threads when a step has at least as many adapters as threads
// (each slot's products then on one thread), else each large product is split over the
// threads; a row's sums do not depend on the thread either way.
#pragma once
#include "cpu_ops.h"
#include <vector>

namespace lora_cpu {

// Products smaller than this (rows x outputs x inputs) run on the calling thread: a rank-8
// adapter's products on a small model are a few microseconds, less than waking the threads.
constexpr int64_t kSerialMacs = 1 << 16;

// B^T's column blocks (lora/layers.py COLUMN_BLOCK): a multiple of every build's vector.
constexpr int64_t kCols = 64;

inline void product(const dot_form::WeightRows& w, const float* x, int64_t M, int64_t N,
                    float* y) {
  if (M * N * w.K < kSerialMacs) return dot_form::linear_range(w, x, M, N, nullptr, y, 0, N);
  dot_form::linear(w, x, M, N, nullptr, y);
}

// The kind a tensor of slots is read as: 0 (float32), or half_rows::kBF16 / kF16.
inline int64_t slot_kind(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return 0;
    case at::kBFloat16: return half_rows::kBF16;
    case at::kHalf: return half_rows::kF16;
    default: TORCH_CHECK(false, "lora_add_: slots are float32, bfloat16 or float16");
  }
  return 0;
}

// W values of bt at p (at most Vec::size()) widened to float32: float32 as stored, bfloat16 /
// float16 widened exactly (in registers for a whole vector).
template <int64_t KIND>
static inline Vec load_widened(const void* base, int64_t at, int64_t w) {
  if constexpr (KIND == 0) {
    return Vec::loadu(static_cast<const float*>(base) + at, w);
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(base) + at;
    if (w == Vec::size()) return half_rows::expand<KIND>(half_rows::Block{p}, 0);
    float buf[Vec::size()];
    for (int64_t i = 0; i < w; ++i)
      buf[i] = KIND == half_rows::kBF16
                   ? static_cast<float>(c10::BFloat16(p[i], c10::BFloat16::from_bits()))
                   : static_cast<float>(c10::Half(p[i], c10::Half::from_bits()));
    return Vec::loadu(buf, w);
  }
}

// One part of a slot's expand: y[rows[i], :N] += h_i (r) @ B^T (r, N), B^T held in column
// blocks (bt: per block of kCols columns, its (r, width) values contiguous, the last block
// narrower), of `kind` (float32, or half values widened as they are read).
struct ExpandPart {
  const float* h;  // the part's h of row 0; ldh apart
  const void* bt;
  int64_t kind, N;
  float* y;  // the part's first column of y's row 0; ldy apart
};

// Column block c of a part for the n rows. A decode step streams the slot once, in address
// order: held as plain (r, N) rows, each block read r short runs N apart, more streams than the
// prefetchers follow (~16 GB/s of ~39 at one row). Per row, acc = fmadd(h_ik, bt[k, j], acc)
// for k ascending, then added to y; the block stays in cache across the rows. Every column
// takes the same vector ops (the last ones partial), so a value does not depend on the block
// or the rows around it.
template <int64_t KIND>
void expand_block(const ExpandPart& part, int64_t c, int64_t ldh, const int64_t* rows,
                  int64_t n, int64_t r, int64_t ldy) {
  constexpr int64_t V = Vec::size(), C = kCols / V;
  const int64_t j0 = c * kCols, w = std::min(kCols, part.N - j0);
  const int64_t at = j0 * r;  // the block's first value
  for (int64_t i = 0; i < n; ++i) {
    const float* hi = part.h + i * ldh;
    float* yr = part.y + rows[i] * ldy + j0;
    if (w == kCols) {  // C independent chains of fmadds (one would wait on each latency)
      Vec acc[C];
      for (int64_t q = 0; q < C; ++q) acc[q] = Vec(0.f);
      for (int64_t k = 0; k < r; ++k) {
        const Vec hk(hi[k]);
        for (int64_t q = 0; q < C; ++q)
          acc[q] = at::vec::fmadd(hk, load_widened<KIND>(part.bt, at + k * kCols + q * V, V),
                                  acc[q]);
      }
      for (int64_t q = 0; q < C; ++q) (Vec::loadu(yr + q * V) + acc[q]).store(yr + q * V);
      continue;
    }
    for (int64_t j = 0; j < w; j += V) {
      const int64_t v = std::min<int64_t>(V, w - j);
      Vec acc(0.f);
      for (int64_t k = 0; k < r; ++k)
        acc = at::vec::fmadd(Vec(hi[k]), load_widened<KIND>(part.bt, at + k * w + j, v), acc);
      (Vec::loadu(yr + j, v) + acc).store(yr + j, v);
    }
  }
}

// Every column block of the parts, split over the threads in one parallel region (a region
// per part cost more than a small adapter's products; blocks are independent).
inline void expand_parts(const std::vector<ExpandPart>& parts, int64_t ldh, const int64_t* rows,
                         int64_t n, int64_t r, int64_t ldy) {
  std::vector<int64_t> first{0};  // each part's first block in the joint numbering
  int64_t columns = 0;
  for (const ExpandPart& p : parts)
    first.push_back(first.back() + (p.N + kCols - 1) / kCols), columns += p.N;
  auto block_range = [&](int64_t b0, int64_t b1) {
    size_t p = 0;
    for (int64_t b = b0; b < b1; ++b) {
      while (b >= first[p + 1]) ++p;
      const int64_t c = b - first[p];
      switch (parts[p].kind) {
        case 0: expand_block<0>(parts[p], c, ldh, rows, n, r, ldy); break;
        case half_rows::kBF16: expand_block<half_rows::kBF16>(parts[p], c, ldh, rows, n, r, ldy);
                               break;
        default: expand_block<half_rows::kF16>(parts[p], c, ldh, rows, n, r, ldy); break;
      }
    }
  };
  if (n * columns * r < kSerialMacs) return block_range(0, first.back());
  at::parallel_for(0, first.back(), 1, block_range);
}

// The first `count` values of slot `s` of a (L, X) tensor of slots as float32: in place, or
// widened into `scratch` (exact).
inline const float* slot_floats(const torch::Tensor& t, int64_t s, int64_t count,
                                std::vector<float>& scratch) {
  const int64_t offset = s * t.size(1), kind = slot_kind(t);
  if (kind == 0) return t.data_ptr<float>() + offset;
  const uint16_t* h = static_cast<const uint16_t*>(t.data_ptr()) + offset;
  scratch.resize(count);
  float* out = scratch.data();
  if (kind == half_rows::kBF16) {  // the 16 bits as a float32's high half: a loop the
    uint32_t* bits = reinterpret_cast<uint32_t*>(out);  // compiler vectorizes
    for (int64_t i = 0; i < count; ++i) bits[i] = static_cast<uint32_t>(h[i]) << 16;
  } else {
    for (int64_t i = 0; i < count; ++i)
      out[i] = static_cast<float>(c10::Half(h[i], c10::Half::from_bits()));
  }
  return out;
}

// Slot `s` of a (L, X) tensor of slots as (N, K) rows the dot kernels read: half rows in place
// where they are whole blocks (linear_half.h), else float32 (in place, or widened).
inline dot_form::WeightRows slot_rows(const torch::Tensor& t, int64_t s, int64_t N, int64_t K,
                                      std::vector<float>& scratch) {
  const int64_t kind = slot_kind(t);
  if (kind != 0 && K % 32 == 0)
    return {kind, 0, K, nullptr, static_cast<const uint16_t*>(t.data_ptr()) + s * t.size(1),
            nullptr, nullptr, 0};
  return {0, 0, K, slot_floats(t, s, N * K, scratch), nullptr, nullptr, nullptr, 0};
}

// y (T, N) += each row's delta. ranks (L,) int64: a slot's rank (0: empty); scales (L,)
// float32: its scaling; present (L, P) uint8: the parts an adapter changes; row_slot (T,)
// int64: a row's slot, -1 for none.
inline void add_(const torch::Tensor& x, torch::Tensor y, const torch::Tensor& a,
                 const std::vector<torch::Tensor>& b, const torch::Tensor& ranks,
                 const torch::Tensor& scales, const torch::Tensor& present,
                 const torch::Tensor& row_slot) {
  check_f32(x, "x");
  check_f32(y, "y");
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && a.is_contiguous(),
              "lora_add_: x, y and a must be contiguous");
  const int64_t T = x.size(0), K = x.size(1), N = y.size(1);
  const int64_t P = static_cast<int64_t>(b.size()), L = a.size(0);
  TORCH_CHECK(P > 0 && y.size(0) == T && row_slot.numel() == T, "lora_add_: shapes");
  const int64_t R = a.size(1) / (P * K);
  std::vector<int64_t> size(P), offset(P);
  for (int64_t p = 0, o = 0; p < P; ++p) {
    size[p] = b[p].size(1) / R, offset[p] = o, o += size[p];
    TORCH_CHECK(b[p].is_contiguous() && b[p].size(0) == L &&
                b[p].scalar_type() == a.scalar_type(), "lora_add_: b's shape or dtype");
  }
  TORCH_CHECK(offset[P - 1] + size[P - 1] == N, "lora_add_: parts do not cover y");
  const int64_t* rank = ranks.data_ptr<int64_t>();
  const float* scale = scales.data_ptr<float>();
  const uint8_t* has = present.data_ptr<uint8_t>();
  const int64_t* slot_of = row_slot.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> rows(L);
  for (int64_t s = 0; s < L; ++s)
    TORCH_CHECK(rank[s] >= 0 && rank[s] <= R, "lora_add_: a slot's rank exceeds its room");
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = slot_of[t];
    TORCH_CHECK(s < L, "lora_add_: row ", t, " names slot ", s, " of ", L);
    if (s >= 0 && rank[s] > 0) rows[s].push_back(t);
  }
  std::vector<int64_t> slots;
  for (int64_t s = 0; s < L; ++s)
    if (!rows[s].empty()) slots.push_back(s);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  auto one_slot = [&](int64_t s) {
    const int64_t r = rank[s], n = static_cast<int64_t>(rows[s].size());
    std::vector<float> xs(n * K), h(n * P * r), scratch;
    for (int64_t i = 0; i < n; ++i)
      std::copy_n(xp + rows[s][i] * K, K, xs.data() + i * K);
    product(slot_rows(a, s, P * r, K, scratch), xs.data(), n, P * r, h.data());
    for (float& v : h) v *= scale[s];
    std::vector<ExpandPart> parts;
    for (int64_t p = 0; p < P; ++p) {
      if (!has[s * P + p]) continue;
      const char* bt = static_cast<const char*>(b[p].data_ptr()) +
                       s * b[p].size(1) * b[p].element_size();
      parts.push_back({h.data() + p * r, bt, slot_kind(b[p]), size[p], yp + offset[p]});
    }
    expand_parts(parts, P * r, rows[s].data(), n, r, N);
  };
  const int64_t count = static_cast<int64_t>(slots.size());
  if (count >= at::get_num_threads() && count > 1) {
    at::parallel_for(0, count, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) one_slot(slots[i]);
    });
  } else {
    for (const int64_t s : slots) one_slot(s);
  }
}

}  // namespace lora_cpu
