"""Build a model for a ModelConfig and fill every parameter from its checkpoint.

Each layer's quantization method (tokenmill/quantization/) creates its parameters uninitialised
(torch.empty), then each checkpoint tensor goes through its parameter's `weight_loader`, with
packed modules (qkv, gate_up) resolved through the model's `packed_modules_mapping`, and last
each method processes its layer's weights (`process_weights_after_loading`: quantize, unpack,
prepack). A parameter left unfilled is an error, never random weights, except with
load_format="dummy", where no checkpoint is read and every parameter is seeded random
(benchmarks of real model shapes: speed does not depend on the values).
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Callable, Iterator

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.distributed import ParallelState
from tokenmill.distributed.pipeline import PPMissingLayer, on_another_stage
from tokenmill.model_loader.gguf_convert import converted_weights
from tokenmill.model_loader.gguf_loader import iterate_gguf
from tokenmill.model_loader.safetensors_loader import iterate_safetensors
from tokenmill.models import resolve_model_class
from tokenmill.quantization import WEIGHT_FORMATS, quantization_config
from tokenmill.quantization.gguf import BLOCK_TYPES
from tokenmill.quantization.unquantized import PREPACK_AUTO_MAX_BYTES
from tokenmill.utils.heap import returning_freed_memory, trim_heap


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def iterate_weights(config: ModelConfig, in_place: Callable[[str], bool] | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (name, tensor) pairs; in_place(name): whether the parameter that
    tensor fills keeps it as loaded (`held_parts`, layers/linear.py): a GGUF file's blocks or
    a safetensors file's tensors then come uncopied, views of the file's map
    (gguf_loader.iterate_gguf, safetensors_loader.iterate_safetensors)."""
    if config.quantization is not None and \
            WEIGHT_FORMATS[config.quantization].sources == ("gguf",):
        # the file's own blocks, not a float32 conversion
        assert config.gguf_file is not None
        return iterate_gguf(config.gguf_file, config.hf_config, raw_types=BLOCK_TYPES,
                            in_place=in_place)
    if config.gguf_file is not None:
        folder = (converted_weights(config.converted_dir, config.gguf_file)
                  if config.converted_dir is not None else None)
        if folder is not None:
            return iterate_safetensors(folder, in_place)
        return iterate_gguf(config.gguf_file, config.hf_config)
    return iterate_safetensors(config.path, in_place)


# A safetensors checkpoint's weights that the kernels read as stored (half precision on CPU)
# stay in its files' maps only when they take more than this share of the machine's memory:
# there a copy would crowd the KV cache (an 8B bf16 model on 24 GB) and cost the start 27 s
# here; below it the copies' 2 MiB pages decode 4-14% faster than the page cache's 4 KiB ones
# (benchmarks/RESULTS.md, forty-sixth session). A GGUF file's blocks are always used in place,
# as llama.cpp uses them.
SAFETENSORS_IN_PLACE_SHARE = 0.25


def maps_safetensors(folder: str) -> bool:
    """Whether a safetensors folder's weights are used in place (SAFETENSORS_IN_PLACE_SHARE)."""
    weights = sum(os.path.getsize(f) for f in glob.glob(os.path.join(folder, "*.safetensors")))
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):  # no sysconf (Windows): copies
        return False
    return weights > SAFETENSORS_IN_PLACE_SHARE * memory


def prepack_decision(config: ModelConfig, prepack: bool | str) -> bool:
    """Whether dense CPU weights also get a oneDNN-packed copy ("auto": by the model's size)."""
    if prepack != "auto":
        return bool(prepack)
    return config.num_parameters * 4 <= PREPACK_AUTO_MAX_BYTES


def load_model(config: ModelConfig, device: torch.device, tp: ParallelState = ParallelState(),
               prepack: bool | str = "auto", batch_invariant: bool = True) -> nn.Module:
    """The model with its weights; batch_invariant: its linear layers' kernels sum every row
    in one order at every step size (EngineConfig.batch_invariant). Its temporaries go back
    to the OS as they are freed, whatever a running engine asked of the heap (utils/heap.py)."""
    with returning_freed_memory():
        return _load_model(config, device, tp, prepack, batch_invariant)


def _load_model(config: ModelConfig, device: torch.device, tp: ParallelState, prepack: bool | str,
                batch_invariant: bool) -> nn.Module:
    cls = resolve_model_class(config.architecture)
    quant = quantization_config(config, device, prepack_decision(config, prepack),
                                batch_invariant and device.type == "cpu")
    with _default_dtype(config.dtype), torch.device(device):
        model = cls(config.arch_config(), tp, quant)
    if config.headless:  # embeddings only: no LM head to fill
        model.lm_head, model.tie_word_embeddings = PPMissingLayer(), False
    if config.load_format == "dummy":
        _init_dummy(model)
        return _process_weights(model).eval()
    params = dict(model.named_parameters())
    mapping = getattr(cls, "packed_modules_mapping", {})
    tied = getattr(model, "tie_word_embeddings", False)
    loaded: set[str] = set()

    holders = {n for n, p in params.items() if hasattr(p, "held_parts")}  # (layers/linear.py)
    if config.gguf_file is None and not maps_safetensors(config.path):
        for n in holders:  # copied into their parameters instead
            del params[n].held_parts
        holders = set()

    def held_in_place(name: str) -> bool:  # the parameter it fills keeps what it loads
        return _target(model, mapping, _model_name(config, name))[0] in holders

    for name, tensor in _split_fused(model, iterate_weights(config, held_in_place)):
        name = _model_name(config, name)
        if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
            continue
        target, shard = _target(model, mapping, name)
        param = params.get(target)
        if param is None and on_another_stage(model, target):
            continue
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {cls.__name__}")
        loader = getattr(param, "weight_loader", None)
        tensor = quant.checkpoint_tensor(name, tensor)
        if tensor.is_floating_point():  # quantized tensors (ints, raw blocks) stay as stored
            tensor = tensor.to(param.dtype if param.is_floating_point() else config.dtype)
        with torch.no_grad():
            if loader is not None:
                loader(param, tensor, shard)
            else:
                if param.shape != tensor.shape:
                    raise ValueError(f"shape mismatch for {name}: checkpoint "
                                     f"{tuple(tensor.shape)}, model {tuple(param.shape)}")
                param.data.copy_(tensor)
        loaded.add(target if shard is None else f"{target}:{shard}")
    _check_complete(model, params, mapping, loaded)
    del params  # the loaded parameters, so that what processing replaces is freed at once
    return _process_weights(model).eval()


def _model_name(config: ModelConfig, name: str) -> str:
    """A checkpoint tensor's name in the model: a base model's names (the stack's, without
    "model.") prefixed for a headless one."""
    return f"model.{name}" if config.headless else name


def _target(model: nn.Module, mapping: dict[str, tuple[str, int | str]], name: str
            ) -> tuple[str, int | str | None]:
    """The parameter a checkpoint tensor fills and its shard there: the model's own names
    (an MoE's experts), a packed module's part (qkv, gate_up), or the name itself."""
    mapped = model.map_weight_name(name) if hasattr(model, "map_weight_name") else None
    if mapped is not None:
        return mapped
    for ckpt_name, (packed, shard_id) in mapping.items():
        if f".{ckpt_name}." in name:
            return name.replace(f".{ckpt_name}.", f".{packed}."), shard_id
    return name, None


def _split_fused(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, a model's fused ones (Phi-3's qkv_proj) split into the
    tensors its `split_checkpoint_tensor` names."""
    split = getattr(model, "split_checkpoint_tensor", None)
    for name, tensor in weights:
        yield from ([(name, tensor)] if split is None else split(name, tensor))


@torch.no_grad()
def _process_weights(model: nn.Module) -> nn.Module:
    """Each layer's method turns what was loaded into what its kernels read (quantize, unpack,
    prepack); a tied LM head has no weights of its own and is skipped."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and any(True for _ in module.parameters(recurse=False)):
            method.process_weights_after_loading(module)
    trim_heap()  # what processing freed (raw blocks split, float weights quantized)
    return model


@torch.no_grad()
def _init_dummy(model: nn.Module, seed: int = 0) -> None:
    """Norm weights 1, biases 0, everything else N(0, 0.02), drawn in parameter order from
    one seeded generator."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            param.zero_()
        elif "norm" in name.rsplit(".", 2)[-2]:
            param.fill_(1.0)
        else:
            if param.device not in generators:
                generators[param.device] = torch.Generator(device=param.device)
                generators[param.device].manual_seed(seed)
            param.normal_(0.0, 0.02, generator=generators[param.device])


def _check_complete(model: nn.Module, params: dict[str, nn.Parameter],
                    mapping: dict[str, tuple[str, int | str]], loaded: set[str]) -> None:
    shards_of: dict[str, list[int | str]] = {}
    for packed, shard in mapping.values():
        shards_of.setdefault(packed, []).append(shard)
    missing = []
    for name, param in params.items():
        module = name.rsplit(".", 2)[-2]
        shards = getattr(param, "expected_shards", None) or shards_of.get(module)
        expected = [f"{name}:{s}" for s in shards] if shards else [name]
        missing += [e for e in expected if e not in loaded]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} weights of "
                         f"{type(model).__name__}: {shown}")
