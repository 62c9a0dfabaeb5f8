"""One parity test per architecture beyond Llama / Qwen2 / Qwen3 (issue 21): tiny random-weight
models of each real architecture, greedy-identical to Hugging Face in float32 for a
mixed-length batch with chunked prefill (budget 64), prefix-cache hits and preemption all
happening in one run; and, per architecture, which way decode steps went: the fused CPU decode
call (models/cpu_decode.py) provably not taken for the models whose layers it does not
implement. Sliding windows: out-of-window KV blocks are freed while the sequence grows."""

from __future__ import annotations

import pytest

from tests.conftest import assert_kv_all_free, generate_greedy, hf_greedy, mixed_prompts
from tokenmill import LLM, SamplingParams

# kind → the attention backend `auto` picks for it on CPU (the C++ kernel computes windows and
# soft-capped scores)
ARCHITECTURES = {"qwen2_moe": "cpu", "qwen3_moe": "cpu", "olmoe": "cpu",
                 "mistral-window": "cpu", "gemma2": "cpu", "gemma3": "cpu",
                 "phi3": "cpu", "phi3-partial": "cpu", "granite": "cpu"}
# whose layers are exactly Llama's (Mistral's with one window for all), Llama's attention with
# Qwen2-MoE's blocks, or with q/k norms (Qwen3-MoE's per head; OLMoE's over all heads, with
# its clamp): the fused CPU decode call takes their decode steps
FUSED_DECODE = {"phi3", "mistral-window", "qwen2_moe", "qwen3_moe", "olmoe"}


@pytest.mark.parametrize("kind", list(ARCHITECTURES))
def test_greedy_matches_hf_under_chunking_prefix_hits_and_preemption(tiny_model, kind):
    path, hf = tiny_model(kind)
    cases = mixed_prompts(8, hf.config.vocab_size, seed=5, max_len=150, max_new=24)
    llm = LLM(path, num_kv_blocks=40, block_size=8, max_num_batched_tokens=64, max_num_seqs=6)
    engine = llm.engine
    try:
        # the last prompt again: its blocks are still in the prefix cache
        got = generate_greedy(llm, cases) + generate_greedy(llm, cases[-1:])
        assert engine.scheduler.num_preemptions > 0 and engine.kv.prefix_hits > 0
        assert type(engine.runner.backend).__name__.lower().startswith(ARCHITECTURES[kind])
        # the others' layers are not the fused call's (q/k norms, partial rotary, Gemma's
        # norms and mixed windows, Granite's multipliers)
        plan = engine.runner.model.model.fused_layers._plan
        assert (plan is not None) == (kind in FUSED_DECODE)
        assert_kv_all_free(engine)
    finally:
        engine.shutdown()
    assert got == [hf_greedy(hf, p, m) for p, m in cases + cases[-1:]]


def test_sliding_window_frees_blocks_out_of_every_layer_s_window(tiny_model):
    """Mistral with a 24-token window in every layer: a request of 300 tokens, prefilled in
    chunks of 32, holds at most the blocks its window and the chunk span, and while decoding
    the window's (24 / 8, plus the partly filled ones), never its 38; output == HF's."""
    path, hf = tiny_model("mistral-window")
    prompt = mixed_prompts(2, hf.config.vocab_size, seed=2, max_len=200)[1][0]
    llm = LLM(path, num_kv_blocks=64, block_size=8, enable_prefix_caching=False,
              max_num_batched_tokens=32)
    engine = llm.engine
    assert engine.kv.sliding_window == 24
    engine.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=100,
                                                      ignore_eos=True))
    held, out = [], []
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o.outputs[0].token_ids
        blocks = engine.kv.req_to_blocks.get("long", [])
        held.append(sum(b is not engine.kv.pool.null_block for b in blocks))
    # 7 chunks (the last samples the first token), 99 decode steps
    assert len(prompt) + 100 > 8 * 37 and len(held) == 7 + 99
    assert max(held) <= (24 + 32) // 8 + 1
    assert max(held[7:]) <= 24 // 8 + 2
    assert out == hf_greedy(hf, prompt, 100)
    assert_kv_all_free(engine)


def test_fused_decode_call_runs_phi3_bitwise_equal_to_the_modules(tiny_model, monkeypatch):
    """Phi-3 with full rotary is Llama's layers loaded from fused tensors: its decode steps go
    through the fused call, and the tokens and logprobs equal the modules' exactly; a
    310-token prompt decodes past position 320, where longrope's long factors take over,
    and stays equal to HF's."""
    path, hf = tiny_model("phi3")
    cases = mixed_prompts(4, 49152, seed=9, max_len=40, max_new=12)
    cases.append((mixed_prompts(2, 49152, seed=10, max_len=310)[1][0], 20))  # 310 tokens
    fused, modules = fused_then_modules(path, cases, monkeypatch)
    assert fused == modules
    assert fused[-1][0] == hf_greedy(hf, cases[-1][0], 20)


def fused_then_modules(path: str, cases, monkeypatch) -> tuple[list, list]:
    """Greedy (token ids, logprobs) of every case through the fused decode call (asserted to
    run), then through the modules alone."""
    from tokenmill.models import cpu_decode

    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2)
              for _, m in cases]

    def run():
        llm = LLM(path)
        outs = llm.generate([p for p, _ in cases], params, use_tqdm=False)
        llm.engine.shutdown()
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    calls = []
    real = cpu_decode._decode_layers_op()
    monkeypatch.setattr(cpu_decode, "_decode_layers_op", lambda: lambda *a: calls.append(1)
                        or real(*a))
    fused = run()
    assert calls
    monkeypatch.setattr(cpu_decode.FusedLayers, "applies", lambda *a: False)
    return fused, run()


def test_gemma2_final_logit_soft_cap_shapes_the_logprobs(tiny_model):
    """The final soft cap never changes the argmax (tanh is monotonic), so greedy parity cannot
    see it: the returned logprobs equal HF's log-softmax of its capped logits."""
    import torch

    path, hf = tiny_model("gemma2")
    prompt = mixed_prompts(3, hf.config.vocab_size, seed=4, max_len=40)[2][0]
    llm = LLM(path)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    llm.engine.shutdown()
    with torch.no_grad():
        expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1], -1)
    got = out.logprobs[0]
    assert len(got) >= 3
    for token, lp in got.items():
        assert abs(lp.logprob - float(expected[token])) < 1e-4
    assert float(expected.max()) - float(expected.min()) < 2 * 5.0 + 1e-3  # capped at ±5


@pytest.mark.parametrize("kind", ["qwen2_moe", "gemma3", "phi3-partial"])
def test_tensor_parallel_greedy_matches_hf(tiny_model, kind):
    """Split over two worker processes: a shared expert beside the split experts (Qwen2-MoE),
    Gemma's norms, windows and two RoPE bases, Phi-3's fused tensors split per rank."""
    from tests.conftest import no_workers_left

    path, hf = tiny_model(kind)
    cases = mixed_prompts(4, hf.config.vocab_size, seed=14, max_len=90, max_new=12)
    llm = LLM(path, tensor_parallel_size=2, max_num_batched_tokens=64)
    try:
        got = generate_greedy(llm, cases)
    finally:
        llm.engine.shutdown()
    assert got == [hf_greedy(hf, p, m) for p, m in cases]
    assert no_workers_left()


def test_fused_decode_call_runs_a_windowed_mistral_bitwise_equal_to_the_modules(tiny_model,
                                                                               monkeypatch):
    """Mistral with a 24-token window in every layer: its decode steps go through the fused
    call (each query's first key moved to its window, as the backend moves it), tokens and
    logprobs bitwise equal to the modules', greedy == HF past the window."""
    path, hf = tiny_model("mistral-window")
    cases = mixed_prompts(4, 49152, seed=16, max_len=60, max_new=20)
    fused, modules = fused_then_modules(path, cases, monkeypatch)
    assert fused == modules
    assert [t for t, _ in fused] == [hf_greedy(hf, p, m) for p, m in cases]


def test_granite_logprobs_are_hf_s_scaled_logits(tiny_model):
    """Granite divides its logits by logits_scaling (8 here): greedy tokens cannot show it, the
    sampled distribution does. The first token's logprobs equal HF's log-softmax."""
    import torch

    path, hf = tiny_model("granite")
    prompt = mixed_prompts(3, 49152, seed=4, max_len=40)[2][0]
    llm = LLM(path)
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=5),
                           use_tqdm=False)[0].outputs[0]
    finally:
        llm.engine.shutdown()
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
    top = out.logprobs[0]
    assert len(top) == 5
    for token, logprob in top.items():
        assert abs(logprob.logprob - float(want[token])) < 1e-4
