"""LLMEngine: the step-level API. It owns the tokenizer, the scheduler and the model runner.

    engine.add_request(id, prompt, params)   # validates; ValueError names the bad field
    outputs = engine.step()                  # one scheduler iteration; outputs that moved
    engine.abort_request(id)                 # frees its blocks at once

One step is `schedule → execute → update_from_output`. A bad request is refused in
`add_request` and never reaches the scheduler, so it cannot disturb the others.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import Scheduler
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.tokenizer import load_tokenizer
from tokenmill.metrics.stats import SchedulerStats
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.utils import cdiv
from tokenmill.utils.profiling import scope
from tokenmill.worker.model_runner import ModelRunner


@dataclass(frozen=True)
class PreparedRequest:
    """A validated, tokenized request, ready for `LLMEngine.add_prepared`."""

    request_id: str
    prompt: str | None
    token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    arrival_time: float


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.model)
        self.runner = ModelRunner(config)
        self.kv = KVCacheManager(self.runner.num_kv_blocks, config.cache.block_size,
                                 enable_prefix_caching=config.cache.enable_prefix_caching,
                                 num_swap_blocks=self.runner.num_swap_blocks)
        self.scheduler = Scheduler(config.scheduler, self.kv, config.model.max_model_len)
        eos = set(config.model.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = sorted(eos)
        self.outputs = OutputProcessor(self.tokenizer)

    @classmethod
    def from_options(cls, model: str | None = None, **options: Any) -> LLMEngine:
        return cls(EngineConfig.create(model, **options))

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int] | dict[str, Any],
                    params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a prompt given as text, token ids, or {"prompt": …, "prompt_token_ids": …}.

        With n > 1 the request runs as n samples that share the prompt's KV blocks; sample i
        has seed `seed + i` when a seed is set (as in vLLM).
        """
        self.add_prepared(self.prepare_request(request_id, prompt, params, arrival_time))

    def prepare_request(self, request_id: str, prompt: str | list[int] | dict[str, Any],
                        params: SamplingParams | None = None,
                        arrival_time: float | None = None) -> PreparedRequest:
        """Tokenize and validate without touching the scheduler (safe off the engine thread)."""
        params = params or SamplingParams()
        prompt_text, token_ids = self._split_prompt(prompt)
        max_tokens = self._validate(token_ids, params)
        return PreparedRequest(request_id, prompt_text, token_ids, params, max_tokens,
                               time.monotonic() if arrival_time is None else arrival_time)

    def add_prepared(self, p: PreparedRequest) -> None:
        if p.request_id in self.outputs.parents:
            raise ValueError(f"request id {p.request_id!r} is already in use")
        children = [Request(self._child_id(p.request_id, i, p.params.n), p.token_ids,
                            self._child_params(p.params, i), self.eos_token_ids, p.max_tokens,
                            p.arrival_time) for i in range(p.params.n)]
        self.scheduler.add_request(children[0], children[1:])
        self.outputs.add(p.request_id, p.prompt, p.token_ids, children)

    @staticmethod
    def _child_id(request_id: str, index: int, n: int) -> str:
        return request_id if n == 1 else f"{index}_{request_id}"

    @staticmethod
    def _child_params(params: SamplingParams, index: int) -> SamplingParams:
        if params.n == 1:
            return params
        seed = None if params.seed is None else params.seed + index
        return dataclasses.replace(params, n=1, seed=seed)

    def _split_prompt(self, prompt: str | list[int] | dict[str, Any]
                      ) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
            if ids is None and not isinstance(text, str):
                raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
            return text, list(ids) if ids is not None else self.encode(text)
        if isinstance(prompt, str):
            return prompt, self.encode(prompt)
        if isinstance(prompt, list | tuple):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, "
                         f"got {type(prompt).__name__}")

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    def _validate(self, token_ids: list[int], params: SamplingParams) -> int:
        """The request's resolved max_tokens; ValueError for anything it cannot be served with."""
        max_len = self.config.model.max_model_len
        n = len(token_ids)
        if n == 0:
            raise ValueError("prompt is empty: it must have at least 1 token")
        vocab = self.config.model.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        bad_bias = [t for t in params.logit_bias if t >= vocab]
        if bad_bias:
            raise ValueError(f"logit_bias token ids must be < vocab size {vocab}, got {bad_bias}")
        # No max_tokens given: up to the context length, or as much as the KV cache can hold
        # for one request if that is less (a request must fit the cache to make progress).
        capacity = self.kv.num_usable_blocks * self.kv.block_size
        max_tokens = (params.max_tokens if params.max_tokens is not None
                      else min(max_len, capacity) - n)
        if n + max_tokens > max_len:
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({max_tokens}) = "
                             f"{n + max_tokens} exceeds the context length "
                             f"max_model_len={max_len}")
        if max_tokens < 1:
            raise ValueError(f"prompt ({n} tokens) leaves no room to generate within "
                             f"max_model_len={max_len} and a KV cache of {capacity} tokens")
        need = cdiv(n + max_tokens, self.kv.block_size)
        if need > self.kv.num_usable_blocks:
            raise ValueError(f"prompt + max_tokens = {n + max_tokens} tokens need {need} KV "
                             f"blocks but the cache has {self.kv.num_usable_blocks}; raise "
                             "kv_cache_memory or lower max_tokens")
        return max_tokens

    def abort_request(self, request_id: str) -> bool:
        """Abort a request (all its samples); returns False if it was unknown or done."""
        children = self.outputs.child_ids(request_id)
        self.outputs.remove(request_id)
        aborted = [self.scheduler.abort_request(cid) for cid in children]
        return any(r is not None for r in aborted)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prompt prefix; False (nothing done) while requests are running."""
        return self.kv.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> SchedulerStats:
        return SchedulerStats(num_running=self.scheduler.num_running,
                              num_waiting=self.scheduler.num_waiting,
                              kv_cache_usage=self.kv.usage,
                              num_preemptions=self.scheduler.num_preemptions,
                              prefix_cache_queries=self.kv.prefix_queries,
                              prefix_cache_hits=self.kv.prefix_hits,
                              num_prompt_tokens_computed=self.scheduler.num_prompt_tokens_computed)

    # ---- stepping ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        # profiler scopes name the parts of a step (benchmarks/profile_step.py)
        with scope("schedule"):
            sched_out = self.scheduler.schedule()
        runner_out = self.runner.execute(sched_out)
        with scope("process_outputs"):
            progressed = self.scheduler.update_from_output(sched_out, runner_out)
            outputs, stopped = self.outputs.process(progressed, runner_out)
        for rid in stopped:  # a stop string ended it: free its blocks now
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
        return outputs
