"""Several served model names (vLLM's `--served-model-name a b`): /v1/models lists each, a
request may name any, answers name the first; other names are still 404."""

from __future__ import annotations

import httpx

from tests.server.conftest import start_server
from tokenmill.cli import build_parser
from tokenmill.engine.llm_engine import LLMEngine


def test_every_name_serves_the_model(tiny_model):
    engine = LLMEngine.from_options(tiny_model("llama")[0], max_model_len=256, num_kv_blocks=32)
    for srv in start_server(engine, ["primary", "alias"]):
        listed = [m["id"] for m in httpx.get(f"{srv.base_url}/v1/models").json()["data"]]
        r = httpx.post(f"{srv.base_url}/v1/completions", json={
            "model": "alias", "prompt": "Hi", "max_tokens": 2})
        chat = httpx.post(f"{srv.base_url}/v1/chat/completions", json={
            "model": "primary", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2})
        missing = httpx.post(f"{srv.base_url}/v1/completions", json={
            "model": "other", "prompt": "Hi", "max_tokens": 2})
        srv.wait_idle()
    assert listed == ["primary", "alias"]
    assert r.status_code == 200 and r.json()["model"] == "primary"
    assert chat.status_code == 200 and chat.json()["model"] == "primary"
    assert missing.status_code == 404


def test_serve_takes_several_names():
    args = build_parser().parse_args(["serve", "m", "--served-model-name", "a", "b"])
    assert args.served_model_name == ["a", "b"]
