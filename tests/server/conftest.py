"""A real tokenmill server on 127.0.0.1 (free port) in a background thread, per test module."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import openai
import pytest
import uvicorn

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.lora.request import LoRARequest
from tokenmill.server.api_server import ServerLimits, ServerLogging, build_app
from tokenmill.server.http_options import HttpOptions
from tokenmill.server.lifecycle import DrainingServer
from tokenmill.server.serving_common import ServingOptions
from tokenmill.server.tools import ToolOptions


@dataclass
class RunningServer:
    base_url: str
    engine: LLMEngine  # the first replica's, with data parallelism
    model: str
    server: DrainingServer | None = None
    thread: threading.Thread | None = None
    engines: list[LLMEngine] | None = None  # every replica

    def wait_idle(self, timeout: float = 20.0) -> None:
        """Wait until nothing runs and every KV block is back in the pool (every replica)."""
        deadline = time.monotonic() + timeout
        for engine in self.engines or [self.engine]:
            kv = engine.kv
            while not (not engine.has_unfinished_requests()
                       and kv.num_free_blocks == kv.num_usable_blocks):
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"server not idle: {kv.num_free_blocks}/{kv.num_usable_blocks} blocks "
                        f"free, unfinished={engine.has_unfinished_requests()}")
                time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(engine: LLMEngine | list[LLMEngine], model: str, api_key: str | None = None,
                 limits: ServerLimits | None = None, tool_options: ToolOptions | None = None,
                 data_parallel_router: str = "cache_aware",
                 lora_modules: Sequence[LoRARequest] = (),
                 log: ServerLogging | None = None,
                 http: HttpOptions | None = None,
                 answers: ServingOptions | None = None) -> Iterator[RunningServer]:
    """The server `tokenmill serve` runs (DrainingServer), on a thread of this process; over
    data-parallel replicas when `engine` is a list."""
    port = free_port()
    http = http or HttpOptions()
    app = build_app(engine, model, api_key, limits, tool_options, data_parallel_router,
                    lora_modules, log, http, answers)
    engines = engine if isinstance(engine, list) else [engine]
    server = DrainingServer(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", timeout_graceful_shutdown=5,
                                           **http.uvicorn_kwargs()),
                            app.state.server.lifecycle)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.05)
    try:
        scheme = "https" if http.ssl_keyfile else "http"
        yield RunningServer(f"{scheme}://127.0.0.1:{port}", engines[0], model, server, thread,
                            engines)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def stream_completions(base_url: str, model: str, prompts: list[str],
                       lengths: list[int]) -> list[str]:
    """The texts of greedy streaming completions, all sent at once by the openai client."""

    async def one(client: openai.AsyncOpenAI, prompt: str, n: int) -> str:
        text = ""
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=n,
                                                 temperature=0, stream=True)
        async for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
        return text

    async def all_of_them() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x",
                                      max_retries=0) as client:
            return await asyncio.gather(*(one(client, p, n)
                                          for p, n in zip(prompts, lengths, strict=True)))

    return asyncio.run(all_of_them())


@pytest.fixture(scope="module")
def tiny_server(tiny_model) -> Iterator[RunningServer]:
    path, _ = tiny_model("llama")
    engine = LLMEngine.from_options(path, max_model_len=512, num_kv_blocks=400)
    yield from start_server(engine, "tiny-llama")
