"""Offline throughput: tokenmill against Hugging Face transformers in the same run.

    python benchmarks/throughput.py [--workload mixed|uniform] [--skip-hf] [engine options]

The same as `tokenmill bench throughput --compare-hf` (tokenmill/bench/throughput.py), with the
Hugging Face comparison on unless --skip-hf.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tokenmill.cli import main  # noqa: E402

if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--skip-hf" in argv:
        argv.remove("--skip-hf")
    elif "--compare-hf" not in argv:
        argv.append("--compare-hf")
    raise SystemExit(main(["bench", "throughput", *argv]))
