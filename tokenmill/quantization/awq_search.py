"""Activation-aware scaling for 4-bit weights quantized at load (AWQ's scale search, Lin et
al. 2023), calibrated on natural text found on the machine at run time.

A few input channels carry much larger activations than the rest (SmolLM2's reach 15-34x
their RMS), and their weights matter most. Scaling those weight columns up by s before
rounding (W' = W diag(s)) gives them finer steps; the layer then multiplies x / s by the
quantized W' (the kernel takes the per-channel `input_scale` 1 / s). For each layer,
s = mean|x|^alpha (normalised), with alpha in [0, 1] chosen on the calibration activations to
minimise || X W^T - (X / s) Q(W s)^T ||^2. alpha = 0 is plain round-to-nearest, so the search
never does worse than it on the calibration data.

The activations come from Hugging Face transformers running the same float checkpoint (the
reference implementation; for a GGUF file, its converted float32 folder), with forward hooks
on each decoder layer's q_proj / o_proj / gate_proj / down_proj inputs, over
`calibration_text` (docstrings of Python's standard library): its last 512 tokens, while
benchmarks/quant_quality.py scores its first 4,096 (same source and style, different text).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
import time

import torch

from tokenmill.quantization.base import CPULinearKernel
from tokenmill.quantization.blocks import dequantize, quantize_q4

logger = logging.getLogger(__name__)

_ALPHAS = [i / 10 for i in range(11)]
_DOC_MODULES = ("argparse", "asyncio", "collections", "concurrent.futures", "contextlib",
                "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message", "enum",
                "fractions", "functools", "gzip", "heapq", "http.client", "http.server",
                "inspect", "ipaddress", "itertools", "json", "logging", "mailbox",
                "multiprocessing", "os", "pathlib", "pickle", "pprint", "queue", "random",
                "re", "sched", "selectors", "shutil", "smtplib", "socket", "socketserver",
                "sqlite3", "statistics", "string", "subprocess", "tarfile", "tempfile",
                "textwrap", "threading", "timeit", "typing", "unittest", "urllib.parse",
                "urllib.request", "uuid", "warnings", "weakref", "xml.dom.minidom", "zipfile")


def _prose(doc: str) -> list[str]:
    """The paragraphs of a docstring that read as English sentences."""
    out = []
    for para in re.split(r"\n\s*\n", doc):
        lines = [ln.strip() for ln in para.splitlines()]
        if not lines or any(ln.startswith((">>>", "...", "$", "#")) for ln in lines):
            continue
        text = " ".join(lines)
        letters = sum(c.isalpha() or c == " " for c in text)
        if len(text) >= 80 and letters / len(text) > 0.9 and text.count("(") < 4:
            out.append(text)
    return out


def calibration_text(min_chars: int) -> str:
    """At least `min_chars` of English prose from the standard library's docstrings, in a
    fixed order (the same text on every machine with the same Python)."""
    seen, paragraphs, total = set(), [], 0
    for name in _DOC_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        objects = [module] + [getattr(module, a) for a in sorted(vars(module))
                              if not a.startswith("_")]
        for obj in objects:
            documented = inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isroutine(obj)
            for p in _prose((inspect.getdoc(obj) if documented else None) or ""):
                if p not in seen:
                    seen.add(p)
                    paragraphs.append(p)
                    total += len(p)
        if total >= min_chars:
            break
    return "\n\n".join(paragraphs)


# HF module (inside a decoder layer) whose input is our layer's input
_HF_INPUT_OF = {"self_attn.qkv_proj": "self_attn.q_proj", "self_attn.o_proj": "self_attn.o_proj",
                "mlp.gate_up_proj": "mlp.gate_proj", "mlp.down_proj": "mlp.down_proj"}


@torch.no_grad()
def collect_activations(hf_folder: str, num_tokens: int = 512,
                        max_rows: int = 512) -> dict[str, torch.Tensor]:
    """Inputs of every decoder linear layer on calibration text: our module path
    ('model.layers.3.mlp.down_proj') → (rows, K) float32, at most max_rows rows each."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(hf_folder)
    model = AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float32).eval()
    # The end of the whole text: benchmarks/quant_quality.py scores its beginning.
    ids = tok(calibration_text(10**9), add_special_tokens=False)["input_ids"][-num_tokens:]
    found: dict[str, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        for ours, theirs in _HF_INPUT_OF.items():
            def keep(_m: torch.nn.Module, args: tuple, name: str = f"model.layers.{i}.{ours}"
                     ) -> None:
                x = args[0].reshape(-1, args[0].shape[-1])
                found[name] = x[:max_rows].float().clone()
            hooks.append(layer.get_submodule(theirs).register_forward_pre_hook(keep))
    try:
        model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    logger.info("AWQ calibration: activations of %d layers over %d tokens in %.1f s",
                len(found), len(ids), time.perf_counter() - t0)
    return found


def search_scale(w: torch.Tensor, x: torch.Tensor,
                 group: int) -> tuple[torch.Tensor | None, float, float]:
    """The per-input-channel scale s (K,) minimising the 4-bit output error on x (rows, K),
    or None when plain rounding (alpha = 0) is best; with the errors of RTN and of the
    choice."""
    w, x = w.float(), x.float()
    ref = x @ w.T
    mean_abs = x.abs().mean(0).clamp(min=1e-8)  # (K,)
    best: tuple[float, torch.Tensor | None] = (float("inf"), None)
    rtn_err = 0.0
    for alpha in _ALPHAS:
        s = mean_abs.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        kernel = CPULinearKernel(CPULinearKernel.Q4, group, quantize_q4(w * s, group))
        err = float((ref - (x / s) @ dequantize(kernel).T).pow(2).mean())
        if alpha == 0:
            rtn_err = err
        if err < best[0]:
            best = (err, None if alpha == 0 else s)
    return best[1], rtn_err, best[0]
