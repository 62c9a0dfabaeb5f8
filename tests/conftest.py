"""Shared fixtures: tiny random-weight Llama/Qwen2/Qwen3 models saved as Hugging Face folders
(with SmolLM2's real tokenizer), the SmolLM2 GGUF file, and a Hugging Face greedy reference."""

from __future__ import annotations

import atexit
import importlib
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "TOKENMILL_CACHE_DIR" not in os.environ:
    # The GGUF conversions of a run go to a folder of its own, removed at exit: the tests
    # write their GGUF files under fresh temporary paths, and each path is a new cache key, so
    # the user's ~/.cache/tokenmill grew by ~0.5 GB a run (44 GB seen). Servers the tests
    # start inherit it.
    os.environ["TOKENMILL_CACHE_DIR"] = tempfile.mkdtemp(prefix="tokenmill-test-cache-")
    atexit.register(shutil.rmtree, os.environ["TOKENMILL_CACHE_DIR"], True)
if not torch.cuda.is_available():
    # The Triton attention kernel then runs in Triton's interpreter on CPU tensors. Triton
    # reads this when a kernel is defined, so it is set before any test imports one.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Engines here do not freeze their start-up heap out of the garbage collector: each freeze is
# a full collection of this process's heap, and the suite starts hundreds of engines (+6
# minutes); tests/utils/test_gc_heap.py turns it on where it is tested. (Imported after the
# environment above: it imports the package.)
from tokenmill.utils import gc_heap  # noqa: E402

gc_heap.ENABLED = False

# name → (config class name, extra config kwargs)
TINY_MODELS = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "llama-mqa-llama3rope": ("LlamaConfig", dict(
        num_key_value_heads=1, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64})),
    # MLPs gated by GELU, exact and tanh-approximated (configs real checkpoints carry)
    # rows of 256 and 512 weights: whole K-quant super-blocks (tests/quantization/
    # test_gguf_kquants.py)
    "llama-256": ("LlamaConfig", dict(hidden_size=256, intermediate_size=512,
                                      tie_word_embeddings=True)),
    "llama-gelu": ("LlamaConfig", dict(hidden_act="gelu", tie_word_embeddings=True)),
    "qwen2-gelu-tanh": ("Qwen2Config", dict(hidden_act="gelu_pytorch_tanh",
                                            tie_word_embeddings=False)),
    "llama-linear-rope": ("LlamaConfig", dict(
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    "mistral": ("MistralConfig", dict(sliding_window=None, tie_word_embeddings=False)),
    # every layer attends its last 24 tokens: blocks older than that are freed
    "mistral-window": ("MistralConfig", dict(sliding_window=24, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2,
                                      sliding_window=None, tie_word_embeddings=False)),
    # experts of 256 x 256: whole K-quant super-blocks (tests/quantization/test_gguf_experts.py)
    "mixtral-256": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2,
                                          hidden_size=256, intermediate_size=256,
                                          sliding_window=None, tie_word_embeddings=False)),
    # experts of 512 x 256: each of two tensor-parallel ranks keeps whole super-blocks
    "mixtral-512": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2,
                                          hidden_size=256, intermediate_size=512,
                                          sliding_window=None, tie_word_embeddings=False)),
    # dense layer 1 (mlp_only_layers), a shared expert, top-k not renormalized
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=48, mlp_only_layers=[1],
                                         shared_expert_intermediate_size=96,
                                         tie_word_embeddings=False)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, head_dim=32,
                                         moe_intermediate_size=48, norm_topk_prob=True,
                                         tie_word_embeddings=False)),
    # layers alternate sliding (window 24) and global; soft caps small enough to bite on these
    # weights; scores scaled by head_dim ** -0.5, as llama.cpp's GGUF assumes (Gemma 3's
    # below scales by another value)
    "gemma2": ("Gemma2Config", dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=24,
                                    attn_logit_softcapping=3.0, final_logit_softcapping=5.0,
                                    num_hidden_layers=3)),
    # two local layers (RoPE base 10^4) per global one (base 10^6, linear scaling x2)
    "gemma3": ("Gemma3TextConfig", dict(head_dim=32, query_pre_attn_scalar=24,
                                        sliding_window=24, sliding_window_pattern=3,
                                        num_hidden_layers=3,
                                        rope_parameters={
                                            "sliding_attention": {"rope_type": "default",
                                                                  "rope_theta": 10000.0},
                                            "full_attention": {"rope_type": "linear",
                                                               "factor": 2.0,
                                                               "rope_theta": 1e6}})),
    # longrope from position 320 (tests/models/test_architectures.py decodes past it); full
    # rotary: the layers are Llama's
    "phi3": ("Phi3Config", dict(
        original_max_position_embeddings=320, tie_word_embeddings=False,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [1.0 + 0.1 * i for i in range(8)],
                         "long_factor": [1.5 + 0.5 * i for i in range(8)]})),
    # Phi-4-mini's shape: half of each head rotated; a 24-token window in every layer
    "phi3-partial": ("Phi3Config", dict(sliding_window=24, tie_word_embeddings=True,
                                        rope_parameters={"rope_type": "default",
                                                         "rope_theta": 10000.0,
                                                         "partial_rotary_factor": 0.5})),
    # what llama.cpp's gemma3 GGUF can describe: 5 local layers per global one, scores
    # scaled by head_dim ** -0.5, RoPE bases 10^4 (local) and 10^6 (global)
    "gemma3-6": ("Gemma3TextConfig", dict(head_dim=32, query_pre_attn_scalar=32,
                                          sliding_window=24, num_hidden_layers=6)),
    "olmoe": ("OlmoeConfig", dict(num_experts=4, num_experts_per_tok=2, clip_qkv=4.0,
                                  tie_word_embeddings=False)),
    # IBM Granite: four multipliers, each far from 1 (granite-3.0-2b's embedding, residual
    # and logits values; scores scaled by 0.5 / sqrt(head_dim))
    "granite": ("GraniteConfig", dict(embedding_multiplier=12.0, residual_multiplier=0.22,
                                      attention_multiplier=0.125, logits_scaling=8.0,
                                      tie_word_embeddings=True)),
}


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from tokenmill.model_loader.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_bf16(smollm2_path: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """SmolLM2 as a Hugging Face bfloat16 folder (its Q4_1 file's float32 expansion rounded:
    a Hub checkpoint's form with real weights), written once per session."""
    from tokenmill.bench.checkpoint_formats import write_bf16_folder

    return write_bf16_folder(smollm2_path, str(tmp_path_factory.mktemp("smollm2") / "bf16"))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
                  ) -> Path:
    """SmolLM2's tokenizer saved as tokenizer.json once, for the tiny models to share; or the
    folder TOKENMILL_TEST_TOKENIZER_DIR names, saved so earlier (for a machine without the
    model's package, such as the lent GPU, where the GGUF file cannot travel)."""
    from tokenmill.engine.tokenizer import gguf_tokenizer

    saved = os.environ.get("TOKENMILL_TEST_TOKENIZER_DIR")
    if saved:
        return Path(saved)
    out = tmp_path_factory.mktemp("tokenizer")
    gguf_tokenizer(request.getfixturevalue("smollm2_path")).save_pretrained(out)
    return out


def build_tiny_model(kind: str, out: Path, tokenizer_dir: Path) -> torch.nn.Module:
    """Save a seeded random-weight HF model of `kind` into `out`; return it (float32, eval)."""
    import shutil

    import transformers

    cls_name, extra = TINY_MODELS[kind]
    kwargs = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, initializer_range=0.2)
    config = getattr(transformers, cls_name)(**(kwargs | extra))
    torch.manual_seed(0)
    # Soft-capped scores: HF's eager attention, the one that caps them (transformers 5.17
    # gave Gemma 2 SDPA by default, which skips the cap without a word)
    attn = {"attn_implementation": "eager"} if getattr(config, "attn_logit_softcapping",
                                                      None) else {}
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                          **attn).eval()
    model.save_pretrained(out, safe_serialization=True)
    for f in os.listdir(tokenizer_dir):
        shutil.copy(tokenizer_dir / f, out / f)
    return model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path):
    """Factory: tiny_model(kind) → (folder, HF model); each kind is built once per session."""
    cache: dict[str, tuple[str, torch.nn.Module]] = {}

    def get(kind: str) -> tuple[str, torch.nn.Module]:
        if kind not in cache:
            out = tmp_path_factory.mktemp(kind)
            cache[kind] = (str(out), build_tiny_model(kind, out, tokenizer_dir))
        return cache[kind]

    return get


@pytest.fixture(scope="session")
def bf16_checkpoint(tiny_model, tmp_path_factory) -> str:
    """The tiny Llama saved by transformers in bfloat16 (a Hub checkpoint's dtype)."""
    import transformers

    folder, _ = tiny_model("llama")
    out = tmp_path_factory.mktemp("llama-bf16")
    transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16) \
        .save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{folder}/{f}", out / f)
    return str(out)


def top1(llm: Any, prompts: list[list[int]]) -> list[int]:
    """The model's most likely next token at every prompt position (teacher-forced), and
    after the last: an LLM's greedy choices over text it is given."""
    from tokenmill import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    top = []
    for out in llm.generate(prompts, params, use_tqdm=False):
        for position in out.prompt_logprobs[1:]:
            top.append(next(t for t, lp in position.items() if lp.rank == 1))
        top.append(out.outputs[0].token_ids[0])
    return top


def agreement(got: list[int], want: list[int]) -> float:
    """The share of positions where two runs picked the same token."""
    return sum(a == b for a, b in zip(got, want, strict=True)) / len(want)


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation with Hugging Face's own forward and KV cache, ignoring EOS."""
    out: list[int] = []
    r = model(torch.tensor([prompt]), use_cache=True)
    for _ in range(max_new_tokens):
        tok = int(r.logits[0, -1].argmax())
        out.append(tok)
        if len(out) == max_new_tokens:
            break
        r = model(torch.tensor([[tok]]), past_key_values=r.past_key_values, use_cache=True)
    return out


def mixed_prompts(n: int, vocab: int, seed: int = 0, max_len: int = 300,
                  max_new: int = 64) -> list[tuple[list[int], int]]:
    """n (prompt token ids, max_tokens) pairs; lengths span 1..max_len, outputs up to max_new."""
    rng = random.Random(seed)
    lengths = [1, max_len, 17, 2, 130, 64, 250, 33, 5, 199, 90, 16][:n]
    lengths += [rng.randint(1, max_len) for _ in range(n - len(lengths))]
    return [([rng.randrange(3, vocab) for _ in range(length)],
             max_new if i % 3 == 0 else rng.randint(1, max_new))
            for i, length in enumerate(lengths)]


def generate_greedy(llm, cases: list[tuple[list[int], int]]) -> list[list[int]]:
    """Greedy token ids from the engine for (prompt ids, max_tokens) cases, ignoring EOS."""
    from tokenmill import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in cases]
    outs = llm.generate([p for p, _ in cases], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def assert_kv_all_free(engine) -> None:
    """Nothing running or waiting, every KV block back in the pool, accounting consistent."""
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_usable_blocks
    assert not engine.has_unfinished_requests()


def no_workers_left(timeout: float = 10.0) -> bool:
    """Whether every child process (workers of mp executors) has exited within `timeout`."""
    import multiprocessing
    import time

    deadline = time.monotonic() + timeout
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    return not multiprocessing.active_children()


def _runnable_isas() -> list[str]:
    # imported here, after the environment above is set (tokenmill imports Triton's kernels)
    from tokenmill.utils.cpp_extension import runnable_isas

    return runnable_isas()


@pytest.fixture(params=_runnable_isas())
def cpu_ops_build(request):
    """Each kernel build of cpu_ops this CPU runs (the installed ones)."""
    try:
        return importlib.import_module(f"tokenmill._C.cpu_ops_{request.param}")
    except ImportError:
        pytest.skip(f"the {request.param} build is not installed")
