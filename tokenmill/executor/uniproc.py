"""UniProcExecutor: the model runner in the engine's own process (tensor_parallel_size 1)."""

from __future__ import annotations

from tokenmill.config import EngineConfig
from tokenmill.core.interface import ModelRunnerOutput, SchedulerOutput
from tokenmill.executor.base import Executor
from tokenmill.worker.model_runner import ModelRunner


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        self.runner = ModelRunner(config)
        self.num_kv_blocks = self.runner.num_kv_blocks
        self.num_swap_blocks = self.runner.num_swap_blocks
        self.spec_costs = self.runner.spec_costs

    def execute(self, sched: SchedulerOutput, block_ops: bool = True) -> ModelRunnerOutput:
        return self.runner.execute(sched, block_ops)
