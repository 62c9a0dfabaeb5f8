"""Completions' `echo` (OpenAI's legacy field, vLLM's behaviour): the prompt comes back ahead
of the answer, with its logprobs when logprobs are asked; with max_tokens 0 the prompt
alone, which is how lm-evaluation-harness scores a text through `local-completions`
(`echo: true, logprobs: 1, max_tokens: 0` or 1). Logprobs equal HF's in float32."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

PROMPT = [1000 + 37 * i % 9000 for i in range(24)]


@pytest.fixture(scope="module")
def hf_reference(tiny_model, tiny_server):
    """(log_softmax over the prompt's positions, the tokenizer)."""
    _, hf = tiny_model("llama")
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT])).logits[0].float()
    return logits.log_softmax(-1), tiny_server.engine.tokenizer


def _complete(srv, **fields) -> dict:
    r = httpx.post(f"{srv.base_url}/v1/completions", timeout=60, json={
        "model": srv.model, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_only_scores_the_prompt_as_lm_eval_asks(tiny_server, hf_reference):
    ref, tok = hf_reference
    body = _complete(tiny_server, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    (choice,) = body["choices"]
    assert choice["text"] == tok.decode(PROMPT)
    lps = choice["logprobs"]
    assert len(lps["tokens"]) == len(PROMPT) and lps["tokens"][1] == tok.decode([PROMPT[1]])
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    for j in range(1, len(PROMPT)):
        assert abs(lps["token_logprobs"][j] - float(ref[j - 1, PROMPT[j]])) < 1e-4
        top = lps["top_logprobs"][j]  # at most the token and the top 1
        assert 1 <= len(top) <= 2 and lps["tokens"][j] in top
        best = int(ref[j - 1].argmax())
        assert abs(top[tok.decode([best])] - float(ref[j - 1, best])) < 1e-4
    offsets = lps["text_offset"]
    assert offsets[0] == 0 and all(b - a == len(t) for a, b, t in
                                   zip(offsets, offsets[1:], lps["tokens"], strict=False))
    assert body["usage"]["prompt_tokens"] == len(PROMPT)
    assert body["usage"]["completion_tokens"] == 1  # (computed, not shown: vLLM counts it)
    tiny_server.wait_idle()


def test_echo_prefixes_the_answer_and_its_logprobs(tiny_server, hf_reference):
    _, tok = hf_reference
    plain = _complete(tiny_server, prompt=PROMPT, logprobs=2, max_tokens=4,
                      ignore_eos=True)["choices"][0]
    echoed = _complete(tiny_server, prompt=PROMPT, logprobs=2, max_tokens=4, echo=True,
                       ignore_eos=True)["choices"][0]
    assert echoed["text"] == tok.decode(PROMPT) + plain["text"]
    P = len(PROMPT)
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert echoed["logprobs"][key][P:] == plain["logprobs"][key]
    assert len(echoed["logprobs"]["tokens"]) == P + 4
    # a text prompt comes back as it was sent; without logprobs there are none
    text = _complete(tiny_server, prompt="Hello there", echo=True, max_tokens=2)["choices"][0]
    assert text["text"].startswith("Hello there") and text["logprobs"] is None
    tiny_server.wait_idle()


@pytest.mark.parametrize("max_tokens", [0, 4])
def test_a_streamed_echo_joins_up_to_the_whole_answer(tiny_server, max_tokens):
    fields = dict(prompt=PROMPT, logprobs=1, max_tokens=max_tokens, echo=True,
                  ignore_eos=True)
    whole = _complete(tiny_server, **fields)["choices"][0]
    text, tokens, token_lps = "", [], []
    with httpx.stream("POST", f"{tiny_server.base_url}/v1/completions", timeout=60, json={
            "model": tiny_server.model, "temperature": 0, "stream": True, **fields}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:])["choices"]:
                text += c["text"]
                if c["logprobs"] is not None:
                    tokens += c["logprobs"]["tokens"]
                    token_lps += c["logprobs"]["token_logprobs"]
    assert text == whole["text"]
    assert tokens == whole["logprobs"]["tokens"]
    assert token_lps == whole["logprobs"]["token_logprobs"]
    tiny_server.wait_idle()


def test_max_tokens_zero_needs_echo(tiny_server):
    r = httpx.post(f"{tiny_server.base_url}/v1/completions", timeout=60, json={
        "model": tiny_server.model, "prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
