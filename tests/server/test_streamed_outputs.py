"""How the server reads a request's outputs (serving_common.merge, StreamedChoices) on a real
AsyncLLM over the tiny Llama: a consumer slower than the steps (a slow client) is never read
ahead of, so what waits is taken as one output; the DELTA outputs it reads add up to the
offline answer; closing it mid-stream aborts the requests and frees their blocks."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from tests.conftest import assert_kv_all_free
from tokenmill import LLM, RequestOutputKind, SamplingParams
from tokenmill.engine.async_engine import AsyncLLM
from tokenmill.server.serving_common import StreamedChoices, merge

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
PARAMS = SamplingParams(n=2, temperature=0.8, seed=11, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model):
    path, _ = tiny_model("llama")
    return LLM(path, max_model_len=256, num_kv_blocks=96)


@pytest.fixture
def engine(llm):
    engine = AsyncLLM(llm.engine)
    engine.start()
    yield engine
    engine.shutdown()
    assert_kv_all_free(llm.engine)


async def _streams(engine: AsyncLLM, prompts: list[list[int]], tag: str) -> list:
    params = dataclasses.replace(PARAMS, output_kind=RequestOutputKind.DELTA)
    return [await engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params)
            for i, p in enumerate(prompts)]


@pytest.mark.parametrize("num_prompts", [1, 2])
def test_a_slow_consumer_is_not_read_ahead_of(llm, engine, num_prompts):
    prompts = PROMPTS[:num_prompts]

    async def run() -> tuple[int, StreamedChoices]:
        streamed, reads = StreamedChoices(), 0
        async for i, out in merge(await _streams(engine, prompts, f"slow{num_prompts}")):
            reads += 1
            for c in out.outputs:
                streamed.add(i, i * PARAMS.n + c.index, out, c)
            await asyncio.sleep(0.03)  # writing to a slow client; the engine steps on
        return reads, streamed

    reads, streamed = asyncio.run(run())
    tokens = num_prompts * PARAMS.n * PARAMS.max_tokens
    # read one by one, each step's outputs were `tokens / n` reads at least
    assert reads < tokens / (2 * PARAMS.n)
    want = llm.generate(prompts, PARAMS, use_tqdm=False)
    for i, out in enumerate(want):
        for c in out.outputs:
            got = streamed.choices[i * PARAMS.n + c.index]
            assert (got.text, got.num_tokens, got.finish_reason) == (
                c.text, len(c.token_ids), c.finish_reason)
    usage = streamed.usage()
    assert usage.prompt_tokens == sum(len(p) for p in prompts)
    assert usage.completion_tokens == tokens


@pytest.mark.parametrize("num_prompts", [1, 2])
def test_closing_the_consumer_mid_stream_aborts_its_requests(llm, engine, num_prompts):
    async def run() -> None:
        outputs = merge(await _streams(engine, PROMPTS[:num_prompts], f"close{num_prompts}"))
        async for _ in outputs:
            break
        await outputs.aclose()
        deadline = time.monotonic() + 10
        while engine.num_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert engine.num_requests == 0

    asyncio.run(run())
    deadline = time.monotonic() + 10
    while llm.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
