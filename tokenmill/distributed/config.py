"""ParallelConfig: how many processes serve one model, and who places them (vLLM's flags).

    --tensor-parallel-size N            attention heads, MLP and vocabulary split over N ranks
    --pipeline-parallel-size M          the decoder layers split into M stages (each stage of
                                        N ranks); M steps in flight, one per stage
    --data-parallel-size D              D engine replicas behind one API server (the server
                                        only: engine/data_parallel.py); an engine built from
                                        this config is one replica
    --distributed-executor-backend B    "uni" (this process, size 1 only), "mp" (one spawned
                                        process per rank; the default above size 1 and with
                                        data parallelism), "ray" (Ray actors, on a Ray
                                        cluster's machines)

Validated at start-up against the model (config_factory.check_parallel): a size that cannot
split the heads, or a feature that does not run split yet, is a ValueError naming both.
"""

from __future__ import annotations

from dataclasses import dataclass

EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None: "uni" at size 1, else "mp"

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of "
                             f"{', '.join(EXECUTOR_BACKENDS)}, got {backend!r}")
        if backend == "uni" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one process; a world of "
                             f"{self.world_size} ranks needs 'mp' or 'ray'")
        if backend == "uni" and self.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 runs each replica's model in worker "
                             "processes: distributed_executor_backend 'mp' or 'ray'")
        if backend == "ray":
            import importlib.util

            if importlib.util.find_spec("ray") is None:
                raise ValueError("distributed_executor_backend='ray' needs Ray: "
                                 "pip install 'tokenmill[ray]'")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor_backend(self) -> str:
        """The backend that runs this config ("uni", "mp" or "ray")."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        # data parallelism: each replica's model in its own process, off the server's GIL
        return "uni" if self.world_size == 1 and self.data_parallel_size == 1 else "mp"
