"""The shared-memory all-reduce (csrc/shm_all_reduce.h, distributed/shm_all_reduce.py) between
spawned processes: exact sums (every rank the same bits) for empty, small, multi-chunk and
strided tensors; many calls in a row (the double buffer); a missing peer raises instead of
hanging."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

from tokenmill.distributed import shm_all_reduce as shm
from tokenmill.layers import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.ops_available(), reason="C++ kernels not built")
SIZES = (0, 5, 576, 64 * 576, 100_000)  # slots of 64 KiB: the last two take several chunks
SLOT = 1 << 16


def _rank_main(rank: int, world: int, path: str, q: mp.Queue) -> None:
    torch.set_num_threads(1)
    comm = shm.ShmAllReduce(path, rank, world, slot_bytes=SLOT)
    out = []
    for n in SIZES:
        x = torch.arange(n, dtype=torch.float32) * (rank + 1) + rank
        out.append(comm.all_reduce(x))
    strided = torch.ones(8, 6)[:, ::2] * (rank + 1)
    comm.all_reduce(strided)
    out.append(strided.clone())
    g = torch.Generator().manual_seed(rank)
    noisy = [comm.all_reduce(torch.randn(3, 7, generator=g)) for _ in range(500)]
    # as numpy: torch tensors would cross the queue as shared memory of an exiting process
    q.put((rank, [t.numpy() for t in out], [t.numpy() for t in noisy]))


def _run(world: int) -> dict[int, tuple]:
    ctx = mp.get_context("spawn")
    path = shm.create_segment(world, SLOT)
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, path, q)) for r in range(world)]
    try:
        for p in procs:
            p.start()
        results = {}
        for _ in procs:
            rank, out, noisy = q.get(timeout=120)
            results[rank] = ([torch.from_numpy(a) for a in out],
                             [torch.from_numpy(a) for a in noisy])
        for p in procs:
            p.join(timeout=30)
        return results
    finally:
        os.unlink(path)


@pytest.mark.parametrize("world", [2, 3])
def test_sums_are_exact_and_identical_on_every_rank(world):
    results = _run(world)
    total = sum(r + 1 for r in range(world))
    for i, n in enumerate(SIZES):
        ref = torch.arange(n, dtype=torch.float32) * total + sum(range(world))
        for r in range(world):
            assert torch.equal(results[r][0][i], ref), (n, r)
    for r in range(world):
        assert torch.equal(results[r][0][-1], torch.full((8, 3), float(total)))
    # random values: the ranks' sum in rank order, the same bits on every rank
    gens = [torch.Generator().manual_seed(r) for r in range(world)]
    for step in range(500):
        parts = [torch.randn(3, 7, generator=g) for g in gens]
        ref = parts[0].clone()
        for p in parts[1:]:
            ref += p
        for r in range(world):
            assert torch.equal(results[r][1][step], ref), (step, r)


def test_a_missing_peer_raises(monkeypatch):
    monkeypatch.setattr(shm, "TIMEOUT_S", 0.2)
    path = shm.create_segment(2, SLOT)
    try:
        comm = shm.ShmAllReduce(path, 0, 2, slot_bytes=SLOT)
        with pytest.raises(RuntimeError, match="rank 1 did not arrive within 0.2 s"):
            comm.all_reduce(torch.ones(4))
    finally:
        os.unlink(path)
