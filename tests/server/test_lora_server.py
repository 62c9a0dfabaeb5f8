"""LoRA adapters over HTTP with the official openai client, as vLLM serves them: --lora-modules
names as a request's `model`, /v1/models with their parent, the runtime load / unload routes
under VLLM_ALLOW_RUNTIME_LORA_UPDATING, and errors in OpenAI's shape (the server serves on)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.lora.conftest import adapters  # noqa: F401  (the fixture)
from tests.server.conftest import start_server
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.lora.request import LoRARequest
from tokenmill.server.lora_modules import RUNTIME_UPDATES_ENV, parse_lora_modules

PROMPT = [11, 12, 13, 14, 15, 16]


@pytest.fixture(scope="module")
def server(adapters):  # noqa: F811
    mp = pytest.MonkeyPatch()
    mp.setenv(RUNTIME_UPDATES_ENV, "True")
    engine = LLMEngine.from_options(adapters.base_path, dtype="float32", enable_lora=True,
                                    max_loras=2, max_lora_rank=16)
    yield from start_server(engine, "tiny-llama", lora_modules=[
        LoRARequest("qv8", 1, adapters.paths["qv8"]),
        LoRARequest("all4", 2, adapters.paths["all4"])])
    mp.undo()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")


def test_a_requests_model_picks_the_adapter(client, server, adapters):  # noqa: F811
    tok = server.engine.tokenizer
    for model, name in [("tiny-llama", None), ("qv8", "qv8"), ("all4", "all4")]:
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert out.model == model
        want = tok.decode(adapters.reference(name, PROMPT, 6))
        assert out.choices[0].text == want, model
    chat = client.chat.completions.create(
        model="all4", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        temperature=0)
    assert chat.model == "all4"
    server.wait_idle()


def test_models_lists_adapters_with_their_parent(client, adapters):  # noqa: F811
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) >= {"tiny-llama", "qv8", "all4"}
    assert cards["qv8"].parent == "tiny-llama" and cards["qv8"].root == adapters.paths["qv8"]
    assert cards["tiny-llama"].parent is None


def test_unknown_adapter_is_a_404_in_openais_shape(client, server):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert e.value.body["param"] == "model" and "nope" in e.value.body["message"]
    server.wait_idle()


def test_runtime_load_and_unload(client, server, adapters, tmp_path):  # noqa: F811
    url = server.base_url
    r = httpx.post(f"{url}/v1/load_lora_adapter",
                   json={"lora_name": "mlp16", "lora_path": adapters.paths["mlp16"]})
    assert r.status_code == 200, r.text
    text = client.completions.create(model="mlp16", prompt=PROMPT, max_tokens=5,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert text.choices[0].text == server.engine.tokenizer.decode(
        adapters.reference("mlp16", PROMPT, 5))
    # a name taken, a folder that is no adapter: 400 naming why; the server serves on
    for body, match in [({"lora_name": "mlp16", "lora_path": adapters.paths["ko2"]},
                         "already served"),
                        ({"lora_name": "bad", "lora_path": str(tmp_path)},
                         "adapter_config.json")]:
        r = httpx.post(f"{url}/v1/load_lora_adapter", json=body)
        assert r.status_code == 400 and match in r.json()["error"]["message"], r.text
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "mlp16"})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="mlp16", prompt="x", max_tokens=2)
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "mlp16"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    out = client.completions.create(model="qv8", prompt=PROMPT, max_tokens=2)
    assert out.usage.completion_tokens == 2  # still serving
    server.wait_idle()


def test_metrics_name_the_running_adapters(client, server):
    client.completions.create(model="qv8", prompt=PROMPT, max_tokens=2)
    text = httpx.get(f"{server.base_url}/metrics").text
    lines = [x for x in text.splitlines() if x.startswith("tokenmill:lora_requests_info{")]
    assert any('max_lora="2"' in x for x in lines), lines


def test_runtime_routes_are_absent_without_the_switch(adapters, monkeypatch):  # noqa: F811
    monkeypatch.delenv(RUNTIME_UPDATES_ENV, raising=False)
    engine = LLMEngine.from_options(adapters.base_path, dtype="float32", enable_lora=True)
    for srv in start_server(engine, "tiny-llama"):
        r = httpx.post(f"{srv.base_url}/v1/load_lora_adapter",
                       json={"lora_name": "x", "lora_path": adapters.paths["qv8"]})
        assert r.status_code == 404


def test_lora_modules_spellings(adapters):  # noqa: F811
    path = adapters.paths["qv8"]
    a, b = parse_lora_modules([f"one={path}", json.dumps(
        {"name": "two", "path": path, "base_model_name": "tiny-llama"})])
    assert (a.lora_name, a.lora_path, b.lora_name, b.base_model_name) == \
        ("one", path, "two", "tiny-llama")
    with pytest.raises(ValueError, match="name=path"):
        parse_lora_modules(["just-a-path"])
    engine = LLMEngine.from_options(adapters.base_path, dtype="float32", enable_lora=True,
                                    max_lora_rank=8)
    with pytest.raises(ValueError, match="max_lora_rank"):  # checked at start-up
        next(start_server(engine, "tiny-llama",
                          lora_modules=[LoRARequest("big", 1, adapters.paths["mlp16"])]))
