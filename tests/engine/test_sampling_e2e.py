"""Generation parameters end to end on real tiny models, checked against Hugging Face where HF
has the same feature: logprobs and prompt logprobs (1e-4), repetition penalty, beam search.
Plus min_tokens, logit_bias, seeds in mixed batches and n > 1 sharing KV blocks."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_kv_all_free, mixed_prompts
from tokenmill import LLM, BeamSearchParams, SamplingParams


@pytest.fixture(scope="module")
def llama(tiny_model):
    path, hf = tiny_model("llama")
    return LLM(path, max_model_len=512), hf


@torch.no_grad()
def hf_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    """(len(tokens), V) log_softmax of HF's logits at every position."""
    return hf(torch.tensor([tokens])).logits[0].float().log_softmax(-1)


@pytest.mark.parametrize("kind, options", [("llama", {}), ("qwen2", {}),
                                           ("llama", {"max_num_batched_tokens": 16})])
def test_logprobs_and_prompt_logprobs_match_hf(tiny_model, kind, options):
    path, hf = tiny_model(kind)
    llm = LLM(path, **options)
    cases = mixed_prompts(4, 49152, seed=7, max_len=60, max_new=10)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5,
                            prompt_logprobs=3)
    outs = llm.generate([p for p, _ in cases], params, use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        ref = hf_logprobs(hf, out.prompt_token_ids + c.token_ids)
        P = len(out.prompt_token_ids)
        assert len(c.logprobs) == len(c.token_ids)
        for j, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
            row = ref[P - 1 + j]
            assert abs(entry[tok].logprob - float(row[tok])) < 1e-4
            assert entry[tok].rank == 1  # greedy picks the most likely token
            top = row.topk(5)
            assert list(entry)[:5] == top.indices.tolist()  # chosen (= top-1) first, then top-5
            for tid, want in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                assert abs(entry[tid].logprob - want) < 1e-4
        assert c.cumulative_logprob == pytest.approx(
            sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs, strict=True)))
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == P
        for i in range(1, P):
            entry, tok = out.prompt_logprobs[i], out.prompt_token_ids[i]
            assert abs(entry[tok].logprob - float(ref[i - 1, tok])) < 1e-4
            # A token deep in a random model's distribution has neighbours within float32
            # noise of it: the rank must lie between those of its logprob -/+ the tolerance.
            want = float(ref[i - 1, tok])
            assert (int((ref[i - 1] > want + 1e-4).sum()) + 1 <= entry[tok].rank
                    <= int((ref[i - 1] > want - 1e-4).sum()) + 1)
            assert len(entry) <= 4 and entry[tok].decoded_token is not None
    assert_kv_all_free(llm.engine)


@pytest.mark.parametrize("penalty", [0.3, 0.6])
def test_repetition_penalty_matches_hf(llama, penalty):
    # NOTE: a random model never repeats on its own, so a penalty > 1 would change nothing here;
    # one < 1 (valid in HF and vLLM) boosts prompt tokens and so really changes the output. The
    # same code path serves penalties > 1, checked by hand in tests/layers/test_sampler.py.
    llm, hf = llama
    prompt = list(range(500, 564))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                repetition_penalty=penalty), use_tqdm=False)
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20,
                      do_sample=False, repetition_penalty=penalty)[0, len(prompt):].tolist()
    assert out[0].outputs[0].token_ids == ref
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                         use_tqdm=False)
    assert plain[0].outputs[0].token_ids != ref  # the penalty really changed the output
    assert set(ref) & set(prompt)


@pytest.mark.parametrize("length_penalty", [1.0, 0.5, 2.0])
@pytest.mark.parametrize("eos_at", [None, 1, 3])
def test_beam_search_matches_hf(llama, length_penalty, eos_at):
    llm, hf = llama
    prompt, width, max_tokens = [5, 99, 1000, 7, 42], 3, 8
    eos = 2
    if eos_at is not None:  # make a token the best beam uses the EOS, so beams finish early
        best = llm.beam_search([prompt], BeamSearchParams(width, max_tokens))[0]
        eos = best.sequences[0].tokens[len(prompt) + eos_at]
    llm.engine.eos_token_ids = [eos]
    try:
        ours = llm.beam_search([prompt], BeamSearchParams(width, max_tokens,
                                                          length_penalty=length_penalty))[0]
    finally:
        llm.engine.eos_token_ids = [2]
    ref = hf.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
                      max_new_tokens=max_tokens, do_sample=False, early_stopping=False,
                      length_penalty=length_penalty, eos_token_id=eos, pad_token_id=eos,
                      output_scores=True, return_dict_in_generate=True)
    want = []
    for seq in ref.sequences.tolist():
        gen = seq[len(prompt):]
        want.append(prompt + (gen[:gen.index(eos) + 1] if eos in gen else gen))
    assert [s.tokens for s in ours.sequences] == want
    assert [s.score for s in ours.sequences] == pytest.approx(ref.sequences_scores.tolist(),
                                                             abs=1e-4)
    if eos_at is not None and length_penalty == 0.5:
        assert any(s.finish_reason == "stop" for s in ours.sequences)


def test_min_tokens_defers_eos_and_stop_ids(llama):
    llm, _ = llama
    prompt = [40, 41, 42]
    ref = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    eos = ref[2]
    first = ref.index(eos)  # where greedy first emits it
    llm.engine.eos_token_ids = [eos]
    try:
        early = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12),
                             use_tqdm=False)[0].outputs[0]
        late = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, min_tokens=6),
                            use_tqdm=False)[0].outputs[0]
        stop_id = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, min_tokens=6,
                                                        ignore_eos=True, stop_token_ids=[eos]),
                               use_tqdm=False)[0].outputs[0]
    finally:
        llm.engine.eos_token_ids = [2]
    assert early.token_ids == ref[:first + 1] and early.finish_reason == "stop"
    for out in (late, stop_id):
        assert len(out.token_ids) >= 6 and eos not in out.token_ids[:6]
        assert out.token_ids[:first] == ref[:first]  # the ban only touches the EOS/stop id
        if eos in out.token_ids:  # allowed from token 6 on, it then ends the request
            assert out.token_ids.index(eos) == len(out.token_ids) - 1
            assert out.finish_reason == "stop"
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == 12


def test_logit_bias_forces_a_token(llama):
    llm, _ = llama
    out = llm.generate([[3, 4, 5]], SamplingParams(temperature=0.7, seed=1, max_tokens=5,
                                                   logit_bias={777: 100.0}), use_tqdm=False)
    assert out[0].outputs[0].token_ids == [777] * 5


def test_seeded_sampling_is_independent_of_batch(llama):
    llm, _ = llama
    target = ([9, 8, 7, 6, 5] * 7, SamplingParams(temperature=0.9, top_k=50, seed=123,
                                                  max_tokens=24, ignore_eos=True))
    alone = llm.generate([target[0]], target[1], use_tqdm=False)[0].outputs[0].token_ids
    others = [(p, SamplingParams(temperature=t, max_tokens=m, ignore_eos=True, top_p=0.9))
              for (p, m), t in zip(mixed_prompts(5, 49152, seed=2, max_len=80, max_new=30),
                                   [0.0, 1.0, 0.5, 1.2, 0.0], strict=True)]
    batch = others[:2] + [target] + others[2:]
    outs = llm.generate([p for p, _ in batch], [s for _, s in batch], use_tqdm=False)
    assert outs[2].outputs[0].token_ids == alone
    chunked = LLM(llm.engine.config.model.path, max_model_len=512, max_num_batched_tokens=24)
    outs = chunked.generate([p for p, _ in batch], [s for _, s in batch], use_tqdm=False)
    assert outs[2].outputs[0].token_ids == alone


@pytest.mark.parametrize("prompt_len", [33, 40])  # P-1 on a block boundary, and not
def test_n_greedy_samples_equal_single_greedy(llama, prompt_len):
    llm, _ = llama
    prompt = list(range(100, 100 + prompt_len))
    single = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    out = llm.generate([prompt], SamplingParams(n=4, temperature=0, max_tokens=16,
                                                ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(c.token_ids == single for c in out.outputs)
    assert_kv_all_free(llm.engine)


def test_n_seeded_samples_equal_single_requests_with_offset_seeds(llama):
    llm, _ = llama
    prompt = list(range(200, 260))
    params = SamplingParams(n=3, temperature=1.0, seed=50, max_tokens=12, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    singles = llm.generate([prompt] * 3, [SamplingParams(temperature=1.0, seed=50 + i,
                                                         max_tokens=12, ignore_eos=True)
                                          for i in range(3)], use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == [s.outputs[0].token_ids for s in singles]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3


def peak_blocks(llm: LLM, prompt: list[int], params: SamplingParams) -> int:
    engine, peak = llm.engine, 0
    engine.add_request("peak", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.kv.num_usable_blocks - engine.kv.num_free_blocks)
    return peak


def test_n8_shares_prompt_blocks(llama):
    llm, _ = llama
    prompt = list(range(1000, 1200))  # 200 tokens: 13 blocks of 16
    one = peak_blocks(llm, prompt, SamplingParams(temperature=1.0, max_tokens=20, seed=0))
    eight = peak_blocks(llm, prompt, SamplingParams(n=8, temperature=1.0, max_tokens=20, seed=0))
    assert one == 14
    # 12 shared full blocks + per sample its copied 13th block and one more: 12 + 8 * 2
    assert eight <= 12 + 8 * 2 < 8 * one / 3
    assert_kv_all_free(llm.engine)


def test_n_with_preemption_and_abort(tiny_model, llama):
    _, hf = llama
    path, _ = tiny_model("llama")
    small = LLM(path, max_model_len=512, num_kv_blocks=20, block_size=8)
    prompt = list(range(300, 340))
    params = SamplingParams(n=3, temperature=0.8, seed=9, max_tokens=40, ignore_eos=True)
    ref = llama[0].generate([prompt], params, use_tqdm=False)[0]
    got = small.generate([prompt], params, use_tqdm=False)[0]
    assert small.engine.scheduler.num_preemptions > 0
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in ref.outputs]
    assert_kv_all_free(small.engine)
    engine = small.engine
    engine.add_request("a", prompt, params)  # abort before the followers fork ...
    assert engine.abort_request("a") and not engine.has_unfinished_requests()
    engine.add_request("b", prompt, params)  # ... and after
    for _ in range(6):
        engine.step()
    assert engine.abort_request("b")
    assert_kv_all_free(engine)


@pytest.mark.parametrize("kwargs, match", [
    (dict(min_p=1.5), "min_p"), (dict(presence_penalty=3), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"), (dict(repetition_penalty=0), "repetition"),
    (dict(logprobs=-1), "logprobs"), (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(min_tokens=5, max_tokens=3), "min_tokens"), (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(logit_bias={5: 101}), "logit_bias"), (dict(seed=1.5), "seed"), (dict(n=0), "n must"),
])
def test_new_parameters_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_logit_bias_token_out_of_vocab_is_refused(llama):
    llm, _ = llama
    with pytest.raises(ValueError, match="logit_bias token ids must be < vocab size 49152"):
        llm.generate(["x"], SamplingParams(logit_bias={60000: 1.0}), use_tqdm=False)
    assert_kv_all_free(llm.engine)


def test_skip_special_tokens(llama):
    llm, _ = llama
    forced = dict(temperature=0, max_tokens=3, logit_bias={1: 100.0})  # <|im_start|>, special
    shown = llm.generate(["x"], SamplingParams(skip_special_tokens=False, **forced),
                         use_tqdm=False)[0].outputs[0]
    hidden = llm.generate(["x"], SamplingParams(**forced), use_tqdm=False)[0].outputs[0]
    assert shown.token_ids == hidden.token_ids == [1, 1, 1]
    assert shown.text == "<|im_start|>" * 3 and hidden.text == ""


def test_max_logprobs_bounds_what_a_request_may_ask(tiny_model):
    """vLLM's max_logprobs (default 20): more is refused by name; an engine started with a
    larger one returns them, equal to HF's top-k; -1 allows the whole vocabulary."""
    path, hf = tiny_model("llama")
    default = LLM(path, max_model_len=128, num_kv_blocks=16)
    with pytest.raises(ValueError, match=r"logprobs must be at most 20 \(the engine's "
                                         r"max_logprobs"):
        default.generate([[5, 6, 7]], SamplingParams(logprobs=21), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs must be at most 20"):
        default.generate([[5, 6, 7]], SamplingParams(prompt_logprobs=21), use_tqdm=False)
    assert_kv_all_free(default.engine)
    wide = LLM(path, max_model_len=128, num_kv_blocks=16, max_logprobs=40)
    out = wide.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2, logprobs=30,
                                                    prompt_logprobs=35), use_tqdm=False)[0]
    entry = out.outputs[0].logprobs[0]
    ref = hf_logprobs(hf, [5, 6, 7])[-1]
    # greedy: the chosen token is the top 1, so the entry is the top 30 in order
    assert list(entry) == ref.topk(30).indices.tolist()
    assert len(out.prompt_logprobs[1]) in (35, 36)  # the prompt token and the top 35
    # the vocabulary's size caps it (configs only: no third engine)
    from tokenmill.engine_args import engine_config as config_of

    assert config_of(path, max_logprobs=-1).model.max_logprobs == 49152
    assert config_of(path, max_logprobs=10**6).model.max_logprobs == 49152
    with pytest.raises(ValueError, match="max_logprobs must be an integer >= -1"):
        config_of(path, max_logprobs=-2)


def test_allowed_token_ids_and_truncated_prompts(llama):
    """vLLM's allowed_token_ids (only those sampled: greedy takes HF's best among them) and
    truncate_prompt_tokens (the prompt's last k tokens, as if sent alone)."""
    llm, hf = llama
    prompt = [1000 + 7 * i for i in range(50)]
    allowed = [100, 200, 300, 4000, 5000]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                            allowed_token_ids=allowed)
    out = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    tokens = list(prompt)
    for t in out:  # HF's argmax over the allowed ids, step by step
        row = hf_logprobs(hf, tokens)[-1]
        assert t == allowed[int(row[allowed].argmax())]
        tokens.append(t)
    sampled = llm.generate([prompt] * 4, SamplingParams(
        temperature=1.5, max_tokens=8, seed=3, ignore_eos=True, allowed_token_ids=allowed),
        use_tqdm=False)
    assert all(t in allowed for o in sampled for t in o.outputs[0].token_ids)
    with pytest.raises(ValueError, match="allowed_token_ids must be < vocab size"):
        llm.generate([prompt], SamplingParams(allowed_token_ids=[10**6]), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids must not be empty"):
        SamplingParams(allowed_token_ids=[])
    cut = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, truncate_prompt_tokens=10)
    (short,) = llm.generate([prompt], cut, use_tqdm=False)
    (alone,) = llm.generate([prompt[-10:]], SamplingParams(temperature=0, max_tokens=5,
                                                           ignore_eos=True), use_tqdm=False)
    assert short.prompt_token_ids == prompt[-10:]
    assert short.outputs[0].token_ids == alone.outputs[0].token_ids
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be an integer >= 1"):
        SamplingParams(truncate_prompt_tokens=0)
    assert_kv_all_free(llm.engine)


def test_bad_words_are_never_generated(llama):
    """vLLM's bad_words: a one-token word's token is never sampled; a word of two tokens
    never has its second after its first (greedy otherwise unchanged up to there), also with
    async scheduling, which then waits for each token before the next step."""
    llm, _ = llama
    tok = llm.get_tokenizer()
    prompt = [1000 + 7 * i for i in range(20)]
    params = dict(temperature=0, max_tokens=12, ignore_eos=True)
    plain = llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0].outputs[0]
    out = plain.token_ids
    one = next(i for i in range(12) if tok.encode(tok.decode([out[i]]).lstrip(),
                                                  add_special_tokens=False) == [out[i]])
    word = tok.decode([out[one]])
    banned = llm.generate([prompt], SamplingParams(**params, bad_words=[word]),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert banned[:one] == out[:one] and out[one] not in banned
    two = next(i for i in range(11)
               if not tok.decode(out[i:i + 2]).startswith(" ")
               and tok.encode(tok.decode(out[i:i + 2]), add_special_tokens=False)
               == list(out[i:i + 2]))
    pair = tok.decode(out[two:two + 2])
    for engine_llm in (llm, LLM(llm.engine.config.model.path, max_model_len=512,
                                async_scheduling=True)):
        got = engine_llm.generate([prompt], SamplingParams(**params, bad_words=[pair]),
                                  use_tqdm=False)[0].outputs[0].token_ids
        assert got[:two + 1] == out[:two + 1] and got[two + 1] != out[two + 1]
        assert all(got[i:i + 2] != out[two:two + 2] for i in range(len(got) - 1))
    with pytest.raises(ValueError, match="bad_words must be non-blank strings"):
        SamplingParams(bad_words=[" "])
    assert_kv_all_free(llm.engine)
