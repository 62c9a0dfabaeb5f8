"""Write the default model (SmolLM2-135M-Instruct, the shipped Q4_1 GGUF) as a Hugging Face
folder in bfloat16: the weights a bf16 checkpoint of it would hold (the GGUF's float32
expansion rounded to bf16), its config, tokenizer and chat template. The bf16 benchmarks
(checkpoint_formats.py, quant_quality.py --matmul-dtype) take it, as vLLM-CPU does.

    python benchmarks/smollm2_bf16.py /tmp/smol/bf16
"""

import argparse

from tokenmill.bench.checkpoint_formats import write_bf16_folder
from tokenmill.model_loader.default_model import default_model_path

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the folder to write")
    print("wrote", write_bf16_folder(default_model_path(), p.parse_args().out))
