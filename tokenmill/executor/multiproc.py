"""MultiprocExecutor: one spawned process per rank on this machine (vLLM's "mp" backend).

Each step's `SchedulerOutput` is pickled once and sent to every rank over its pipe; every rank
executes it (their collectives pair up: shared memory and gloo on CPU, NCCL on CUDA) and
replies; the driver's (rank 0's) reply carries the sampled tokens. Waiting for replies also
watches the processes, so a rank that dies mid-step fails the step at once (`WorkerDiedError`)
instead of hanging.

Failure rules (`driver_output`, executor/base.py): a rank that dies, or fails while the driver
did not, is fatal: every worker is stopped and `WorkerDiedError` raised.

Workers are spawned (not forked: the engine process holds threads), so a script that builds an
engine with tensor_parallel_size > 1 needs the `if __name__ == "__main__":` guard, as in vLLM.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import pickle
import tempfile
import time
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from tokenmill.config import EngineConfig
from tokenmill.core.interface import GrammarOutput, SchedulerOutput
from tokenmill.distributed import shm_all_reduce
from tokenmill.executor.base import WorkerPoolExecutor
from tokenmill.worker.worker_proc import worker_main

logger = logging.getLogger(__name__)
_JOIN_TIMEOUT_S = 10.0


class MultiprocExecutor(WorkerPoolExecutor):
    def __init__(self, config: EngineConfig) -> None:
        self.world_size = config.parallel.world_size
        self.tp_size = tp = config.parallel.tensor_parallel_size
        self._tmp = tempfile.TemporaryDirectory(prefix="tokenmill-dist-")
        init_method = f"file://{os.path.join(self._tmp.name, 'rendezvous')}"
        # the cores are shared by every rank of every data-parallel replica
        threads = max(1, torch.get_num_threads()
                      // (self.world_size * config.parallel.data_parallel_size))
        ctx = mp.get_context("spawn")
        # gloo on loopback: the ranks of this executor all live on this machine
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        # CPU: the layers' all-reduces go through shared memory (distributed/shm_all_reduce.py),
        # one segment per pipeline stage's tensor-parallel group
        self._shm_paths = ([shm_all_reduce.create_segment(tp)
                            for _ in range(config.parallel.pipeline_parallel_size)]
                           if config.device == "cpu" and tp > 1 and shm_all_reduce.enabled()
                           else None)
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        t0 = time.perf_counter()
        for rank in range(self.world_size):
            ours, theirs = ctx.Pipe()
            p = ctx.Process(target=worker_main, name=f"tokenmill-worker-{rank}",
                            args=(rank, self.world_size, config, init_method, theirs, threads,
                                  logging.getLogger().getEffectiveLevel(), self._shm_paths),
                            daemon=True)
            p.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(p)
        try:
            facts = [self._reply(rank, "start") for rank in range(self.world_size)]
        except BaseException:
            self.shutdown()
            raise
        for path in self._shm_paths or []:  # every rank has mapped them: no file left
            os.unlink(path)                  # behind, however this process ends
        self._shm_paths = None
        self._adopt(facts)
        logger.info("%d worker processes ready (tensor parallel %d x pipeline parallel %d, "
                    "%d threads each) in %.1f s", self.world_size, tp,
                    config.parallel.pipeline_parallel_size, threads, time.perf_counter() - t0)

    def _reply(self, rank: int, what: str) -> Any:
        """Rank's start-up reply (its facts), or RuntimeError naming its failure."""
        conn, proc = self.conns[rank], self.procs[rank]
        ready = wait([conn, proc.sentinel])
        if conn in ready:
            kind, payload = conn.recv()
            if kind == "ready":
                return payload
            raise RuntimeError(f"worker rank {rank} failed to {what}:\n{payload}")
        raise RuntimeError(f"worker rank {rank} exited during {what} "
                           f"(exit code {proc.exitcode})")

    def _send(self, sched: SchedulerOutput, grammar: GrammarOutput | None,
              block_ops: bool) -> None:
        self.check_health()
        data = pickle.dumps(("execute", sched, grammar, block_ops),
                            protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self.conns:
                conn.send_bytes(data)
        except OSError as e:
            self._fail(f"a worker's pipe broke ({e})")

    def _gather(self, handle: None) -> list[tuple[str, Any]]:
        # each pipe's next reply answers the oldest step not yet gathered
        replies: list[tuple[str, Any] | None] = [None] * self.world_size
        pending = {conn: rank for rank, conn in enumerate(self.conns)}
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs)}
        while pending:
            ready = wait([*pending, *sentinels])
            for obj in ready:
                if obj in sentinels:
                    self._fail(self._exit_message(sentinels[obj]))
            for obj in ready:
                rank = pending.pop(obj)
                try:
                    replies[rank] = obj.recv()
                except (EOFError, OSError):  # it is exiting
                    self._fail(self._exit_message(rank))
        return replies  # type: ignore[return-value]

    def _exit_message(self, rank: int) -> str:
        p = self.procs[rank]
        p.join(timeout=_JOIN_TIMEOUT_S)  # it has exited or is exiting: its exit code
        return f"worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}"

    def _stop(self) -> None:
        self.shutdown(graceful=False)

    def check_health(self) -> None:
        if self._dead is None and not self._closed:
            for rank, p in enumerate(self.procs):
                if not p.is_alive():
                    self._fail(self._exit_message(rank))
        self._raise_if_dead()

    def shutdown(self, graceful: bool = True) -> None:
        """Stop every worker: asked to exit (graceful), or killed at once (after a failure,
        when the others may be waiting in a collective for the one that is gone)."""
        if self._closed:
            return
        self._closed = True
        if graceful:
            for conn in self.conns:
                with contextlib.suppress(OSError):
                    conn.send_bytes(pickle.dumps(("shutdown",)))
            deadline = time.monotonic() + _JOIN_TIMEOUT_S
            for p in self.procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():  # stuck in a collective whose peer is gone
                p.kill()
                p.join(timeout=_JOIN_TIMEOUT_S)
        for conn in self.conns:
            conn.close()
        self._tmp.cleanup()
        for path in self._shm_paths or []:
            with contextlib.suppress(OSError):
                os.unlink(path)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at exit multiprocessing may be torn down
            self.shutdown()

