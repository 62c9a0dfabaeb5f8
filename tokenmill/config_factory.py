"""The config factory: engine options (EngineArgs) → EngineConfig. Everything that reads a
checkpoint or picks a policy for one lives here, above the config dataclasses.

    EngineArgs ──create_engine_config──▶ EngineConfig
                   │ model_config (config_model.py): a path / Hub id / GGUF file →
                   │   ModelConfig (reads the checkpoint's config; its quirks normalized)
                   │ the model's sampling defaults, chat template, logprobs cap
                   │ the defaults that depend on the model and the device: the weight format,
                   │   the dense weights' dtype and products' dtype (config_weights.py),
                   │   batch invariance
                   │ the draft model of speculative decoding, checked against the target
                   ▼
    config.py: frozen dataclasses and their own validation only (no file is read there)

Invariants: the Hugging Face config object is never changed (a quirk is an override that
`ModelConfig.arch_config()` applies to a copy); an option that cannot be served is a ValueError
naming it at start-up, before any weight is read.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
)
from tokenmill.config_graphs import resolve_graphs
from tokenmill.config_model import model_config
from tokenmill.config_scheduler import resolve_async_scheduling, scheduler_config
from tokenmill.config_weights import (
    asked_half_weights,
    default_quantization,
    default_weight_dtype,
    float16_weights,
    resolve_matmul_dtype,
    stored_dtype,
)
from tokenmill.distributed.config import ParallelConfig
from tokenmill.engine.chat_content import checked_format
from tokenmill.engine.tokenizer import load_chat_template
from tokenmill.kv_offload.factory import kv_offload_config
from tokenmill.layers.linear import check_heads_split
from tokenmill.lora.config import LoRAConfig
from tokenmill.lora.targets import check_architecture as check_lora_architecture
from tokenmill.model_loader.generation_config import model_sampling_defaults
from tokenmill.pooling_params import PoolerConfig
from tokenmill.reasoning.config import ReasoningConfig
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.structured_output.config import StructuredOutputsConfig
from tokenmill.utils import cpp_extension
from tokenmill.utils.sizes import parse_size

if TYPE_CHECKING:
    from tokenmill.engine_args import EngineArgs

logger = logging.getLogger(__name__)


def create_engine_config(args: EngineArgs, offline: bool = False) -> EngineConfig:
    """The engine's config from its options (each EngineArgs field lands in one place here);
    offline: for the offline LLM (vLLM's usage context: larger default steps on CUDA)."""
    device = resolve_device(args.device)
    _check_formats(args.tokenizer_mode, args.config_format)
    model = model_config(args.model, args.dtype, args.max_model_len, args.load_format,
                         args.quantization, args.int8_activations, args.revision,
                         args.download_dir, args.tokenizer, args.trust_remote_code,
                         args.hf_overrides, args.tokenizer_revision,
                         _hf_token(args.hf_token))
    if args.quantization is None:  # none asked for ("none" is an answer)
        model = dataclasses.replace(model, quantization=default_quantization(model, device))
    half = asked_half_weights(model, device) if args.dtype != "auto" else None
    if half is not None:
        logger.info("dtype=%s on CPU: keeping %s's weights in %s (rounded at load where stored "
                    "in another dtype), computing as for a %s checkpoint (float32 activations)",
                    args.dtype, model.path, args.dtype, args.dtype)
        model = dataclasses.replace(model, dtype=torch.float32, weight_dtype=half)
    elif args.dtype == "auto":
        model = dataclasses.replace(model, weight_dtype=default_weight_dtype(model, device))
    model = dataclasses.replace(
        model, matmul_dtype=resolve_matmul_dtype(args.matmul_dtype, model),
        sampling_defaults=model_sampling_defaults(model.path, args.generation_config,
                                                  args.override_generation_config),
        chat_template=load_chat_template(args.chat_template),
        chat_template_content_format=checked_format(args.chat_template_content_format),
        max_logprobs=_max_logprobs(args.max_logprobs, model.vocab_size))
    speculative = SpeculativeConfig.parse(args.speculative_config)
    draft = None
    if speculative is not None and speculative.method == "draft_model":
        draft = draft_model_config(speculative, model, device)
    parallel = ParallelConfig(**args.group("parallel"))
    check_parallel(parallel, model.hf_config, device, draft is not None)
    scheduler = scheduler_config(args, model, resolve_async_scheduling(
        args.async_scheduling, device, speculative, parallel), device, offline)
    if speculative is not None and parallel.pipeline_parallel_size > 1:
        raise ValueError("speculative decoding does not run with "
                         "pipeline_parallel_size > 1 yet")
    cache = args.group("cache")
    cache["kv_cache_dtype"] = resolve_kv_cache_dtype(cache["kv_cache_dtype"], model,
                                                     args.dtype)
    for size in ("kv_cache_memory", "swap_space"):
        if cache[size] is not None:
            cache[size] = parse_size(cache[size])
    cache["gpu_memory_utilization"] = float(cache["gpu_memory_utilization"])
    cache = CacheConfig(**cache)
    seed = int(args.seed)
    eager, graph_sizes = resolve_graphs(args.enforce_eager, args.cuda_graph_sizes,
                                        args.compilation_config)
    return EngineConfig(
        model=model, cache=cache, scheduler=scheduler, parallel=parallel,
        device=device, seed=seed, prepack_weights=args.prepack_weights,
        attention_backend=args.attention_backend,
        batch_invariant=resolve_batch_invariant(args.batch_invariant, device, model,
                                                args.attention_backend),
        enforce_eager=eager, cuda_graph_sizes=graph_sizes, speculative=speculative,
        draft_model=draft,
        structured_outputs=StructuredOutputsConfig.parse(args.structured_outputs_config),
        reasoning=ReasoningConfig.parse(args.reasoning_parser, args.reasoning_config),
        runner=_runner(args.runner, model),
        pooler_config=PoolerConfig.parse(args.pooler_config),
        lora=_lora_config(args, model),
        kv_offload=kv_offload_config(args.group("kv_offload"), model, cache, parallel, seed,
                                     draft is not None),
        enable_sleep_mode=_sleep_mode(args.enable_sleep_mode, parallel))


def _check_formats(tokenizer_mode: str, config_format: str) -> None:
    """vLLM's --tokenizer-mode and --config-format: the Hugging Face forms are what tokenmill
    reads; the others (mistral_common's tokenizer, params.json, ...) are refused by name."""
    if tokenizer_mode.lower() not in ("auto", "hf"):
        raise ValueError(f"tokenizer_mode {tokenizer_mode!r}: tokenmill reads Hugging Face "
                         "tokenizers (auto, hf); serve the model's Hugging Face tokenizer "
                         "files (tokenizer.json) instead")
    if config_format.lower() not in ("auto", "hf"):
        raise ValueError(f"config_format {config_format!r}: tokenmill reads config.json (auto, "
                         "hf); serve the model's Hugging Face files instead")


def _hf_token(value: str | None) -> str | bool | None:
    """--hf-token: a token, or true for the one `hf auth login` stored."""
    return True if value is not None and value.lower() == "true" else value


def resolve_kv_cache_dtype(asked: str, model: ModelConfig, dtype_asked: str = "auto") -> str:
    """The KV cache format `asked` ("auto" resolved) for `model`: "auto" is bfloat16 where
    the products are (matmul_dtype bfloat16: the cache in their dtype), for a GGUF file
    served in its blocks (llama.cpp's cache is 16-bit by default, vLLM's the checkpoint's
    half precision: +20-38% batched on SmolLM2 Q4_1 on an AMX Xeon, RESULTS.md; top-1
    99.66-99.85% against a float32 cache, quant_quality.py), and for a bfloat16 checkpoint
    whose weights are quantized and computed in float32 (dtype "auto" on CPU: the cache in
    the checkpoint's dtype, as vLLM keeps it whatever the weights' format; +16% / +31%
    batched for SmolLM2 int8 on a Zen 4, RESULTS.md fifty-sixth session); else the model's
    dtype; "float16" for float16 weights computed in float32 (config_weights.float16_weights).
    "float32" keeps a float32 model's cache exact, and needs a float32 model."""
    if asked == "float32" and model.dtype != torch.float32:
        raise ValueError(f"kv_cache_dtype 'float32' keeps a float32 model's K and V as "
                         f"computed; this model computes in {model.dtype}: use 'auto'")
    if asked != "auto":
        return asked
    if model.matmul_dtype == torch.bfloat16:
        return "bfloat16"
    if model.quantization == "gguf":
        logger.info("KV cache in bfloat16 for the GGUF blocks (llama.cpp's cache is 16-bit; "
                    "--kv-cache-dtype float32 keeps the float32 expansion's exact cache)")
        return "bfloat16"
    if (dtype_asked == "auto" and model.quantization is not None
            and model.dtype == torch.float32 and stored_dtype(model) == torch.bfloat16):
        logger.info("KV cache in bfloat16, the checkpoint's dtype (its weights in %s, "
                    "computed in float32; --kv-cache-dtype float32 keeps a float32 cache)",
                    model.quantization)
        return "bfloat16"
    if model.dtype == torch.float32 and float16_weights(model, dtype_asked):
        logger.info("KV cache in float16, the weights' dtype (computed in float32; "
                    "--kv-cache-dtype float32 keeps a float32 cache)")
        return "float16"
    return asked


def _sleep_mode(asked: bool | None, parallel: ParallelConfig) -> bool:
    if asked and (parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1):
        raise ValueError("enable_sleep_mode runs with tensor_parallel_size 1 and "
                         "pipeline_parallel_size 1 only, yet")
    return bool(asked)


def _lora_config(args: EngineArgs, model: ModelConfig) -> LoRAConfig | None:
    options = args.group("lora")
    if not options.pop("enable_lora"):
        return None
    check_lora_architecture(model.architecture)
    if options["lora_dtype"] == "auto":  # the base weights' dtype
        dtype = model.weight_dtype or model.dtype
        options["lora_dtype"] = str(dtype).removeprefix("torch.")
    return LoRAConfig(**options)


def resolve_device(device: str | None) -> str:
    """The device an engine runs on: the one asked for, else CUDA when present, else CPU."""
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


# ---- the model ------------------------------------------------------------------------------

def _max_logprobs(asked: int, vocab_size: int) -> int:
    """--max-logprobs: -1 is the vocabulary's size; no more than it."""
    if isinstance(asked, bool) or not isinstance(asked, int) or asked < -1:
        raise ValueError(f"max_logprobs must be an integer >= -1, got {asked!r}")
    return vocab_size if asked == -1 else min(asked, vocab_size)


def _runner(asked: str, model: ModelConfig) -> str:
    """The runner: a base model without an LM head only embeds."""
    if not model.headless:
        return asked
    if asked == "generate":
        raise ValueError(f"{model.path} is a base model without an LM head "
                         f"({model.hf_config.architectures[0]}): it computes embeddings only; "
                         "use runner='pooling'")
    return "pooling"


# ---- policies that depend on the model and the device ---------------------------------------

def resolve_batch_invariant(asked: bool | None, device: str, model: ModelConfig,
                            attention_backend: str) -> bool:
    """Whether the engine runs batch-invariant (EngineConfig.batch_invariant): as asked, or
    by default (None) wherever it is built: on CPU, in float32, with the C++ kernels and an
    attention backend that keeps each query's order (the C++ paged kernel, "cpu" or "auto").
    Asked for where it is not built: ValueError saying why (vLLM's mode is a GPU opt-in)."""
    if asked not in (None, True, False):
        raise ValueError(f"batch_invariant must be True or False, got {asked!r}")
    why_not = None
    if not device.startswith("cpu"):
        why_not = f"on {device}: the batch-invariant kernels are the CPU's"
    elif not cpp_extension.kernels_enabled():
        why_not = "without the C++ CPU kernels (TOKENMILL_CPU_KERNELS=0)"
    elif model.dtype != torch.float32:
        why_not = f"in {model.dtype}: the CPU kernels compute float32"
    elif model.quantization == "fp8" and model.hf_quant_config is None:
        why_not = "with quantization='fp8': torch's fp8 GEMM sums in an order of its own"
    elif attention_backend not in ("auto", "cpu"):
        why_not = (f"with attention_backend={attention_backend!r}: only the C++ paged kernel "
                   "attends every query in a fixed order")
    if why_not is None:
        return asked is not False
    if asked:
        raise ValueError(f"batch_invariant=True is not available {why_not}")
    return False


def check_parallel(parallel: ParallelConfig, hf_config: Any, device: str,
                   draft_model: bool) -> None:
    """ValueError unless this model can be split this way on this device."""
    pp, tp, world = (parallel.pipeline_parallel_size, parallel.tensor_parallel_size,
                     parallel.world_size)
    if pp > hf_config.num_hidden_layers:
        raise ValueError(f"pipeline_parallel_size={pp} exceeds the model's "
                         f"{hf_config.num_hidden_layers} layers (a stage holds at least one)")
    if draft_model and world > 1:
        raise ValueError("speculative method 'draft_model' does not run with "
                         "tensor_parallel_size or pipeline_parallel_size > 1 yet "
                         "(n-gram and suffix drafts run with tensor parallelism)")
    if device.startswith("cuda") and torch.cuda.device_count() < world:
        raise ValueError(f"{world} ranks (tensor x pipeline parallel) need {world} GPUs; "
                         f"{torch.cuda.device_count()} visible")
    if tp == 1:
        return
    heads = hf_config.num_attention_heads
    check_heads_split(heads, getattr(hf_config, "num_key_value_heads", None) or heads, tp)
    if hf_config.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} cannot split the MLP's "
                         f"{hf_config.intermediate_size} intermediate features evenly")


def draft_model_config(spec: SpeculativeConfig, target: ModelConfig, device: str) -> ModelConfig:
    """The draft's ModelConfig (spec_decode/draft_model.py), checked against the target (same
    vocabulary, its context)."""
    path = target.path if spec.model is None else os.path.expanduser(spec.model)
    try:
        draft = model_config(path, dtype=str(target.dtype).removeprefix("torch."),
                             max_model_len=target.max_model_len, quantization=spec.quantization,
                             trust_remote_code=target.trust_remote_code)
    except ValueError as e:
        raise ValueError(f"speculative draft model: {e}") from None
    if spec.quantization is None:
        draft = dataclasses.replace(draft, quantization=default_quantization(draft, device))
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative draft model {path} has a vocabulary of "
                         f"{draft.vocab_size} tokens, the target {target.vocab_size}: a draft "
                         "must share the target's tokenizer")
    if (os.path.realpath(draft.path) == os.path.realpath(target.path)
            and draft.quantization == target.quantization):
        raise ValueError(f"speculative draft model: {path} in weight format "
                         f"{draft.quantization or 'dense'} is the target itself; pass a "
                         "smaller model or a cheaper 'quantization' (e.g. 'gguf', 'int8')")
    return draft
