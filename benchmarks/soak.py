"""Soak test of the server; see tokenmill/bench/soak.py.

    python benchmarks/soak.py                      # 10,000 requests on SmolLM2, concurrency 32
    python benchmarks/soak.py --requests 2000 --concurrency 64
"""

from tokenmill.bench.soak import main

if __name__ == "__main__":
    raise SystemExit(main())
