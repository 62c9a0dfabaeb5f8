// All decoder layers of a small decode step (1-4 tokens) in one C++ call.
//
// At batch 1 a layer's math is its four weight reads (about 0.5 ms for SmolLM2) and a little
// vector work; called op by op from Python, each layer also paid about 80 us of interpreter,
// binding and dispatch cost (2.5 ms a step over 30 layers, benchmarks/RESULTS.md). This runs
// the same ops as models/cpu_decode.py's Python loop, in the same order and with the same
// kernels (cpu_ops.h, paged_attention_cpu.h), so the results are bitwise equal to it and to
// the modules' forward (tests/models/test_cpu_decode.py). The caller guarantees what makes
// that true: a Llama-style layer (no per-head q/k norm), float32 dense weights, and a step
// whose every query goes to the paged-attention kernel (no cascade, no prefill chunk).
//
// Per layer, with hidden (T, H) and residual (T, H):
//   h, residual = add_rms_norm(hidden, residual, in_norm)   (layer 0: rms_norm, residual = x)
//   q, k, v     = split(h @ Wqkv^T + b)                      (T, Hq | Hkv | Hkv, D) views
//   rotary_(q, k); store k, v at slot_mapping; a = paged_attention(q)   (T, Hq * D)
//   h, residual = add_rms_norm(a @ Wo^T + b, residual, post_norm)
//   hidden      = silu_and_mul(h @ Wgu^T + b) @ Wdown^T + b
// Returns (hidden, residual) after the last layer, as the Python loop does.
#include "cpu_ops.h"
#include "paged_attention_cpu.h"

namespace {
constexpr size_t kWeightsPerLayer = 6;  // in_norm, post_norm, qkv, o, gate_up, down
constexpr size_t kBiasesPerLayer = 4;   // qkv, o, gate_up, down (None where absent)
}  // namespace

std::vector<torch::Tensor> decode_layers(
    torch::Tensor hidden, const std::vector<torch::Tensor>& weights,
    const std::vector<c10::optional<torch::Tensor>>& biases,
    const std::vector<torch::Tensor>& kv_caches, torch::Tensor cos, torch::Tensor sin,
    torch::Tensor slot_mapping, torch::Tensor block_tables, torch::Tensor seq_rows,
    torch::Tensor start_lens, torch::Tensor ctx_lens, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, double eps, double scale) {
  const size_t L = kv_caches.size();
  TORCH_CHECK(weights.size() == L * kWeightsPerLayer && biases.size() == L * kBiasesPerLayer,
              "decode_layers: 6 weights and 4 biases per layer");
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(0) >= 1 && hidden.size(0) <= 4,
              "decode_layers takes 1 to 4 tokens");
  const int64_t T = hidden.size(0), Hq = num_heads, Hkv = num_kv_heads, D = head_dim;
  const int64_t H = hidden.size(1);
  torch::Tensor residual;
  for (size_t l = 0; l < L; ++l) {
    const torch::Tensor* w = &weights[l * kWeightsPerLayer];
    const c10::optional<torch::Tensor>* b = &biases[l * kBiasesPerLayer];
    if (l == 0) {  // no residual yet: RMSNorm's plain path (torch's rms_norm, as in Python)
      residual = hidden;
      hidden = at::rms_norm(hidden, {H}, w[0], eps);
    } else {
      auto normed = add_rms_norm(hidden, residual, w[0], eps);
      hidden = normed[0];
      residual = normed[1];
    }
    auto qkv = linear_small_m(hidden, w[2], b[0]).view({T, Hq + 2 * Hkv, D});
    auto q = qkv.narrow(1, 0, Hq), k = qkv.narrow(1, Hq, Hkv), v = qkv.narrow(1, Hq + Hkv, Hkv);
    rotary_(q, k, cos, sin);
    const auto& cache = kv_caches[l];  // (2, num_blocks, block_size, Hkv, D)
    auto k_cache = cache.select(0, 0), v_cache = cache.select(0, 1);
    store_kv_(k_cache, v_cache, k, v, slot_mapping);
    auto attn = paged_attention(q, k_cache, v_cache, block_tables, seq_rows, start_lens,
                                ctx_lens, scale)[0].view({T, Hq * D});
    auto normed = add_rms_norm(linear_small_m(attn, w[3], b[1]), residual, w[1], eps);
    residual = normed[1];
    hidden = linear_small_m(silu_and_mul(linear_small_m(normed[0], w[4], b[2])), w[5], b[3]);
  }
  return {hidden, residual};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is released: a server's event loop keeps running during the step.
  m.def("decode_layers", &decode_layers, "all decoder layers of a 1-4 token decode step",
        py::call_guard<py::gil_scoped_release>());
}
