"""UniProcExecutor: the model runner in the engine's own process (tensor_parallel_size 1).

With async scheduling on CPU the runner is built and every step runs on the executor's step
thread (executor/base.py): there the forward pass is the host's own work, which overlaps the
engine's only from another thread, and the model's OpenMP work then always comes from that one
thread. Torch ops from a second thread start a second OpenMP pool, whose idle workers spin on
the cores the first one needs (measured on 2 cores: a decode step run from another thread than
the one that loaded the model took 2.5x as long).

On a GPU a launch returns once the step's work is queued (ModelRunner.launch), so the engine's
own thread launches step N+1 while the device runs N, as vLLM's engine core does: no second
thread, and no hand-offs of Python's lock between two busy threads, which cost up to its
switch interval (5 ms) each.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch

from tokenmill.config import EngineConfig
from tokenmill.core.interface import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from tokenmill.executor.base import Executor
from tokenmill.worker.model_runner import ModelRunner


class UniProcExecutor(Executor):
    # the devices whose async steps run on the step thread (module doc)
    STEP_THREAD_DEVICES = frozenset({"cpu"})

    def __init__(self, config: EngineConfig) -> None:
        self.on_step_thread = (config.scheduler.async_scheduling and
                               torch.device(config.device).type in self.STEP_THREAD_DEVICES)
        self.runner = (self._submit(ModelRunner, config).result() if self.on_step_thread
                       else ModelRunner(config))
        self.num_kv_blocks = self.runner.num_kv_blocks
        self.num_swap_blocks = self.runner.num_swap_blocks
        self.spec_costs = self.runner.spec_costs

    def execute(self, sched: SchedulerOutput, grammar: GrammarOutput | None = None,
                block_ops: bool = True) -> ModelRunnerOutput:
        if self.on_step_thread:
            return self._submit(self.runner.execute, sched, block_ops, grammar).result()
        return self.runner.execute(sched, block_ops, grammar)

    def sleep(self, level: int) -> None:
        self._on_runner_thread(self.runner.sleep, level)

    def wake_up(self) -> None:
        self._on_runner_thread(self.runner.wake_up)

    def _on_runner_thread(self, fn: Any, *args: Any, wait: bool = True) -> None:
        """fn on the thread the runner's torch work runs on (see the module doc); wait=False:
        without waiting for it there."""
        if self.on_step_thread:
            done = self._submit(fn, *args)
            if wait:
                done.result()
        else:
            fn(*args)

    def shutdown(self) -> None:
        """Finish the KV block files being written (the disk tier), so a restart finds them."""
        if self.runner.offload is not None:
            self.runner.offload.close()

    def launch_async(self, sched: SchedulerOutput, grammar: GrammarOutput | None = None
                     ) -> Future[Future[ModelRunnerOutput]]:
        if self.on_step_thread:
            return self._submit(self.runner.launch, sched, grammar)
        queued: Future[Future[ModelRunnerOutput]] = Future()
        queued.set_result(self.runner.launch(sched, grammar))  # returns once queued
        return queued

    def finish_in_flight(self) -> None:
        # the engine then waits on the step's output
        self._on_runner_thread(self.runner.finish_in_flight, wait=False)

    def execute_async(self, sched: SchedulerOutput, grammar: GrammarOutput | None = None
                      ) -> Future[ModelRunnerOutput]:
        # the runner's own execute: the base's would submit `execute`, which itself submits
        # to this same one thread and waits
        return self._submit(self.runner.execute, sched, True, grammar)
