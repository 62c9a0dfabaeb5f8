"""EngineArgs is the one declaration of the engine options: every field is a flag of the
commands that run an engine and a keyword of LLM / LLMEngine.from_options, and each reaches the
config. A field added without a case below fails `test_every_field_has_a_case`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.model_loader.test_hub import MAIN, _lay_out
from tokenmill.cli import build_parser
from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenmill.engine_args import EngineArgs, engine_config

# a generation config of its own (--generation-config FOLDER): written once, at collection
GENERATION_DIR = tempfile.mkdtemp(prefix="tm-generation-config-")
Path(GENERATION_DIR, "generation_config.json").write_text(
    json.dumps({"temperature": 0.5, "max_new_tokens": 9}))
TRANSFER = {"kv_connector": "SharedStorageConnector", "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"shared_storage_path": "/tmp/tm-kv-shared"}}
JSON_SPEC = '{"method": "ngram", "num_speculative_tokens": 2}'


@dataclasses.dataclass(frozen=True)
class Case:
    """Setting `field` by `argv` on the command line (or by `value` as a keyword) makes the
    config's `where` equal `expected`; `model` replaces the tiny Llama's path."""

    field: str
    argv: tuple[str, ...]
    value: Any
    where: str
    expected: Any
    extra: tuple[tuple[str, Any], ...] = ()  # other options the value needs


CASES = [
    Case("revision", ("--revision", "dev"), "dev", "model.max_model_len", 64),
    Case("download_dir", (), None, "model.download_dir", None),  # see the hub test below
    Case("tokenizer", (), None, "model.tokenizer", None),  # the tokenizer folder: below
    Case("tokenizer_revision", (), None, "model.tokenizer", None),  # the hub test below
    Case("tokenizer_mode", (), None, "model.tokenizer", None),  # only auto / hf: below
    Case("config_format", (), None, "model.tokenizer", None),  # only auto / hf: below
    Case("hf_token", ("--hf-token", "hf_x"), "hf_x", "model.hf_token", "hf_x"),
    # a float32 checkpoint's weights kept in the half dtype asked for on CPU:
    # tests/quantization/test_half_weights.py
    Case("dtype", ("--dtype", "bfloat16"), "bfloat16", "model.weight_dtype", torch.bfloat16),
    # a bfloat16 checkpoint's, chosen by the CPU: tests/quantization/test_half_weights.py
    Case("matmul_dtype", (), None, "model.matmul_dtype", None),
    # a folder's own config code: tests/engine/test_config_and_loading.py
    Case("trust_remote_code", ("--trust-remote-code",), True, "model.trust_remote_code", True),
    Case("max_logprobs", ("--max-logprobs", "50"), 50, "model.max_logprobs", 50),
    # the model built with them: tests/model_loader/test_hf_overrides.py
    Case("hf_overrides", ("--hf-overrides", '{"rms_norm_eps": 0.001}'), {"rms_norm_eps": 0.001},
         "model.hf_config.rms_norm_eps", 0.001),
    Case("chat_template", ("--chat-template", "{{ messages }}"), "{{ messages }}",
         "model.chat_template", "{{ messages }}"),
    Case("chat_template_content_format", ("--chat-template-content-format", "openai"),
         "openai", "model.chat_template_content_format", "openai"),
    Case("generation_config", ("--generation-config", GENERATION_DIR), GENERATION_DIR,
         "model.sampling_defaults", {"temperature": 0.5, "max_tokens": 9}),
    Case("override_generation_config", ("--override-generation-config", '{"top_k": 3}'),
         {"top_k": 3}, "model.sampling_defaults", {"top_k": 3}),
    Case("max_model_len", ("--max-model-len", "64"), 64, "model.max_model_len", 64),
    Case("load_format", ("--load-format", "dummy"), "dummy", "model.load_format", "dummy"),
    Case("quantization", ("-q", "int8"), "int8", "model.quantization", "int8"),
    Case("int8_activations", ("--int8-activations",), True, "model.int8_activations", True,
         (("quantization", "int8"),)),
    Case("block_size", ("--block-size", "32"), 32, "cache.block_size", 32),
    Case("kv_cache_memory", ("--kv-cache-memory", "64MiB"), "64MiB", "cache.kv_cache_memory",
         64 << 20),
    Case("gpu_memory_utilization", ("--gpu-memory-utilization", "0.5"), 0.5,
         "cache.gpu_memory_utilization", 0.5),
    Case("num_kv_blocks", ("--num-kv-blocks", "7"), 7, "cache.num_kv_blocks", 7),
    Case("enable_prefix_caching", ("--no-enable-prefix-caching",), False,
         "cache.enable_prefix_caching", False),
    Case("swap_space", ("--swap-space", "2GiB"), "2GiB", "cache.swap_space", 2 << 30),
    Case("kv_cache_dtype", ("--kv-cache-dtype", "int8"), "int8", "cache.kv_cache_dtype", "int8"),
    Case("kv_offloading_size", ("--kv-offloading-size", "1GiB"), "1GiB",
         "kv_offload.host_blocks", 2**30 // 8192),  # the tiny Llama's blocks: 8 KiB
    Case("kv_offloading_backend", ("--kv-offloading-backend", "disk"), "disk",
         "kv_offload.disk_bytes", 2**30, (("kv_offloading_size", "1GiB"),)),
    Case("kv_offloading_dir", ("--kv-offloading-dir", "/tmp/tm-kv-case"), "/tmp/tm-kv-case",
         "kv_offload.disk_dir", "/tmp/tm-kv-case", (("kv_offloading_size", "1GiB"),
                                                     ("kv_offloading_backend", "disk"))),
    Case("kv_transfer_config", ("--kv-transfer-config", json.dumps(TRANSFER)), TRANSFER,
         "kv_offload.transfer.kv_role", "kv_consumer"),
    Case("max_num_batched_tokens", ("--max-num-batched-tokens", "512"), 512,
         "scheduler.max_num_batched_tokens", 512),
    Case("max_num_seqs", ("--max-num-seqs", "3"), 3, "scheduler.max_num_seqs", 3),
    Case("enable_chunked_prefill", ("--no-enable-chunked-prefill",), False,
         "scheduler.enable_chunked_prefill", False),
    Case("preemption_mode", ("--preemption-mode", "swap"), "swap", "scheduler.preemption_mode",
         "swap"),
    Case("async_scheduling", ("--async-scheduling",), True, "scheduler.async_scheduling", True),
    Case("scheduling_policy", ("--scheduling-policy", "priority"), "priority",
         "scheduler.scheduling_policy", "priority"),
    Case("tensor_parallel_size", ("-tp", "2"), 2, "parallel.tensor_parallel_size", 2),
    Case("pipeline_parallel_size", ("-pp", "2"), 2, "parallel.pipeline_parallel_size", 2),
    Case("data_parallel_size", ("-dp", "2"), 2, "parallel.data_parallel_size", 2),
    Case("distributed_executor_backend", ("--distributed-executor-backend", "mp"), "mp",
         "parallel.distributed_executor_backend", "mp"),
    Case("enable_lora", ("--enable-lora",), True, "lora.max_loras", 1),
    Case("max_loras", ("--max-loras", "3"), 3, "lora.max_loras", 3, (("enable_lora", True),)),
    Case("max_lora_rank", ("--max-lora-rank", "64"), 64, "lora.max_lora_rank", 64,
         (("enable_lora", True),)),
    Case("max_cpu_loras", ("--max-cpu-loras", "4"), 4, "lora.max_cpu_loras", 4,
         (("enable_lora", True),)),
    Case("lora_dtype", ("--lora-dtype", "bfloat16"), "bfloat16", "lora.lora_dtype", "bfloat16",
         (("enable_lora", True),)),
    Case("device", ("--device", "cpu:0"), "cpu:0", "device", "cpu:0"),
    Case("seed", ("--seed", "7"), 7, "seed", 7),
    Case("prepack_weights", ("--no-prepack-weights",), False, "prepack_weights", False),
    Case("batch_invariant", ("--no-batch-invariant",), False, "batch_invariant", False),
    Case("attention_backend", ("--attention-backend", "torch"), "torch", "attention_backend",
         "torch"),
    Case("enforce_eager", ("--enforce-eager",), True, "enforce_eager", True),
    Case("cuda_graph_sizes", ("--cuda-graph-sizes", "1", "2", "8"), [1, 2, 8],
         "cuda_graph_sizes", (1, 2, 8)),
    # its rules: tests/test_config_graphs.py
    Case("compilation_config", ("--compilation-config", '{"cudagraph_mode": "NONE"}'),
         {"cudagraph_mode": "NONE"}, "enforce_eager", True),
    Case("speculative_config", ("--speculative-config", JSON_SPEC), json.loads(JSON_SPEC),
         "speculative.num_speculative_tokens", 2),
    Case("structured_outputs_config", ("--structured-outputs-config", '{"backend": "guidance"}'),
         {"backend": "guidance"}, "structured_outputs.backend", "guidance"),
    Case("reasoning_parser", ("--reasoning-parser", "qwen3"), "qwen3", "reasoning.parser",
         "qwen3"),
    Case("reasoning_config", ("--reasoning-config", '{"reasoning_end_str": "Done.</think>"}'),
         {"reasoning_end_str": "Done.</think>"}, "reasoning.end_str", "Done.</think>",
         (("reasoning_parser", "qwen3"),)),
    Case("runner", ("--runner", "generate"), "generate", "runner", "generate"),
    Case("enable_sleep_mode", ("--enable-sleep-mode",), True, "enable_sleep_mode", True),
    Case("pooler_config", ("--pooler-config", '{"pooling_type": "MEAN"}'),
         {"pooling_type": "MEAN"}, "pooler_config.pooling_type", "MEAN"),
]


def _at(config: EngineConfig, where: str) -> Any:
    value: Any = config
    for name in where.split("."):
        value = getattr(value, name, None)
    return value


def _engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    return parser


def test_every_field_has_a_case():
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert {c.field for c in CASES} | {"model"} == fields


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, tiny_model) -> Path:
    """A download dir holding org/tiny-llama at main and at dev (dev: 64 positions)."""
    cache = tmp_path_factory.mktemp("download_dir")
    folder = Path(tiny_model("llama")[0])
    files = {f.name: f for f in folder.iterdir() if f.is_file()}
    short = cache.parent / "config-64.json"
    short.write_text(json.dumps(json.loads((folder / "config.json").read_text())
                                | {"max_position_embeddings": 64}))
    _lay_out(cache, "org/tiny-llama", {MAIN: ("main", files),
                                       "c" * 40: ("dev", files | {"config.json": short})})
    return cache


@pytest.mark.parametrize("case", [c for c in CASES if c.argv], ids=lambda c: c.field)
def test_each_field_is_a_flag_and_a_keyword_that_reaches_the_config(case, tiny_model,
                                                                   hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = tiny_model("llama")[0]
    extra = dict(case.extra)
    if case.field == "revision":  # a Hub id's revision: the dev branch's config
        model, extra = "org/tiny-llama", {"download_dir": str(hub_cache)}
    extra_argv = [a for name, v in extra.items()
                  for a in ((f"--{name.replace('_', '-')}",) if v is True
                            else (f"--{name.replace('_', '-')}", str(v)))]
    args = _engine_parser().parse_args(["--model", model, *case.argv, *extra_argv])
    from_cli = EngineArgs.from_cli_args(args)
    from_kwargs = EngineArgs.from_options(model, **{case.field: case.value}, **extra)
    assert getattr(from_kwargs, case.field) == case.value
    if isinstance(case.value, dict):  # JSON on the command line, a dict as a keyword
        assert json.loads(getattr(from_cli, case.field)) == case.value
    else:
        assert from_cli == from_kwargs
    assert _at(from_cli.create_engine_config(), case.where) == case.expected
    assert _at(from_kwargs.create_engine_config(), case.where) == case.expected
    default = EngineArgs.from_options(model, **extra).create_engine_config()
    assert _at(default, case.where) != case.expected  # the case shows the field, not a default


def test_hub_fields_and_the_tokenizer_reach_the_model_config(tiny_model, hub_cache,
                                                             monkeypatch, tokenizer_dir):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv = ["--model", "org/tiny-llama", "--download-dir", str(hub_cache), "--revision", "dev",
            "--tokenizer", "org/tiny-llama"]
    config = EngineArgs.from_cli_args(_engine_parser().parse_args(argv)).create_engine_config()
    model = config.model
    assert (model.hub_id, model.revision, model.download_dir) == (
        "org/tiny-llama", "dev", str(hub_cache))
    assert model.path.startswith(str(hub_cache)) and model.path.endswith("c" * 40)
    assert model.tokenizer == model.path  # the tokenizer id, resolved at the same revision
    own = EngineArgs.from_cli_args(_engine_parser().parse_args(
        [*argv, "--tokenizer-revision", "main"])).create_engine_config().model
    assert own.path == model.path and own.tokenizer.endswith(MAIN)  # its own revision
    local = engine_config(tiny_model("llama")[0], tokenizer=str(tokenizer_dir))
    assert local.model.tokenizer == str(tokenizer_dir)
    assert engine_config(tiny_model("llama")[0]).model.tokenizer is None


def test_spellings_users_bring():
    """vLLM's --no-enable-* spellings and tokenmill's shorter ones set the same field."""
    parser = _engine_parser()
    for argv, field in [(["--no-chunked-prefill"], "enable_chunked_prefill"),
                        (["--no-enable-chunked-prefill"], "enable_chunked_prefill"),
                        (["--no-prefix-caching"], "enable_prefix_caching"),
                        (["--no-enable-prefix-caching"], "enable_prefix_caching")]:
        assert EngineArgs.cli_options(parser.parse_args(argv)) == {field: False}
    assert EngineArgs.cli_options(parser.parse_args([])) == {}
    with pytest.raises(SystemExit):  # choices come from the registries
        parser.parse_args(["--quantization", "fp4"])


def test_cuda_graph_sizes_spellings_and_checks(tiny_model):
    """vLLM's --max-cudagraph-capture-size N is --cuda-graph-sizes N (an int keyword too);
    sizes must be positive integers."""
    parser = _engine_parser()
    assert EngineArgs.cli_options(parser.parse_args(["--max-cudagraph-capture-size", "64"])) \
        == {"cuda_graph_sizes": [64]}
    path = tiny_model("llama")[0]
    assert engine_config(path, cuda_graph_sizes=64).cuda_graph_sizes == (64,)
    for bad in ([0], [8, -1], [], [2.5]):
        with pytest.raises(ValueError, match="cuda_graph_sizes must be positive integers"):
            engine_config(path, cuda_graph_sizes=bad)
    with pytest.raises(SystemExit):
        parser.parse_args(["--cuda-graph-sizes", "x"])


def test_generate_and_serve_take_every_engine_flag():
    parser = build_parser()
    flags = {f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(EngineArgs)}
    for command in ("generate", "serve"):
        sub = parser._subparsers._group_actions[0].choices[command]
        assert flags <= set(sub._option_string_actions), command


def test_unknown_options_and_defaults():
    with pytest.raises(ValueError, match="unknown engine option 'max_batch'.*max_num_seqs"):
        EngineArgs.from_options(None, max_batch=4)
    # None is "the default", as vLLM's keywords take it
    assert EngineArgs.from_options(None, max_model_len=None) == EngineArgs()
    # the defaults are the configs' own
    assert EngineArgs().block_size == CacheConfig().block_size
    assert EngineArgs().max_num_seqs is None  # by device and use (scheduler_defaults)


def test_engine_config_is_what_llm_runs(tiny_model):
    path = tiny_model("llama")[0]
    assert engine_config(path, max_num_seqs=3) == \
        EngineArgs(model=path, max_num_seqs=3).create_engine_config()


@pytest.mark.parametrize("name, gib, offline, want", [
    ("NVIDIA H100 80GB HBM3", 80, True, (16384, 1024)),
    ("NVIDIA H200", 141, False, (8192, 1024)),
    ("NVIDIA A100-SXM4-80GB", 80, True, (8192, 256)),
    ("NVIDIA L4", 23, False, (2048, 256)),
])
def test_cuda_step_defaults_are_vllm_s(monkeypatch, name, gib, offline, want):
    """max_num_batched_tokens and max_num_seqs where not asked: on CUDA vLLM's (by the GPU's
    memory, the offline LLM's larger than a server's), on CPU SchedulerConfig's."""
    import types

    from tokenmill import config_scheduler

    props = types.SimpleNamespace(name=name, total_memory=gib * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    assert config_scheduler.scheduler_defaults("cuda", offline) == want
    assert config_scheduler.scheduler_defaults("cpu", offline) == (
        SchedulerConfig.max_num_batched_tokens, SchedulerConfig.max_num_seqs)


def test_only_hugging_face_formats_are_read(tiny_model):
    path = tiny_model("llama")[0]
    for mode in ("auto", "hf", "HF"):
        engine_config(path, tokenizer_mode=mode, config_format=mode)
    with pytest.raises(ValueError, match="tokenizer_mode 'mistral': tokenmill reads Hugging"):
        engine_config(path, tokenizer_mode="mistral")
    with pytest.raises(ValueError, match="config_format 'mistral': tokenmill reads config"):
        engine_config(path, config_format="mistral")


def test_the_hf_token_stays_out_of_reprs(tiny_model):
    config = engine_config(tiny_model("llama")[0], hf_token="hf_secret")
    assert config.model.hf_token == "hf_secret" and "hf_secret" not in repr(config)
    assert engine_config(tiny_model("llama")[0], hf_token="true").model.hf_token is True
