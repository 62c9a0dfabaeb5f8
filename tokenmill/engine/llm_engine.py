"""LLMEngine: the step-level API. It owns the tokenizer, the scheduler and the model runner.

    engine.add_request(id, prompt, params)   # validates; ValueError names the bad field
    outputs = engine.step()                  # one scheduler iteration; outputs that moved
    engine.abort_request(id)                 # frees its blocks at once

One step is `schedule → execute → update_from_output`. A bad request is refused in
`add_request` (engine/request_intake.py validates it) and never reaches the scheduler, so it
cannot disturb the others. Async scheduling keeps one step in flight while the next is
scheduled; pipeline parallelism keeps one per stage, each of other requests.

Failure isolation (the second line of defence, behind validation): when executing a step raises,
each scheduled request is executed again alone. Those that succeed alone keep their tokens (the
step goes on without a gap); those that fail alone end with finish_reason "error" and the error
in `RequestOutput.error`, and their KV blocks are freed. Only a failure that is not tied to a
request is engine-wide and raises `EngineDeadError`: the KV block operations failing, every
request of a multi-request step failing alone, three consecutive steps in which every request
failed, or a worker process dying (multi-process executors). Because a failed forward pass may
leave garbage in blocks that were offered to the prefix cache, cache hits are suspended until
the engine is next idle, when the cache is reset.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections import deque
from concurrent.futures import Future
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.config_factory import resolve_device
from tokenmill.core.interface import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import Scheduler
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.request_intake import PreparedRequest, RequestIntake
from tokenmill.engine.tokenizer import load_tokenizer
from tokenmill.engine_args import EngineArgs
from tokenmill.executor import Executor, WorkerDiedError, make_executor
from tokenmill.kv_offload.manager import OffloadManager
from tokenmill.lora.registry import AdapterRegistry
from tokenmill.lora.request import LoRARequest
from tokenmill.metrics.stats import SchedulerStats, scheduler_stats
from tokenmill.outputs import RequestOutput
from tokenmill.reasoning.gate import ReasoningTokens
from tokenmill.sampling_params import SEED_MIN, SamplingParams
from tokenmill.structured_output.manager import StructuredOutputManager
from tokenmill.utils.cpp_extension import prebuild_cpu_extensions
from tokenmill.utils.gc_heap import freeze_startup_heap
from tokenmill.utils.profiling import scope
from tokenmill.worker.model_runner import KVBlockOpsError, ModelRunner

logger = logging.getLogger(__name__)
_MAX_ALL_FAILED_STEPS = 3


class EngineDeadError(RuntimeError):
    """The engine cannot go on: a failure not tied to any one request."""


class EngineSleepingError(RuntimeError):
    """A request arrived while the engine sleeps (sleep mode): it is refused, not queued."""


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.sleep_level = 0  # sleep mode: 0 awake, else the level it sleeps at
        self.tokenizer = load_tokenizer(config.model)
        self.executor: Executor = make_executor(config)  # the model runner(s)
        self.kv = KVCacheManager(self.executor.num_kv_blocks, config.cache.block_size,
                                 enable_prefix_caching=config.cache.enable_prefix_caching,
                                 num_swap_blocks=self.executor.num_swap_blocks,
                                 sliding_window=config.model.kv_sliding_window,
                                 offload=None if config.kv_offload is None else
                                 OffloadManager(config.kv_offload, config.cache.block_size))
        # pipeline parallelism: one step in flight per stage, each of other requests
        self._depth = config.parallel.pipeline_parallel_size
        self.scheduler = Scheduler(config.scheduler, self.kv, config.model.max_model_len,
                                   config.speculative, self.executor.spec_costs,
                                   jump_forward=config.structured_outputs.jump_forward,
                                   pipeline_depth=self._depth,
                                   max_loras=None if config.lora is None
                                   else config.lora.max_loras)
        eos = set(config.model.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = sorted(eos)
        self.structured = StructuredOutputManager(config.structured_outputs, self.tokenizer,
                                                  config.model.vocab_size, self.eos_token_ids)
        self.outputs = OutputProcessor(self.tokenizer)
        self.adapters = AdapterRegistry(config.model.hf_config, config.lora,
                                        config.model.hf_token)
        reasoning = None if config.reasoning is None else ReasoningTokens.of(
            config.reasoning, self.tokenizer, config.structured_outputs.enable_in_reasoning)
        self.intake = RequestIntake(config.model, self.tokenizer, self.kv, self.structured,
                                    config.runner, config.pooler_config, self.adapters,
                                    config.scheduler.scheduling_policy, reasoning)
        self._all_failed_steps = 0  # consecutive steps in which every request failed
        # steps sent and not yet applied, oldest first, with the Futures of their outputs'
        # Futures, set once the step's work is queued (async scheduling: the one the model is
        # running; pipeline parallelism: one per stage)
        self._in_flight: deque[tuple[SchedulerOutput, GrammarOutput | None,
                                     Future[Future[ModelRunnerOutput]]]] = deque()
        freeze_startup_heap()  # last: the engine's own objects are start-up heap too

    @property
    def runner(self) -> ModelRunner:
        """The model runner, when it runs in this process (tensor_parallel_size 1)."""
        runner = getattr(self.executor, "runner", None)
        if runner is None:
            raise AttributeError("the model runners live in worker processes "
                                 f"({type(self.executor).__name__})")
        return runner

    def check_health(self) -> None:
        """EngineDeadError if the engine can no longer run steps (a worker died)."""
        try:
            self.executor.check_health()
        except WorkerDiedError as e:
            raise _worker_died(e) from e

    def shutdown(self) -> None:
        """Finish the steps in flight; stop the worker processes, if any (idempotent)."""
        while self._in_flight:
            with contextlib.suppress(Exception):  # their requests are being dropped anyway
                output = self._in_flight.popleft()[2].result()
                self.executor.finish_in_flight()
                output.result()
        try:
            self._save_cached_blocks()
        except Exception as e:  # shutting down regardless
            logger.warning("the cached KV blocks were not saved to disk: %s", e)
        self.executor.shutdown()

    def _save_cached_blocks(self) -> None:
        """The disk tier keeps what the prefix cache holds (for the next process, or past a
        sleep), in one step of copies only; its report counted like any step's."""
        ops = self.kv.save_cached_blocks()
        if ops:
            out = self.executor.execute(SchedulerOutput(kv_offload=ops))
            self.kv.offload.apply(out.kv_offload)

    @classmethod
    def from_options(cls, model: str | None = None, **options: Any) -> LLMEngine:
        """An engine from `LLM`'s keywords (engine_args.py EngineArgs: vLLM's names)."""
        return cls.from_engine_args(EngineArgs.from_options(model, **options), offline=True)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, offline: bool = False) -> LLMEngine:
        """offline: for the offline LLM (its larger default steps on CUDA; a server's
        otherwise)."""
        if resolve_device(args.device).startswith("cpu"):
            # A first start compiles the kernels side by side while the model loads.
            prebuild_cpu_extensions()
        t0 = time.perf_counter()
        engine = cls(args.create_engine_config(offline))
        logger.info("engine ready in %.1f s", time.perf_counter() - t0)
        return engine

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int] | dict[str, Any],
                    params: SamplingParams | None = None,
                    arrival_time: float | None = None,
                    lora_request: LoRARequest | None = None, priority: int = 0) -> None:
        """Queue a prompt given as text, token ids, or {"prompt": …, "prompt_token_ids": …},
        with a LoRA adapter when `lora_request` names one; `priority`: lower is served first
        (scheduling_policy "priority" only).

        With n > 1 the request runs as n samples that share the prompt's KV blocks; sample i
        has seed `seed + i` when a seed is set (as in vLLM).
        """
        self.add_prepared(self.prepare_request(request_id, prompt, params, arrival_time,
                                               lora_request, priority))

    def prepare_request(self, request_id: str, prompt: str | list[int] | dict[str, Any],
                        params: SamplingParams | None = None,
                        arrival_time: float | None = None,
                        lora_request: LoRARequest | None = None, priority: int = 0
                        ) -> PreparedRequest:
        """Tokenize and validate without touching the scheduler (safe off the engine thread)."""
        return self.intake.prepare(request_id, prompt, params, arrival_time, lora_request,
                                   priority)

    def encode(self, text: str) -> list[int]:
        return self.intake.encode(text)

    def check_text_length(self, num_chars: int) -> None:
        self.intake.check_text_length(num_chars)

    def add_prepared(self, p: PreparedRequest) -> None:
        if self.sleep_level:
            raise EngineSleepingError("the engine is asleep (sleep mode): wake it first "
                                      "(POST /wake_up, LLM.wake_up)")
        if self.outputs.is_known(p.request_id):
            raise ValueError(f"request id {p.request_id!r} is already in use")
        if p.pooling is not None:  # an embedding request: one, sampling nothing
            request = Request(p.request_id, p.token_ids, p.params, self.eos_token_ids,
                              p.max_tokens, p.arrival_time, pooling_params=p.pooling,
                              priority=p.priority)
            self.scheduler.add_request(request)
            self.outputs.add_pooling(request)
            return
        children = [Request(self._child_id(p.request_id, i, p.params.n), p.token_ids,
                            self._child_params(p.params, i), self.eos_token_ids, p.max_tokens,
                            p.arrival_time, lora=p.lora, priority=p.priority)
                    for i in range(p.params.n)]
        for child in children:
            child.bad_words = p.bad_words
            if p.grammar is not None:
                child.grammar = p.grammar.matcher()
        self.scheduler.add_request(children[0], children[1:])
        self.outputs.add(p.request_id, p.prompt, p.token_ids, children)

    @staticmethod
    def _child_id(request_id: str, index: int, n: int) -> str:
        return request_id if n == 1 else f"{index}_{request_id}"

    @staticmethod
    def _child_params(params: SamplingParams, index: int) -> SamplingParams:
        if params.n == 1:
            return params
        seed = None if params.seed is None else _wrap_seed(params.seed + index)
        return dataclasses.replace(params, n=1, seed=seed)

    def abort_request(self, request_id: str) -> bool:
        """Abort a request (all its samples); returns False if it was unknown or done."""
        children = self.outputs.child_ids(request_id)
        self.outputs.remove(request_id)
        aborted = [self.scheduler.abort_request(cid) for cid in children]
        return any(r is not None for r in aborted)

    def finish_request(self, request_id: str, finish_reason: str = "abort",
                       error: str | None = None) -> RequestOutput | None:
        """Abort a request and return its final output (every running sample ends with
        `finish_reason`); None if it was unknown or done. For deadlines and shutdown."""
        out = self.outputs.final_output(request_id, finish_reason, error)
        self.abort_request(request_id)
        return out

    # ---- sleep mode -------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Release the KV cache and the weights while idle (vLLM's sleep mode; level 1: on CUDA
        the weights wait in host memory; level 2, and on CPU: they are read again on wake).
        The prefix cache is emptied (its KV is gone); the disk tier first keeps its blocks."""
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep mode is off: start the engine with enable_sleep_mode=True "
                             "(--enable-sleep-mode)")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self.sleep_level:
            return
        if self.has_unfinished_requests():
            raise ValueError(f"{self.scheduler.num_running + self.scheduler.num_waiting} "
                             "requests are in flight: sleep when the engine is idle")
        self._save_cached_blocks()
        self.kv.reset_prefix_cache()
        self.executor.sleep(level)
        self.sleep_level = level

    def wake_up(self) -> None:
        """Take the weights and the KV cache again (a no-op when awake)."""
        if self.sleep_level:
            self.executor.wake_up()
            self.sleep_level = 0

    @property
    def is_sleeping(self) -> bool:
        return self.sleep_level > 0

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prompt prefix; False (nothing done) while requests are running."""
        return self.kv.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        # a step in flight (async scheduling, pipeline parallelism) is one more step() to drain
        return bool(self._in_flight) or self.scheduler.has_unfinished_requests()

    def stats(self) -> SchedulerStats:
        return scheduler_stats(self.scheduler, self.kv)

    # ---- stepping ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration; raises EngineDeadError for a failure not tied to a request.

        With async scheduling, step N+1 is scheduled while the model runs step N, and runs
        while step N's outputs are applied and processed (see the module doc); with pipeline
        parallelism, steps go on being scheduled and sent until each stage has one."""
        if self.config.scheduler.async_scheduling:
            return self._step_async()
        if self._depth > 1:
            return self._step_pipelined()
        sched_out, grammar = self._schedule()
        return self._apply(sched_out, *self._run(sched_out, grammar))

    def _step_async(self) -> list[RequestOutput]:
        if not self._in_flight:
            self._in_flight.append(self._launch(*self._schedule()))
        sched_out, grammar, queued = self._in_flight.popleft()
        next_out, next_grammar = self._schedule()  # meanwhile the model runs sched_out
        output = queued.result()  # sched_out's work is queued, or it failed
        # NOTE: sent before sched_out's tokens are back only if it did not fail before its
        # work was queued: a failed step's requests are re-executed first
        ahead = not next_out.is_noop and not (output.done() and output.exception())
        if ahead:  # its inputs are prepared while the device runs sched_out
            self._in_flight.append(self._launch(next_out, next_grammar))
        else:
            self.executor.finish_in_flight()
        runner_out, failed = self._run(sched_out, grammar, output)
        if not ahead and not next_out.is_noop:
            self._in_flight.append(self._launch(next_out, next_grammar))
        return self._apply(sched_out, runner_out, failed)

    def _launch(self, sched_out: SchedulerOutput, grammar: GrammarOutput | None
                ) -> tuple[SchedulerOutput, GrammarOutput | None,
                           Future[Future[ModelRunnerOutput]]]:
        return sched_out, grammar, self.executor.launch_async(sched_out, grammar)

    def _step_pipelined(self) -> list[RequestOutput]:
        """Fill the pipeline (up to one step per stage, each of requests with no step in
        flight: the scheduler skips those), then apply the oldest step's outputs."""
        while len(self._in_flight) < self._depth:
            sched_out, grammar = self._schedule()
            if sched_out.is_noop and self._in_flight:
                break  # nothing new to start: wait for the oldest
            self._in_flight.append(self._launch(sched_out, grammar))
        sched_out, grammar, queued = self._in_flight.popleft()
        return self._apply(sched_out, *self._run(sched_out, grammar, queued.result()))

    def _schedule(self) -> tuple[SchedulerOutput, GrammarOutput | None]:
        """The next step, and its grammar bitmasks (being filled) beside it."""
        # profiler scopes name the parts of a step (benchmarks/profile_step.py)
        with scope("schedule"):
            sched_out = self.scheduler.schedule()
            grammar = self.structured.submit(sched_out, {
                r.req_id: g for r in sched_out.scheduled
                if (g := self.scheduler.requests[r.req_id].grammar) is not None})
        return sched_out, grammar

    def _run(self, sched_out: SchedulerOutput, grammar: GrammarOutput | None,
             future: Future[ModelRunnerOutput] | None = None
             ) -> tuple[ModelRunnerOutput, list[RequestOutput]]:
        """The step's output (executed now, or awaited from `future`) and the final outputs of
        the requests it failed: a failed step's requests are re-executed one by one (module
        doc)."""
        failed: list[RequestOutput] = []
        try:
            runner_out = (self.executor.execute(sched_out, grammar) if future is None
                          else future.result())
            self._all_failed_steps = 0
        except KVBlockOpsError as e:
            raise EngineDeadError(f"KV cache block operations failed: {e}") from e
        except WorkerDiedError as e:
            raise _worker_died(e) from e
        except Exception as e:
            runner_out = self._isolate_failure(sched_out, grammar, e, failed)
        finally:  # the matchers are the worker thread's until their masks are filled
            self.structured.wait(grammar)
        return runner_out, failed

    def _apply(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput,
               failed: list[RequestOutput]) -> list[RequestOutput]:
        """The step's tokens into the scheduler and the requests' outputs (`failed`: those
        the step ended with an error)."""
        with scope("process_outputs"):
            progressed = self.scheduler.update_from_output(sched_out, runner_out)
            outputs, stopped = self.outputs.process(progressed, runner_out)
        for rid in stopped:  # a stop string ended it: free its blocks now
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
        if self.kv.prefix_cache_suspended and not self.has_unfinished_requests():
            self.kv.reset_prefix_cache()
        return outputs + failed

    def _isolate_failure(self, sched_out: SchedulerOutput, grammar: GrammarOutput | None,
                         error: Exception, failed: list[RequestOutput]) -> ModelRunnerOutput:
        """Execute each request of a failed step alone: keep what succeeds, end what fails
        (its final output goes to `failed`). The step's block copies and swaps were done."""
        logger.warning("a step of %d requests failed (%s: %s); executing them one by one",
                       len(sched_out.scheduled), type(error).__name__, error)
        merged = ModelRunnerOutput([r.req_id for r in sched_out.scheduled],
                                   [[] for _ in sched_out.scheduled])
        culprits: dict[str, Exception] = {}
        # requests that ended since the step was scheduled (async scheduling: a culprit of
        # the step before) are neither re-executed nor counted
        live = [i for i, r in enumerate(sched_out.scheduled) if r.req_id in self.scheduler.requests]
        for i in live:
            r = sched_out.scheduled[i]
            try:
                out = self.executor.execute(sched_out.for_request(i), grammar,
                                            block_ops=False)
            except WorkerDiedError as e:
                raise _worker_died(e) from e
            except Exception as e:
                culprits[r.req_id] = e
                continue
            merged.sampled_token_ids[i] = out.sampled_token_ids[0]
            merged.logprobs.update(out.logprobs)
            merged.prompt_logprobs.update(out.prompt_logprobs)
            merged.pooled.update(out.pooled)
            merged.kv_offload = merged.kv_offload or out.kv_offload  # reported once
        if not live:
            return merged
        everyone = len(culprits) == len(live)
        self._all_failed_steps = self._all_failed_steps + 1 if everyone else 0
        if everyone and (len(culprits) > 1 or self._all_failed_steps >= _MAX_ALL_FAILED_STEPS):
            raise EngineDeadError(f"every request of a step failed: {error}") from error
        self.kv.suspend_prefix_cache()
        for req_id, e in culprits.items():
            parent = self.outputs.parent_id(req_id)
            logger.error("request %s failed in the engine: %s: %s", parent, type(e).__name__, e)
            out = self.finish_request(parent, "error", f"{type(e).__name__}: {e}")
            if out is not None:
                failed.append(out)
        return merged


def _worker_died(error: WorkerDiedError) -> EngineDeadError:
    return EngineDeadError(f"a worker died: {error}")


def _wrap_seed(seed: int) -> int:
    """A seed reduced into the signed 64-bit range (sample i of a request seeds with seed + i)."""
    return (seed - SEED_MIN) % 2**64 + SEED_MIN
