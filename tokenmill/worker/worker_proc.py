"""The main loop of one worker process of the multiprocess executor (executor/multiproc.py).

A worker joins the process group (gloo on CPU, NCCL on CUDA), maps the shared-memory
all-reduce segment (CPU), builds a ModelRunner over its tensor-parallel shard, reports
("ready", facts) or ("error", traceback), then serves messages from the engine on its pipe,
each a pickled tuple:

    ("execute", SchedulerOutput, GrammarOutput | None, block_ops)
                                             → ("ok", ModelRunnerOutput | None)  (driver: its
                                                output; other ranks: None), ("kv_error", why),
                                                ("error", why) or ("peer_failed", why)
                                                (another rank failed the step first: an
                                                earlier pipeline stage, or the driver
                                                whose sampled tokens this rank awaited)
    ("shutdown",)                            → the process exits

It exits when the engine's end of the pipe closes (the engine process is gone) and, on Linux,
when its parent dies (PR_SET_PDEATHSIG): no orphan is left either way.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import logging
import os
import pickle
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch

from tokenmill.utils.gc_heap import freeze_startup_heap

# A collective whose peer never arrives (a rank stuck or desynchronised) fails after this long
# instead of hanging the engine forever.
COLLECTIVE_TIMEOUT_S = 120


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):  # PR_SET_PDEATHSIG = 1
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


def build_runner(rank: int, world_size: int, config: Any, init_method: str,
                 shm_paths: list[str] | None) -> Any:
    """Join the process group, make the stages' tensor-parallel groups, map this stage's
    all-reduce segment (`shm_paths`: one per pipeline stage), build this rank's ModelRunner
    (shared by the pipe loop below and the Ray actor, executor/ray_executor.py)."""
    from tokenmill.distributed import ParallelState
    from tokenmill.distributed.shm_all_reduce import ShmAllReduce
    from tokenmill.worker.model_runner import ModelRunner

    cuda = config.device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    torch.distributed.init_process_group(
        "nccl" if cuda else "gloo", init_method=init_method, rank=rank,
        world_size=world_size, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    tp, pp = config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size
    pp_rank, tp_rank = divmod(rank, tp)  # stage-major (distributed/parallel_state.py)
    group = None  # one stage: its tensor-parallel group is the world
    if pp > 1:  # every rank makes every group, in the same order (torch.distributed's rule)
        group = [torch.distributed.new_group(list(range(s * tp, (s + 1) * tp)))
                 for s in range(pp)][pp_rank]
    comm = (None if shm_paths is None
            else ShmAllReduce(shm_paths[pp_rank], tp_rank, tp, group=group))
    return ModelRunner(config, ParallelState(tp_rank, tp, comm, pp_rank, pp, group))


def runner_facts(runner: Any) -> tuple[int, int, Any]:
    """What the engine sizes itself by: KV blocks, swap blocks, speculative costs."""
    return runner.num_kv_blocks, runner.num_swap_blocks, runner.spec_costs


def execute_step(runner: Any, sched: Any, grammar: Any, block_ops: bool) -> tuple[str, Any]:
    """One step's reply (see the module doc)."""
    from tokenmill.distributed import PeerFailed
    from tokenmill.worker.model_runner import KVBlockOpsError

    try:
        out = runner.execute(sched, block_ops, grammar)
        return ("ok", out if runner.is_driver else None)
    except KVBlockOpsError as e:
        return ("kv_error", str(e))
    except PeerFailed as e:  # the rank that failed first names the error
        return ("peer_failed", str(e))
    except Exception as e:  # the engine decides: one request's failure, or a dead rank
        return ("error", f"{type(e).__name__}: {e}")


def worker_main(rank: int, world_size: int, config: Any, init_method: str, conn: Connection,
                num_threads: int, log_level: int, shm_paths: list[str] | None) -> None:
    _die_with_parent()
    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s")
    torch.set_num_threads(num_threads)
    try:
        runner = build_runner(rank, world_size, config, init_method, shm_paths)
        freeze_startup_heap()
        conn.send(("ready", runner_facts(runner)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            os._exit(0)  # the engine is gone: nothing left to serve
        if msg[0] == "shutdown":
            break
        conn.send(execute_step(runner, *msg[1:]))
    torch.distributed.destroy_process_group()
