"""Write the default model (SmolLM2-135M-Instruct) as the GGUF files llama.cpp users have:
its bf16 folder (smollm2_bf16.py) as an F32 GGUF in llama.cpp's converter layout
(tests/gguf_writer.py), then quantized by llama.cpp's own quantizer (llama-cpp-python's
`llama_model_quantize`) into each type asked for. The K-quant benchmarks take them
(`tokenmill bench latency --llama-cpp`, quant_quality.py --model).

    python benchmarks/smollm2_kquants.py /tmp/smol/bf16 /tmp/smol --types Q4_K_M,Q6_K
"""

import argparse
import os
import sys
import types
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.gguf_writer import write_gguf  # noqa: E402
from tokenmill.model_loader.default_model import default_model_path  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bf16_folder", help="SmolLM2 as a bf16 HF folder (smollm2_bf16.py)")
    p.add_argument("out", help="the folder to write SmolLM2-<TYPE>.gguf into")
    p.add_argument("--types", default="Q4_K_M,Q5_K_M,Q6_K",
                   help="llama.cpp file types (LLAMA_FTYPE_MOSTLY_<TYPE>)")
    args = p.parse_args()
    import llama_cpp
    from transformers import AutoConfig

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    f32 = out / "SmolLM2-F32.gguf"
    if not f32.is_file():
        hf = types.SimpleNamespace(config=AutoConfig.from_pretrained(args.bf16_folder))
        write_gguf("llama", args.bf16_folder, hf, default_model_path(), f32)
    for name in args.types.split(","):
        path = out / f"SmolLM2-{name}.gguf"
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name}")
        if llama_cpp.llama_model_quantize(str(f32).encode(), str(path).encode(), params):
            raise SystemExit(f"llama.cpp could not quantize {f32} to {name}")
        print("wrote", path)


if __name__ == "__main__":
    main()
