"""Random-weight Llama-3.2-1B / Llama-3.1-8B shapes as GGUF files (Q4_K_M, Q8_0), served by
tokenmill and llama.cpp on the same files; see tokenmill/bench/real_gguf.py.

    python benchmarks/real_gguf.py                       # both shapes, both types
    python benchmarks/real_gguf.py --shapes 1b --types Q4_K_M
    python benchmarks/real_gguf.py --shapes 1b --types Q4_K_M,Q2_K --int8-activations
"""

from tokenmill.bench.real_gguf import main

if __name__ == "__main__":
    raise SystemExit(main())
