"""POST /v1/embeddings through the official `openai` client against a real server: one input
or a batch, text or token ids, float or base64 (the client's default) encodings, `dimensions`;
every embedding equals the offline engine's; bad fields are 400s naming them, the server keeps
serving with every KV block free; a generate-only server refuses embeddings."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch

from tests.server.conftest import start_server
from tokenmill import LLM, PoolingParams
from tokenmill.engine.llm_engine import LLMEngine

TEXTS = ["Hello, my name is", "The quick brown fox jumps over the lazy dog", "1, 2, 3,"]


@pytest.fixture(scope="module")
def server(tiny_model):
    path, _ = tiny_model("qwen3")
    engine = LLMEngine.from_options(path, max_model_len=512, num_kv_blocks=200)
    yield from start_server(engine, "tiny-qwen3")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_model):
    llm = LLM(tiny_model("qwen3")[0], runner="pooling")
    yield llm
    llm.engine.shutdown()


def close(a, b) -> bool:
    return torch.allclose(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-6)


def test_embeddings_equal_offline(client, offline, server):
    expected = [o.outputs.embedding for o in offline.embed(TEXTS, use_tqdm=False)]
    # left unset, the client asks for base64 and decodes it itself
    for fmt in (openai.NOT_GIVEN, "float", "base64"):
        resp = client.embeddings.create(model="tiny-qwen3", input=TEXTS, encoding_format=fmt)
        assert [d.index for d in resp.data] == [0, 1, 2]
        got = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4").tolist()
               if fmt == "base64" else d.embedding for d in resp.data]
        assert all(close(g, e) for g, e in zip(got, expected, strict=True))
        assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(
            len(offline.get_tokenizer().encode(t)) for t in TEXTS)
    ids = offline.get_tokenizer().encode(TEXTS[1])
    one = client.embeddings.create(model="tiny-qwen3", input=ids, encoding_format="float")
    assert len(one.data) == 1 and close(one.data[0].embedding, expected[1])
    short = client.embeddings.create(model="tiny-qwen3", input=TEXTS[0], dimensions=16,
                                     encoding_format="float").data[0].embedding
    want = offline.embed([TEXTS[0]], PoolingParams(dimensions=16), use_tqdm=False)[0]
    assert len(short) == 16 and close(short, want.outputs.embedding)
    assert abs(sum(x * x for x in short) - 1) < 1e-5
    server.wait_idle()


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "dimensions": 100000}, None),
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": [], "model": "tiny-qwen3"}, "input"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hi", "truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
    ({"input": [[1, 2], [49152 * 4]]}, None),
])
def test_bad_fields_are_400(server, client, body, param):
    r = httpx.post(f"{server.base_url}/v1/embeddings", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == 400 and error["message"]
    if param is not None:
        assert param in (error["param"] or "") + error["message"]
    # the server still answers, with every block free
    assert client.embeddings.create(model="tiny-qwen3", input="ok").data
    server.wait_idle()


def test_generate_only_server_refuses_embeddings(tiny_model):
    path, _ = tiny_model("llama")
    engine = LLMEngine.from_options(path, max_model_len=512, num_kv_blocks=100,
                                    runner="generate")
    for srv in start_server(engine, "tiny-llama"):
        c = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="runner='pooling' or 'auto'"):
            c.embeddings.create(model="tiny-llama", input="hi")
        assert c.completions.create(model="tiny-llama", prompt="hi", max_tokens=2).choices
