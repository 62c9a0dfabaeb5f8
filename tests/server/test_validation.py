"""Validation at the edge (issue 15): every field the engine would choke on, every field we do
not implement, every type a lenient parser would coerce, and every error route answers a 4xx
in OpenAI's shape naming the field, and the server keeps serving with every block free."""

from __future__ import annotations

import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def base(tiny_server) -> str:
    return tiny_server.base_url


def post(base: str, path: str, body: dict | bytes) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(f"{base}{path}", content=body, timeout=30,
                          headers={"content-type": "application/json"})
    return httpx.post(f"{base}{path}", json=body, timeout=30)


def assert_error(r: httpx.Response, status: int, param: str | None = "any",
                 contains: str = "") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    if param != "any":
        assert err["param"] == param, err
    assert contains in err["message"], err
    return err


CMPL = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 3}
CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.mark.parametrize("field, value", [
    ("seed", 18446744073709551616), ("seed", 2**63), ("seed", -(2**63) - 1),
    ("top_k", 9223372036854775808), ("top_k", -2), ("n", 20000), ("n", 0),
])
def test_out_of_range_integers_are_400(base, tiny_server, field, value):
    assert_error(post(base, "/v1/completions", CMPL | {field: value}), 400, field)
    tiny_server.wait_idle()


def test_largest_valid_seed_and_top_k_are_served(base, tiny_server):
    """int64 seeds and top_k beyond the vocabulary are legal: the engine reduces n > 1 seeds
    into 64 bits and caps top_k at the vocabulary, so nothing overflows inside a step."""
    r = post(base, "/v1/completions", CMPL | {"seed": 2**63 - 1, "n": 3, "temperature": 1.0,
                                              "top_k": 2**62})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 3
    tiny_server.wait_idle()


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty",
                                   "frequency_penalty", "repetition_penalty"])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_floats_are_400(base, field, value):
    body = b'{"model": "tiny-llama", "prompt": "hi", "max_tokens": 2, "%s": %s}' % (
        field.encode(), value.encode())
    assert_error(post(base, "/v1/completions", body), 400, field)


@pytest.mark.parametrize("body, param", [
    ({"prompt": [False]}, "prompt"), ({"prompt": [True, 2]}, "prompt"),
    ({"prompt": []}, "prompt"), ({"prompt": [[]]}, "prompt"), ({"prompt": 5}, "prompt"),
    ({"prompt": ["a", [1]]}, "prompt"), ({"prompt": [-1]}, "prompt"),
    ({"prompt": ["x"] * 257}, "prompt"),
    ({"stream": "yes"}, "stream"), ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_tokens": "3"}, "max_tokens"), ({"temperature": "0.5"}, "temperature"),
    ({"ignore_eos": 1}, "ignore_eos"), ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"logprobs": True}, "logprobs"),
])
def test_strict_types(base, body, param):
    assert_error(post(base, "/v1/completions", CMPL | body), 400, param)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strin"}}}}, "structured_outputs"),
    ({"guided_regex": "[a-"}, "structured_outputs"),
    ({"tools": [{"type": "function", "function": {"name": "f",
                                                  "parameters": {"type": "string"}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),  # auto
    ({"tool_choice": "required"}, "tool_choice"), ({"best_of": 3}, "best_of"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"frobnicate": 1}, "frobnicate"), ({"guided_decoding_backend": "x"},
                                        "guided_decoding_backend"),
    ({"max_completion_tokens": 0}, "max_tokens"),
    ({"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "logprobs"),  # over max_logprobs
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
])
def test_unimplemented_and_unknown_fields_are_400_by_name(base, tiny_server, body, param):
    err = assert_error(post(base, "/v1/chat/completions", CHAT | body), 400, param)
    assert param in err["message"]
    tiny_server.wait_idle()


def test_inert_values_of_unimplemented_fields_are_accepted(base, tiny_server):
    body = CHAT | {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
                   "best_of": 1, "user": "u1", "parallel_tool_calls": False, "store": False}
    assert post(base, "/v1/chat/completions", body).status_code == 200
    tiny_server.wait_idle()


def test_max_completion_tokens_wins_over_max_tokens(base, tiny_server):
    r = post(base, "/v1/chat/completions", CHAT | {"max_completion_tokens": 2, "max_tokens": 9,
                                                   "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 2
    tiny_server.wait_idle()


def test_prompt_logprobs_are_returned(base, tiny_server):
    r = post(base, "/v1/completions", CMPL | {"prompt": [5, 6, 7, 8], "prompt_logprobs": 2})
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert len(plp) == 4 and plp[0] is None
    assert all("6" in plp[1] and len(plp[j]) >= 2 for j in (1,))
    chat = post(base, "/v1/chat/completions", CHAT | {"prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 3
    tiny_server.wait_idle()


def test_text_parts_equal_plain_content(base, tiny_server):
    plain = post(base, "/v1/chat/completions", CHAT | {"temperature": 0, "messages": [
        {"role": "user", "content": "Hello\nthere"}]}).json()
    parts = post(base, "/v1/chat/completions", CHAT | {"temperature": 0, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hello"},
                                     {"type": "text", "text": "there"}]}]}).json()
    assert parts["choices"][0]["message"] == plain["choices"][0]["message"]
    assert parts["usage"] == plain["usage"]
    tiny_server.wait_idle()


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "a\\ud800b", "max_tokens": 2}'),
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": ["ok", "\\udfff"], "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("/v1/completions", b'{"prompt": "x", "stop": ["\\ud800"]}'),
    ("/tokenize", b'{"prompt": "\\ud800"}'),
    ("/tokenize", b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
])
def test_lone_surrogates_are_400(base, path, body):
    assert_error(post(base, path, body), 400, contains="Unicode")


def test_error_routes_have_the_openai_shape(base):
    assert_error(httpx.get(f"{base}/v1/nothing-here"), 404)
    assert_error(httpx.get(f"{base}/v1/completions"), 405)
    assert_error(post(base, "/v1/completions", b"{not json"), 400, None, "malformed JSON")
    assert_error(post(base, "/v1/completions", b"[1, 2]"), 400)
    assert_error(post(base, "/v1/completions", b""), 400)
    with pytest.raises(openai.BadRequestError) as e:
        openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0).completions.create(
            model="tiny-llama", prompt="hi", extra_body={"seed": 2**64})
    assert e.value.body["param"] == "seed"


def test_request_id_is_accepted_generated_and_returned(base, tiny_server):
    r = post(base, "/v1/completions", CMPL)
    generated = r.headers["x-request-id"]
    assert len(generated) >= 16 and r.json()["id"] == f"cmpl-{generated}"
    r = httpx.post(f"{base}/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "abc-1"})
    assert r.headers["x-request-id"] == "abc-1" and r.json()["id"] == "chatcmpl-abc-1"
    # the same id twice at once still works (engine ids stay unique)
    r2 = httpx.post(f"{base}/v1/completions", json=CMPL | {"n": 2},
                    headers={"X-Request-Id": "abc-1"})
    assert r2.status_code == 200 and r2.headers["x-request-id"] == "abc-1"
    bad = httpx.get(f"{base}/v1/nothing", headers={"X-Request-Id": "x" * 500})
    assert bad.headers["x-request-id"] != "x" * 500  # over-long ids are replaced
    tiny_server.wait_idle()
