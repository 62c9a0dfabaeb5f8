"""DataParallelLLM: D engine replicas behind one API server (vLLM's --data-parallel-size).

Each replica is a whole engine: its own scheduler, KV cache and prefix cache, stepping on its
own AsyncLLM thread, its model runner(s) in worker processes (the mp executor even at one rank
per replica, so the replicas compute in parallel and never under this process's GIL). A
request is tokenized once, routed (engine/dp_router.py: cache_aware, where its prefix is
likely cached; round_robin) and served whole by that replica; nothing crosses between them.

It has AsyncLLM's surface (the server takes either): add_request / generate / abort /
abort_all / start / shutdown / is_running / dead_error, and `engine`, replica 0's, for what
every replica shares (tokenizer, config, grammar compiler). A replica that dies makes the
whole front dead (its streams end with EngineDeadError, /health answers 503, the server exits
1): a server never runs on quietly with part of its capacity.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from tokenmill.engine.async_engine import AsyncLLM, RequestStream
from tokenmill.engine.dp_router import make_router
from tokenmill.engine.llm_engine import EngineDeadError, LLMEngine
from tokenmill.engine_args import EngineArgs
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def make_replicas(args: EngineArgs) -> list[LLMEngine]:
    """The data_parallel_size engines the options ask for (1 without data parallelism), each
    with its own worker processes."""
    engines = [LLMEngine.from_engine_args(args)]
    try:
        for i in range(1, engines[0].config.parallel.data_parallel_size):
            t0 = time.perf_counter()
            engines.append(LLMEngine(engines[0].config))
            logger.info("data-parallel replica %d ready in %.1f s", i, time.perf_counter() - t0)
    except BaseException:
        for engine in engines:
            engine.shutdown()
        raise
    return engines


class DataParallelLLM:
    def __init__(self, engines: list[LLMEngine], router: str = "cache_aware",
                 on_step: Callable[..., None] | None = None,
                 on_dead: Callable[[BaseException], None] | None = None) -> None:
        """`on_step(stats, step, replica=i)` from replica i's engine thread; `on_dead(error)`
        once per replica that dies."""
        self.replicas = [
            AsyncLLM(e, on_step=None if on_step is None else functools.partial(on_step,
                                                                               replica=i),
                     on_dead=on_dead)
            for i, e in enumerate(engines)]
        self.router = make_router(router, engines[0].config.cache.block_size,
                                  [e.kv.num_usable_blocks for e in engines])

    @property
    def engine(self) -> LLMEngine:
        return self.replicas[0].engine

    # ---- lifecycle --------------------------------------------------------------------------
    async def sleep(self, level: int = 1) -> None:
        for r in self.replicas:
            await r.sleep(level)

    async def wake_up(self) -> None:
        for r in self.replicas:
            await r.wake_up()

    @property
    def is_sleeping(self) -> bool:
        return any(r.is_sleeping for r in self.replicas)

    def start(self) -> None:
        for r in self.replicas:
            r.start()

    def shutdown(self) -> None:
        for r in self.replicas:
            r.shutdown()

    @property
    def is_running(self) -> bool:
        return all(r.is_running for r in self.replicas)

    @property
    def dead_error(self) -> BaseException | None:
        return next((r.dead_error for r in self.replicas if r.dead_error is not None), None)

    # ---- requests ---------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: Any, params: SamplingParams,
                          deadline: float | None = None,
                          lora_request: LoRARequest | None = None, priority: int = 0
                          ) -> RequestStream:
        """AsyncLLM.add_request on the replica the router picks for the tokenized prompt."""
        if (error := self.dead_error) is not None:
            raise EngineDeadError(f"the engine is dead: {error}")
        prepared = await self.replicas[0].prepare(request_id, prompt, params, lora_request,
                                                  priority)
        replica = self.router.route(prepared.token_ids,
                                    [r.num_requests for r in self.replicas])
        return self.replicas[replica].submit(prepared, deadline)

    async def generate(self, request_id: str, prompt: Any, params: SamplingParams
                       ) -> AsyncIterator[RequestOutput]:
        async for out in await self.add_request(request_id, prompt, params):
            yield out

    def abort(self, request_id: str) -> None:
        for r in self.replicas:
            if r.has_request(request_id):
                r.abort(request_id)

    def abort_all(self) -> None:
        for r in self.replicas:
            r.abort_all()
