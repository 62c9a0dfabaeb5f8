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
}
