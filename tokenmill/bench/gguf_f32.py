"""An F32 copy of a GGUF file (every tensor dequantized, metadata unchanged), for llama.cpp.

tokenmill dequantizes a GGUF model's weights to float32 and computes with those. To compare
single-stream decode with llama.cpp like for like, llama.cpp must read the same float32
weights, not the file's 4-5 bit blocks (which it streams 6-7x faster). The copy is written once
into tokenmill's cache folder, keyed on the source file like the converted GGUF folder.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

from tokenmill.model_loader.gguf_cache import cache_root, keyed_name


def f32_copy(gguf_path: str, perturb_seed: int | None = None) -> str:
    """Path of an F32 copy of `gguf_path`, writing it on first use.

    With `perturb_seed`, each weight of a quantized tensor also moves by a seeded uniform
    amount within half its block's quantization step (`_off_grid`): the copy is then a float
    checkpoint of which the file is a faithful quantization, as a real full-precision model is,
    instead of one that its own quantization reproduces exactly."""
    import gguf

    suffix = ".F32.gguf" if perturb_seed is None else f".F32.offgrid{perturb_seed}.gguf"
    name = keyed_name(gguf_path) + suffix
    out = cache_root() / "gguf-f32" / name
    if out.is_file():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(gguf_path)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    fd, tmp = tempfile.mkstemp(prefix=name + ".", dir=out.parent)
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(tmp, arch)
        for field in reader.fields.values():
            # The writer adds the architecture and the GGUF.* header fields itself.
            if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
                continue
            if field.name == gguf.Keys.General.FILE_TYPE:
                writer.add_file_type(gguf.LlamaFileType.ALL_F32)
                continue
            val_type = field.types[0]
            sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), val_type, sub_type=sub_type)
        rng = None if perturb_seed is None else np.random.default_rng(perturb_seed)
        for t in reader.tensors:
            data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            if rng is not None and t.tensor_type.name in _LEVELS:
                data = _off_grid(data, _LEVELS[t.tensor_type.name], rng)
            writer.add_tensor(t.name, data, raw_dtype=gguf.GGMLQuantizationType.F32)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return str(out)


# Quantization levels per 32-value block of the GGUF block types: a block's step is its range
# over (levels - 1).
_LEVELS = {"Q4_0": 16, "Q4_1": 16, "Q8_0": 256}


def _off_grid(data: np.ndarray, levels: int, rng: np.random.Generator) -> np.ndarray:
    """`data` moved by uniform noise of up to half a quantization step of its 32-block."""
    blocks = data.reshape(-1, 32)
    step = (blocks.max(axis=1, keepdims=True) - blocks.min(axis=1, keepdims=True)) / (levels - 1)
    noise = rng.uniform(-0.5, 0.5, size=blocks.shape).astype(np.float32) * step
    return (blocks + noise).reshape(data.shape)
