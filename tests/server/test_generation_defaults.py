"""A model whose generation_config.json recommends sampling values: a request that leaves
them unset takes them (its own values win), chat's max_tokens defaults to the model's
max_new_tokens while completions keep 16, and the offline LLM without sampling_params runs
them too (vLLM's --generation-config auto); `vllm` turns them off."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import start_server
from tokenmill import LLM, SamplingParams
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server.api_server import ServerLogging

RECOMMENDED = {"temperature": 0.0, "top_k": 5, "repetition_penalty": 1.3,
               "max_new_tokens": 7, "bos_token_id": 1, "eos_token_id": 2}


@pytest.fixture(scope="module")
def recommending_model(tiny_model, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("recommending")
    shutil.copytree(tiny_model("llama")[0], folder, dirs_exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(RECOMMENDED))
    return str(folder)


def _logged_params(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tokenmill.server.request_log"]


def test_requests_take_the_model_s_defaults(recommending_model, caplog):
    engine = LLMEngine.from_options(recommending_model, max_model_len=512, num_kv_blocks=200)
    assert dict(engine.config.model.sampling_defaults) == {
        "temperature": 0.0, "top_k": 5, "repetition_penalty": 1.3, "max_tokens": 7}
    caplog.set_level(logging.INFO)
    messages = [{"role": "user", "content": "Say something"}]
    def chat(base_url: str, **fields: object) -> dict:
        r = httpx.post(f"{base_url}/v1/chat/completions", timeout=60, json={
            "model": "m", "messages": messages, "ignore_eos": True, **fields})
        assert r.status_code == 200, r.text
        return r.json()

    for srv in start_server(engine, "m", log=ServerLogging(log_requests=True,
                                                           log_stats=False)):
        by_default = chat(srv.base_url)
        explicit = chat(srv.base_url, temperature=0, top_k=5, repetition_penalty=1.3,
                        max_tokens=7)
        own = chat(srv.base_url, repetition_penalty=1.0, top_k=0, max_tokens=3)
        r = httpx.post(f"{srv.base_url}/v1/completions", timeout=60, json={
            "model": "m", "prompt": "Hello", "ignore_eos": True})
        srv.wait_idle()
    # the defaults: greedy (temperature 0) with the penalty, 7 tokens, as if asked
    assert by_default["usage"]["completion_tokens"] == 7  # the model's max_new_tokens
    assert by_default["choices"][0]["message"] == explicit["choices"][0]["message"]
    assert own["usage"]["completion_tokens"] == 3
    assert r.json()["usage"]["completion_tokens"] == 16  # completions: vLLM's 16
    logged = _logged_params(caplog)
    assert "temperature=0.0, top_p=1.0, top_k=5" in logged[0]
    # (max_tokens left to the engine, which stops at the model's 7: the usage above)
    assert "repetition_penalty=1.3" in logged[0] and "max_tokens=None" in logged[0]
    assert "top_k=0" in logged[2] and "repetition_penalty=1.0" in logged[2]
    assert "temperature=0.0" in logged[2]  # what the request left unset still defaults


def test_offline_defaults_and_turning_them_off(recommending_model):
    llm = LLM(recommending_model, max_model_len=512, num_kv_blocks=64)
    params = llm.get_default_sampling_params()
    # (max_tokens None: the engine caps it by the model's max_new_tokens and the context)
    assert (params.temperature, params.top_k, params.repetition_penalty, params.max_tokens) == (
        0.0, 5, 1.3, None)
    out = llm.generate("Hello", use_tqdm=False)[0].outputs[0]
    asked = llm.generate("Hello", SamplingParams(temperature=0, top_k=5, repetition_penalty=1.3,
                                                 max_tokens=7), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == asked.token_ids and 1 <= len(out.token_ids) <= 7
    neutral = LLM(recommending_model, max_model_len=512, num_kv_blocks=64,
                  generation_config="vllm")
    assert neutral.get_default_sampling_params() == SamplingParams()
    assert Path(recommending_model, "generation_config.json").exists()


def test_a_default_max_new_tokens_past_the_context_is_capped(recommending_model):
    """A model's max_new_tokens larger than the room its context leaves does not fail the
    requests that rely on it: they stop at the context's end (vLLM's rule)."""
    llm = LLM(recommending_model, max_model_len=64, num_kv_blocks=16,
              override_generation_config={"max_new_tokens": 100000})
    prompt = list(range(100, 120))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=None,
                                                ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 64 - 20
    with pytest.raises(ValueError, match="exceeds the context length"):  # asked: refused
        llm.generate([prompt], SamplingParams(max_tokens=100), use_tqdm=False)
