// One MoE layer's experts on CPU in one call (layers/fused_moe.py FusedMoE): the grouped
// computation of `grouped_experts` (the T x k (token, expert) pairs sorted by expert once;
// per active expert, ascending: its gate_up product, the gated activation, its down product,
// scaled by the routing weights and added into the output rows) with the same ATen ops and
// the same kernels (`linear`, `gated_act`), in the same order, so a result is bitwise the
// Python loop's. What goes is the interpreter: a decode step of a 64-expert, top-8 model
// made ~100 Python-level op calls a layer (7 ms of a 26 ms step on two cores).
//
// The experts' weights are bound once (`MoEExperts`, built when the layer's weights are in
// place): a call passes only x and the routing. A step of few (token, expert) pairs (decode)
// computes its active experts side by side on the threads, each expert's products on one
// thread (a product of one or two rows through a 2 MB expert is too small to split), then
// adds them in ascending expert order as the loop does: a row's product does not depend on
// the thread that computes it (linear_cpu.h), so the result is the same bitwise. The fused
// decode call (decode_layers_cpu.cpp) runs a whole MoE block: the router's product,
// `select_experts`, then the experts.
#pragma once
#include "cpu_ops.h"
#include <tuple>
#include <vector>

// A linear layer's weight as `linear` takes it: (kind, group, tensors, int8 activations,
// input scale, batch-invariant).
using ExpertWeight = std::tuple<int64_t, int64_t, std::vector<torch::Tensor>, bool,
                                c10::optional<torch::Tensor>, bool>;

// layers/fused_moe.py select_experts, op for op: softmax over the router logits in float32,
// top-k, renormalized to sum 1 where the model does. → (weights (T, k) float32, ids (T, k)).
inline std::tuple<torch::Tensor, torch::Tensor> select_experts(const torch::Tensor& logits,
                                                               int64_t top_k,
                                                               bool renormalize) {
  const torch::Tensor probs = at::softmax(logits.to(at::kFloat), -1);
  auto [weights, ids] = at::topk(probs, top_k, -1);
  if (renormalize) weights.div_(weights.sum(-1, /*keepdim=*/true));
  return {weights, ids};
}

class MoEExperts {
 public:
  // up[e]: expert e's gate_up weight (2 I, H); down[e]: its down weight (H, I); act: a code
  // of kGatedActs.
  MoEExperts(std::vector<ExpertWeight> up, std::vector<ExpertWeight> down, int64_t act)
      : up_(std::move(up)), down_(std::move(down)), act_(act) {
    TORCH_CHECK(up_.size() == down_.size() && !up_.empty(), "MoEExperts: one up and one "
                "down weight per expert");
    TORCH_CHECK(act >= 0 && act < 3, "MoEExperts: unknown activation code ", act);
  }

  // x (T, H) float32, weights (T, k) float32, ids (T, k) int64 → (T, H).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& weights,
                        const torch::Tensor& ids) const {
    check_f32(x, "x");
    const int64_t k = ids.size(1), E = static_cast<int64_t>(up_.size());
    const torch::Tensor flat = ids.reshape(-1);  // (T k,) token-major
    const torch::Tensor order = torch::argsort(flat, /*stable=*/true);  // the pairs, by expert
    const torch::Tensor counts = torch::bincount(flat, {}, E);
    const torch::Tensor tokens = torch::floor_divide(order, k);  // each sorted pair's token
    const torch::Tensor pair_weights = weights.reshape(-1).index({order});
    const torch::Tensor xs = x.index({tokens});  // (T k, H), gathered once
    torch::Tensor out = torch::zeros_like(x);
    const int64_t* count = counts.data_ptr<int64_t>();
    std::vector<int64_t> active, starts;  // the active experts, ascending, and their pairs
    for (int64_t e = 0, start = 0; e < E; start += count[e], ++e)
      if (count[e] > 0) active.push_back(e), starts.push_back(start);
    const int64_t A = static_cast<int64_t>(active.size());
    std::vector<torch::Tensor> ys(A);
    auto expert = [&](int64_t i) {  // active expert i's scaled outputs (n, H)
      const int64_t e = active[i], n = count[e];
      const torch::Tensor h = gated_act(product(up_[e], xs.narrow(0, starts[i], n)), act_);
      ys[i] = product(down_[e], h) * pair_weights.narrow(0, starts[i], n).unsqueeze(1);
    };
    if (flat.numel() <= kExpertParallelPairs) {
      at::parallel_for(0, A, 1, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) expert(i);
      });
    } else {
      for (int64_t i = 0; i < A; ++i) expert(i);
    }
    for (int64_t i = 0; i < A; ++i)  // in ascending expert order, as the loop adds them
      out.index_add_(0, tokens.narrow(0, starts[i], count[active[i]]),
                     ys[i].to(out.scalar_type()));
    return out;
  }

  // Up to this many (token, expert) pairs the experts run side by side (a decode step of a
  // few tokens); more, and each expert's products take the threads.
  static constexpr int64_t kExpertParallelPairs = 32;

 private:
  static torch::Tensor product(const ExpertWeight& w, const torch::Tensor& x) {
    const auto& [kind, group, tensors, int8_acts, input_scale, invariant] = w;
    return linear(x, kind, group, tensors, c10::nullopt, int8_acts, input_scale, invariant);
  }

  std::vector<ExpertWeight> up_, down_;
  int64_t act_;
};
