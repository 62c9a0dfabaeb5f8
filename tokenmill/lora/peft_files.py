"""peft's adapter folders as users have them: `adapter_config.json` beside
`adapter_model.safetensors` (or `adapter_model.bin`), read and checked against the model.

What is served: LoRA on any of the attention and MLP projections (q/k/v/o, gate/up/down), each
module's delta `scaling * B @ A` with scaling `lora_alpha / r` (`lora_alpha / sqrt(r)` with
`use_rslora`). The modules are those the file holds weights for, which is what peft's
`target_modules` (names, a regex or "all-linear") and `layers_to_transform` resolved to when it
saved them. Everything else a config may ask for is refused by name, never ignored: other peft
types, DoRA, trained biases, `modules_to_save`, embedding adapters, per-module rank / alpha
patterns, Conv1D's transposed layout.

An adapter's identity (`key`) is a sha256 of the config values that change its output and of
every weight's bytes, so renaming or renumbering an adapter does not change it and any other
adapter has another one.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# the projections an adapter may target, as the checkpoint names them (per decoder layer)
TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_MODULE = re.compile(r"model\.layers\.(\d+)\.(" + "|".join(re.escape(t) for t in TARGETS)
                     + r")$")
# peft's file keys: base_model.model.<module>.lora_A[.<adapter>].weight
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])(\.[^.]+)?\.weight$")
# config fields that must hold these values (anything else is a feature we do not serve)
_REFUSED = {"use_dora": (False, None), "bias": ("none", None), "fan_in_fan_out": (False, None),
            "lora_bias": (False, None), "modules_to_save": (None, []),
            "rank_pattern": ({}, None), "alpha_pattern": ({}, None),
            "trainable_token_indices": (None,), "layer_replication": (None,),
            "target_parameters": (None, [])}


class AdapterError(ValueError):
    """An adapter that cannot be served with this model and these limits (the message says
    which adapter and why)."""


@dataclass(frozen=True)
class AdapterConfig:
    r: int
    lora_alpha: float
    use_rslora: bool
    base_model: str | None  # peft's base_model_name_or_path, for messages

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


@dataclass(frozen=True)
class PeftAdapter:
    """An adapter read from its folder: per module (the checkpoint's name, e.g.
    model.layers.0.self_attn.q_proj), A (r, in) and B (out, r), float32."""

    path: str
    config: AdapterConfig
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    key: str


def read_config(path: str) -> AdapterConfig:
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise AdapterError(f"LoRA adapter at {path!r}: no {CONFIG_FILE} (not a peft adapter "
                           "folder)")
    with open(file) as f:
        raw = json.load(f)
    if raw.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"LoRA adapter at {path!r}: peft_type {raw['peft_type']!r} is not "
                           "served (LORA only)")
    for name, allowed in _REFUSED.items():
        if raw.get(name) not in allowed:
            raise AdapterError(f"LoRA adapter at {path!r}: {name}={raw[name]!r} is not "
                               "supported")
    r = raw.get("r")
    if not isinstance(r, int) or r < 1:
        raise AdapterError(f"LoRA adapter at {path!r}: r must be a positive integer, got {r!r}")
    return AdapterConfig(r=r, lora_alpha=float(raw.get("lora_alpha", 8)),
                         use_rslora=bool(raw.get("use_rslora", False)),
                         base_model=raw.get("base_model_name_or_path"))


def _load_tensors(path: str) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        if name.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(file)
        return torch.load(file, map_location="cpu", weights_only=True)
    raise AdapterError(f"LoRA adapter at {path!r}: no weights ({' or '.join(WEIGHT_FILES)})")


def read_adapter(path: str) -> PeftAdapter:
    """The adapter in folder `path`; AdapterError for anything it holds that is not served."""
    config = read_config(path)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in _load_tensors(path).items():
        m = _KEY.match(key)
        if m is None:
            what = "an embedding adapter" if "lora_embedding" in key else "a tensor"
            raise AdapterError(f"LoRA adapter at {path!r}: {what} {key!r} is not served "
                               "(LoRA A / B weights of linear layers only)")
        parts.setdefault(m["module"], {})[m["ab"]] = tensor
    digest = hashlib.sha256(json.dumps(
        {"r": config.r, "alpha": config.lora_alpha, "rslora": config.use_rslora}).encode())
    weights = {}
    for module in sorted(parts):
        pair = parts[module]
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"LoRA adapter at {path!r}: {module} has lora_{''.join(pair)} "
                               "but not both A and B")
        a, b = pair["A"], pair["B"]
        digest.update(module.encode())
        for t in (a, b):
            digest.update(str((t.dtype, tuple(t.shape))).encode())
            digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
        weights[module] = (a.float().contiguous(), b.float().contiguous())
    if not weights:
        raise AdapterError(f"LoRA adapter at {path!r}: holds no LoRA weights")
    return PeftAdapter(path, config, weights, digest.hexdigest())


def check_adapter(adapter: PeftAdapter, shapes: dict[str, tuple[int, int]], num_layers: int,
                  max_rank: int) -> None:
    """AdapterError unless the adapter fits the model: every module one of its targeted
    projections (`shapes`: TARGETS entry → (in, out) features) with A, B of the model's
    shapes, and its rank at most `max_rank` (max_lora_rank)."""
    where = f"LoRA adapter at {adapter.path!r}"
    r = adapter.config.r
    if r > max_rank:
        raise AdapterError(f"{where}: rank {r} exceeds max_lora_rank={max_rank}; start the "
                           f"engine with max_lora_rank >= {r}")
    base = adapter.config.base_model
    for module, (a, b) in adapter.weights.items():
        m = _MODULE.fullmatch(module)
        if m is None or int(m[1]) >= num_layers or m[2] not in shapes:
            raise AdapterError(f"{where}: targets {module!r}, which this model does not have "
                               f"(LoRA is served on {', '.join(sorted(shapes))} of its "
                               f"{num_layers} layers)")
        n_in, n_out = shapes[m[2]]
        if tuple(a.shape) != (r, n_in) or tuple(b.shape) != (n_out, r):
            raise AdapterError(
                f"{where}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, this model "
                f"needs ({r}, {n_in}) and ({n_out}, {r}): the adapter was trained for another "
                f"base model ({base or 'unnamed'})")
