"""Engine behaviour on a real tiny model: step-level API, abort, stop tokens, input order,
bad input refused with a clear ValueError while the engine keeps serving, and no leaked blocks."""

from __future__ import annotations

import random

import pytest

from tests.conftest import assert_kv_all_free
from tokenmill import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model):
    path, _ = tiny_model("llama")
    return LLM(path, max_model_len=256, num_kv_blocks=64)


def test_outputs_in_input_order_with_fields(llm):
    prompts = ["Hello there", [5, 6, 7, 8], {"prompt_token_ids": [9] * 30}, "A much longer prompt "
               "with quite a few more words in it than the others"]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    tok = llm.get_tokenizer()
    assert [o.prompt for o in outs] == ["Hello there", None, None, prompts[3]]
    assert outs[0].prompt_token_ids == tok.encode("Hello there")
    assert outs[1].prompt_token_ids == [5, 6, 7, 8]
    for o in outs:
        c = o.outputs[0]
        assert o.finished and len(c.token_ids) == 12 and c.finish_reason == "length"
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    # the same prompt alone gives the same tokens as inside the batch
    alone = llm.generate(prompts[3], GREEDY, use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == outs[3].outputs[0].token_ids
    assert_kv_all_free(llm.engine)


def test_stop_token_ids_and_eos(llm):
    ref = llm.generate([[11, 12, 13]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop = ref[4]
    first = ref.index(stop)
    out = llm.generate([[11, 12, 13]], SamplingParams(temperature=0, max_tokens=12,
                                                      ignore_eos=True, stop_token_ids=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    # With EOS redefined as that token, the request stops there unless ignore_eos is set.
    llm.engine.eos_token_ids = [stop]
    try:
        out = llm.generate([[11, 12, 13]], SamplingParams(temperature=0, max_tokens=12),
                           use_tqdm=False)[0].outputs[0]
    finally:
        llm.engine.eos_token_ids = [2]
    assert out.token_ids == ref[:first + 1] and out.finish_reason == "stop"
    assert out.stop_reason is None


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_a_stop_tokens_text_is_left_out_unless_asked(llm, skip_special_tokens):
    """vLLM's rule: the stop token (a stop id, EOS) is in token_ids, not in the text, unless
    include_stop_str_in_output; with skip_special_tokens false EOS's text would show."""
    tok = llm.get_tokenizer()
    ref = llm.generate([[11, 12, 13]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop = ref[4]
    first = ref.index(stop)
    for include in (False, True):
        out = llm.generate([[11, 12, 13]], SamplingParams(
            temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop],
            include_stop_str_in_output=include, skip_special_tokens=skip_special_tokens),
            use_tqdm=False)[0].outputs[0]
        shown = ref[:first + 1] if include else ref[:first]
        assert out.token_ids == ref[:first + 1]
        assert out.text == tok.decode(shown, skip_special_tokens=skip_special_tokens)
    eos = llm.generate([[11, 12, 13]], SamplingParams(  # EOS made certain at the 4th token
        temperature=0, max_tokens=12, min_tokens=3, logit_bias={2: 100.0},
        skip_special_tokens=skip_special_tokens), use_tqdm=False)[0].outputs[0]
    assert eos.token_ids[-1] == 2 and len(eos.token_ids) == 4 and eos.finish_reason == "stop"
    assert eos.text == tok.decode(eos.token_ids[:-1], skip_special_tokens=skip_special_tokens)
    assert tok.decode([2]) not in eos.text


def test_abort_mid_run_frees_blocks_and_spares_others(llm):
    engine = llm.engine
    expected = [o.outputs[0].token_ids for o in
                llm.generate([[20] * 40, [21] * 70], GREEDY, use_tqdm=False)]
    engine.add_request("keep-0", [20] * 40, GREEDY)
    engine.add_request("drop", [22] * 90, GREEDY)
    engine.add_request("keep-1", [21] * 70, GREEDY)
    for _ in range(3):
        engine.step()
    assert engine.kv.get_block_ids("drop")
    assert engine.abort_request("drop") is True
    assert engine.kv.get_block_ids("drop") == []
    assert engine.abort_request("drop") is False
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert done == {"keep-0": expected[0], "keep-1": expected[1]}
    assert_kv_all_free(engine)


def test_abort_while_waiting(llm):
    engine = llm.engine
    engine.add_request("w", [3] * 10, GREEDY)
    assert engine.abort_request("w")
    assert engine.step() == []
    assert_kv_all_free(engine)


@pytest.mark.parametrize("prompt, params, match", [
    ("", GREEDY, "prompt is empty"),
    ([], GREEDY, "prompt is empty"),
    ([1] * 250, SamplingParams(max_tokens=10), r"max_tokens \(10\).*max_model_len=256"),
    ([1] * 256, SamplingParams(max_tokens=None), "no room"),
    ([49152], GREEDY, r"token ids must be integers in \[0, 49152\)"),
    (3.5, GREEDY, "prompt must be"),
])
def test_bad_requests_are_refused_and_engine_keeps_serving(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([[5, 6], prompt], params, use_tqdm=False)
    assert_kv_all_free(llm.engine)
    out = llm.generate([[5, 6]], GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 12


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(n=0), "n must"),
])
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_default_max_tokens_fits_the_cache(tiny_model):
    path, _ = tiny_model("llama")
    small = LLM(path, max_model_len=512, num_kv_blocks=9)  # 8 usable blocks: 128 tokens
    out = small.generate([[5] * 100], SamplingParams(temperature=0, max_tokens=None,
                                                     ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 28 and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="need 9 KV blocks but the cache has 8"):
        small.generate([[5] * 100], SamplingParams(max_tokens=29), use_tqdm=False)
    with pytest.raises(ValueError, match="KV cache of 128 tokens"):
        small.generate([[5] * 128], SamplingParams(max_tokens=None), use_tqdm=False)


def test_mismatched_params_list(llm):
    with pytest.raises(ValueError, match="2 sampling_params for 3 prompts"):
        llm.generate(["a", "b", "c"], [GREEDY, GREEDY], use_tqdm=False)


def test_random_requests_with_aborts_leak_nothing(llm):
    engine, rng = llm.engine, random.Random(5)
    live: list[str] = []
    for i in range(40):
        rid = f"rand-{i}"
        engine.add_request(rid, [rng.randrange(3, 49152) for _ in range(rng.randint(1, 150))],
                           SamplingParams(temperature=rng.choice([0, 0.8]),
                                          top_k=rng.choice([0, 20]),
                                          max_tokens=rng.randint(1, 30),
                                          seed=rng.randrange(99)))
        live.append(rid)
        if rng.random() < 0.5:
            for out in engine.step():
                if out.finished:
                    live.remove(out.request_id)
        if rng.random() < 0.2 and live:
            engine.abort_request(live.pop(rng.randrange(len(live))))
        engine.kv.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
    assert_kv_all_free(engine)


def test_chat_uses_template(llm):
    tok = llm.get_tokenizer()
    msgs = [{"role": "user", "content": "Hi"}]
    out = llm.chat(msgs, GREEDY, use_tqdm=False)[0]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert out.prompt == text
    assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    assert out.prompt_token_ids[0] == 1  # <|im_start|>, once
