"""Weight formats: one method object per linear layer (base.py), vLLM's names.

    None / "none"  dense weights in the model's dtype (unquantized.py)
    "int8"         Q8_0 blocks quantized at load from a float checkpoint (load_time.py)
    "int4"         4-bit groups quantized at load from a float checkpoint, with an
                   activation-aware scale search (load_time.py, awq_search.py)
    "awq", "gptq"  4-bit checkpoints in those published layouts (int4_checkpoints.py)
    "gguf"         a GGUF file's blocks as stored: Q4_0 / Q4_1 / Q8_0, Q5_0 / Q5_1, the
                   K-quants Q2_K .. Q6_K, IQ4_NL / IQ4_XS (gguf.py GGUF_TYPES)

With none asked for (`quantization=None`), a GGUF file of block types the kernels read is
served as "gguf" (config_weights.default_quantization); "none" asks for the float32 expansion
explicitly.

Each format is one registered `WeightFormat` (WEIGHT_FORMATS: name, what it is made from, its
config's builder); config_factory.py checks an option against the registry, not against names.
`quantization_config(model_config, device, prepack)` builds the model's config; anything the
model, its checkpoint or the device cannot run is a ValueError at start-up naming what is
supported. Every quantized format ends in the two block layouts of blocks.py, which the C++
kernels (csrc/linear_cpu.h) read in every path, or in GGUF blocks read in place by the dot
kernels (csrc/linear_gguf.h).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenmill.quantization.base import (
    CPULinearKernel,
    LinearMethodBase,
    QuantizationConfig,
    set_weight_attrs,
)
from tokenmill.quantization.unquantized import UnquantizedConfig, UnquantizedLinearMethod

if TYPE_CHECKING:
    from tokenmill.config import ModelConfig

logger = logging.getLogger(__name__)

__all__ = ["QUANTIZATION_METHODS", "WEIGHT_FORMATS", "CPULinearKernel", "LinearMethodBase",
           "QuantizationConfig", "UnquantizedConfig", "UnquantizedLinearMethod", "WeightFormat",
           "quantization_config",
           "set_weight_attrs"]


# False: int4 rounds to nearest without its activation-aware search (benchmarks compare)
INT4_CALIBRATION = True


def _calibration(model: ModelConfig) -> dict[str, torch.Tensor] | None:
    """Calibration activations for int4's activation-aware search, from the float checkpoint
    as an HF folder (a GGUF file's converted folder); None, logged, where there is none."""
    if not INT4_CALIBRATION:
        logger.info("int4: scale search off; plain round-to-nearest")
        return None
    if model.load_format == "dummy":
        logger.info("int4: dummy weights, nothing to calibrate on; plain round-to-nearest")
        return None
    folder: str | None = model.path
    if model.gguf_file is not None:  # its float32 expansion, written once into the cache
        from tokenmill.model_loader.gguf_convert import converted_weights

        folder = (converted_weights(model.converted_dir, model.gguf_file)
                  if model.converted_dir is not None else None)
    if folder is None:
        logger.info("int4: no float checkpoint folder to calibrate on (GGUF cache off or too "
                    "large); plain round-to-nearest")
        return None
    from tokenmill.quantization.awq_search import collect_activations

    return collect_activations(folder)


def _int8(model: ModelConfig, prepack: bool, int8_acts: bool,
          inv: bool) -> QuantizationConfig:
    from tokenmill.quantization.load_time import Int8Config

    return Int8Config(int8_acts, inv)


def _int4(model: ModelConfig, prepack: bool, int8_acts: bool,
          inv: bool) -> QuantizationConfig:
    from tokenmill.quantization.load_time import Int4Config

    return Int4Config(int8_activations=int8_acts, activations=_calibration(model),
                      batch_invariant=inv)


def _fp8(model: ModelConfig, prepack: bool, int8_acts: bool,
         inv: bool) -> QuantizationConfig:
    from tokenmill.quantization.fp8 import Fp8Config

    if int8_acts:
        raise ValueError("int8_activations does not apply to quantization='fp8' (its "
                         "activations are fp8 already)")
    return Fp8Config(prepack, model.hf_quant_config, inv)


def _int4_checkpoint(model: ModelConfig, prepack: bool, int8_acts: bool,
                     inv: bool) -> QuantizationConfig:
    from tokenmill.quantization.int4_checkpoints import Int4CheckpointConfig

    assert model.quantization is not None
    return Int4CheckpointConfig(model.quantization, model.hf_quant_config or {}, prepack,
                                int8_acts, inv)


def _gguf(model: ModelConfig, prepack: bool, int8_acts: bool,
          inv: bool) -> QuantizationConfig:
    from tokenmill.model_loader.gguf_loader import gguf_tensor_types
    from tokenmill.models import resolve_model_class
    from tokenmill.quantization.gguf import GGUFConfig

    assert model.gguf_file is not None
    mapping = getattr(resolve_model_class(model.architecture), "packed_modules_mapping", {})
    return GGUFConfig(gguf_tensor_types(model.gguf_file), prepack, mapping, int8_acts, inv,
                      model.matmul_dtype)


@dataclass(frozen=True)
class WeightFormat:
    """A registered weight format: its name (vLLM's), what it is made from, its config.

    sources: what it is served from, any of "float" (quantized at load from any float
    checkpoint; load_format="dummy" draws the floats), "checkpoint" (a checkpoint stored in
    this format, named by its config.json's quantization_config), "gguf" (a GGUF file's
    tensors as stored)."""

    name: str
    sources: tuple[str, ...]
    build: Callable[[ModelConfig, bool, bool, bool], QuantizationConfig]


WEIGHT_FORMATS = {f.name: f for f in (
    WeightFormat("int8", ("float",), _int8),
    WeightFormat("int4", ("float",), _int4),
    WeightFormat("fp8", ("float", "checkpoint"), _fp8),
    WeightFormat("awq", ("checkpoint",), _int4_checkpoint),
    WeightFormat("gptq", ("checkpoint",), _int4_checkpoint),
    WeightFormat("gguf", ("gguf",), _gguf),
)}
QUANTIZATION_METHODS = tuple(WEIGHT_FORMATS)


def quantization_config(model: ModelConfig, device: torch.device, prepack: bool,
                        batch_invariant: bool = True) -> QuantizationConfig:
    """The weight format of `model` on `device` (model.quantization already validated by
    ModelConfig against the checkpoint); batch_invariant: its kernels sum every row in one
    order at every step size (EngineConfig.batch_invariant)."""
    name, int8_acts, inv = model.quantization, model.int8_activations, batch_invariant
    if name is None:
        if int8_acts:
            raise ValueError("int8_activations applies to quantized weights; pass a "
                             "quantization method too")
        return UnquantizedConfig(prepack, inv, model.weight_dtype, model.matmul_dtype)
    if name not in WEIGHT_FORMATS:
        raise ValueError(f"unknown quantization {name!r}; supported: "
                         f"{', '.join(QUANTIZATION_METHODS)} or None")
    if model.dtype != torch.float32 and device.type == "cpu":  # before int4's calibration
        raise ValueError(f"quantization={name!r} computes in float32 on CPU; dtype is "
                         f"{model.dtype}")
    config = WEIGHT_FORMATS[name].build(model, prepack, int8_acts, inv)
    config.check_device(device)
    return config
