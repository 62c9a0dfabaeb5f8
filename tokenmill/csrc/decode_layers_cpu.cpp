// All decoder layers of a CPU step (decodes and prefill chunks) in one C++ call.
//
// At batch 1 a layer's math is its four weight reads and a little vector work; called op by
// op from Python, each layer also paid about 80 us of interpreter, binding and dispatch cost
// (2.5 ms a step over 30 layers, benchmarks/RESULTS.md), and at 64 decodes about 150 us while
// the second core waited (6-19% of the step). This runs the same ops as the modules' forward,
// in the same order and with the same kernels (cpu_ops.h, linear_cpu.h, paged_attention_cpu.h),
// so its results are bitwise equal to the modules' (tests/models/test_cpu_decode.py) at every
// step size the caller admits (each linear layer's method takes the same kernel at that
// size). Each linear layer comes as its quantization method's descriptor (kind, group,
// tensors): any weight format `linear` knows runs here unchanged.
//
// What it computes is a fixed set of ops, `kOps` below, published to Python as OPS: the
// caller (models/cpu_decode.py) builds its plan from what each module states it computes
// (layers/op_spec.py) and runs this call only when every stated op and variant is in the set;
// anything else runs the modules. The caller also guarantees float32 activations and a step
// whose every query (a decode's or a prefill chunk's) goes to the paged-attention kernel.
//
// Per layer ("pre_norm_block"), with hidden (T, H) and residual (T, H):
//   h, residual = add_rms_norm(hidden, residual, in_norm)   (layer 0: rms_norm, residual = x)
//   q, k, v     = split(linear(h, qkv))                      (T, Hq | Hkv | Hkv, D) views
//   q, k = rms_norm(q, q_norm), rms_norm(k, k_norm)  over each head (Qwen3: "qk_norm"), or
//          over all of q's and all of k's heads at once (OLMoE: "qk_norm_all_heads"), then
//   q, k, v = clamp(q | k | v, -clip, clip)  (OLMoE's clip_qkv: "clip_qkv")
//   rotary_(q, k); q, k = q R, k R (a quantized cache's key rotation, given as R^T)
//   store k, v at slot_mapping; a = paged_attention(q)   (T, Hq * D)
//   h, residual = add_rms_norm(all_reduce(linear(a, o)), residual, post_norm)
//   hidden      = all_reduce(linear(gated_act(linear(h, gate_up), act), down))
// or, for a layer with a mixture of experts in place of the MLP ("moe", moe_cpu.h):
//   weights, ids = select_experts(linear(h, router), top_k, renormalize)
//   hidden      = experts.forward(h, weights, ids)                 (not under TP)
//   (+ sigmoid(linear(h, shared_gate)) * linear(gated_act(linear(h, gate_up), act), down):
//   Qwen2-MoE's shared expert, "moe.shared_expert")
// all_reduce: under tensor parallelism (a shared-memory segment given: shm_all_reduce.h) the
// row-parallel outputs are summed over the ranks, as RowParallelLinear does (which is why the
// caller admits those layers only without a bias); without a segment it is the identity.
// A linear layer with LoRA slots adds its rows' adapter deltas after its product (loras,
// beside the linears; row_slot: each row's slot this step, None when no row has an adapter).
// Returns (hidden, residual, the all-reduce's last sequence number) after the last layer.
#include "cpu_ops.h"
#include "lora_cpu.h"
#include "moe_cpu.h"
#include "paged_attention_cpu.h"

namespace {
// The ops and variants this call computes (names as layers/op_spec.py's specs state them).
const std::vector<std::string> kOps = {
    "pre_norm_block", "rms_norm", "rope",
    "attention", "attention.window", "attention.key_rotation", "attention.kv_float32",
    "attention.kv_bfloat16", "attention.kv_float16", "attention.kv_int8", "attention.kv_fp8",
    "attention.qk_norm",
    "attention.qk_norm_all_heads", "attention.clip_qkv",
    "linear", "linear.bias", "linear.tp_all_reduce", "linear.lora",
    "gated_mlp", "gated_act", "gated_act.silu", "gated_act.gelu", "gated_act.gelu_tanh",
    "moe", "moe.shared_expert", "moe_experts", "moe_experts.renormalize"};
constexpr size_t kNormsPerLayer = 2;  // in_norm, post_norm
// Linear layers per layer: qkv, o, then the MLP's gate_up, down, or an MoE block's router
// (and its shared expert's gate, gate_up, down) (bias None where absent).
// An MoE layer's block: its experts (bound once), top_k, renormalize, whether it has a shared
// expert; experts None for an MLP layer.
using MoEDesc = std::tuple<const MoEExperts*, int64_t, bool, bool>;
size_t linears_of(const MoEDesc& m) {
  return std::get<0>(m) == nullptr ? 4 : std::get<3>(m) ? 6 : 3;
}
// kind, group, tensors, int8 activations, input scale, batch-invariant, bias (as
// cpu_ops.linear takes them)
using LinearDesc = std::tuple<int64_t, int64_t, std::vector<torch::Tensor>, bool,
                              c10::optional<torch::Tensor>, bool, c10::optional<torch::Tensor>>;

// x (T, H, D) @ R, given R^T (D, D): rows through the invariant dot kernels, as the
// attention module rotates them (layers/attention.py).
torch::Tensor rotate(const torch::Tensor& x, const torch::Tensor& rotation_t) {
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  return linear(x.reshape({T * H, D}), 0, 0, {rotation_t}, c10::nullopt, false, c10::nullopt,
                true).view({T, H, D});
}

// A linear layer's LoRA slots as lora_cpu::add_ reads them: a, b, ranks, scales, present.
using LoRADesc = std::tuple<torch::Tensor, std::vector<torch::Tensor>, torch::Tensor,
                            torch::Tensor, torch::Tensor>;
using OptLoRA = c10::optional<LoRADesc>;

// The layer's product, then (a step with adapters: row_slot given) its rows' LoRA deltas,
// before any all-reduce, as LinearBase.forward adds them (lora/layers.py).
torch::Tensor run_linear(const LinearDesc& d, const OptLoRA& lora,
                         const c10::optional<torch::Tensor>& row_slot, const torch::Tensor& x) {
  auto y = linear(x, std::get<0>(d), std::get<1>(d), std::get<2>(d), std::get<6>(d),
                  std::get<3>(d), std::get<4>(d), std::get<5>(d));
  if (lora.has_value() && row_slot.has_value()) {
    const auto& [a, b, ranks, scales, present] = *lora;
    lora_cpu::add_(x.contiguous(), y, a, b, ranks, scales, present, *row_slot);
  }
  return y;
}
}  // namespace

std::tuple<torch::Tensor, torch::Tensor, int64_t> decode_layers(
    torch::Tensor hidden, const std::vector<torch::Tensor>& norms,
    const std::vector<LinearDesc>& linears, const std::vector<torch::Tensor>& kv_caches,
    const std::vector<c10::optional<torch::Tensor>>& kv_scales,
    const c10::optional<torch::Tensor>& key_rotation,
    torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_mapping,
    torch::Tensor block_tables, torch::Tensor seq_rows, torch::Tensor start_lens,
    torch::Tensor ctx_lens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    double eps, double scale, const c10::optional<torch::Tensor>& shm_segment, int64_t rank,
    int64_t world, int64_t slot_bytes, int64_t seq, double timeout_s,
    const std::vector<int64_t>& acts, int64_t split_keys, const std::vector<MoEDesc>& moe,
    const std::vector<OptLoRA>& loras, const c10::optional<torch::Tensor>& row_slot,
    const std::vector<torch::Tensor>& qk_norms, bool qk_norm_all_heads, double clip_qkv) {
  const size_t L = kv_caches.size();
  size_t num_linears = 0;
  for (const auto& m : moe) num_linears += linears_of(m);
  TORCH_CHECK(moe.size() == L && norms.size() == L * kNormsPerLayer &&
              linears.size() == num_linears &&
              (loras.empty() || loras.size() == num_linears),
              "decode_layers: 2 norms and 4 linear layers per layer (an MoE layer: 3, or 6 "
              "with a shared expert)");
  TORCH_CHECK(kv_scales.size() == L && acts.size() == L,
              "decode_layers: one kv_scales entry and one activation per layer");
  TORCH_CHECK(qk_norms.empty() || qk_norms.size() == 2 * L,
              "decode_layers: q and k norms for every layer, or none");
  TORCH_CHECK(clip_qkv == 0 || clip_qkv > 0, "decode_layers: clip_qkv > 0, or 0 for none");
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(0) >= 1,
              "decode_layers takes (tokens, hidden), 1 token or more");
  const int64_t T = hidden.size(0), Hq = num_heads, Hkv = num_kv_heads, D = head_dim;
  const int64_t H = hidden.size(1);
  torch::Tensor residual;
  auto all_reduce = [&](torch::Tensor x) {
    if (shm_segment.has_value())
      seq = shm_all_reduce_(x, *shm_segment, rank, world, slot_bytes, seq, timeout_s);
    return x;
  };
  const LinearDesc* lin = linears.data();
  // each linear layer's LoRA slots, beside it (none passed: no row has an adapter)
  const std::vector<OptLoRA> no_loras(loras.empty() ? num_linears : 0);
  const OptLoRA* lo = loras.empty() ? no_loras.data() : loras.data();
  auto run = [&](int64_t i, const torch::Tensor& x) {
    return run_linear(lin[i], lo[i], row_slot, x);
  };
  for (size_t l = 0; l < L; ++l) {
    const torch::Tensor* w = &norms[l * kNormsPerLayer];
    const auto& [experts, top_k, renormalize, shared] = moe[l];
    if (l == 0) {  // no residual yet: RMSNorm's plain path (torch's rms_norm, as the module)
      residual = hidden;
      hidden = at::rms_norm(hidden, {H}, w[0], eps);
    } else {
      auto normed = add_rms_norm(hidden, residual, w[0], eps);
      hidden = normed[0];
      residual = normed[1];
    }
    auto qkv = run(0, hidden).view({T, Hq + 2 * Hkv, D});
    auto q = qkv.narrow(1, 0, Hq), k = qkv.narrow(1, Hq, Hkv), v = qkv.narrow(1, Hq + Hkv, Hkv);
    if (!qk_norms.empty()) {  // RMSNorm's plain path (torch's rms_norm), as the modules
      if (qk_norm_all_heads) {  // (T, Hq D) and (T, Hkv D), then back to heads
        q = at::rms_norm(qkv.view({T, -1}).narrow(1, 0, Hq * D), {Hq * D}, qk_norms[2 * l],
                         eps).view({T, Hq, D});
        k = at::rms_norm(qkv.view({T, -1}).narrow(1, Hq * D, Hkv * D), {Hkv * D},
                         qk_norms[2 * l + 1], eps).view({T, Hkv, D});
      } else {
        q = at::rms_norm(q, {D}, qk_norms[2 * l], eps);
        k = at::rms_norm(k, {D}, qk_norms[2 * l + 1], eps);
      }
    }
    if (clip_qkv > 0) {
      q = q.clamp(-clip_qkv, clip_qkv);
      k = k.clamp(-clip_qkv, clip_qkv);
      v = v.clamp(-clip_qkv, clip_qkv);
    }
    rotary_(q, k, cos, sin);
    if (key_rotation.has_value()) {  // a quantized cache's keys are stored rotated (and q)
      q = rotate(q, *key_rotation);
      k = rotate(k, *key_rotation);
    }
    const auto& cache = kv_caches[l];  // (2, num_blocks, block_size, Hkv, R), any row format
    auto k_cache = cache.select(0, 0), v_cache = cache.select(0, 1);
    store_kv_(k_cache, v_cache, k, v, slot_mapping, kv_scales[l]);
    auto attn = paged_attention(q, k_cache, v_cache, block_tables, seq_rows, start_lens,
                                ctx_lens, scale, kv_scales[l], 0.0, split_keys)[0]
                    .view({T, Hq * D});
    auto normed = add_rms_norm(all_reduce(run(1, attn)), residual, w[1], eps);
    residual = normed[1];
    if (experts != nullptr) {
      auto [weights, ids] = select_experts(run(2, normed[0]), top_k, renormalize);
      hidden = experts->forward(normed[0], weights, ids);
      if (shared)
        hidden = hidden + ::sigmoid(run(3, normed[0])) *
                              run(5, gated_act(run(4, normed[0]), acts[l]));
    } else {
      hidden = all_reduce(run(3, gated_act(run(2, normed[0]), acts[l])));
    }
    lin += linears_of(moe[l]);
    lo += linears_of(moe[l]);
  }
  return {hidden, residual, seq};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is released: a server's event loop keeps running during the step.
  m.def("decode_layers", &decode_layers, "all decoder layers of a CPU step",
        py::call_guard<py::gil_scoped_release>());
  m.attr("OPS") = py::cast(kOps);
  // An MoE layer's experts as the call takes them (the same class as cpu_ops'; this
  // module's own objects, built by models/cpu_decode.py).
  py::class_<MoEExperts>(m, "MoEExperts", py::module_local())
      .def(py::init<std::vector<ExpertWeight>, std::vector<ExpertWeight>, int64_t>(),
           py::arg("up"), py::arg("down"), py::arg("act"));
}
