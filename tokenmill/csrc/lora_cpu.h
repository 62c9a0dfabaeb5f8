// LoRA deltas of one linear layer on CPU, every adapter of a step in one call (lora/layers.py
// LinearLoRA; Punica's shrink / expand, gathered per adapter).
//
// The layer holds max_loras slots: slot s's A for all P parts of the layer stacked, rank r
// leading rows first (a (L, P R K), flat per slot: A_s = (P r, K)), and each part's B with the
// adapter's scaling folded in (b[p] (L, n_p R), flat: B_sp = (n_p, r)). For the rows of each
// slot, in ascending row order:
//
//     h = x[rows] @ A_s^T                      (n, P r)
//     y[rows, part p] += h[:, p r:(p+1) r] @ B_sp^T   for each part the adapter has
//
// Products go through the batch-invariant dot kernels (linear_dot.h), which sum each row in one
// order at every number of rows: a row's delta depends on that row and its adapter only, and
// is the same whichever rows share its step. Slots side by side on the threads when a step has
// at least as many adapters as threads (each slot's products then on one thread), else each
// product split over the threads; a row's sums do not depend on the thread either way.
#pragma once
#include "cpu_ops.h"
#include <vector>

namespace lora_cpu {

// A dense (N, K) float32 weight as the dot kernels read it.
inline dot_form::WeightRows dense_rows(const float* w, int64_t K) {
  return {0, 0, K, w, nullptr, nullptr, nullptr, 0};
}

// y (T, N) += each row's delta. ranks (L,) int64: a slot's rank (0: empty); present (L, P)
// uint8: the parts an adapter changes; row_slot (T,) int64: a row's slot, -1 for none.
inline void add_(const torch::Tensor& x, torch::Tensor y, const torch::Tensor& a,
                 const std::vector<torch::Tensor>& b, const torch::Tensor& ranks,
                 const torch::Tensor& present, const torch::Tensor& row_slot) {
  check_f32(x, "x");
  check_f32(y, "y");
  check_f32(a, "a");
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && a.is_contiguous(),
              "lora_add_: x, y and a must be contiguous");
  const int64_t T = x.size(0), K = x.size(1), N = y.size(1);
  const int64_t P = static_cast<int64_t>(b.size()), L = a.size(0);
  TORCH_CHECK(P > 0 && y.size(0) == T && row_slot.numel() == T, "lora_add_: shapes");
  const int64_t R = a.size(1) / (P * K);
  std::vector<int64_t> size(P), offset(P);
  for (int64_t p = 0, o = 0; p < P; ++p) {
    check_f32(b[p], "b");
    size[p] = b[p].size(1) / R, offset[p] = o, o += size[p];
    TORCH_CHECK(b[p].is_contiguous() && b[p].size(0) == L, "lora_add_: b's shape");
  }
  TORCH_CHECK(offset[P - 1] + size[P - 1] == N, "lora_add_: parts do not cover y");
  const int64_t* rank = ranks.data_ptr<int64_t>();
  const uint8_t* has = present.data_ptr<uint8_t>();
  const int64_t* slot_of = row_slot.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> rows(L);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = slot_of[t];
    if (s >= 0 && rank[s] > 0) rows[s].push_back(t);
  }
  std::vector<int64_t> slots;
  for (int64_t s = 0; s < L; ++s)
    if (!rows[s].empty()) slots.push_back(s);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  auto one_slot = [&](int64_t s) {
    const int64_t r = rank[s], n = static_cast<int64_t>(rows[s].size());
    std::vector<float> xs(n * K), h(n * P * r), hp(n * r), delta;
    for (int64_t i = 0; i < n; ++i)
      std::copy_n(xp + rows[s][i] * K, K, xs.data() + i * K);
    const float* as = a.data_ptr<float>() + s * a.size(1);
    dot_form::linear(dense_rows(as, K), xs.data(), n, P * r, nullptr, h.data());
    for (int64_t p = 0; p < P; ++p) {
      if (!has[s * P + p]) continue;
      for (int64_t i = 0; i < n; ++i)
        std::copy_n(h.data() + i * P * r + p * r, r, hp.data() + i * r);
      delta.resize(n * size[p]);
      const float* bs = b[p].data_ptr<float>() + s * b[p].size(1);
      dot_form::linear(dense_rows(bs, r), hp.data(), n, size[p], nullptr, delta.data());
      for (int64_t i = 0; i < n; ++i) {
        float* yr = yp + rows[s][i] * N + offset[p];
        const float* dr = delta.data() + i * size[p];
        for (int64_t j = 0; j < size[p]; ++j) yr[j] += dr[j];
      }
    }
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
