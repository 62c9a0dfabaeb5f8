"""GGUF files: the model config from metadata, and a streaming iterator of dequantized tensors
under Hugging Face names.

llama.cpp's converter permutes the rows of Llama q/k projections for its interleaved RoPE; we
undo that so the weights match HF's rotate_half convention (the registry entry says which
architectures it permuted: models/registry.py). Other architectures are stored unpermuted.
The tokenizer and chat template also live in the metadata; transformers builds a fast
tokenizer from them (see engine/tokenizer.py).

Tensor names: `_LAYER_NAMES` is llama.cpp's Llama / Qwen / MoE table; an architecture's
registry entry overrides the names it uses differently (Gemma's norms, Phi-3's fused tensors,
Mixtral's `block_sparse_moe`), says whether norm weights were stored plus one (Gemma), and
turns its metadata into config fields. A stacked expert tensor (E, rows, cols) is yielded as
one tensor per expert under the model's checkpoint names.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Collection, Iterator
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from tokenmill.model_loader.gguf_cache import cached_folder
from tokenmill.model_loader.gguf_index import (
    GGUFIndex,
    GGUFTensor,
    build_index,
    file_map,
    read_index,
    tensor_data,
)
from tokenmill.utils.file_maps import (
    MADV_DONTNEED,
    MADV_POPULATE_READ,
    MADV_WILLNEED,
    advise_file_pages,
    file_map_ranges,
)

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    # mixtures of experts: the router, stacked experts ("{e}": one per expert), shared expert
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj", "ffn_down_exps": "mlp.experts.{e}.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# read into the config (longrope), not weights
_CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def find_gguf_file(path: str) -> str | None:
    """The GGUF file `path` names: the file itself, or the single .gguf inside a folder."""
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model file {path!r} is not a .gguf file; pass a GGUF file or a "
                             "Hugging Face model folder")
        return path
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        found = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(found) > 1:
            raise ValueError(f"{path} holds several .gguf files ({', '.join(found)}); "
                             "pass the one to load")
        if found:
            return os.path.join(path, found[0])
    return None


@lru_cache(maxsize=4)
def gguf_reader(path: str) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # gguf raises ValueError, struct.error, ... for a broken file
        raise ValueError(f"cannot read GGUF file {path}: {e}") from e


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_hf_config(path: str) -> Any:
    """A transformers config built from the GGUF metadata."""
    import gguf
    from transformers import AutoConfig

    r = gguf_reader(path)
    spec = _architecture(r, path)
    arch = spec.gguf_name
    if "rope_freqs.weight" in {t.name for t in r.tensors}:
        raise ValueError(f"{path} uses llama.cpp rope_freqs (Llama 3.1 RoPE scaling) which is "
                         "not supported from GGUF yet; load the Hugging Face folder instead")
    model_type, hf_arch = spec.model_type, spec.name
    g = lambda key, default=None: _field(r, f"{arch}.{key}", default)
    n_heads = g("attention.head_count")
    hidden = g("embedding_length")
    kwargs: dict[str, Any] = dict(
        architectures=[hf_arch],
        vocab_size=g("vocab_size") or len(_field(r, "tokenizer.ggml.tokens")),
        hidden_size=hidden, intermediate_size=g("feed_forward_length"),
        num_hidden_layers=g("block_count"), num_attention_heads=n_heads,
        num_key_value_heads=g("attention.head_count_kv", n_heads),
        head_dim=g("attention.key_length", hidden // n_heads),
        max_position_embeddings=g("context_length"),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in {t.name for t in r.tensors},
        bos_token_id=_field(r, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(r, "tokenizer.ggml.eos_token_id"),
        dtype="float32",
    )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(g("rope.freq_base", 1e4))}
    if g("rope.scaling.type") == "linear":
        rope.update(rope_type="linear", factor=float(g("rope.scaling.factor")))
    elif g("rope.scaling.type") not in (None, "none"):
        raise ValueError(f"unsupported GGUF RoPE scaling {g('rope.scaling.type')!r} in {path}")
    kwargs["rope_parameters"] = rope
    tensors = {t.name: t for t in r.tensors}

    def tensor(name: str) -> np.ndarray | None:
        t = tensors.get(name)
        return None if t is None else gguf.quants.dequantize(t.data, t.tensor_type)

    kwargs.update(spec.gguf_config_kwargs(g, tensor, set(tensors)))
    return AutoConfig.for_model(model_type, **kwargs)


def _architecture(r: Any, path: str) -> Any:
    """The registry entry reading this file (by its architecture and whether it has experts)."""
    arch = _field(r, "general.architecture")
    return _architecture_of(arch, (_field(r, f"{arch}.expert_count") or 0) > 0, path)


def _architecture_of(arch: str, experts: bool, path: str) -> Any:
    from tokenmill.models import registry

    spec = registry.gguf_architecture(arch, experts)
    if spec is None:
        kind = f"{arch!r} with experts" if experts else repr(arch)
        raise ValueError(f"unsupported GGUF architecture {kind} in {path}; "
                         f"supported: {registry.gguf_names()}")
    return spec


@lru_cache(maxsize=4)
def gguf_index(path: str) -> GGUFIndex:
    """Where the file's tensors are (model_loader/gguf_index.py): read from its converted
    folder when an earlier start wrote it there, else built with the gguf package's reader."""
    folder = cached_folder(path)
    index = read_index(folder) if folder is not None else None
    return index if index is not None else build_index(gguf_reader(path))


def _spec(path: str) -> Any:
    index = gguf_index(path)
    return _architecture_of(index.architecture, index.experts > 0, path)


def gguf_num_elements(path: str) -> int:
    """How many weights the file holds (every tensor, as stored)."""
    return sum(t.n_elements for t in gguf_index(path).tensors)


def gguf_num_tensors(path: str) -> int:
    return len(gguf_index(path).tensors)


def iterate_gguf(path: str, hf_config: Any, raw_types: Collection[str] = (),
                 in_place: Callable[[str], bool] | None = None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) for every tensor of the file: float32, dequantized, except
    tensors of a type in `raw_types` (GGML names, e.g. "Q4_1"), which come as their raw block
    rows, uint8 (rows, bytes per row), under `<module>.qweight` (quantization/gguf.py splits
    them). The q/k un-permutation moves whole rows, so raw blocks stay untouched.

    in_place(name it is yielded under): whether the model keeps that tensor's raw rows as
    they are (its parameter holds its parts: layers/linear.py). Those come as views of the
    file's map (gguf_index.file_map), used in place: no copy, and the pages stay the page
    cache's, shared with every process that maps the file. Every other tensor is a copy, and
    its pages of the map are released once the loader has it (they would count in this
    process's RSS beside the copy). Stacked experts and un-permuted q/k rows are always
    copies."""
    import gguf

    spec = _spec(path)
    names = _LAYER_NAMES | dict(spec.gguf_tensors)
    data = file_map(path)
    ranges = file_map_ranges()  # (the map's among them, read once for the whole file)
    kept_tensors = []
    for t in gguf_index(path).tensors:
        if t.name in _CONFIG_TENSORS:
            continue
        name = _hf_name(t.name, names)
        stored = tensor_data(path, t, data)
        permuted = spec.gguf_qk_permuted and (".q_proj." in name or ".k_proj." in name)
        kept = False
        if t.type_name in raw_types:
            name = name[:-len("weight")] + "qweight"
            kept = (in_place is not None and not permuted and "{e}" not in name
                    and in_place(name))
            array = stored if kept else np.array(stored, dtype=np.uint8, copy=True)
        else:
            array = gguf.quants.dequantize(stored, gguf.GGMLQuantizationType[t.type_name])
            array = np.require(array, np.float32, ["C", "W"])  # torch wants writable memory
            if spec.gguf_norm_offset and name.endswith("norm.weight"):
                array = array - spec.gguf_norm_offset
            if name.endswith("shared_expert_gate.weight"):
                array = array.reshape(1, -1)  # llama.cpp stores the (1, H) gate as (H,)
        if permuted:
            heads = (hf_config.num_attention_heads if ".q_proj." in name
                     else hf_config.num_key_value_heads)
            array = _unpermute_qk(array, heads)
        if "{e}" in name:  # stacked experts (E, rows, cols): one tensor each
            for e in range(array.shape[0]):
                yield name.format(e=e), torch.from_numpy(np.ascontiguousarray(array[e]))
        else:
            yield name, torch.from_numpy(np.ascontiguousarray(array))
        if kept:
            kept_tensors.append(t)
        else:
            _drop_pages(data, t, ranges)  # copied into the model by now
    _populate(data, kept_tensors, ranges)


def _populate(data: np.memmap, tensors: list[GGUFTensor], ranges: list[tuple[int, int]]
              ) -> None:
    """Map the pages of the tensors used in place now, as llama.cpp's MAP_POPULATE does: the
    first step would otherwise fault them in one by one (and read a cold file at random).
    An older kernel without MADV_POPULATE_READ reads them ahead, mapped at first touch."""
    for t in tensors:
        advise_file_pages(data.ctypes.data + t.data_offset, t.n_bytes, MADV_POPULATE_READ,
                          MADV_WILLNEED, ranges=ranges)


def _drop_pages(data: np.memmap, tensor: GGUFTensor, ranges: list[tuple[int, int]]) -> None:
    """Release the map's pages of a tensor already copied into the model: read through the
    map they count in this process's RSS, and without this a load would peak at twice the
    file (the map's pages plus the model's copy). Pages it shares with a neighbour used in
    place are read again from the page cache when next touched: the map is private and never
    written, so its contents stay the file's."""
    advise_file_pages(data.ctypes.data + tensor.data_offset, tensor.n_bytes, MADV_DONTNEED,
                      ranges=ranges)


def gguf_tensor_types(path: str) -> dict[str, str]:
    """HF parameter name → GGML type name ("Q4_1", "F32", ...) of every tensor of the file."""
    names = _LAYER_NAMES | dict(_spec(path).gguf_tensors)
    return {_hf_name(t.name, names): t.type_name for t in gguf_index(path).tensors
            if t.name not in _CONFIG_TENSORS}


def _hf_name(name: str, layer_names: dict[str, str] = _LAYER_NAMES) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if not m or m.group(2) not in layer_names:
        raise ValueError(f"unexpected GGUF tensor {name!r}")
    return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}.{m.group(3)}"


def _unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's (heads, 2, D/2) → (heads, D/2, 2) row interleave of q/k projections."""
    rows = w.shape[0]
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))
