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


def f32_copy(gguf_path: str) -> str:
    """Path of an F32 copy of `gguf_path`, writing it on first use."""
    import gguf

    name = keyed_name(gguf_path) + ".F32.gguf"
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
        for t in reader.tensors:
            data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
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
