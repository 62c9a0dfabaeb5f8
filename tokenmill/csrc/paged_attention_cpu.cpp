// Python bindings of the paged attention in paged_attention_cpu.h (the kernels live in the header so
// that decode_layers_cpu.cpp can call them without a Python round trip).
#include "paged_attention_cpu.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention from the block-paged KV cache");
}
