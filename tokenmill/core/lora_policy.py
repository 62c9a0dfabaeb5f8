"""LoRA admission, a policy object of the scheduler (core/scheduler.py): a step's requests use
at most `max_loras` adapters, and no waiting adapter starves.

The running requests' adapters are the step's (running requests are all scheduled, and the
policy only admits requests whose adapter is running already or fits in a free place). A
waiting request whose adapter does not fit is passed over, as in vLLM, so that requests of the
running adapters (and base requests) keep the batch full; but only by requests that were
already queued when it was first passed over. Those are finitely many, so the running adapters
drain, a place frees and it starts: it waits for the work queued before it and the running
requests, never for later arrivals. Base requests (no adapter) may always pass: they hold no
adapter's place.
"""

from __future__ import annotations

import itertools
import math

from tokenmill.core.request import Request


class LoRAPolicy:
    def __init__(self, max_loras: int | None) -> None:
        self.max_loras = max_loras  # None: the engine serves no adapters
        self._arrivals = itertools.count()
        self._seq: dict[str, int] = {}  # adapter requests' queue order
        self._blocked_at: dict[str, int] = {}  # passed-over request → arrivals then
        self._limit: float = math.inf  # this scan's: adapter requests queued from here wait

    def on_add(self, request: Request) -> None:
        if request.lora is not None:
            if self.max_loras is None:
                raise ValueError("this engine serves no LoRA adapters (enable_lora=False)")
            self._seq[request.request_id] = next(self._arrivals)

    def on_finish(self, request: Request) -> None:
        self._seq.pop(request.request_id, None)
        self._blocked_at.pop(request.request_id, None)

    def new_scan(self) -> None:
        """Start a step's pass over the waiting queue."""
        self._limit = math.inf

    def may_start(self, request: Request, running: list[Request]) -> bool:
        """Whether the waiting request may start now (its adapter fits, and it does not pass a
        request that was passed over before it arrived); a request refused for its adapter is
        recorded as passed over."""
        key = request.lora_key
        if key is None:
            return True
        if self._seq[request.request_id] >= self._limit:
            return False
        active = {r.lora_key for r in running if r.lora_key is not None}
        if key in active or len(active) < self.max_loras:
            return True
        blocked_at = self._blocked_at.setdefault(request.request_id, next(self._arrivals))
        self._limit = min(self._limit, blocked_at)
        return False

    def on_start(self, request: Request) -> None:
        self._blocked_at.pop(request.request_id, None)

    def active_adapters(self, requests: list[Request]) -> set[str]:
        return {r.lora.name for r in requests if r.lora is not None}
