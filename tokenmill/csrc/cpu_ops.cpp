// Python bindings of the fused layer ops in cpu_ops.h (the kernels live in the header so
// that decode_layers_cpu.cpp can call them without a Python round trip).
//
// Every op releases the GIL while it runs: a prefill step's products take tens of
// milliseconds each, and a server's event loop (and its /health) must keep running meanwhile
// (under a burst of requests it had waited seconds for the engine thread's kernels).
#include "cpu_ops.h"
#include "lora_cpu.h"
#include "moe_cpu.h"

namespace {
using release = py::call_guard<py::gil_scoped_release>;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "y = x @ W^T (+ bias) for a (kind, group, tensors) weight",
        py::arg("x"), py::arg("kind"), py::arg("group"), py::arg("tensors"), py::arg("bias"),
        py::arg("int8_acts") = false, py::arg("input_scale") = py::none(),
        py::arg("invariant") = false, release());
  // Weight kind 10 (csrc/linear_bf16.h): whether this module's products run on AVX512-BF16
  // (the CPU has it and the switch is on) and, given `enable`, the switch set (off: the
  // float32 emulation, which the tests compare the instructions with); returns the state
  // before. This module's switch only: decode_layers_cpu keeps its own (on).
  m.def("bf16_products_hardware", [](c10::optional<bool> enable) {
    const bool before = bf16_products::hardware_active();
    if (enable.has_value()) bf16_products::use_hardware() = *enable;
    return before;
  }, py::arg("enable") = py::none());
  // Likewise for AMX tiles (csrc/linear_bf16_amx.h) within the hardware path: whether the
  // loader packs bfloat16 weights for them (kind 16: the CPU has AMX-BF16, Linux granted the
  // tile state, both switches on) and, given `enable`, this switch set (off: kind 10 stays,
  // vdpbf16ps, whose order the tests transcribe).
  m.def("bf16_products_amx", [](c10::optional<bool> enable) {
    const bool before = bf16_products::amx_active();
    if (enable.has_value()) bf16_products::use_amx() = *enable;
    return before;
  }, py::arg("enable") = py::none());
  m.def("bf16_tiles", &bf16_products::pack_tiles,
        "W (N, K) bfloat16 packed for AMX tiles (kind 16): (N / 16, K / 2, 16, 2)", release());
  // The switch of the block tiles (csrc/linear_block_tiles.h, linear_kquant_tiles.h): given
  // `enable`, set; returns the state before (on: the loader packs what `packs_kind` says).
  m.def("block_tiles", [](c10::optional<bool> enable) {
    const bool before = block_tiles::use_tiles();
    if (enable.has_value()) block_tiles::use_tiles() = *enable;
    return before;
  }, py::arg("enable") = py::none());
  // Whether the loader packs block weights of kind `kind` into tiles of 16 rows here (the
  // switch above on): kinds 1 and 2 where their tiles are built (above), GGUF Q4_K (kind 5)
  // on every SIMD build (kind 19, linear_kquant_tiles.h), GGUF Q6_K (kind 7) on AVX-512 VNNI
  // builds (kind 20, linear_q6k_tiles.h).
  m.def("packs_kind", [](int64_t kind) {
    if (kind == block_tiles::kQ8Source || kind == block_tiles::kQ4Source)
      return block_tiles::active();
#if defined(TOKENMILL_KQUANT_TILES)
    if (kind == gguf_blocks::kQ4_K) return block_tiles::use_tiles();
#endif
#if defined(TOKENMILL_Q6K_TILES)
    if (kind == gguf_blocks::kQ6_K) return block_tiles::use_tiles();
#endif
    return false;
  }, py::arg("kind"));
  // Whether the products of those tiles run on AMX-INT8 here (the CPU has it, Linux granted
  // the tile state, TOKENMILL_AMX is not 0); elsewhere vpdpbusd, the same bits.
  m.def("block_tiles_amx", [] {
#if defined(TM_HAVE_BLOCK_TILES)
    return amx::available(amx::kInt8);
#else
    return false;
#endif
  });
  m.def("gather_rows", &gather_rows, "rows of a quantized weight as float32", release());
  m.def("add_rms_norm", &add_rms_norm, "(rms_norm(x + residual) * weight, x + residual)",
        release());
  m.def("gated_act", &gated_act, "act(gate) * up, act by its code in GATED_ACTS", release());
  // Whether GGUF block weights (Q5_0 .. Q6_K) meet float activations rounded to int16
  // (csrc/linear_gguf_rows.h: the SIMD builds) rather than exact float32 (the portable one).
  m.attr("GGUF_INT16_ACTIVATIONS") = kGgufRows;
  m.attr("GATED_ACTS") = py::make_tuple(kGatedActs[0], kGatedActs[1], kGatedActs[2]);
  m.def("sigmoid", &sigmoid, "1 / (1 + exp(-x)), the same for an element wherever it lies",
        release());
  m.def("rotary_", &rotary_, "rotate_half RoPE in place on q and k", release());
  m.def("store_kv_", &store_kv_, "write k, v rows into their KV cache slots (quantized "
        "when the cache is)", py::arg("k_cache"), py::arg("v_cache"), py::arg("k"), py::arg("v"),
        py::arg("slot_mapping"), py::arg("kv_scales") = py::none(), release());
  m.def("argmax_rows", &argmax_rows, "torch.argmax(x, -1) of a float32 (S, V) matrix",
        release());
  m.def("apply_token_bitmask_", &apply_token_bitmask_,
        "-inf at the tokens a grammar bitmask disallows, in rows of logits", release());
  py::class_<MoEExperts>(m, "MoEExperts", py::module_local(),
                         "an MoE layer's experts, bound once (moe_cpu.h)")
      .def(py::init<std::vector<ExpertWeight>, std::vector<ExpertWeight>, int64_t>(),
           py::arg("up"), py::arg("down"), py::arg("act"))
      .def("forward", &MoEExperts::forward, "x (T, H), routing weights and ids (T, k)",
           py::arg("x"), py::arg("weights"), py::arg("ids"), release());
  m.def("lora_add_", &lora_cpu::add_, "y += each row's LoRA delta, every adapter of the step "
        "in one call (lora_cpu.h)", py::arg("x"), py::arg("y"), py::arg("a"), py::arg("b"),
        py::arg("ranks"), py::arg("scales"), py::arg("present"), py::arg("row_slot"), release());
  m.def("shm_all_reduce_", &shm_all_reduce_, "sum a float32 tensor over the ranks sharing a "
        "memory segment, in place; the last sequence number used", release());
}
