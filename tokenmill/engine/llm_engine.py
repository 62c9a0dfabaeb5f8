"""LLMEngine: the step-level API. It owns the tokenizer, the scheduler and the model runner.

    engine.add_request(id, prompt, params)   # validates; ValueError names the bad field
    outputs = engine.step()                  # one scheduler iteration; outputs that moved
    engine.abort_request(id)                 # frees its blocks at once

One step is `schedule → execute → update_from_output`. A bad request is refused in
`add_request` and never reaches the scheduler, so it cannot disturb the others.
"""

from __future__ import annotations

import time
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import Scheduler
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.tokenizer import load_tokenizer
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.utils import cdiv
from tokenmill.worker.model_runner import ModelRunner


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.model)
        self.runner = ModelRunner(config)
        self.kv = KVCacheManager(self.runner.num_kv_blocks, config.cache.block_size)
        self.scheduler = Scheduler(config.scheduler, self.kv, config.model.max_model_len)
        eos = set(config.model.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = sorted(eos)
        self._prompts: dict[str, str | None] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}

    @classmethod
    def from_options(cls, model: str | None = None, **options: Any) -> LLMEngine:
        return cls(EngineConfig.create(model, **options))

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int] | dict[str, Any],
                    params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a prompt given as text, token ids, or {"prompt": …, "prompt_token_ids": …}."""
        params = params or SamplingParams()
        prompt_text, token_ids = self._split_prompt(prompt)
        max_tokens = self._validate(token_ids, params)
        request = Request(request_id, token_ids, params, self.eos_token_ids, max_tokens,
                          arrival_time)
        self.scheduler.add_request(request)
        self._prompts[request_id] = prompt_text
        self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, token_ids,
                                                         params.skip_special_tokens)

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
        max_tokens = params.max_tokens if params.max_tokens is not None else max_len - n
        if n + max_tokens > max_len:
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({max_tokens}) = "
                             f"{n + max_tokens} exceeds the context length "
                             f"max_model_len={max_len}")
        if max_tokens < 1:
            raise ValueError(f"prompt ({n} tokens) leaves no room to generate within "
                             f"max_model_len={max_len}")
        need = cdiv(n + max_tokens, self.kv.block_size)
        if need > self.kv.num_usable_blocks:
            raise ValueError(f"prompt + max_tokens = {n + max_tokens} tokens need {need} KV "
                             f"blocks but the cache has {self.kv.num_usable_blocks}; raise "
                             "kv_cache_memory or lower max_tokens")
        return max_tokens

    def abort_request(self, request_id: str) -> bool:
        """Abort a request (waiting or running); returns False if it was unknown or done."""
        self._prompts.pop(request_id, None)
        self._detok.pop(request_id, None)
        return self.scheduler.abort_request(request_id) is not None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- stepping ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched_out = self.scheduler.schedule()
        runner_out = self.runner.execute(sched_out)
        progressed = self.scheduler.update_from_output(sched_out, runner_out)
        return [self._make_output(r) for r in progressed]

    def _make_output(self, request: Request) -> RequestOutput:
        rid = request.request_id
        detok = self._detok[rid]
        detok.add_tokens(request.output_token_ids[detok.num_output_tokens:])
        finished = request.is_finished
        completion = CompletionOutput(
            index=0, text=detok.text, token_ids=list(request.output_token_ids),
            finish_reason=RequestStatus.finish_reason(request.status),
            stop_reason=request.stop_reason)
        out = RequestOutput(request_id=rid, prompt=self._prompts[rid],
                            prompt_token_ids=request.prompt_token_ids, outputs=[completion],
                            finished=finished,
                            metrics={"arrival_time": request.arrival_time,
                                     "now": time.monotonic(),
                                     "num_preemptions": request.num_preemptions})
        if finished:
            del self._prompts[rid], self._detok[rid]
        return out
