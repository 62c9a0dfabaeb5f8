// Python bindings of the paged attention in paged_attention_cpu.h (the kernels live in the header so
// that decode_layers_cpu.cpp can call them without a Python round trip).
#include "paged_attention_cpu.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention from the block-paged KV cache",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("seq_rows"), py::arg("start_lens"), py::arg("ctx_lens"), py::arg("scale"),
        py::arg("kv_scales") = py::none(), py::arg("soft_cap") = 0.0,
        py::arg("split_keys") = 0,
        py::call_guard<py::gil_scoped_release>());  // (the event loop runs meanwhile)
  m.def("bf16_on_tiles", [](int64_t head_size) { return on_tiles(KVFormat::kBf16, head_size); },
        "whether a bfloat16 cache with heads of this size is attended on the AMX tile unit "
        "(q and p rounded to bfloat16: paged_attention_amx.h)", py::arg("head_size"));
  m.def("bf16_rounds_qp", [](int64_t head_size, int64_t group) {
          return on_tiles(KVFormat::kBf16, head_size) ||
                 keys_dot(KVFormat::kBf16, head_size, group);
        },
        "whether a bfloat16 cache with heads of this size, `group` query heads per KV head, is "
        "attended with q and p rounded to bfloat16 (the AMX tile unit, or vdpbf16ps: "
        "paged_attention_keys_dp.h)", py::arg("head_size"), py::arg("group"));
  // The vdpbf16ps path's switch (tests compare it with the float32 one on the same machine);
  // returns the state before. TOKENMILL_BF16_DOT_ATTENTION=0 sets it off at start-up.
  m.def("bf16_dot_attention", [](c10::optional<bool> enable) {
#ifdef TM_ATTENTION_KEYS_DP
    const bool before = attention_keys_dp::use_dot();
    if (enable.has_value()) attention_keys_dp::use_dot() = *enable;
    return before;
#else
    return false;
#endif
  }, py::arg("enable") = py::none());
}
