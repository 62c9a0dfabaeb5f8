"""Executors: where a step's model runners live (executor/base.py)."""

from __future__ import annotations

from tokenmill.config import EngineConfig
from tokenmill.executor.base import Executor, WorkerDiedError

__all__ = ["Executor", "WorkerDiedError", "make_executor"]


def make_executor(config: EngineConfig) -> Executor:
    backend = config.parallel.executor_backend
    if backend == "uni":
        from tokenmill.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config)
    if backend == "ray":
        from tokenmill.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    from tokenmill.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config)
