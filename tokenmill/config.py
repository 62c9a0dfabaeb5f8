"""Engine configuration: frozen dataclasses grouped by concern, and validation of engine options.

`EngineConfig.create(model, **options)` is the one place where user options become a config:
unknown options and out-of-range values raise `ValueError` naming the option. Configs are frozen;
derive changed copies with `dataclasses.replace`. Model quirks (HF folder vs GGUF file, rope
scaling, tied embeddings) are normalized in `ModelConfig` so models never look at file formats.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenmill.distributed.config import ParallelConfig
from tokenmill.pooling_params import PoolerConfig
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.structured_output.config import StructuredOutputsConfig
from tokenmill.utils import parse_size

# RoPE types whose frequencies do not depend on the sequence length (so a cos/sin table works).
# (longrope: its short / long factors switch at a fixed position, layers/rotary.py)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
LOAD_FORMATS = ("auto", "dummy")
RUNNERS = ("auto", "generate", "pooling")
_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    """A model's shape and where to load it from. `hf_config` is a transformers PretrainedConfig."""

    path: str  # folder with config.json, or a .gguf file
    hf_config: Any
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    gguf_file: str | None = None  # set when weights come from a GGUF file
    # A GGUF model's converted copy (model_loader/gguf_cache.py): tokenizer and weights are
    # read from here when set, the GGUF file itself otherwise.
    converted_dir: str | None = None
    # a base model without an LM head (registry.HEADLESS): embeddings only, tensor names
    # without the "model." prefix
    headless: bool = False
    # "auto": the weights of the checkpoint; "dummy": seeded random weights of the model's
    # shape, no checkpoint read (vLLM's name; benchmarks of real shapes, model_loader/loader.py)
    load_format: str = "auto"
    # The weight format (tokenmill/quantization/): None (dense), "int8", "int4", "awq",
    # "gptq" or "gguf"; hf_quant_config is the checkpoint's own quantization_config. Unset
    # in EngineConfig.create, a quantized GGUF may become "gguf" (default_quantization).
    quantization: str | None = None
    hf_quant_config: dict[str, Any] | None = None
    # Quantized weights multiply int8-quantized activations in every step (llama.cpp's
    # numbers, faster) instead of float ones (rounded to int16 per 32 values on AVX-512 VNNI
    # CPUs, exact elsewhere; csrc/linear_cpu.h).
    int8_activations: bool = False
    # Dense weights kept in this dtype on CPU (a bfloat16 / float16 checkpoint's own, with
    # `dtype` float32 for everything else; quantization/unquantized.py); None: `dtype`.
    weight_dtype: torch.dtype | None = None
    # The model as the user named it (a Hub id, or None for a local path): the served name.
    hub_id: str | None = None
    # Where the tokenizer comes from when not from the model itself (vLLM's --tokenizer,
    # resolved to a local folder); None: the model's folder or GGUF metadata.
    tokenizer: str | None = None

    @staticmethod
    def from_path(path: str | None, dtype: str = "auto", max_model_len: int | None = None,
                  load_format: str = "auto", quantization: str | None = None,
                  int8_activations: bool = False, revision: str | None = None,
                  download_dir: str | None = None, tokenizer: str | None = None
                  ) -> ModelConfig:
        """`path`: a Hugging Face folder, a .gguf file or a Hub id (model_loader/hub.py, at
        `revision`, cached in `download_dir`); None: the default model."""
        from tokenmill.model_loader.default_model import default_model_path
        from tokenmill.model_loader.gguf_cache import converted_folder, load_full_config
        from tokenmill.model_loader.gguf_loader import find_gguf_file, gguf_hf_config

        path = default_model_path() if path is None else os.path.expanduser(str(path))
        hub_id, path = _local_model(path, revision, download_dir)
        tokenizer_dir = (None if tokenizer is None else
                         _local_model(os.path.expanduser(tokenizer), revision, download_dir,
                                      tokenizer_only=True)[1])
        gguf_file = find_gguf_file(path)
        converted = None
        if gguf_file is not None:
            converted = converted_folder(gguf_file)
            if converted is not None:
                hf_config = load_full_config(converted)
            else:
                hf_config = gguf_hf_config(gguf_file)
        elif os.path.isfile(os.path.join(path, "config.json")):
            from transformers import AutoConfig

            try:
                hf_config = AutoConfig.from_pretrained(path)
            except Exception as e:  # transformers raises many types for a broken config
                raise ValueError(f"cannot read {path}/config.json: {e}") from e
        elif os.path.exists(path):
            raise ValueError(
                f"model path {path!r} has neither a config.json nor a .gguf file")
        else:
            raise ValueError(f"model path {path!r} does not exist")
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, "
                             f"got {load_format!r}")
        config = ModelConfig._build(path, hf_config, gguf_file, dtype, max_model_len, converted)
        hf_quant = _checkpoint_quantization(hf_config)
        quantization = _resolve_quantization(quantization, hf_quant, gguf_file, path)
        if load_format == "dummy" and quantization is not None and \
                _format_source(quantization) != "float":
            raise ValueError(f"load_format='dummy' draws float weights: it works with "
                             f"quantization None or one made from them (int8, int4), not "
                             f"{quantization!r}")
        return dataclasses.replace(config, load_format=load_format, quantization=quantization,
                                   hf_quant_config=hf_quant,
                                   int8_activations=bool(int8_activations), hub_id=hub_id,
                                   tokenizer=tokenizer_dir)

    @property
    def served_name(self) -> str:
        """The name the API serves the model under: its Hub id, else the file or folder's."""
        if self.hub_id is not None:
            return self.hub_id
        name = os.path.basename(os.path.normpath(self.gguf_file or self.path))
        return name.removesuffix(".gguf")

    @staticmethod
    def _build(path: str, hf_config: Any, gguf_file: str | None, dtype: str,
               max_model_len: int | None, converted_dir: str | None = None) -> ModelConfig:
        from tokenmill.models import registry

        archs = getattr(hf_config, "architectures", None) or []
        spec = registry.find_architecture(archs)
        if spec is None:
            raise ValueError(
                f"unsupported model architecture {archs or hf_config.model_type!r} in {path}; "
                f"supported: {registry.supported()}")
        arch = spec.name
        from tokenmill.layers.rotary import rope_parameter_sets

        for rope in rope_parameter_sets(hf_config).values():
            rope_type = rope.get("rope_type", "default")
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(f"unsupported RoPE type {rope_type!r} in {path}; "
                                 f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        ctx = int(hf_config.max_position_embeddings)
        if max_model_len is None:
            max_model_len = ctx
        elif not 1 <= max_model_len <= ctx:
            raise ValueError(f"max_model_len must be in [1, {ctx}] for this model, "
                             f"got {max_model_len}")
        window = getattr(hf_config, "sliding_window", None)
        if window and window >= max_model_len:
            # a window as long as the context never drops a token: plain attention (which
            # the fused CPU decode call runs), the same model
            hf_config.sliding_window = None
        return ModelConfig(path=path, hf_config=hf_config, architecture=arch,
                           dtype=_resolve_dtype(dtype, hf_config), max_model_len=max_model_len,
                           gguf_file=gguf_file, converted_dir=converted_dir,
                           headless=registry.is_headless(archs))

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def kv_sliding_window(self) -> int | None:
        """The window when every layer attends only its last `window` tokens (Mistral): KV
        blocks older than that are freed as a sequence grows (core/kv_cache_manager.py).
        None when some layer attends the whole context (Gemma's global layers, most models)."""
        from tokenmill.layers.attention import layer_sliding_window

        windows = {layer_sliding_window(self.hf_config, i) for i in range(self.num_layers)}
        return windows.pop() if len(windows) == 1 else None

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.hf_config, "num_key_value_heads", None) or \
            self.hf_config.num_attention_heads

    @property
    def head_dim(self) -> int:
        c = self.hf_config
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    @property
    def num_parameters(self) -> int:
        """Weights of the embedding, LM head and linear layers (norms and biases left out)."""
        c = self.hf_config
        hidden, inter = c.hidden_size, c.intermediate_size
        q, kv = c.num_attention_heads * self.head_dim, self.num_kv_heads * self.head_dim
        tied = bool(getattr(c, "tie_word_embeddings", False))
        per_layer = hidden * (2 * q + 2 * kv) + 3 * hidden * inter
        return c.vocab_size * hidden * (1 if tied else 2) + c.num_hidden_layers * per_layer

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def eos_token_ids(self) -> list[int]:
        eos = getattr(self.hf_config, "eos_token_id", None)
        if eos is None:
            return []
        return list(eos) if isinstance(eos, list | tuple) else [int(eos)]


def _local_model(name: str, revision: str | None, download_dir: str | None,
                 tokenizer_only: bool = False) -> tuple[str | None, str]:
    """(the Hub id, the local path) of a model or tokenizer name: a local path is itself (and
    takes no revision), anything else is resolved as a Hub id (model_loader/hub.py)."""
    from tokenmill.model_loader.hub import parse_hub_id, resolve_hub_model

    if os.path.exists(name) or parse_hub_id(name) is None:
        if revision is not None and os.path.exists(name):
            raise ValueError(f"revision applies to Hugging Face Hub ids; {name!r} is a local "
                             "path")
        return None, name
    return name, resolve_hub_model(name, revision, download_dir, tokenizer_only)


def _runner(asked: str, model: ModelConfig) -> str:
    """The runner: a base model without an LM head only embeds."""
    if not model.headless:
        return asked
    if asked == "generate":
        raise ValueError(f"{model.path} is a base model without an LM head "
                         f"({model.hf_config.architectures[0]}): it computes embeddings only; "
                         "use runner='pooling'")
    return "pooling"


def _checkpoint_quantization(hf_config: Any) -> dict[str, Any] | None:
    q = getattr(hf_config, "quantization_config", None)
    if q is None:
        return None
    return dict(q) if isinstance(q, dict) else q.to_dict()


def _format_source(name: str) -> str:
    from tokenmill.quantization import WEIGHT_FORMATS

    return WEIGHT_FORMATS[name].source


def _resolve_quantization(asked: str | None, checkpoint: dict[str, Any] | None,
                          gguf_file: str | None, path: str) -> str | None:
    """The weight format to serve, from the option and what the checkpoint holds (each
    format's `source` in the registry, quantization/__init__.py WEIGHT_FORMATS)."""
    from tokenmill.quantization import QUANTIZATION_METHODS, WEIGHT_FORMATS

    if asked in (None, "none", "None"):
        asked = None
    elif asked not in WEIGHT_FORMATS:
        raise ValueError(f"unknown quantization {asked!r}; supported: "
                         f"{', '.join(QUANTIZATION_METHODS)} or None")
    stored = [f.name for f in WEIGHT_FORMATS.values() if f.source == "checkpoint"]
    if checkpoint is not None:  # a pre-quantized HF checkpoint: serve it in its own format
        method = str(checkpoint.get("quant_method", "")).lower()
        if method not in stored:
            raise ValueError(f"{path} is quantized with {method!r}, which tokenmill cannot "
                             f"serve; supported checkpoint formats: {', '.join(stored)}")
        if asked not in (None, method):
            raise ValueError(f"quantization={asked!r}, but {path} is a {method} checkpoint; "
                             f"pass quantization={method!r} or leave it unset")
        return method
    source = None if asked is None else WEIGHT_FORMATS[asked].source
    if source == "checkpoint":
        raise ValueError(f"quantization={asked!r} needs a checkpoint in that format (its "
                         f"config.json names it in quantization_config); {path} has none")
    if source == "gguf" and gguf_file is None:
        raise ValueError(f"quantization={asked!r} serves the blocks of a GGUF file; {path} is "
                         "not one")
    return asked


def resolve_batch_invariant(asked: bool | None, device: str, model: ModelConfig,
                            attention_backend: str) -> bool:
    """Whether the engine runs batch-invariant (EngineConfig.batch_invariant): as asked, or
    by default (None) wherever it is built: on CPU, in float32, with the C++ kernels and an
    attention backend that keeps each query's order (the C++ paged kernel, "cpu" or "auto").
    Asked for where it is not built: ValueError saying why (vLLM's mode is a GPU opt-in)."""
    from tokenmill.utils.cpp_extension import kernels_enabled

    if asked not in (None, True, False):
        raise ValueError(f"batch_invariant must be True or False, got {asked!r}")
    why_not = None
    if not device.startswith("cpu"):
        why_not = f"on {device}: the batch-invariant kernels are the CPU's"
    elif not kernels_enabled():
        why_not = "without the C++ CPU kernels (TOKENMILL_CPU_KERNELS=0)"
    elif model.dtype != torch.float32:
        why_not = f"in {model.dtype}: the CPU kernels compute float32"
    elif attention_backend not in ("auto", "cpu"):
        why_not = (f"with attention_backend={attention_backend!r}: only the C++ paged kernel "
                   "attends every query in a fixed order")
    if why_not is None:
        return asked is not False
    if asked:
        raise ValueError(f"batch_invariant=True is not available {why_not}")
    return False


def resolve_device(device: str | None) -> str:
    """The device an engine runs on: the one asked for, else CUDA when present, else CPU."""
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def _resolve_dtype(dtype: str | torch.dtype, hf_config: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        # NOTE: float32 is the CPU fast path (bf16/fp16 GEMMs are 6-10x slower without AVX512);
        # on GPUs the checkpoint's own half precision is what users expect.
        if not torch.cuda.is_available():
            return torch.float32
        d = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        return d if isinstance(d, torch.dtype) and d != torch.float32 else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
    return _DTYPES[dtype]


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # bytes for K and V of all layers; None: sized at start-up (worker/kv_budget.py)
    kv_cache_memory: int | None = None
    num_kv_blocks: int | None = None  # overrides kv_cache_memory (tests, tuning)
    enable_prefix_caching: bool = True
    swap_space: int = 2**30  # bytes of CPU memory for swapped-out KV (preemption_mode="swap")
    # "auto": the model's dtype; "int8": one scale per token and KV head; "fp8" (=
    # "fp8_e4m3"): e4m3 with per-head scales (attention/kv_formats.py)
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        from tokenmill.attention.kv_formats import kv_format

        kv_format(self.kv_cache_dtype).check_available()  # ValueError: unknown or unbuilt
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two in [1, 128], "
                             f"got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 256  # requests running at once
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"  # or "swap": copy the KV to CPU memory and back
    # Schedule step N+1 while the model runs step N (vLLM's --async-scheduling): a decoding
    # request is scheduled ahead with its token in flight as a placeholder (core/scheduler.py).
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', "
                             f"got {self.preemption_mode!r}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, "
                             f"got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: str = "cpu"
    seed: int = 0
    # CPU float32: also keep a copy of each dense weight in oneDNN's blocked layout for large
    # GEMMs (layers/cpu_gemm.py); "auto": for models up to PREPACK_AUTO_MAX_BYTES of float32
    # weights (quantization/unquantized.py), since the copy doubles their memory. Only
    # without batch invariance (whose kernels read the weights as stored).
    prepack_weights: bool | str = "auto"
    # A request's logits do not depend on the rest of its step (other requests, chunking,
    # a prefix-cache hit, preemption, speculative verify steps): every linear layer and
    # attention query is summed in one order at every step size (csrc/linear_dot.h, the
    # paged kernel's fixed key chunks). Resolved at create (resolve_batch_invariant): on by
    # default where built (CPU, float32, the C++ kernels), off elsewhere.
    batch_invariant: bool = False
    # auto: the C++ paged kernel for float32 on CPU, else the PyTorch backend (attention/).
    attention_backend: str = "auto"
    # CUDA: run decode steps eagerly instead of replaying captured CUDA graphs (vLLM's name).
    enforce_eager: bool = False
    # Speculative decoding (vLLM's --speculative-config; spec_decode/config.py); None: off.
    speculative: SpeculativeConfig | None = None
    # The draft of speculative method "draft_model" (spec_decode/draft_model.py), resolved and
    # checked against the target at start-up.
    draft_model: ModelConfig | None = None
    # Structured outputs (vLLM's --structured-outputs-config; structured_output/config.py).
    structured_outputs: StructuredOutputsConfig = StructuredOutputsConfig()
    # vLLM's --runner: "generate" (text only), "pooling" (embeddings only), "auto" (both)
    runner: str = "auto"
    # how an embedding request pools the hidden states (vLLM's --pooler-config)
    pooler_config: PoolerConfig = PoolerConfig()

    def __post_init__(self) -> None:
        from tokenmill.attention.base import BACKEND_NAMES

        if self.prepack_weights not in (True, False, "auto"):
            raise ValueError(f"prepack_weights must be True, False or 'auto', got "
                             f"{self.prepack_weights!r}")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}")
        if self.attention_backend not in BACKEND_NAMES:
            raise ValueError(f"attention_backend must be one of {', '.join(BACKEND_NAMES)}, "
                             f"got {self.attention_backend!r}")

    @staticmethod
    def create(model: str | None = None, **options: Any) -> EngineConfig:
        """Build from a model path (None: the default model) and flat vLLM-style options."""
        groups: dict[str, dict[str, Any]] = {"model": {}, "cache": {}, "scheduler": {},
                                              "parallel": {}, "engine": {}}
        owners = {"dtype": "model", "max_model_len": "model", "load_format": "model",
                  "quantization": "model", "int8_activations": "model",
                  "revision": "model", "download_dir": "model", "tokenizer": "model",
                  "block_size": "cache", "kv_cache_memory": "cache", "num_kv_blocks": "cache",
                  "enable_prefix_caching": "cache", "swap_space": "cache",
                  "kv_cache_dtype": "cache",
                  "max_num_batched_tokens": "scheduler", "max_num_seqs": "scheduler",
                  "enable_chunked_prefill": "scheduler", "preemption_mode": "scheduler",
                  "async_scheduling": "scheduler",
                  "tensor_parallel_size": "parallel", "pipeline_parallel_size": "parallel",
                  "data_parallel_size": "parallel", "distributed_executor_backend": "parallel",
                  "device": "engine", "seed": "engine",
                  "prepack_weights": "engine", "attention_backend": "engine",
                  "enforce_eager": "engine", "speculative_config": "engine",
                  "batch_invariant": "engine",
                  "structured_outputs_config": "engine", "runner": "engine",
                  "pooler_config": "engine"}
        for name, value in options.items():
            if name not in owners:
                raise ValueError(f"unknown engine option {name!r}; known: "
                                 f"{', '.join(sorted(owners))}")
            if value is not None:
                groups[owners[name]][name] = value
        for size in ("kv_cache_memory", "swap_space"):
            if size in groups["cache"]:
                groups["cache"][size] = parse_size(groups["cache"][size])
        device = resolve_device(groups["engine"].get("device"))
        model_cfg = ModelConfig.from_path(model, **groups["model"])
        if "quantization" not in groups["model"]:  # none asked for ("none" is an answer)
            from tokenmill.quantization import default_quantization

            model_cfg = dataclasses.replace(
                model_cfg, quantization=default_quantization(model_cfg, device))
        if "dtype" not in groups["model"] or groups["model"]["dtype"] == "auto":
            from tokenmill.quantization import default_weight_dtype

            model_cfg = dataclasses.replace(
                model_cfg, weight_dtype=default_weight_dtype(model_cfg, device))
        sched = SchedulerConfig(**groups["scheduler"])
        if not sched.enable_chunked_prefill:
            # Without chunking a whole prompt must fit in one step (vLLM's rule too).
            if "max_num_batched_tokens" not in groups["scheduler"]:
                sched = dataclasses.replace(sched, max_num_batched_tokens=max(
                    model_cfg.max_model_len, sched.max_num_batched_tokens))
            elif sched.max_num_batched_tokens < model_cfg.max_model_len:
                raise ValueError(
                    f"max_num_batched_tokens ({sched.max_num_batched_tokens}) must be >= "
                    f"max_model_len ({model_cfg.max_model_len}) when chunked prefill is off")
        speculative = SpeculativeConfig.parse(groups["engine"].get("speculative_config"))
        draft = None
        if speculative is not None and speculative.method == "draft_model":
            from tokenmill.spec_decode.draft_model import draft_model_config

            draft = draft_model_config(speculative, model_cfg, device)
        parallel = ParallelConfig(**groups["parallel"])
        parallel.check_model(model_cfg.hf_config, device, draft is not None)
        if sched.async_scheduling and (speculative is not None
                                       or parallel.pipeline_parallel_size > 1):
            raise ValueError("async_scheduling does not run with speculative decoding or "
                             "pipeline_parallel_size > 1 yet")
        if speculative is not None and parallel.pipeline_parallel_size > 1:
            raise ValueError("speculative decoding does not run with "
                             "pipeline_parallel_size > 1 yet")
        attention_backend = groups["engine"].get("attention_backend", "auto")
        invariant = resolve_batch_invariant(groups["engine"].get("batch_invariant"), device,
                                            model_cfg, attention_backend)
        return EngineConfig(model=model_cfg, cache=CacheConfig(**groups["cache"]),
                            scheduler=sched, parallel=parallel,
                            device=device, seed=int(groups["engine"].get("seed", 0)),
                            prepack_weights=groups["engine"].get("prepack_weights", "auto"),
                            attention_backend=attention_backend, batch_invariant=invariant,
                            enforce_eager=bool(groups["engine"].get("enforce_eager", False)),
                            speculative=speculative, draft_model=draft,
                            structured_outputs=StructuredOutputsConfig.parse(
                                groups["engine"].get("structured_outputs_config")),
                            runner=_runner(groups["engine"].get("runner", "auto"), model_cfg),
                            pooler_config=PoolerConfig.parse(
                                groups["engine"].get("pooler_config")))
