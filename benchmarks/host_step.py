"""The engine's host work in one step, without a model, ms: the scheduler's step (schedule() and
update_from_output() with one sampled token per request), the step's input tensors
(attention/input_batch.py InputBatch.build) and its attention metadata (each backend's
build_metadata: the CPU kernel's and the Triton kernel's, the latter in Triton's interpreter
mode, which changes nothing of the host work).

    python benchmarks/host_step.py                        # this tree
    python benchmarks/host_step.py --trees /tmp/before .  # two checkouts, rounds alternated

Synthetic steps of the shapes a GPU serves: decode batches of 1 to 1,024 sequences with
contexts of 300-900 tokens (block tables of ~20-57 blocks), and a prefill step of 16 prompts of
1,024 tokens. Seeded, one thread, median of 30 builds each. The work is the engine's host work
whatever the device (on CUDA the same tensors are then copied in one transfer).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any


def cases() -> dict[str, list]:
    from tokenmill.core.interface import ScheduledRequest
    from tokenmill.sampling_params import SamplingParams

    sp, rng = SamplingParams(), random.Random(0)

    def decode(batch: int) -> list:
        reqs = []
        for i in range(batch):
            context = rng.randrange(300, 900)
            blocks = [rng.randrange(1, 90_000) for _ in range(context // 16 + 1)]
            reqs.append(ScheduledRequest(str(i), [rng.randrange(40_000)], context, blocks,
                                         True, sp))
        return reqs

    prefill = [ScheduledRequest(str(i), [rng.randrange(40_000) for _ in range(1024)], 0,
                                [rng.randrange(1, 90_000) for _ in range(64)], True, sp)
               for i in range(16)]
    return {**{f"decode {b}": decode(b) for b in (1, 64, 256, 1024)},
            "prefill 16 x 1024": prefill}


def _median_ms(fn: Any) -> float:
    fn()
    times = []
    for _ in range(30):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def scheduler_step_ms(batch: int) -> float:
    """schedule() + update_from_output() for `batch` requests decoding at contexts of
    300-900 tokens (prefix caching on, a 16-token block), median over 30 steps."""
    from tokenmill.config import SchedulerConfig
    from tokenmill.core.interface import ModelRunnerOutput
    from tokenmill.core.kv_cache_manager import KVCacheManager
    from tokenmill.core.request import Request
    from tokenmill.core.scheduler import Scheduler
    from tokenmill.sampling_params import SamplingParams

    rng = random.Random(0)
    kv = KVCacheManager(batch * 64, 16, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=1 << 20, max_num_seqs=batch),
                      kv, max_model_len=4096)
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(100, 40_000) for _ in range(rng.randrange(300, 900))]
        sched.add_request(Request(str(i), prompt, params, [2], 1000))

    def step() -> None:
        out = sched.schedule()
        sched.update_from_output(out, ModelRunnerOutput(
            [r.req_id for r in out.scheduled],
            [[rng.randrange(100, 40_000)] if r.sample else [] for r in out.scheduled]))

    step()  # the prompts
    return _median_ms(step)


def measure() -> dict[str, float]:
    os.environ["TRITON_INTERPRET"] = "1"  # the Triton backend on CPU tensors
    import torch

    from tokenmill.attention.input_batch import InputBatch
    from tokenmill.attention.registry import get_attention_backend

    torch.set_num_threads(1)
    cpu, out = torch.device("cpu"), {}
    backends = {name: get_attention_backend(name, 16, cpu, max_model_len=4096)
                for name in ("cpu", "triton")}
    for batch in (64, 256, 1024):
        out[f"decode {batch}: scheduler"] = scheduler_step_ms(batch)
    for name, reqs in cases().items():
        out[f"{name}: inputs"] = _median_ms(lambda r=reqs: InputBatch.build(r, 16, cpu))
        batch = InputBatch.build(reqs, 16, cpu)
        for backend_name, backend in backends.items():
            out[f"{name}: {backend_name} metadata"] = _median_ms(
                lambda b=backend, x=batch: b.build_metadata(x))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs="*", default=[], help="checkouts to compare")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:  # the working directory's tree first, as `python -m` would have it
        sys.path.insert(0, os.getcwd())
        return print(json.dumps(measure()))
    from tokenmill.bench.machine import describe_machine

    print(describe_machine())
    trees = args.trees or [str(Path(__file__).resolve().parents[1])]
    got: dict[tuple[str, str], list[float]] = defaultdict(list)
    for _ in range(args.rounds):
        for tree in trees:  # each in its own process, that tree's package imported
            res = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--measure"],
                                 cwd=tree, check=True, capture_output=True, text=True)
            for name, ms in json.loads(res.stdout.strip().splitlines()[-1]).items():
                got[(tree, name)].append(ms)
    names = list(dict.fromkeys(name for _, name in got))
    print(f"ms per build (median of 30; medians over {args.rounds} alternated rounds)")
    print(f"{'step: part':<36}" + "".join(f"{t[-24:]:>26}" for t in trees))
    for name in names:
        print(f"{name:<36}" + "".join(f"{statistics.median(got[(t, name)]):>26.3f}"
                                      for t in trees))


if __name__ == "__main__":
    main()
