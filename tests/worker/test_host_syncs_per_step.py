"""Issue 39: nothing inside a CUDA step makes the host wait for the device but the transfer
of its sampled tokens (utils/host_syncs.py counts the waits by line, torch's sync debug
mode). A synchronous step waits once, for its tokens (and their logprobs, copied before
them); an async step waits on an event, which is no sync of the stream, and reads its
tokens and logprobs from pinned memory; a step verifying drafts
brings its verdicts over in one transfer. A failure lists the lines that waited. CUDA only
(benchmarks/gpu_session.sh): a CPU has no stream to wait for."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_kv_all_free
from tokenmill import LLM, SamplingParams
from tokenmill.utils.host_syncs import HostSyncs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

STEPS = 5


def _syncs_over_decode_steps(llm: LLM, prompts: list[list[int]],
                             logprobs: int | None = None) -> HostSyncs:
    engine = llm.engine
    for i, prompt in enumerate(prompts):  # (logprobs: the even requests ask)
        engine.add_request(f"r{i}", prompt, SamplingParams(
            temperature=0, max_tokens=24, ignore_eos=True,
            logprobs=logprobs if i % 2 == 0 else None))
    sched = engine.scheduler
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                               for r in sched.running):
        engine.step()
    for _ in range(2):
        engine.step()  # past the last prefill's own token (an async step runs one ahead)
    with HostSyncs() as syncs:
        for _ in range(STEPS):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    assert_kv_all_free(engine)
    return syncs


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("enforce_eager, logprobs", [(False, None), (True, None), (False, 3)])
def test_a_decode_step_waits_for_the_device_only_for_its_tokens(tiny_model, enforce_eager,
                                                                 logprobs, async_scheduling):
    """Logprobs asked by some requests ride with the tokens: no wait of their own."""
    path, hf = tiny_model("llama")
    llm = LLM(path, dtype="float32", enforce_eager=enforce_eager,
              async_scheduling=async_scheduling)
    vocab = hf.config.vocab_size
    prompts = [[(7 * i + j) % vocab for j in range(n)] for i, n in enumerate([5, 40, 17, 3])]
    syncs = _syncs_over_decode_steps(llm, prompts, logprobs)
    assert syncs.total == (0 if async_scheduling else STEPS), syncs.sites
    if not async_scheduling:
        [site] = syncs.sites
        assert site.startswith("tokenmill/worker/step_sampling.py:"), site


def test_a_step_verifying_drafts_waits_once(tiny_model):
    """n-gram drafts on repetitive prompts: each step verifies drafts (or, without a match,
    samples plainly), and either way waits for the device once."""
    path, _ = tiny_model("llama")
    llm = LLM(path, dtype="float32", speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2})
    prompts = [[11, 12, 13, 14] * 6, [21, 22, 23] * 8]
    syncs = _syncs_over_decode_steps(llm, prompts)
    assert syncs.total == STEPS, syncs.sites
    assert all(site.startswith(("tokenmill/layers/rejection_sampler.py:",
                                "tokenmill/worker/step_sampling.py:"))
               for site in syncs.sites), syncs.sites
