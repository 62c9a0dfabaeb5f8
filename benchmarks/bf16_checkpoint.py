"""bf16 safetensors checkpoints of real shapes (Llama-3.2-1B, Llama-3.1-8B, random weights) served
by tokenmill: load time, peak RSS, TTFT, decode and batch throughput; see
tokenmill/bench/bf16_checkpoint.py.

    python benchmarks/bf16_checkpoint.py --shapes 1b
    python benchmarks/bf16_checkpoint.py --shapes 8b --prompt-len 32 --decode-len 16 --batch 4
    python benchmarks/bf16_checkpoint.py --shapes 1b --tree /path/to/other/checkout --rounds 2
"""

from tokenmill.bench.bf16_checkpoint import main

if __name__ == "__main__":
    raise SystemExit(main())
