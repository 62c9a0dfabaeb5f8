// Python bindings of the fused layer ops in cpu_ops.h (the kernels live in the header so
// that decode_layers_cpu.cpp can call them without a Python round trip).
#include "cpu_ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "y = x @ W^T (+ bias) for a (kind, group, tensors) weight",
        py::arg("x"), py::arg("kind"), py::arg("group"), py::arg("tensors"), py::arg("bias"),
        py::arg("int8_acts") = false, py::arg("input_scale") = py::none(),
        py::arg("invariant") = false);
  m.def("gather_rows", &gather_rows, "rows of a quantized weight as float32");
  m.def("add_rms_norm", &add_rms_norm, "(rms_norm(x + residual) * weight, x + residual)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("gated_act", &gated_act, "act(gate) * up, act by its code in GATED_ACTS");
  m.def("sigmoid", &sigmoid, "1 / (1 + exp(-x)), the same for an element wherever it lies");
  m.attr("GATED_ACTS") = py::make_tuple(kGatedActs[0], kGatedActs[1], kGatedActs[2]);
  m.def("rotary_", &rotary_, "rotate_half RoPE in place on q and k");
  m.def("store_kv_", &store_kv_, "write k, v rows into their KV cache slots (quantized "
        "when the cache is)", py::arg("k_cache"), py::arg("v_cache"), py::arg("k"), py::arg("v"),
        py::arg("slot_mapping"), py::arg("kv_scales") = py::none());
  m.def("argmax_rows", &argmax_rows, "torch.argmax(x, -1) of a float32 (S, V) matrix");
  m.def("apply_token_bitmask_", &apply_token_bitmask_,
        "-inf at the tokens a grammar bitmask disallows, in rows of logits");
  m.def("shm_all_reduce_", &shm_all_reduce_, "sum a float32 tensor over the ranks sharing a "
        "memory segment, in place; the last sequence number used");
}
