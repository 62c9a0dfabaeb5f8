"""Batch invariance (EngineConfig.batch_invariant, the default on CPU): a request's logits are
bitwise the same alone and in any step composition: beside other requests, with its prompt
chunked, its prefix from the prefix cache, after preemption (recompute or swap) and in
speculative verify steps; for every weight format (float32, int8, int4, GGUF blocks, int8
activations) and a quantized KV cache. The logits are compared through the logprobs they give
(bitwise: log_softmax of equal rows is equal, of different rows is not) at every generated
and prompt position.

The compositions are drawn by a seeded generator; the same checks with batch_invariant=False
fail (the last test), so they can tell."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tests.gguf_writer import write_gguf
from tokenmill import LLM, SamplingParams
from tokenmill.layers import cpu_ops
from tokenmill.spec_decode.policy import SpecCosts

pytestmark = pytest.mark.skipif(not cpu_ops.ops_available(), reason="C++ toolchain unavailable")

VOCAB = 49152
# format → (LLM options); "gguf": the tiny model written as a Q4_1 GGUF (token_embd Q8_0)
FORMATS = {"float32": {}, "int8": {"quantization": "int8"},
           "int4": {"quantization": "int4"}, "gguf": {"quantization": "gguf"},
           "int4+int8acts": {"quantization": "int4", "int8_activations": True},
           "float32+kv-int8": {"kv_cache_dtype": "int8"},
           "float32+kv-bfloat16": {"kv_cache_dtype": "bfloat16"}}


def _probe(seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(70)]


PROBE_PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5,
                              prompt_logprobs=3)


def _fingerprint(out: Any) -> tuple:
    """The probe's tokens and every logprob value it returned, exactly."""
    c = out.outputs[0]
    gen = [sorted((t, lp.logprob) for t, lp in d.items()) for d in c.logprobs]
    prompt = [None if d is None else sorted((t, lp.logprob) for t, lp in d.items())
              for d in out.prompt_logprobs]
    return tuple(c.token_ids), gen, prompt


@pytest.fixture(scope="module")
def model_path(tiny_model, smollm2_path, tmp_path_factory):
    """format → the model path it runs from."""
    folder, hf = tiny_model("llama")
    gguf_file = tmp_path_factory.mktemp("gguf") / "llama-q4_1.gguf"
    write_gguf("llama", folder, hf, smollm2_path, gguf_file, "Q4_1")
    return lambda fmt: str(gguf_file) if fmt == "gguf" else folder


def _compositions(rng: random.Random) -> list[dict[str, Any]]:
    """Engine options that shape the probe's steps: token budgets that chunk its prompt, KV
    caches small enough to preempt it (by recompute or swap), the prefix cache on or off."""
    out = []
    for budget, blocks, mode, prefix in ((5, 18, "recompute", True), (13, 14, "swap", True),
                                         (29, 16, "recompute", False), (64, None, None, True)):
        opts: dict[str, Any] = {"max_num_batched_tokens": budget,
                                "enable_prefix_caching": prefix, "block_size": 16}
        if blocks is not None:
            opts |= {"num_kv_blocks": blocks, "preemption_mode": mode}
        out.append(opts)
    rng.shuffle(out)
    return out


def _batches(rng: random.Random, probe: list[int]) -> list[tuple[list[list[int]], int]]:
    """Two batches of random neighbours with the probe at a random place; the second also
    holds a request sharing a random-length prefix of the probe's prompt."""
    batches = []
    for shared in (False, True):
        n = rng.randint(2, 6)
        others = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 90))]
                  for _ in range(n)]
        if shared:
            others[0] = probe[:rng.randint(16, 60)] + others[0]
        at = rng.randint(0, n)
        batches.append((others[:at] + [probe] + others[at:], at))
    return batches


def _run_compositions(path: str, fmt_opts: dict[str, Any], seed: int,
                      **extra: Any) -> tuple[tuple, list[tuple], int]:
    """(the probe alone, the probe in every composition, preemptions seen)."""
    probe = _probe()
    alone = _fingerprint(LLM(path, **fmt_opts, **extra).generate([probe], PROBE_PARAMS,
                                                                   use_tqdm=False)[0])
    rng = random.Random(seed)
    got, preemptions = [], 0
    for opts in _compositions(rng):
        llm = LLM(path, **fmt_opts, **opts, **extra)
        for prompts, at in _batches(rng, probe):
            params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 24),
                                     ignore_eos=True) for _ in prompts]
            params[at] = PROBE_PARAMS
            got.append(_fingerprint(llm.generate(prompts, params, use_tqdm=False)[at]))
        preemptions += llm.engine.stats().num_preemptions
    return alone, got, preemptions


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_probe_logits_are_the_same_in_every_step_composition(fmt, model_path):
    alone, got, preemptions = _run_compositions(model_path(fmt), FORMATS[fmt], seed=1)
    assert preemptions > 0  # the small caches did preempt
    assert len(got) == 8
    for i, g in enumerate(got):
        assert g[0] == alone[0], f"composition {i}: other tokens"
        assert g == alone, f"composition {i}: same tokens, other logits"


@pytest.mark.parametrize("fmt", ["float32", "gguf"])
def test_probe_logits_are_the_same_in_speculative_verify_steps(fmt, model_path, monkeypatch):
    """Drafts by the target's own weights in another format, as many as asked (verifying
    made free, so that the policy drafts all 6 on this tiny model): most steps verify several
    of the probe's tokens at once, through the kernels' larger-M paths and the modules (past
    the fused call's 4 tokens), giving its logits bit for bit."""
    monkeypatch.setattr("tokenmill.worker.model_runner.measure_spec_costs",
                        lambda *args: SpecCosts(0.0, 0.0))
    draft = {"method": "draft_model", "num_speculative_tokens": 6,
             "quantization": "int8" if fmt == "float32" else "none"}
    path, opts = model_path(fmt), FORMATS[fmt]
    probe = _probe()
    alone = _fingerprint(LLM(path, **opts).generate([probe], PROBE_PARAMS, use_tqdm=False)[0])
    llm = LLM(path, **opts, speculative_config=draft)
    assert _fingerprint(llm.generate([probe], PROBE_PARAMS, use_tqdm=False)[0]) == alone
    stats = llm.engine.stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    assert max(i for i, n in enumerate(stats.spec_decode_num_accepted_tokens_per_pos)
               if n) >= 3  # verify steps of more than 4 tokens happened


def test_the_checks_tell_without_batch_invariance(model_path):
    """The same compositions with batch_invariant=False: the probe's logits move (its tokens
    need not), so the tests above would see a kernel that is not invariant."""
    alone, got, _ = _run_compositions(model_path("float32"), {}, seed=1,
                                      batch_invariant=False)
    assert any(g != alone for g in got)


@pytest.mark.slow
def test_smollm2_prefix_cache_on_and_off_give_the_same_tokens(smollm2_path):
    """The default model in its GGUF blocks (the default format on VNNI CPUs, asked for here
    on every CPU; the format whose tokens moved with the cache before): 12 requests sharing a
    544-token system prompt (past attention's first 512-key chunk), greedy, the same tokens and
    logprobs with the prefix cache on and off. (float32 and the other formats: the probe
    tests above, on tiny models.)"""
    rng = random.Random(5)
    prefix = [rng.randrange(3, VOCAB) for _ in range(544)]
    prompts = [prefix + [rng.randrange(3, VOCAB) for _ in range(16)] for _ in range(12)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    runs = [LLM(smollm2_path, quantization="gguf", enable_prefix_caching=on)
            .generate(prompts, params, use_tqdm=False) for on in (True, False)]
    cached, fresh = ([_fingerprint_gen(o) for o in outs] for outs in runs)
    assert cached == fresh


def _fingerprint_gen(out: Any) -> tuple:
    c = out.outputs[0]
    return tuple(c.token_ids), [sorted((t, lp.logprob) for t, lp in d.items())
                                for d in c.logprobs]
