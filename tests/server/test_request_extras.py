"""vLLM's request extras through the API: allowed_token_ids (only those sampled),
truncate_prompt_tokens (the prompt's last k tokens) and bad_words, with their checks as 400s
by name."""

from __future__ import annotations

import httpx

PROMPT = [1500 + 11 * i for i in range(40)]


def _post(srv, **body) -> httpx.Response:
    return httpx.post(f"{srv.base_url}/v1/completions", timeout=60,
                      json={"model": srv.model, "temperature": 1.0, "seed": 5, **body})


def test_allowed_token_ids_and_truncation(tiny_server):
    allowed = [300, 301, 302]
    r = _post(tiny_server, prompt=PROMPT, max_tokens=12, ignore_eos=True, logprobs=0,
              allowed_token_ids=allowed)
    tokens = r.json()["choices"][0]["logprobs"]["tokens"]
    tok = tiny_server.engine.tokenizer
    assert len(tokens) == 12 and set(tokens) <= {tok.decode([t]) for t in allowed}
    cut = _post(tiny_server, prompt=PROMPT, max_tokens=4, truncate_prompt_tokens=8,
                temperature=0)
    alone = _post(tiny_server, prompt=PROMPT[-8:], max_tokens=4, temperature=0)
    assert cut.json()["usage"]["prompt_tokens"] == 8
    assert cut.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
    plain = _post(tiny_server, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0)
    word = plain.json()["choices"][0]["logprobs"]["tokens"][0]
    # (a token that spells itself: the word bans exactly it)
    assert word.strip() and len(tok.encode(word.lstrip(), add_special_tokens=False)) == 1
    banned = _post(tiny_server, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0,
                   bad_words=[word])
    assert banned.json()["choices"][0]["logprobs"]["tokens"][0] != word
    for bad, name in (({"allowed_token_ids": []}, "allowed_token_ids"),
                      ({"allowed_token_ids": [10**7]}, "allowed_token_ids"),
                      ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                      ({"bad_words": [""]}, "bad_words")):
        r = _post(tiny_server, prompt="hi", max_tokens=2, **bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text
    tiny_server.wait_idle()
