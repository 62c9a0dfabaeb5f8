"""Executor: runs each step on the model runners of one engine, wherever they live.

The engine talks only to this interface: `execute(sched, grammar)` returns the driver
rank's `ModelRunnerOutput` (`grammar`: the step's GrammarOutput beside it, or None);
`num_kv_blocks` / `num_swap_blocks` / `spec_costs` are what the runners measured at start-up
(the engine sizes its KV cache manager and scheduler by them); `check_health()` raises
`WorkerDiedError` once a worker is gone; `shutdown()` leaves no process behind.
`execute_async(sched, grammar)` starts a step and returns its output's Future (async
scheduling and pipeline parallelism: the engine schedules the next step meanwhile; the
model's kernels release the GIL); `launch_async` also says when the step's work is queued
(in process, before its tokens are back: the next step is prepared meanwhile);
`_submit` runs work on the executor's one step thread.

    uni        the runner in this process (executor/uniproc.py)
    mp         one spawned process per rank, torch.distributed between them
               (executor/multiproc.py)
    ray        one Ray actor per rank, on a Ray cluster's machines (executor/ray_executor.py)

The two with workers elsewhere share `WorkerPoolExecutor`: what the ranks report at start-up,
the step as it crosses to them, the one rule for a failed step (`driver_output`) and the
failed state.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NoReturn, TypeVar

from tokenmill.core.interface import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from tokenmill.spec_decode.policy import SpecCosts

T = TypeVar("T")
logger = logging.getLogger(__name__)


class WorkerDiedError(RuntimeError):
    """A worker process ended or failed: the engine cannot go on."""


def driver_output(replies: list[tuple[str, Any]], tp_size: int = 1) -> ModelRunnerOutput:
    """The driver's output from every rank's reply to a step (worker_proc.py); the driver is
    the last pipeline stage's first rank (ranks are stage-major, `tp_size` per stage).

    A step's failure is raised for the engine to isolate (RuntimeError, or KVBlockOpsError for
    the block copies) when every rank that failed gave the same reason and those ranks are the
    driver alone (sampling) or whole pipeline stages (the same inputs fail the same way on
    every rank of a stage; the ranks that could not go on without them reply "peer_failed").
    Anything else, a rank failing while the rest of its stage did not, is fatal: its
    collectives may be out of step with the others' (WorkerDiedError)."""
    from tokenmill.worker.model_runner import KVBlockOpsError

    driver = len(replies) - tp_size
    failed = {rank: why for rank, (kind, why) in enumerate(replies)
              if kind in ("error", "kv_error")}
    if not failed and replies[driver][0] == "ok":
        return replies[driver][1]
    stages = {rank // tp_size for rank in failed}
    whole_stages = set(failed) == {r for s in stages for r in range(s * tp_size,
                                                                      (s + 1) * tp_size)}
    if len(set(failed.values())) != 1 or not (whole_stages or set(failed) == {driver}):
        raise WorkerDiedError("; ".join(f"rank {r}: {kind}: {why}"
                                        for r, (kind, why) in enumerate(replies) if kind != "ok"))
    why = next(iter(failed.values()))
    if any(replies[rank][0] == "kv_error" for rank in failed):
        raise KVBlockOpsError(why)
    raise RuntimeError(why)


class Executor(ABC):
    num_kv_blocks: int
    num_swap_blocks: int
    spec_costs: SpecCosts | None

    _step_thread: ThreadPoolExecutor | None = None

    @abstractmethod
    def execute(self, sched: SchedulerOutput, grammar: GrammarOutput | None = None,
                block_ops: bool = True) -> ModelRunnerOutput:
        """Run one step (ModelRunner.execute's contract) on every rank; the driver's output."""

    @abstractmethod
    def execute_async(self, sched: SchedulerOutput, grammar: GrammarOutput | None = None
                      ) -> Future[ModelRunnerOutput]:
        """Start one step; its output's Future. Steps complete in the order started (one at a
        time on the runner's step thread in process; through the stages of a worker pool)."""

    def launch_async(self, sched: SchedulerOutput, grammar: GrammarOutput | None = None
                     ) -> Future[Future[ModelRunnerOutput]]:
        """Start one step (async scheduling); a Future set once the step's work is queued,
        holding its output's Future: the engine then sends the next step, whose inputs the
        runner prepares while this one runs (worker/in_flight.py). Here: set once the
        output is back (workers elsewhere run a step to its end)."""
        output = self.execute_async(sched, grammar)
        queued: Future[Future[ModelRunnerOutput]] = Future()
        output.add_done_callback(lambda _: queued.set_result(output))
        return queued

    def finish_in_flight(self) -> None:  # noqa: B027 (workers elsewhere leave none)
        """Bring a step launched ahead of the next to its end: no next step is coming."""

    def _submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """fn(*args) on the executor's one step thread."""
        if self._step_thread is None:
            self._step_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-step")
        return self._step_thread.submit(fn, *args)

    def sleep(self, level: int) -> None:
        """Sleep mode (worker/sleep_mode.py) on every rank."""
        raise NotImplementedError(f"sleep mode does not run with {type(self).__name__} yet "
                                  "(tensor_parallel_size 1 and pipeline_parallel_size 1 only)")

    def wake_up(self) -> None:
        raise NotImplementedError(f"sleep mode does not run with {type(self).__name__} yet")

    def check_health(self) -> None:  # noqa: B027 (in-process: nothing can die apart)
        """Raise WorkerDiedError if the executor can no longer run steps."""

    def shutdown(self) -> None:  # noqa: B027
        """Stop every worker; idempotent."""


class WorkerPoolExecutor(Executor):
    """An executor whose ranks live in other processes (mp, ray).

    A step is sent to every rank at once (`_send`) and its replies are collected on the step
    thread, steps in the order sent (`_gather`): with pipeline parallelism several steps are
    in flight, each stage working on a different one, and `execute` waits behind them."""

    world_size: int
    tp_size: int
    _dead: str | None = None  # why it can no longer run steps
    _closed: bool = False

    @abstractmethod
    def _stop(self) -> None:
        """Stop every worker now (the others may wait in a collective for a dead one)."""

    @abstractmethod
    def _send(self, sched: SchedulerOutput, grammar: GrammarOutput | None,
              block_ops: bool) -> Any:
        """Send a step to every rank; a handle for `_gather`."""

    @abstractmethod
    def _gather(self, handle: Any) -> list[tuple[str, Any]]:
        """Every rank's reply to the step sent as `handle` (the oldest not yet gathered);
        WorkerDiedError when a rank dies first."""

    def execute(self, sched: SchedulerOutput, grammar: GrammarOutput | None = None,
                block_ops: bool = True) -> ModelRunnerOutput:
        return self.execute_async(sched, grammar, block_ops).result()

    def execute_async(self, sched: SchedulerOutput, grammar: GrammarOutput | None = None,
                      block_ops: bool = True) -> Future[ModelRunnerOutput]:
        self._raise_if_dead()
        # a Future of grammar bitmasks does not cross processes: its masks are waited for
        handle = self._send(sched, grammar and grammar.resolved(), block_ops)
        return self._submit(self._collect, handle)

    def _collect(self, handle: Any) -> ModelRunnerOutput:
        return self._output(self._gather(handle))

    def _adopt(self, facts: list[tuple[int, int, SpecCosts | None]]) -> None:
        """What the ranks measured at start-up (worker_proc.runner_facts), one per rank."""
        self.num_kv_blocks = min(f[0] for f in facts)
        self.num_swap_blocks = min(f[1] for f in facts)
        self.spec_costs = facts[0][2]

    def _output(self, replies: list[tuple[str, Any]]) -> ModelRunnerOutput:
        """The step's output (driver_output), every worker stopped when a rank failed alone."""
        try:
            return driver_output(replies, self.tp_size)
        except WorkerDiedError as e:
            self._fail(str(e))

    def _fail(self, why: str) -> NoReturn:
        self._dead = why
        logger.error("executor failed: %s; stopping every worker", why)
        self._stop()
        raise WorkerDiedError(why)

    def _raise_if_dead(self) -> None:
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
