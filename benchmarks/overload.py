"""Overload run against `tokenmill serve`; see tokenmill/bench/overload.py.

    python benchmarks/overload.py                  # 1,000 simultaneous requests, bound 256
"""

from tokenmill.bench.overload import main

if __name__ == "__main__":
    raise SystemExit(main())
