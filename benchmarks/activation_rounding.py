"""What rounding a linear layer's input costs in agreement with float32 (int16, int8, bf16 and
mixed int8 / int16 rules per 32-block), emulated on the float32 weights; see
tokenmill/bench/activation_rounding.py.

    python benchmarks/activation_rounding.py [--model FILE.gguf] [--rules int16,int8,bf16,mix4]
"""

from tokenmill.bench.activation_rounding import main

if __name__ == "__main__":
    raise SystemExit(main())
