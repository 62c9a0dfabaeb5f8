"""RequestStream (engine/request_stream.py) on a real AsyncLLM over the tiny Llama: a reader
slower than the steps takes what waited as one output, and what it reads adds up to the
offline answer whatever the kind; an error after outputs comes once they are read."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from tests.conftest import assert_kv_all_free
from tokenmill import LLM, RequestOutputKind, SamplingParams
from tokenmill.engine.async_engine import AsyncLLM
from tokenmill.engine.llm_engine import EngineDeadError
from tokenmill.engine.request_stream import RequestStream
from tokenmill.outputs import CompletionOutput, RequestOutput

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def llm(tiny_model):
    path, _ = tiny_model("llama")
    return LLM(path, max_model_len=256, num_kv_blocks=96)


@pytest.fixture(scope="module")
def offline(llm):
    return [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


async def _read_slowly(engine: AsyncLLM, kind: RequestOutputKind, stall_s: float
                       ) -> list[list[RequestOutput]]:
    """Each request's outputs, read after the event loop was held for `stall_s` (the engine
    thread steps meanwhile, so outputs wait) and then as they come."""
    params = dataclasses.replace(PARAMS, output_kind=kind)
    streams = [await engine.add_request(f"{kind.name}-{i}", {"prompt_token_ids": p}, params)
               for i, p in enumerate(PROMPTS)]
    time.sleep(stall_s)  # blocks the loop: no output is read while the engine steps

    async def read(stream: RequestStream) -> list[RequestOutput]:
        return [out async for out in stream]

    return list(await asyncio.gather(*(read(s) for s in streams)))


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_a_slow_reader_takes_waiting_outputs_as_one(llm, offline, kind):
    engine = AsyncLLM(llm.engine)
    engine.start()
    try:
        got = asyncio.run(_read_slowly(engine, kind, stall_s=0.5))
    finally:
        engine.shutdown()
    for outs, want in zip(got, offline, strict=True):
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        # the stall let the steps run ahead: fewer reads than tokens, the first one several
        assert len(outs) < len(want.token_ids)
        assert len(outs[0].outputs[0].token_ids) > 1
        if kind is RequestOutputKind.DELTA:
            parts = [c for o in outs for c in o.outputs]
            assert [t for c in parts for t in c.token_ids] == want.token_ids
            assert "".join(c.text for c in parts) == want.text
            assert [lp for c in parts for lp in c.logprobs] == want.logprobs
        else:
            assert outs[-1].outputs[0] == want
            # every read is everything so far: each holds the one before it
            sizes = [len(o.outputs[0].token_ids) for o in outs]
            assert sizes == sorted(set(sizes))
    assert_kv_all_free(llm.engine)


class _Owner:
    """What a stream tells its owner (AsyncLLM's two calls), recorded."""

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.ended: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def stream_ended(self, request_id: str) -> None:
        self.ended.append(request_id)


def _output(tokens: list[int], finished: bool = False) -> RequestOutput:
    return RequestOutput("r", None, [1], [CompletionOutput(0, "x" * len(tokens), tokens)],
                         finished=finished)


def test_an_error_after_outputs_is_raised_once_they_are_read():
    async def run() -> tuple[list[RequestOutput], BaseException | None]:
        owner = _Owner()
        stream = RequestStream(owner, "r", RequestOutputKind.DELTA)
        stream.put(_output([1, 2]))
        stream.put(_output([3]))
        stream.put(EngineDeadError("the engine died"))
        read, error = [], None
        try:
            async for out in stream:
                read.append(out)
        except EngineDeadError as e:
            error = e
        assert owner.aborted == ["r"] and owner.ended == []
        return read, error

    read, error = asyncio.run(run())
    assert [o.outputs[0].token_ids for o in read] == [[1, 2, 3]]
    assert isinstance(error, EngineDeadError)


def test_a_finished_output_ends_the_stream_without_an_abort():
    async def run() -> _Owner:
        owner = _Owner()
        stream = RequestStream(owner, "r", RequestOutputKind.CUMULATIVE)
        stream.put(_output([1]))
        stream.put(_output([1, 2], finished=True))
        assert [o.outputs[0].token_ids async for o in stream] == [[1, 2]]
        del stream
        return owner

    owner = asyncio.run(run())
    assert owner.ended == ["r"] and owner.aborted == []


def test_a_reader_cancelled_while_waiting_aborts_its_request():
    async def run() -> _Owner:
        owner = _Owner()
        stream = RequestStream(owner, "r", RequestOutputKind.DELTA)
        task = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return owner

    assert asyncio.run(run()).aborted == ["r"]
