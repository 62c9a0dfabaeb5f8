"""Single-stream latency (time to first token, decode tokens/s), optionally against llama.cpp.

    python benchmarks/latency.py [--llama-cpp] [--repeats 3] [engine options]

The same as `tokenmill bench latency` (tokenmill/bench/latency.py).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tokenmill.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(["bench", "latency", *sys.argv[1:]]))
