"""StructuredOutputManager: compiled grammars (cached), and each step's token bitmasks,
filled on a worker thread while the model runs.

Flow (vLLM v1's, in one process): `compile` at validation time (a bad constraint is a
ValueError before anything is scheduled; equal constraints compile once, LRU-cached by
(kind, spec)); each request sample gets its own matcher (`Request.grammar`), which the
scheduler advances on every emitted token. After `schedule()`, `submit` hands the step's
constrained requests to the worker thread, which fills one bitmask row per sampled position
(the draft positions too: the matcher accepts each draft, fills the next row, and rolls them
all back) while the runner's forward pass runs; the runner waits for the result only when it
samples, and applies it to the logits (layers/token_bitmask.py).

Invariant: between `submit` and `wait`, only the worker thread touches the step's matchers;
the engine calls `wait` before `update_from_output` advances them.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from tokenmill.core.interface import GrammarOutput, SchedulerOutput
from tokenmill.structured_output.backend import (
    CompiledGrammar,
    GrammarMatcher,
    StructuredOutputBackend,
    bitmask_width,
)
from tokenmill.structured_output.config import StructuredOutputsConfig
from tokenmill.structured_output.params import StructuredOutputsParams

_CACHE_SIZE = 256  # compiled grammars kept (a schema reused by many requests compiles once)


def make_backend(name: str, tokenizer: Any, vocab_size: int,
                 eos_token_ids: list[int]) -> StructuredOutputBackend:
    """The backend `name` ("auto": llguidance if installed, else xgrammar)."""
    if name == "auto":
        try:
            import llguidance  # noqa: F401
            name = "guidance"
        except ImportError:
            name = "xgrammar"
    if name not in ("guidance", "llguidance", "xgrammar"):
        raise ValueError(f"unknown structured outputs backend {name!r}")
    try:
        if name in ("guidance", "llguidance"):
            from tokenmill.structured_output.llguidance_backend import LLGuidanceBackend

            return LLGuidanceBackend(tokenizer, vocab_size, eos_token_ids)
        from tokenmill.structured_output.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer, vocab_size, eos_token_ids)
    except ImportError as e:
        raise ValueError(f"structured outputs backend {name!r} is not installed ({e}); "
                         "pip install llguidance, or tokenmill[xgrammar]") from None


class StructuredOutputManager:
    def __init__(self, config: StructuredOutputsConfig, tokenizer: Any, vocab_size: int,
                 eos_token_ids: list[int]) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self._tokenizer, self._eos = tokenizer, list(eos_token_ids)
        self._backend: StructuredOutputBackend | None = None  # made on first use (~0.3 s)
        self._lock = threading.Lock()  # compile runs on request threads (server)
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._worker: ThreadPoolExecutor | None = None

    @property
    def backend(self) -> StructuredOutputBackend:
        if self._backend is None:
            self._backend = make_backend(self.config.backend, self._tokenizer,
                                         self.vocab_size, self._eos)
        return self._backend

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of a constraint (cached); ValueError if it is unusable."""
        key = (params.kind, params.spec)
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
            grammar = self.backend.compile(params)
            self._cache[key] = grammar
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
            return grammar

    def submit(self, sched: SchedulerOutput, grammars: dict[str, GrammarMatcher]
               ) -> GrammarOutput | None:
        """Start filling this step's bitmasks: for each scheduled request that samples and has
        a matcher in `grammars` that constrains its next token (or drafts to check), (1 +
        drafts, W) int32 rows, as the step's GrammarOutput. None if no request needs one."""
        jobs = [(r.req_id, m, list(r.spec_token_ids)) for r in sched.scheduled
                if r.sample and (m := grammars.get(r.req_id)) is not None
                and (r.spec_token_ids or m.constrains())]  # (a free row needs no mask)
        if not jobs:
            return None
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-bitmask")
        return GrammarOutput(self._worker.submit(fill_bitmasks, jobs,
                                                 bitmask_width(self.vocab_size)))

    @staticmethod
    def wait(grammar: GrammarOutput | None) -> None:
        """Block until a submitted fill is done (its errors surface where it is used)."""
        if grammar is not None:
            with contextlib.suppress(Exception):  # the runner already raised it
                grammar.masks()


def fill_bitmasks(jobs: list[tuple[str, GrammarMatcher, list[int]]],
                  width: int) -> dict[str, torch.Tensor]:
    """req_id → (1 + len(drafts), width) bitmask rows: row j allows what may follow the
    request's tokens plus its first j drafts. Rows past a draft the grammar refuses allow
    everything (they are never used: the refused draft is rejected at its own row)."""
    total = sum(1 + len(d) for _, _, d in jobs)
    bitmask = torch.full((total, width), -1, dtype=torch.int32)
    out: dict[str, torch.Tensor] = {}
    row = 0
    for req_id, matcher, drafts in jobs:
        matcher.fill_bitmask(bitmask, row)
        accepted = 0
        for j, d in enumerate(drafts[:matcher.validate(drafts)]):
            matcher.accept(d)
            accepted += 1
            if matcher.is_terminated():
                break
            matcher.fill_bitmask(bitmask, row + 1 + j)
        matcher.rollback(accepted)
        out[req_id] = bitmask[row:row + 1 + len(drafts)]
        row += 1 + len(drafts)
    return out
