"""How a checkpoint's weights are served, chosen at start-up (config_factory's weight half):
the weight format (a quantization method, a GGUF file's own blocks) and, for dense
half-precision checkpoints on CPU, the dtype the weights are kept in and the dtype their
products are computed in. Each choice reads the model's config and this CPU's flags, never the
weights; an option that cannot be served is a ValueError naming it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tokenmill.config import ModelConfig
from tokenmill.model_loader import gguf_loader
from tokenmill.quantization import QUANTIZATION_METHODS, WEIGHT_FORMATS
from tokenmill.quantization.gguf import BLOCK_TYPES, SUPPORTED_TYPES
from tokenmill.utils import cpp_extension

logger = logging.getLogger(__name__)


def checkpoint_quantization(hf_config: Any) -> dict[str, Any] | None:
    q = getattr(hf_config, "quantization_config", None)
    if q is None:
        return None
    return dict(q) if isinstance(q, dict) else q.to_dict()


def resolve_quantization(asked: str | None, checkpoint: dict[str, Any] | None,
                          gguf_file: str | None, path: str) -> str | None:
    """The weight format to serve, from the option and what the checkpoint holds (each
    format's `source` in the registry, quantization/__init__.py WEIGHT_FORMATS)."""
    if asked in (None, "none", "None"):
        asked = None
    elif asked not in WEIGHT_FORMATS:
        raise ValueError(f"unknown quantization {asked!r}; supported: "
                         f"{', '.join(QUANTIZATION_METHODS)} or None")
    stored = [f.name for f in WEIGHT_FORMATS.values() if "checkpoint" in f.sources]
    if checkpoint is not None:  # a pre-quantized HF checkpoint: serve it in its own format
        method = str(checkpoint.get("quant_method", "")).lower()
        if method not in stored:
            raise ValueError(f"{path} is quantized with {method!r}, which tokenmill cannot "
                             f"serve; supported checkpoint formats: {', '.join(stored)}")
        if asked not in (None, method):
            raise ValueError(f"quantization={asked!r}, but {path} is a {method} checkpoint; "
                             f"pass quantization={method!r} or leave it unset")
        return method
    sources = () if asked is None else WEIGHT_FORMATS[asked].sources
    if sources == ("checkpoint",):
        raise ValueError(f"quantization={asked!r} needs a checkpoint in that format (its "
                         f"config.json names it in quantization_config); {path} has none")
    if sources == ("gguf",) and gguf_file is None:
        raise ValueError(f"quantization={asked!r} serves the blocks of a GGUF file; {path} is "
                         "not one")
    return asked


def default_quantization(model: ModelConfig, device: str) -> str | None:
    """The format to serve `model` in when none was asked for: "gguf" for a GGUF file of
    block types the kernels read (quantization/gguf.py SUPPORTED_TYPES) or of F16 / BF16
    tensors (kept in their half precision), in float32 on a CPU with the C++ kernels (an
    MoE's expert blocks too: quantization/gguf_experts.py); else the checkpoint's own
    (model.quantization: None, or an AWQ / GPTQ checkpoint's method).

    The blocks are what llama.cpp users expect: the file's own numbers at its own size (the
    float32 expansion is 4-7x larger), and with batch invariance (the CPU default) the dot
    kernels multiply exactly the dequantized weights, so greedy output equals the float32
    expansion's (tests/quantization/test_gguf_native.py). A file holding a type outside the
    table is expanded, with a log line naming the type."""
    if (model.quantization is not None or model.gguf_file is None or model.load_format != "auto"
            or not device.startswith("cpu") or model.dtype != torch.float32
            or not cpp_extension.kernels_enabled()):
        return model.quantization
    types = _gguf_types(model)
    if types <= {"F32"}:
        return None  # a float32 file: nothing to keep in its own form
    if not types <= set(SUPPORTED_TYPES):
        logger.warning("%s holds GGUF types %s, which are not served in their blocks (%s are): "
                       "expanding it to float32", model.gguf_file,
                       ", ".join(sorted(types - set(SUPPORTED_TYPES))), ", ".join(BLOCK_TYPES))
        return None
    logger.info("serving %s in its own %s blocks (quantization='gguf'; pass "
                "quantization='none' for its float32 expansion)", model.gguf_file,
                "/".join(sorted(types & set(BLOCK_TYPES))))
    return "gguf"


def stored_dtype(model: ModelConfig) -> torch.dtype:
    """The dtype the checkpoint's config says its weights are stored in; float32 where it names
    none, as transformers reads it (random-weight benchmark shapes, older checkpoints)."""
    stored = getattr(model.hf_config, "dtype", None)  # (transformers 5 reads torch_dtype)
    stored = getattr(torch, stored, None) if isinstance(stored, str) else stored
    return stored or torch.float32


def _dense_on_cpu_kernels(model: ModelConfig, device: str) -> bool:
    """Whether the model's dense weights are served by the C++ kernels on CPU: unquantized,
    not a GGUF file's tensors."""
    return (device.startswith("cpu") and model.quantization is None and model.gguf_file is None
            and cpp_extension.kernels_enabled())


def _keeps_as_stored(model: ModelConfig, device: str) -> bool:
    """Whether the checkpoint's half-precision weights can be kept as stored and computed in
    float32 here: a bfloat16 / float16 checkpoint, unquantized, on a CPU with the C++ kernels."""
    return (stored_dtype(model) in (torch.bfloat16, torch.float16)
            and _dense_on_cpu_kernels(model, device))


def asked_half_weights(model: ModelConfig, device: str) -> torch.dtype | None:
    """The dtype dense weights are kept in when a half dtype is asked for on CPU (model.dtype:
    `--dtype bfloat16`, the dtype vLLM's CPU backend runs, or float16): the checkpoint's own,
    or a float32 checkpoint's weights rounded to it as they load (half its size, no float32
    copy), or a float16 checkpoint's asked in bfloat16 (what vLLM's CPU backend serves a
    float16 model in; bfloat16 holds float16's range, so only precision is rounded away, as
    asked: SmolLM2's batched workloads ran 2.0x the float16 weights' float32 products).
    Each is then served as dtype="auto" serves a half-precision checkpoint there:
    the weights kept in half precision, products in bf16 where matmul_dtype says so,
    activations, norms and sums in float32; not every module in half precision through
    torch's ops (a Qwen3-0.6B-shaped decode after 500 tokens took 166-168 ms a step so, most
    of it in MKL's bf16 GEMV, against 58-75 ms served as auto serves it: benchmarks/
    RESULTS.md, fifty-first session). None: served as asked (quantized or GGUF weights, a
    GPU, a bf16 checkpoint asked in float16, whose range the rounding would cut); a config
    that names no dtype counts as float32 (stored_dtype)."""
    asked, stored = model.dtype, stored_dtype(model)
    if asked not in (torch.bfloat16, torch.float16):
        return None
    # float32 rounds to either half dtype, float16 to bfloat16 (its range fits); not bf16 to fp16
    if stored not in (asked, torch.float32) and (stored, asked) != (torch.float16, torch.bfloat16):
        return None
    return asked if _dense_on_cpu_kernels(model, device) else None


def default_weight_dtype(model: ModelConfig, device: str) -> torch.dtype | None:
    """The dtype dense weights are kept in when the user set no dtype: a bfloat16 / float16
    checkpoint's own on a CPU with the C++ kernels (computed in float32: activations, norms
    and sums; the weights widened in registers, exactly), instead of a float32 copy twice its
    size (a half dtype asked for: asked_half_weights); None (the model's dtype)
    elsewhere."""
    if model.dtype != torch.float32 or not _keeps_as_stored(model, device):
        return None
    stored = stored_dtype(model)
    logger.info("keeping the %s checkpoint's weights in %s (computing in float32)",
                model.path, stored)
    return stored


def float16_weights(model: ModelConfig, dtype_asked: str) -> bool:
    """Whether a model computed in float32 keeps float16 weights: a float16 checkpoint as
    stored (or a float32 one asked in float16), or quantized at load from a float16
    checkpoint under dtype "auto". Its cache is then float16 too (half the float32 cache's
    bytes), as vLLM keeps a float16 model's."""
    if model.weight_dtype == torch.float16:
        return True
    return (dtype_asked == "auto" and model.quantization not in (None, "gguf")
            and stored_dtype(model) == torch.float16)


def _bf16_matrices(model: ModelConfig, all_of_them: bool) -> bool:
    """Whether the model's dense weights are bfloat16: a bf16 checkpoint kept in bf16, or a
    GGUF file served in its own tensors (quantization "gguf") whose non-F32 tensors are all
    (`all_of_them`) or some BF16."""
    if model.weight_dtype == torch.bfloat16:
        return True
    if model.gguf_file is None or model.quantization != "gguf":
        return False
    types = _gguf_types(model) - {"F32"}
    return types == {"BF16"} if all_of_them else "BF16" in types


def _gguf_types(model: ModelConfig) -> set[str]:
    """The GGML types of the model's GGUF file's tensors."""
    assert model.gguf_file is not None
    return set(gguf_loader.gguf_tensor_types(model.gguf_file).values())


def resolve_matmul_dtype(asked: str, model: ModelConfig) -> torch.dtype | None:
    """The dtype bfloat16 weights are multiplied in on CPU (ModelConfig.matmul_dtype): a
    bfloat16 checkpoint's, or a GGUF file's BF16 tensors. bfloat16 where asked, or by default
    ("auto") where the CPU has AVX512-BF16 and its kernel build and the weights are all
    bfloat16 (a GGUF of K-quants with a BF16 output tensor keeps float32 products); None
    (float32 products) otherwise."""
    if asked not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"matmul_dtype must be auto, float32 or bfloat16; got {asked!r}")
    if asked == "float32" or (asked == "auto" and not _bf16_matrices(model, all_of_them=True)):
        return None
    if not _bf16_matrices(model, all_of_them=False):
        raise ValueError("matmul_dtype='bfloat16' multiplies a bfloat16 checkpoint's weights "
                         "(or a GGUF file's BF16 tensors) as stored on CPU (dtype='auto'); "
                         f"this model's dense weights are {model.weight_dtype or model.dtype}")
    hardware = cpp_extension.has_bf16_instructions()
    if asked == "auto" and not hardware:
        return None
    how = ("on AMX tiles" if cpp_extension.has_amx_bf16() else "with vdpbf16ps") if hardware \
        else "emulated: this CPU has no AVX512-BF16"
    logger.info("multiplying %s's bfloat16 weights in bfloat16 (float32 sums; %s)", model.path,
                how)
    return torch.bfloat16
