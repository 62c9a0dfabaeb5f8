"""Accuracy of each weight format against float32 (KL, top-1 agreement, perplexity) over
natural English text found on the machine; see tokenmill/bench/quant_quality.py.

    python benchmarks/quant_quality.py                       # gguf, int8, int4 on SmolLM2
    python benchmarks/quant_quality.py --methods int8 --tokens 8192
    python benchmarks/quant_quality.py --kv-cache-dtype int8   # the KV cache instead
"""

from tokenmill.bench.quant_quality import main

if __name__ == "__main__":
    raise SystemExit(main())
