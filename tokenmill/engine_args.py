"""EngineArgs: every engine option declared once (vLLM's EngineArgs).

Each field carries its type, default, help, config group and CLI spelling. From it come:
- the keywords of `LLM(model, **options)`, `LLMEngine.from_options` and `make_replicas`
  (`EngineArgs.from_options`: an unknown keyword is a ValueError listing the known ones);
- the flags of every command that runs an engine (`add_cli_args`: `--max-num-seqs`; a bool
  field gets `--x` and `--no-x`; extra spellings such as `-tp` in `flags`);
- the config (`create_engine_config`, config_factory.py): the fields of the cache, scheduler
  and parallel groups are those configs' keywords as they stand; the model and engine groups
  are resolved there against the checkpoint and the device.

Invariant: a field's default is its config's default (read from the config class) or None
where the default depends on the model or the device (then its help says how it is chosen);
a None passed as a keyword or left on the command line means that default.
tests/engine/test_engine_args.py walks every field through the CLI, the keywords and the config.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

from tokenmill.attention.kv_formats import PLANNED_KV_FORMATS, kv_format_names
from tokenmill.attention.registry import BACKEND_NAMES
from tokenmill.config import (
    DTYPES,
    LOAD_FORMATS,
    PREEMPTION_MODES,
    RUNNERS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from tokenmill.config_factory import create_engine_config
from tokenmill.core.scheduling_policy import SCHEDULING_POLICIES
from tokenmill.distributed.config import EXECUTOR_BACKENDS, ParallelConfig
from tokenmill.engine.chat_content import CONTENT_FORMATS
from tokenmill.kv_offload.config import OFFLOADING_BACKENDS
from tokenmill.lora.config import LORA_DTYPES, LoRAConfig
from tokenmill.quantization import QUANTIZATION_METHODS
from tokenmill.reasoning.parsers import REASONING_PARSERS

GROUPS = ("model", "cache", "kv_offload", "scheduler", "parallel", "lora", "engine")


def option(default: Any, help: str, group: str, *, flags: tuple[str, ...] = (),
           choices: tuple[Any, ...] | None = None, negations: tuple[str, ...] = (),
           metavar: str | None = None) -> Any:
    """An EngineArgs field. group: the config it belongs to (GROUPS); flags: CLI spellings
    besides --the-field-name; negations: extra spellings that set a bool field False."""
    assert group in GROUPS, group
    return dataclasses.field(default=default, metadata={
        "help": help, "group": group, "flags": flags, "choices": choices,
        "negations": negations, "metavar": metavar})


@dataclass
class EngineArgs:
    # ---- the model -------------------------------------------------------------------------
    model: str | None = option(
        None, "a Hugging Face folder, a .gguf file or a Hub id (ORG/NAME, ORG/NAME:Q4_K_M, "
        "ORG/NAME/FILE.gguf; default: SmolLM2-135M-Instruct)", "model")
    revision: str | None = option(
        None, "a Hub model's branch, tag or commit (default: main)", "model")
    download_dir: str | None = option(
        None, "the Hugging Face cache to read and download Hub models into (default: "
        "HF_HUB_CACHE / HF_HOME's)", "model")
    tokenizer: str | None = option(
        None, "a tokenizer folder or Hub id to use instead of the model's own (e.g. the "
        "original repository of a GGUF file)", "model")
    tokenizer_revision: str | None = option(
        None, "vLLM's flag: the --tokenizer Hub id's branch, tag or commit (default: "
        "--revision)", "model")
    tokenizer_mode: str = option(
        "auto", "vLLM's flag: auto and hf read the Hugging Face tokenizer (what tokenmill "
        "always does); mistral (mistral_common's tokenizer) and the other modes are refused: "
        "serve the model's Hugging Face files", "model")
    config_format: str = option(
        "auto", "vLLM's flag: auto and hf read config.json (a GGUF file: its metadata); "
        "mistral (params.json) is refused: serve the model's Hugging Face files", "model")
    hf_token: str | None = option(
        None, "vLLM's flag: the token Hub files are fetched with (true: the one `hf auth "
        "login` stored; default: HF_TOKEN's, else the stored one)", "model", metavar="TOKEN")
    dtype: str = option(
        "auto", "the compute dtype; auto: float32 on CPU (a bf16 / fp16 checkpoint's dense "
        "weights kept in their own dtype), the checkpoint's half precision on GPU; bfloat16 / "
        "float16 on CPU: a float32 checkpoint's dense weights rounded to it at load and served "
        "as such a checkpoint is (float32 activations)", "model",
        choices=("auto", *DTYPES))
    matmul_dtype: str = option(
        "auto", "CPU, a bfloat16 checkpoint kept as stored (dtype auto) or a GGUF file's BF16 "
        "tensors: the dtype their products are computed in; bfloat16 = activations rounded "
        "to bf16, float32 sums (AVX512-BF16, "
        "~2x the speed of batched steps; emulated elsewhere), with a bfloat16 KV cache under "
        "kv_cache_dtype auto; float32 = the weights widened exactly (float32's results); auto "
        "= bfloat16 where the CPU has AVX512-BF16 and the weights are all bf16, else float32",
        "model",
        choices=("auto", "float32", "bfloat16"))
    trust_remote_code: bool = option(
        False, "vLLM's flag: let transformers run the model folder's own config and "
        "tokenizer code (its auto_map); the model itself always runs tokenmill's own "
        "implementation of its architecture", "model")
    hf_overrides: str | dict[str, Any] | None = option(
        None, "vLLM's flag: JSON of config.json values to use instead of the checkpoint's "
        "(a sub-config's keys as an object), e.g. '{\"max_position_embeddings\": 8192}'",
        "model")
    max_logprobs: int = option(
        ModelConfig.max_logprobs, "vLLM's flag: the most logprobs (and prompt_logprobs, chat's "
        "top_logprobs) a request may ask; -1: the vocabulary's size", "model")
    chat_template: str | None = option(
        None, "vLLM's flag: a Jinja chat template file, or the template itself, rendering "
        "conversations instead of the tokenizer's (chat completions, Messages, Responses, "
        "/tokenize, LLM.chat)", "model")
    chat_template_content_format: str = option(
        ModelConfig.chat_template_content_format, "vLLM's flag: how the chat template gets "
        "a message's content: string (the text), openai (a list of {type: text, text} parts, "
        "for templates that loop over them), auto (read from the template)", "model",
        choices=CONTENT_FORMATS)
    generation_config: str = option(
        "auto", "vLLM's flag: where requests' default sampling values come from: auto, the "
        "model's generation_config.json (temperature, top_p, top_k, min_p, penalties, "
        "max_new_tokens as max_tokens; a request's own values win); vllm, none (neutral "
        "defaults); or a folder holding a generation_config.json", "model")
    override_generation_config: str | dict[str, Any] | None = option(
        None, "vLLM's flag: JSON of sampling defaults set over --generation-config's, e.g. "
        "'{\"temperature\": 0.5}'", "model")
    max_model_len: int | None = option(
        None, "the longest prompt + output in tokens (default: the model's context)", "model")
    load_format: str = option(
        "auto", "dummy: seeded random weights of the model's shape (benchmarks)", "model",
        choices=LOAD_FORMATS)
    quantization: str | None = option(
        None, "weight format: int8 / int4 quantize a float checkpoint at load (CPU and CUDA); "
        "fp8: W8A8 e4m3, per-channel weight and per-token activation scales (CUDA sm_89+, "
        "CPU for reference); awq / gptq read such checkpoints (the default for them); gguf "
        "serves a GGUF file's blocks as stored (the default for a quantized GGUF on CPU); "
        "none: dense, a GGUF expanded to float32",
        "model", flags=("-q",), choices=("none", *QUANTIZATION_METHODS))
    int8_activations: bool = option(
        ModelConfig.int8_activations, "quantized weights: every step multiplies "
        "int8-quantized activations (llama.cpp's numbers; faster, slightly less exact)",
        "model")
    # ---- the KV cache ----------------------------------------------------------------------
    block_size: int = option(CacheConfig.block_size, "tokens per KV block", "cache")
    kv_cache_memory: str | int | None = option(
        CacheConfig.kv_cache_memory, "KV cache size: bytes or e.g. 512MiB, 4GiB (default: "
        "half the memory free after the weights on CPU; on GPU what "
        "--gpu-memory-utilization leaves; logged)", "cache",
        flags=("--kv-cache-memory-bytes",))
    gpu_memory_utilization: float = option(
        CacheConfig.gpu_memory_utilization, "CUDA: the fraction of the GPU's memory this "
        "engine may fill (weights, a profiled step's activations at max_num_batched_tokens, "
        "then the KV cache in the rest; as vLLM's); --kv-cache-memory overrides", "cache")
    num_kv_blocks: int | None = option(
        CacheConfig.num_kv_blocks, "exact number of KV blocks (overrides --kv-cache-memory)",
        "cache")
    enable_prefix_caching: bool = option(
        CacheConfig.enable_prefix_caching, "reuse the KV blocks of prompt prefixes computed "
        "before (a radix tree over whole blocks)", "cache", negations=("--no-prefix-caching",))
    swap_space: str | int = option(
        CacheConfig.swap_space, "CPU memory for swapped-out KV (--preemption-mode swap): "
        "bytes or e.g. 1GiB", "cache")
    kv_cache_dtype: str = option(
        CacheConfig.kv_cache_dtype, "KV cache storage (vLLM's flag): auto = the model's dtype "
        "(bfloat16 under matmul_dtype bfloat16, for a GGUF file's blocks, as llama.cpp's "
        "16-bit cache, and for a bf16 checkpoint's quantized weights, as vLLM's); "
        "float32 = a float32 model's K and V exactly; "
        "bfloat16 = half a float32 model's bytes; int8 = one scale per token and KV head, "
        "~3.8x the tokens; fp8 (= fp8_e4m3) = e4m3 with a per-head scale, 4x; fp8_e5m2 is not "
        "built yet", "cache", choices=(*kv_format_names(), *PLANNED_KV_FORMATS))
    # ---- the scheduler ---------------------------------------------------------------------
    max_num_batched_tokens: int | None = option(
        None, f"the token budget of one step (default: {SchedulerConfig.max_num_batched_tokens}"
        "; on CUDA vLLM's: 8192 for a server and 16384 offline on GPUs of 70 GiB or more, "
        "else 2048 and 8192; without chunked prefill at least max_model_len)", "scheduler")
    max_num_seqs: int | None = option(
        None, f"requests running at once (default: {SchedulerConfig.max_num_seqs}; on CUDA "
        "vLLM's: 1024 on GPUs of 70 GiB or more)", "scheduler")
    enable_chunked_prefill: bool = option(
        SchedulerConfig.enable_chunked_prefill, "split long prompts over steps, beside the "
        "decoding requests", "scheduler", negations=("--no-chunked-prefill",))
    preemption_mode: str = option(
        SchedulerConfig.preemption_mode, "what a request preempted for memory loses: "
        "recompute (its KV, computed again) or swap (copied to CPU memory and back)",
        "scheduler", choices=PREEMPTION_MODES)
    async_scheduling: bool | None = option(
        None, "schedule and prepare each step while the model runs the one before (default: "
        "on for CUDA where it runs: tensor_parallel_size 1, no speculative decoding, "
        "pipeline_parallel_size 1; off on CPU, where the forward pass already uses every "
        "core); --no-: never", "scheduler")
    scheduling_policy: str = option(
        SchedulerConfig.scheduling_policy, "the order requests are served in: fcfs, or "
        "priority (a request's `priority`, lower first, then arrival; a full batch gives up "
        "its lowest-priority request to a higher one)", "scheduler",
        choices=SCHEDULING_POLICIES)
    # ---- parallelism -----------------------------------------------------------------------
    tensor_parallel_size: int = option(
        ParallelConfig.tensor_parallel_size, "split the model's heads, MLP and vocabulary over "
        "this many worker processes (gloo on CPU, NCCL on CUDA)", "parallel", flags=("-tp",))
    pipeline_parallel_size: int = option(
        ParallelConfig.pipeline_parallel_size, "split the model's layers into this many "
        "stages, one worker process (or tensor-parallel group) each, steps in flight through "
        "them", "parallel", flags=("-pp",))
    data_parallel_size: int = option(
        ParallelConfig.data_parallel_size, "serve this many engine replicas behind one API "
        "server, each with its own KV cache and worker processes (tokenmill serve only)",
        "parallel", flags=("-dp",))
    distributed_executor_backend: str | None = option(
        ParallelConfig.distributed_executor_backend, "where the ranks run: uni (this process, "
        "size 1), mp (one process per rank; the default above size 1), ray (Ray actors on a "
        "Ray cluster's machines: docs/parallel.md)", "parallel", choices=EXECUTOR_BACKENDS)
    # ---- LoRA adapters ---------------------------------------------------------------------
    kv_offloading_size: float | str | None = option(
        None, "KV tiers (vLLM's flag): the size of the tier below the KV cache, GiB or a size "
        "with a unit (512MiB): evicted prefix-cache blocks go there and are served back "
        "from it", "kv_offload")
    kv_offloading_backend: str | None = option(
        None, "the tier: native = CPU memory (the default when a size is given), disk = block "
        "files in --kv-offloading-dir (the default when a directory is given), kept across "
        "restarts", "kv_offload",
        choices=OFFLOADING_BACKENDS)
    kv_offloading_dir: str | None = option(
        None, "the disk tier's directory (--kv-offloading-backend disk)", "kv_offload")
    kv_transfer_config: str | dict[str, Any] | None = option(
        None, 'disaggregated prefill as JSON (vLLM\'s flag): {"kv_connector": '
        '"SharedStorageConnector", "kv_role": "kv_producer" | "kv_consumer" | "kv_both", '
        '"kv_connector_extra_config": {"shared_storage_path": DIR}}', "kv_offload")
    enable_lora: bool = option(
        False, "serve LoRA adapters (peft folders) over the model: per request "
        "(lora_request) or, on the server, by --lora-modules names", "lora")
    max_loras: int = option(LoRAConfig.max_loras, "adapters one step may use at once",
                            "lora")
    max_lora_rank: int = option(LoRAConfig.max_lora_rank, "the largest adapter rank served",
                                "lora")
    max_cpu_loras: int | None = option(
        None, "adapters kept in memory, least recently used out (default: max_loras)", "lora")
    lora_dtype: str = option(
        LoRAConfig.lora_dtype, "the dtype adapters are held in; auto: the base weights' "
        "(bfloat16 for a bf16 checkpoint, float32 for float32 and quantized bases); a "
        "half dtype halves the adapters' memory and reads, exact for adapters saved in it",
        "lora", choices=LORA_DTYPES)
    # ---- the engine ------------------------------------------------------------------------
    device: str | None = option(None, "cpu or cuda (default: cuda when present)", "engine")
    seed: int = option(EngineConfig.seed, "the seed of dummy weights and of requests "
                       "without their own", "engine")
    prepack_weights: bool | str = option(
        EngineConfig.prepack_weights, "CPU float32: keep a oneDNN-packed copy of each weight "
        "for large batches (default auto: for models up to 5 GiB of weights); --no-: no "
        "packed copy (half the weight memory)", "engine")
    batch_invariant: bool | None = option(
        None, "a request's tokens never depend on what shares its step (default: on where "
        "built: CPU, float32, the C++ kernels); --no-: the fastest kernel for each step size "
        "(results may then vary in the last bits with the batch)", "engine")
    attention_backend: str = option(EngineConfig.attention_backend, "the attention kernels",
                                    "engine", choices=BACKEND_NAMES)
    enforce_eager: bool = option(EngineConfig.enforce_eager, "CUDA: run decode steps eagerly, "
                                 "without CUDA graphs", "engine")
    cuda_graph_sizes: list[int] | None = option(
        None, "CUDA (vLLM's flag): the decode batch sizes captured as graphs; one value N: "
        "vLLM's sizes up to N (1, 2, 4, then every 8 up to 256 and every 16 beyond); several: "
        "those sizes; none over --max-num-seqs (default: vLLM's sizes up to "
        "min(max_num_seqs, 512); larger batches run eagerly)", "engine",
        flags=("--max-cudagraph-capture-size",), metavar="N")
    compilation_config: str | dict[str, Any] | None = option(
        None, "vLLM's flag, its CUDA-graph keys: cudagraph_mode (NONE, FULL_DECODE_ONLY, "
        "FULL_AND_PIECEWISE: decode steps graphed, mixed ones eager), cudagraph_capture_sizes, "
        "max_cudagraph_capture_size; tokenmill compiles nothing, so other keys are refused",
        "engine")
    speculative_config: str | dict[str, Any] | None = option(
        None, 'speculative decoding as JSON (vLLM\'s flag): method "ngram", "suffix" or '
        '"draft_model" (with "model" and/or "quantization"), e.g. \'{"method": "suffix", '
        '"num_speculative_tokens": 3}\'', "engine")
    structured_outputs_config: str | dict[str, Any] | None = option(
        None, 'structured outputs as JSON (vLLM\'s flag): "backend" ("auto", "guidance" or '
        '"xgrammar"), "jump_forward" (true or false) and "enable_in_reasoning" (true: with a '
        'reasoning parser, grammars apply from the first token, not from where the reasoning '
        'ends)', "engine")
    reasoning_parser: str | None = option(
        None, "vLLM's flag: the thinking model's reasoning tags (deepseek_r1: an answer "
        "reasons until </think>, with or without <think>; qwen3: only after <think>; mistral: "
        "[THINK] ... [/THINK]). The "
        "server splits answers with it (chat's message.reasoning, Responses' reasoning items, "
        "Messages' thinking blocks); the engine enforces requests' thinking_token_budget and "
        "starts their grammars where the reasoning ends", "engine",
        choices=tuple(sorted(REASONING_PARSERS)))
    reasoning_config: str | dict[str, Any] | None = option(
        None, "vLLM's flag, as JSON: \"reasoning_start_str\" and \"reasoning_end_str\" (the "
        "text forced when a thinking budget runs out, e.g. a closing phrase before </think>; "
        "default: the parser's tags)", "engine")
    enable_sleep_mode: bool = option(
        EngineConfig.enable_sleep_mode, "let the engine sleep while idle (LLM.sleep, the "
        "server's POST /sleep?level=1|2, /wake_up): its KV cache and weights released, read "
        "again on wake", "engine")
    runner: str = option(EngineConfig.runner, "vLLM's flag: 'pooling' serves embeddings only "
                         "(/v1/embeddings), 'generate' text only; 'auto' both", "engine",
                         choices=RUNNERS)
    pooler_config: str | dict[str, Any] | None = option(
        None, 'embeddings\' pooling as JSON (vLLM\'s flag): "pooling_type" ("LAST", the '
        'default, or "MEAN") and "normalize" (true, the default, or false)', "engine")

    @classmethod
    def from_options(cls, model: str | None = None, **options: Any) -> EngineArgs:
        """From `LLM`'s keywords: None means the default; an unknown name is a ValueError."""
        known = {f.name for f in dataclasses.fields(cls)} - {"model"}
        for name in options:
            if name not in known:
                raise ValueError(f"unknown engine option {name!r}; known: "
                                 f"{', '.join(sorted(known))}")
        return cls(model=model, **{k: v for k, v in options.items() if v is not None})

    def group(self, name: str) -> dict[str, Any]:
        """The fields of one config group, by name (the cache, scheduler and parallel groups
        are their configs' keywords)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.metadata["group"] == name}

    def create_engine_config(self, offline: bool = False) -> EngineConfig:
        """offline: for the offline LLM (its larger default steps on CUDA)."""
        return create_engine_config(self, offline)

    # ---- the command line ------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Every field as a flag (default None: the field's default), in one argument group."""
        group = parser.add_argument_group("engine")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            meta = f.metadata
            names = [f"--{f.name.replace('_', '-')}", *meta["flags"]]
            kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": meta["help"]}
            if bool in typing.get_args(hints[f.name]) or hints[f.name] is bool:
                group.add_argument(*names, action=argparse.BooleanOptionalAction, **kwargs)
                for negation in meta["negations"]:
                    group.add_argument(negation, dest=f.name, action="store_false",
                                       default=None, help=f"= --no-{names[0][2:]}")
                continue
            if meta["choices"] is not None:
                kwargs["choices"] = list(meta["choices"])
            if meta["metavar"] is not None:
                kwargs["metavar"] = meta["metavar"]
            if _is_list(hints[f.name]):  # e.g. --cuda-graph-sizes 1 2 4
                kwargs["nargs"] = "+"
            kwargs["type"] = _cli_type(hints[f.name])
            group.add_argument(*names, **kwargs)

    @classmethod
    def cli_options(cls, args: argparse.Namespace) -> dict[str, Any]:
        """The flags given on the command line as keywords (the model's left out)."""
        return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                if f.name != "model" and getattr(args, f.name, None) is not None}

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, model: str | None = None) -> EngineArgs:
        """The flags given (those left out keep their defaults); `model` before --model."""
        return cls(model=model or getattr(args, "model", None), **cls.cli_options(args))


def _is_list(hint: Any) -> bool:
    return any(typing.get_origin(t) is list for t in typing.get_args(hint) or (hint,))


def _cli_type(hint: Any) -> type:
    """The command line's parser for a field of this type (for a list, of each item): int
    for int fields, float for float ones, else str (a size, a name or JSON, parsed where the
    config is built)."""
    types = set(typing.get_args(hint)) or {hint}
    if _is_list(hint) or types <= {int, type(None)}:
        return int
    return float if types <= {float, type(None)} else str


def engine_config(model: str | None = None, **options: Any) -> EngineConfig:
    """The config `LLM(model, **options)` runs with."""
    return EngineArgs.from_options(model, **options).create_engine_config(offline=True)
