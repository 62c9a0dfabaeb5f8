"""A CPU prefill step with glibc's malloc defaults and with freed memory kept for the next
step (utils/heap.py): wall time, page faults, system time, peak RSS; see
tokenmill/bench/step_memory.py.

    python benchmarks/step_memory.py [--model FILE] [--rounds 3] [--thread]
"""

from tokenmill.bench.step_memory import main

if __name__ == "__main__":
    raise SystemExit(main())
