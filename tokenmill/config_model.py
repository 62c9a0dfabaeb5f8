"""ModelConfig from a model as users name it: a Hugging Face folder, a .gguf file or a Hub id
(resolved through model_loader/hub.py), its config.json read (with --hf-overrides over it, and
its quirks normalized into ModelConfig.hf_overrides), its architecture and RoPE checked, its
context length and compute dtype chosen. config_factory.py assembles the engine's config
around it.

Invariant: the object transformers loaded is never changed (overrides and quirks apply to
copies); a model that cannot be served is a ValueError naming it before any weight is read.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from tokenmill.config import DTYPES, LOAD_FORMATS, SUPPORTED_ROPE_TYPES, ModelConfig
from tokenmill.config_weights import checkpoint_quantization, resolve_quantization
from tokenmill.layers.rotary import rope_parameter_sets
from tokenmill.model_loader import gguf_loader
from tokenmill.model_loader.default_model import default_model_path
from tokenmill.model_loader.gguf_cache import load_full_config
from tokenmill.model_loader.gguf_convert import converted_folder
from tokenmill.model_loader.hf_overrides import parse_hf_overrides, with_hf_overrides
from tokenmill.model_loader.hub import parse_hub_id, resolve_hub_model
from tokenmill.models import registry
from tokenmill.quantization import WEIGHT_FORMATS


def model_config(path: str | None, dtype: str = "auto", max_model_len: int | None = None,
                 load_format: str = "auto", quantization: str | None = None,
                 int8_activations: bool = False, revision: str | None = None,
                 download_dir: str | None = None, tokenizer: str | None = None,
                 trust_remote_code: bool = False,
                 hf_overrides: str | dict[str, Any] | None = None,
                 tokenizer_revision: str | None = None,
                 hf_token: str | bool | None = None) -> ModelConfig:
    """`path`: a Hugging Face folder, a .gguf file or a Hub id (model_loader/hub.py, at
    `revision`, cached in `download_dir`, fetched with `hf_token` if given); None: the
    default model; `tokenizer` at `tokenizer_revision` (else `revision`). The weight format
    is the one asked for or the checkpoint's own (default_quantization picks among the
    rest)."""
    path = default_model_path() if path is None else os.path.expanduser(str(path))
    hub = _HubAccess(download_dir, hf_token)
    hub_id, path = _local_model(path, revision, hub, with_code=trust_remote_code)
    tokenizer_dir = (None if tokenizer is None else
                     _local_model(os.path.expanduser(tokenizer),
                                  tokenizer_revision or revision, hub, True,
                                  trust_remote_code)[1])
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, "
                         f"got {load_format!r}")
    hf_config, gguf_file, converted = _read_hf_config(path, trust_remote_code)
    hf_config = with_hf_overrides(hf_config, parse_hf_overrides(hf_overrides))
    hf_quant = checkpoint_quantization(hf_config)
    quantization = resolve_quantization(quantization, hf_quant, gguf_file, path)
    if load_format == "dummy" and quantization is not None and (
            "float" not in WEIGHT_FORMATS[quantization].sources or hf_quant is not None):
        raise ValueError(f"load_format='dummy' draws float weights: it works with "
                         f"quantization None or one made from them (int8, int4, fp8), not "
                         f"{quantization!r} of a quantized checkpoint")
    archs = getattr(hf_config, "architectures", None) or []
    spec = registry.find_architecture(archs)
    if spec is None:
        raise ValueError(
            f"unsupported model architecture {archs or hf_config.model_type!r} in {path}; "
            f"supported: {registry.supported()}")
    _check_rope(hf_config, path)
    max_model_len = _max_model_len(hf_config, max_model_len)
    return ModelConfig(
        path=path, hf_config=hf_config, architecture=spec.name,
        dtype=_resolve_dtype(dtype, hf_config), max_model_len=max_model_len,
        gguf_file=gguf_file, converted_dir=converted, headless=registry.is_headless(archs),
        load_format=load_format, quantization=quantization, hf_quant_config=hf_quant,
        int8_activations=bool(int8_activations), hub_id=hub_id, tokenizer=tokenizer_dir,
        revision=revision, download_dir=download_dir, trust_remote_code=trust_remote_code,
        hf_overrides=_normalized_quirks(hf_config, max_model_len), hf_token=hf_token)


def _read_hf_config(path: str, trust_remote_code: bool = False
                    ) -> tuple[Any, str | None, str | None]:
    """(the transformers config, the GGUF file, its converted folder) of a local model
    (trust_remote_code: a config class of the folder's own code may be run, as vLLM's flag)."""
    gguf_file = gguf_loader.find_gguf_file(path)
    if gguf_file is not None:
        converted = converted_folder(gguf_file)
        if converted is not None:
            return load_full_config(converted), gguf_file, converted
        return gguf_loader.gguf_hf_config(gguf_file), gguf_file, None
    if os.path.isfile(os.path.join(path, "config.json")):
        from transformers import AutoConfig  # transformers' import: a second, only here

        try:
            return (AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code),
                    None, None)
        except Exception as e:  # transformers raises many types for a broken config
            raise ValueError(f"cannot read {path}/config.json: {e}") from e
    if os.path.exists(path):
        raise ValueError(f"model path {path!r} has neither a config.json nor a .gguf file")
    raise ValueError(f"model path {path!r} does not exist")


def _check_rope(hf_config: Any, path: str) -> None:
    for rope in rope_parameter_sets(hf_config).values():
        rope_type = rope.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported RoPE type {rope_type!r} in {path}; "
                             f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def _max_model_len(hf_config: Any, asked: int | None) -> int:
    ctx = int(hf_config.max_position_embeddings)
    if asked is None:
        return ctx
    if not 1 <= asked <= ctx:
        raise ValueError(f"max_model_len must be in [1, {ctx}] for this model, got {asked}")
    return asked


def _normalized_quirks(hf_config: Any, max_model_len: int) -> dict[str, Any]:
    """Config values the model is built with instead of the checkpoint's (applied to a copy:
    ModelConfig.arch_config)."""
    window = getattr(hf_config, "sliding_window", None)
    if window and window >= max_model_len:
        # a window as long as the context never drops a token: plain attention (which the
        # fused CPU decode call runs), the same model
        return {"sliding_window": None}
    return {}


@dataclasses.dataclass(frozen=True)
class _HubAccess:
    """Where Hub ids are cached and the token they are fetched with (vLLM's --download-dir,
    --hf-token)."""

    download_dir: str | None
    token: str | bool | None = dataclasses.field(repr=False)


def _local_model(name: str, revision: str | None, hub: _HubAccess,
                 tokenizer_only: bool = False, with_code: bool = False
                 ) -> tuple[str | None, str]:
    """(the Hub id, the local path) of a model or tokenizer name: a local path is itself (and
    takes no revision), anything else is resolved as a Hub id (model_loader/hub.py)."""
    if os.path.exists(name) or parse_hub_id(name) is None:
        if revision is not None and os.path.exists(name):
            raise ValueError(f"revision applies to Hugging Face Hub ids; {name!r} is a local "
                             "path")
        return None, name
    return name, resolve_hub_model(name, revision, hub.download_dir, tokenizer_only,
                                   with_code, hub.token)


def _resolve_dtype(dtype: str | torch.dtype, hf_config: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        # NOTE: float32 is the CPU fast path (bf16/fp16 GEMMs are 6-10x slower without AVX512);
        # on GPUs the checkpoint's own half precision is what users expect.
        if not torch.cuda.is_available():
            return torch.float32
        d = getattr(hf_config, "dtype", None)  # (transformers 5 reads torch_dtype into it)
        return d if isinstance(d, torch.dtype) and d != torch.float32 else torch.bfloat16
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]
