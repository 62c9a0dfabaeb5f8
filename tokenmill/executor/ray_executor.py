"""RayExecutor: the ranks (tensor- and pipeline-parallel) as Ray actors (vLLM's
`--distributed-executor-backend ray`), placed by a placement group on a running Ray cluster,
one machine or several.

    ray start --head                       # on the first machine
    ray start --address=HEAD_IP:6379       # on each other machine
    tokenmill serve MODEL --tensor-parallel-size N --distributed-executor-backend ray

The engine connects to the cluster it finds ($RAY_ADDRESS, or one started on this machine; an
engine built after the caller's own `ray.init(...)` uses that), or, when there is none, starts
a local instance of its own, which it shuts down with itself. One bundle per rank ({"CPU": 1},
or {"GPU": 1} on CUDA), packed on as few machines as will hold them. Every rank runs the same
code as a multiprocess worker (worker/worker_proc.py: build_runner, execute_step); ranks on one
machine share the shared-memory all-reduce, ranks across machines all-reduce through gloo /
NCCL.

Resources, checked before asking for them (`_check_resources`):
- a local instance the engine starts itself declares as many CPUs as the ranks need when the
  machine has fewer: the ranks then share its cores, as the mp executor's processes do (the
  engine is the instance's only user, so nothing else is promised those CPUs);
- a cluster the engine joins is someone's declared capacity: with fewer CPUs (or GPUs) in all
  than ranks the engine fails at once naming what is missing, and when the cluster has them
  but others hold them it waits up to _WAIT_FOR_RESOURCES_S, then fails the same way.

A step is one `ray.put` of the pickled SchedulerOutput and one call per actor; a dead actor
fails the step at once (its call raises) and every actor is killed; `check_health` pings them
when the engine is idle.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import time
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.core.interface import GrammarOutput, SchedulerOutput
from tokenmill.executor.base import WorkerPoolExecutor

logger = logging.getLogger(__name__)
_START_TIMEOUT_S = 600.0  # the actors' start (model loading) once placed
_WAIT_FOR_RESOURCES_S = 60.0  # for a cluster's CPUs / GPUs that others hold
_PING_TIMEOUT_S = 10.0


class RayWorker:
    """One rank, as a Ray actor (created with ray.remote(RayWorker))."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.runner: Any = None

    def place(self) -> tuple[str, str]:
        """(node id, node IP) of the machine this actor runs on."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def create_segments(self, ranks: int, count: int) -> list[str]:
        from tokenmill.distributed import shm_all_reduce

        return [shm_all_reduce.create_segment(ranks) for _ in range(count)]

    def remove(self, paths: list[str]) -> None:
        for path in paths:
            os.unlink(path)

    def start(self, config: EngineConfig, init_method: str, shm_paths: list[str] | None,
              num_threads: int, local: bool) -> tuple[int, int, Any]:
        import torch

        from tokenmill.worker.worker_proc import build_runner, runner_facts

        if local:  # every rank on this machine: gloo over loopback
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        torch.set_num_threads(num_threads)
        self.runner = build_runner(self.rank, self.world_size, config, init_method, shm_paths)
        return runner_facts(self.runner)

    def execute(self, data: bytes, block_ops: bool) -> tuple[str, Any]:
        from tokenmill.worker.worker_proc import execute_step

        return execute_step(self.runner, *pickle.loads(data), block_ops)

    def ping(self) -> bool:
        return True


class RayExecutor(WorkerPoolExecutor):
    def __init__(self, config: EngineConfig) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.world_size = config.parallel.world_size
        self.tp_size = tp = config.parallel.tensor_parallel_size
        resource = "GPU" if config.device.startswith("cuda") else "CPU"
        self._owns_ray = _connect(self.world_size, resource)
        t0 = time.perf_counter()
        self._pg = placement_group([{resource: 1}] * self.world_size, strategy="PACK")
        try:
            _check_resources(self._pg, self.world_size, resource)
        except BaseException:
            self.shutdown()
            raise
        actor_cls = ray.remote(num_cpus=1 if resource == "CPU" else 0,
                               num_gpus=1 if resource == "GPU" else 0)(RayWorker)
        self.actors = [actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            self._pg, placement_group_bundle_index=rank)).remote(rank, self.world_size)
            for rank in range(self.world_size)]
        try:
            places = ray.get([a.place.remote() for a in self.actors], timeout=_START_TIMEOUT_S)
            local = len({node for node, _ in places}) == 1
            port = ray.get(self.actors[0].free_port.remote())
            init_method = f"tcp://{places[0][1]}:{port}"
            # one shared-memory all-reduce segment per pipeline stage's tensor-parallel group
            shm_paths = (ray.get(self.actors[0].create_segments.remote(
                tp, config.parallel.pipeline_parallel_size))
                if local and resource == "CPU" and tp > 1 else None)
            threads = max(1, (os.cpu_count() or 1) // self.world_size) if local else 1
            facts = self._get([a.start.remote(config, init_method, shm_paths, threads, local)
                               for a in self.actors], "start")
            if shm_paths is not None:  # every rank mapped them
                ray.get(self.actors[0].remove.remote(shm_paths))
        except BaseException:
            self.shutdown()
            raise
        self._adopt(facts)
        logger.info("%d Ray workers ready on %d node(s) in %.1f s", self.world_size,
                    len({node for node, _ in places}), time.perf_counter() - t0)

    def _get(self, refs: list[Any], what: str) -> list[Any]:
        """Every result, in rank order; the first failure (a dead actor, an exception) raised
        as soon as it happens, not after the slower ranks."""
        import ray

        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(ready[0])
            except ray.exceptions.RayActorError as e:
                self._fail(f"Ray worker rank {refs.index(ready[0])} died during {what}: {e}")
            except ray.exceptions.RayTaskError as e:
                if what == "start":
                    raise RuntimeError(f"Ray worker rank {refs.index(ready[0])} failed to "
                                       f"start:\n{e}") from None
                raise
        return ray.get(refs)

    def _send(self, sched: SchedulerOutput, grammar: GrammarOutput | None,
              block_ops: bool) -> list[Any]:
        import ray

        data = ray.put(pickle.dumps((sched, grammar), protocol=pickle.HIGHEST_PROTOCOL))
        return [a.execute.remote(data, block_ops) for a in self.actors]  # run in call order

    def _gather(self, handle: list[Any]) -> list[tuple[str, Any]]:
        return self._get(handle, "a step")

    def _stop(self) -> None:
        self.shutdown()

    def check_health(self) -> None:
        import ray

        if self._dead is None and not self._closed:
            try:
                ray.get([a.ping.remote() for a in self.actors], timeout=_PING_TIMEOUT_S)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                self._fail(f"a Ray worker is gone: {type(e).__name__}: {e}")
        self._raise_if_dead()

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if self._closed:
            return
        self._closed = True
        for a in getattr(self, "actors", []):
            ray.kill(a)
        remove_placement_group(self._pg)
        self._shutdown_ray()

    def _shutdown_ray(self) -> None:
        """The Ray instance the engine started goes with it (its processes with it)."""
        import ray

        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False


def _connect(ranks: int, resource: str) -> bool:
    """Join the caller's Ray, or a cluster found running, or else start a local instance that
    declares at least `ranks` CPUs; True when the engine started it."""
    import ray

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init()
        return False
    try:
        ray.init(address="auto")
        return False
    except ConnectionError:  # no cluster running: a local instance of our own
        pass
    cpus = os.cpu_count() or 1
    if resource == "CPU" and cpus < ranks:
        logger.info("starting a local Ray instance declaring %d CPUs for %d ranks on %d cores: "
                    "the ranks share the cores, as the mp executor's processes do", ranks,
                    ranks, cpus)
    ray.init(num_cpus=max(cpus, ranks) if resource == "CPU" else None)
    return True


def _check_resources(pg: Any, ranks: int, resource: str) -> None:
    """Fail at once when the cluster cannot hold the ranks' bundles at all, and within
    _WAIT_FOR_RESOURCES_S when others hold what it has; else return once placed."""
    import ray

    total = ray.cluster_resources().get(resource, 0)
    free = ray.available_resources().get(resource, 0)
    what = (f"{ranks} ranks (tensor x pipeline parallel) need {ranks} {resource}s, one per "
            f"rank")
    if total < ranks:
        raise ValueError(f"{what}; the Ray cluster has {total:g} {resource}s in all "
                         f"({free:g} free). Add nodes, ask for fewer ranks, or use "
                         "--distributed-executor-backend mp on one machine")
    try:
        ray.get(pg.ready(), timeout=_WAIT_FOR_RESOURCES_S)
    except ray.exceptions.GetTimeoutError:
        free = ray.available_resources().get(resource, 0)
        raise ValueError(f"{what}; the Ray cluster has {total:g} but only {free:g} free, "
                         f"held by others, after {_WAIT_FOR_RESOURCES_S:.0f} s") from None
