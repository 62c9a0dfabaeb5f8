"""Engine configuration as data: frozen dataclasses grouped by concern, each validating its
own values (a ValueError naming the option).

Nothing here reads a file or picks a policy: config_factory.py builds these from the engine
options (engine_args.py EngineArgs), reading the checkpoint there. Configs are frozen; derive
changed copies with `dataclasses.replace`. Model quirks (HF folder vs GGUF file, rope scaling,
a window as long as the context) are normalized into ModelConfig's own fields and
`hf_overrides`, so models never look at file formats and the Hugging Face object is never
changed: `ModelConfig.arch_config()` is the config a model is built from.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenmill.attention.kv_formats import kv_format
from tokenmill.attention.registry import BACKEND_NAMES
from tokenmill.core.scheduling_policy import SCHEDULING_POLICIES
from tokenmill.distributed.config import ParallelConfig
from tokenmill.kv_offload.config import KVOffloadConfig
from tokenmill.lora.config import LoRAConfig
from tokenmill.pooling_params import PoolerConfig
from tokenmill.reasoning.config import ReasoningConfig
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.structured_output.config import StructuredOutputsConfig

# RoPE types whose frequencies do not depend on the sequence length (so a cos/sin table works).
# (longrope: its short / long factors switch at a fixed position, layers/rotary.py)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
LOAD_FORMATS = ("auto", "dummy")
RUNNERS = ("auto", "generate", "pooling")
PREEMPTION_MODES = ("recompute", "swap")
DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


def layer_sliding_window(config: Any, layer_idx: int) -> int | None:
    """The layer's attention window in tokens, or None for full attention: transformers'
    `layer_types` ("sliding_attention" / "full_attention") where the config has them, else
    `sliding_window` for every layer where the config enables it (`use_sliding_window`,
    which configs without the flag, such as Mistral's, leave on)."""
    window = getattr(config, "sliding_window", None) or None
    types = getattr(config, "layer_types", None)
    if types is not None:
        return window if types[layer_idx] == "sliding_attention" else None
    return window if getattr(config, "use_sliding_window", True) else None


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
    # The weight format (tokenmill/quantization/): None (dense), "int8", "int4", "fp8",
    # "awq", "gptq" or "gguf"; hf_quant_config is the checkpoint's own quantization_config. Unset
    # in the options, a quantized GGUF may become "gguf" (config_weights.default_quantization).
    quantization: str | None = None
    hf_quant_config: dict[str, Any] | None = None
    # Quantized weights multiply int8-quantized activations in every step (llama.cpp's
    # numbers, faster) instead of float ones (rounded to int16 per 32 values on AVX-512 VNNI
    # CPUs, exact elsewhere; csrc/linear_cpu.h).
    int8_activations: bool = False
    # Dense weights kept in this dtype on CPU (a bfloat16 / float16 checkpoint's own, with
    # `dtype` float32 for everything else; quantization/unquantized.py); None: `dtype`.
    weight_dtype: torch.dtype | None = None
    # The dtype those half-precision weights are multiplied in: None, float32 (the weights
    # widened exactly: float32's results); bfloat16 (bf16 weights only: activations rounded to
    # bf16 at each product, float32 sums; AVX512-BF16's instructions, emulated elsewhere).
    matmul_dtype: torch.dtype | None = None
    # The model as the user named it (a Hub id, or None for a local path): the served name.
    hub_id: str | None = None
    # Where the tokenizer comes from when not from the model itself (vLLM's --tokenizer,
    # resolved to a local folder); None: the model's folder or GGUF metadata.
    tokenizer: str | None = None
    # Where a Hub id was resolved: its revision (None: main) and cache (None: HF_HUB_CACHE's).
    revision: str | None = None
    download_dir: str | None = None
    # vLLM's --hf-token: the token Hub files are fetched with (True: the stored login); None:
    # HF_TOKEN's or the stored login, as huggingface_hub reads them. Kept out of repr.
    hf_token: str | bool | None = field(default=None, repr=False)
    # vLLM's --trust-remote-code: transformers may run the folder's own config / tokenizer code
    trust_remote_code: bool = False
    # vLLM's --max-logprobs: the most logprobs / prompt_logprobs a request may ask (-1: the
    # vocabulary's size)
    max_logprobs: int = 20
    # hf_config values the model is built with instead of the checkpoint's (a normalized
    # quirk, e.g. sliding_window None where the window covers max_model_len): arch_config().
    hf_overrides: Mapping[str, Any] = field(default_factory=dict)
    # the sampling values a request leaves unset take (the model's generation_config.json,
    # vLLM's --generation-config: model_loader/generation_config.py), SamplingParams keywords
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)
    # the chat template asked for instead of the tokenizer's (vLLM's --chat-template: the
    # text, read from its file); None: the tokenizer's (engine/tokenizer.chat_template_of)
    chat_template: str | None = None
    # how the template gets a message's content (vLLM's --chat-template-content-format:
    # engine/chat_content.py): "auto" (read from the template), "string" or "openai" (parts)
    chat_template_content_format: str = "auto"

    def arch_config(self) -> Any:
        """The config the model's modules are built from: hf_config with hf_overrides, on a
        copy (the checkpoint's own object is never changed)."""
        if not self.hf_overrides:
            return self.hf_config
        config = copy.copy(self.hf_config)
        for name, value in self.hf_overrides.items():
            setattr(config, name, value)
        return config

    @property
    def served_name(self) -> str:
        """The name the API serves the model under: its Hub id, else the file or folder's."""
        if self.hub_id is not None:
            return self.hub_id
        name = os.path.basename(os.path.normpath(self.gguf_file or self.path))
        return name.removesuffix(".gguf")

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def kv_sliding_window(self) -> int | None:
        """The window when every layer attends only its last `window` tokens (Mistral): KV
        blocks older than that are freed as a sequence grows (core/kv_cache_manager.py).
        None when some layer attends the whole context (Gemma's global layers, most models)."""
        config = self.arch_config()
        windows = {layer_sliding_window(config, i) for i in range(self.num_layers)}
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


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # bytes for K and V of all layers; None: sized at start-up (worker/kv_budget.py)
    kv_cache_memory: int | None = None
    num_kv_blocks: int | None = None  # overrides kv_cache_memory (tests, tuning)
    # CUDA, kv_cache_memory unset: the share of the device's memory this engine fills (the KV
    # cache takes what the weights and a profiled step leave: worker/memory_profile.py)
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    swap_space: int = 2**30  # bytes of CPU memory for swapped-out KV (preemption_mode="swap")
    # "auto": the model's dtype (config_factory.resolve_kv_cache_dtype: bfloat16 for bf16
    # products, GGUF blocks and a bf16 checkpoint's quantized weights); "float32";
    # "bfloat16"; "int8": one scale per token and KV head; "fp8" (= "fp8_e4m3"): e4m3 with
    # per-head scales (attention/kv_formats.py)
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        kv_format(self.kv_cache_dtype).check_available()  # ValueError: unknown or unbuilt
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two in [1, 128], "
                             f"got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 256  # requests running at once
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"  # or "swap": copy the KV to CPU memory and back
    # Schedule step N+1 while the model runs step N (vLLM's --async-scheduling): a decoding
    # request is scheduled ahead with its token in flight as a placeholder (core/scheduler.py).
    async_scheduling: bool = False
    # "fcfs" or "priority": requests' `priority` first, lower served first (vLLM's
    # --scheduling-policy; core/scheduling_policy.py)
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of "
                             f"{', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
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
    # paged kernel's fixed key chunks). Resolved by config_factory.resolve_batch_invariant: on by
    # default where built (CPU, float32, the C++ kernels), off elsewhere.
    batch_invariant: bool = False
    # auto: the C++ paged kernel for float32 on CPU, else the PyTorch backend (attention/).
    attention_backend: str = "auto"
    # CUDA: run decode steps eagerly instead of replaying captured CUDA graphs (vLLM's name).
    enforce_eager: bool = False
    # CUDA: the decode batch sizes captured as graphs (vLLM's --cuda-graph-sizes: one value N,
    # vLLM's sizes up to N; several, those sizes; worker/cuda_graphs.py); None: vLLM's default
    cuda_graph_sizes: tuple[int, ...] | None = None
    # Speculative decoding (vLLM's --speculative-config; spec_decode/config.py); None: off.
    speculative: SpeculativeConfig | None = None
    # The draft of speculative method "draft_model" (spec_decode/draft_model.py), resolved and
    # checked against the target at start-up.
    draft_model: ModelConfig | None = None
    # Structured outputs (vLLM's --structured-outputs-config; structured_output/config.py).
    structured_outputs: StructuredOutputsConfig = StructuredOutputsConfig()
    # a thinking model's reasoning tags (vLLM's --reasoning-parser, --reasoning-config;
    # reasoning/config.py); None: requests' reasoning is not known to the engine
    reasoning: ReasoningConfig | None = None
    # vLLM's --runner: "generate" (text only), "pooling" (embeddings only), "auto" (both)
    runner: str = "auto"
    # how an embedding request pools the hidden states (vLLM's --pooler-config)
    pooler_config: PoolerConfig = PoolerConfig()
    # multi-LoRA serving (vLLM's --enable-lora, lora/); None: no adapters
    lora: LoRAConfig | None = None
    # KV tiers below the cache and disaggregated prefill's transfer (kv_offload/); None: none
    kv_offload: KVOffloadConfig | None = None
    # vLLM's --enable-sleep-mode: LLMEngine.sleep / wake_up (worker/sleep_mode.py)
    enable_sleep_mode: bool = False

    def __post_init__(self) -> None:
        if self.prepack_weights not in (True, False, "auto"):
            raise ValueError(f"prepack_weights must be True, False or 'auto', got "
                             f"{self.prepack_weights!r}")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}")
        if self.cuda_graph_sizes is not None and (
                not self.cuda_graph_sizes
                or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                           for n in self.cuda_graph_sizes)):
            raise ValueError(f"cuda_graph_sizes must be positive integers, got "
                             f"{self.cuda_graph_sizes!r}")
        if self.attention_backend not in BACKEND_NAMES:
            raise ValueError(f"attention_backend must be one of {', '.join(BACKEND_NAMES)}, "
                             f"got {self.attention_backend!r}")
