"""Single decode steps of tokenmill and llama.cpp on one GGUF file, interleaved in one process.

    python benchmarks/decode_steps.py MODEL.gguf [--prompt-len 32 1500] [--steps 60]

See tokenmill/bench/decode_steps.py.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tokenmill.bench.decode_steps import main  # noqa: E402

if __name__ == "__main__":
    main()
