"""quantization/triton_block_gemm.py: the Q8_0 / Q4 blocks multiplied on CUDA, against
blocks.dequantize (compiled on a CUDA machine, interpreted on CPU tensors elsewhere), and the
block methods' CUDA path end to end: int8, int4 and an AWQ checkpoint give the tokens the CPU
kernels give for the same blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.attention.triton_paged import triton_available
from tokenmill.layers import cpu_ops
from tokenmill.quantization.base import CPULinearKernel
from tokenmill.quantization.blocks import dequantize, quantize_q4, quantize_q8_0

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("kind, group", [(CPULinearKernel.Q8_0, 32), (CPULinearKernel.Q4, 32),
                                         (CPULinearKernel.Q4, 64)])
@pytest.mark.parametrize("m, n, k", [(1, 64, 64), (5, 96, 128), (40, 80, 192), (0, 64, 64)])
@pytest.mark.parametrize("extras", [False, True])
def test_block_linear_matches_the_dequantized_weight(kind, group, m, n, k, extras):
    from tokenmill.quantization.triton_block_gemm import block_linear

    if k % group:
        pytest.skip("the group must divide the inputs")
    g = torch.Generator().manual_seed(m + n + k + group)
    w = torch.randn(n, k, generator=g)
    blocks = quantize_q8_0(w) if kind == CPULinearKernel.Q8_0 else quantize_q4(w, group)
    ref_w = dequantize(CPULinearKernel(kind, group, blocks))  # (N, K) float32
    x = torch.randn(m, k, generator=g)
    scale = (0.5 + torch.rand(k, generator=g)) if extras else None
    bias = torch.randn(n, generator=g) if extras else None
    want = F.linear(x if scale is None else x * scale, ref_w, bias)
    to = lambda t: None if t is None else t.to(DEVICE)
    got = block_linear(x.to(DEVICE), kind, group, *(b.to(DEVICE) for b in blocks),
                       *([None] if len(blocks) == 2 else []), to(scale), to(bias))
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-4)
    if DEVICE.type == "cuda":  # half precision: x and the dequantized weight in bf16
        got16 = block_linear(x.to(DEVICE, torch.bfloat16), kind, group,
                             *(b.to(DEVICE) for b in blocks),
                             *([None] if len(blocks) == 2 else []), to(scale), to(bias))
        torch.testing.assert_close(got16.float().cpu(), want, rtol=3e-2, atol=3e-2 * k ** 0.5)


# int8 end to end under -m slow (19 s in the interpreter): its kernel is checked above, and
# int4 takes the same method branch in CI
@pytest.mark.skipif(not cpu_ops.ops_available(), reason="C++ kernels not built")
@pytest.mark.parametrize("quantization", [pytest.param("int8", marks=pytest.mark.slow), "int4"])
def test_block_methods_cuda_path_gives_the_cpu_kernels_tokens(tiny_model, monkeypatch,
                                                                quantization):
    """The method objects' CUDA branch (the Triton GEMM, embedding rows dequantized by
    PyTorch) routed on CPU tensors into the interpreted kernel: the same blocks, the same
    greedy tokens as the C++ kernels (float32: both exact products, sums in another order)."""
    from tests.conftest import generate_greedy, mixed_prompts
    from tokenmill import LLM
    from tokenmill.quantization import block_method

    path, hf = tiny_model("llama")
    cases = [(p, 3) for p, _ in mixed_prompts(2, hf.config.vocab_size, seed=5, max_len=24)]
    kw = dict(quantization=quantization, dtype="float32", attention_backend="torch",
              load_format="dummy", batch_invariant=False, device="cpu")
    cpu_tokens = generate_greedy(LLM(path, **kw), cases)
    calls = {"apply": 0, "embed": 0}
    orig_gemm = block_method.BlockLinearMethod._gemm

    def counted_gemm(self, layer, x, bias):
        calls["apply"] += 1
        return orig_gemm(self, layer, x, bias)

    def counted_rows(kernel):
        calls["embed"] += 1
        return dequantize(kernel)

    monkeypatch.setattr(block_method, "on_cuda", lambda t: True)
    monkeypatch.setattr(block_method.BlockLinearMethod, "_gemm", counted_gemm)
    monkeypatch.setattr(block_method, "dequantize", counted_rows)
    llm = LLM(path, **kw)
    assert generate_greedy(llm, cases) == cpu_tokens
    assert calls["apply"] > 0 and calls["embed"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_engine_on_cuda(tiny_model, quantization):
    """On the GPU: float32 activations give the greedy tokens of Hugging Face's forward on the
    dequantized weights (the reference the CPU kernels meet in test_load_time.py; it needs
    no C++ kernels, which a GPU machine need not build); bfloat16 ones run."""
    from tests.conftest import generate_greedy, hf_greedy, mixed_prompts
    from tests.quantization.reference import hf_with_effective_weights, reference_model
    from tokenmill import LLM

    path, hf = tiny_model("llama")
    cases = [(p, 8) for p, _ in mixed_prompts(3, hf.config.vocab_size, seed=6, max_len=40)]
    kw = dict(quantization=quantization, device="cuda", batch_invariant=False)
    llm = LLM(path, dtype="float32", **kw)
    ref = reference_model(hf, quantization)
    if quantization == "int4":  # the activation-aware scales it chose at load
        ref = hf_with_effective_weights(ref, llm.engine.runner.model)
    assert generate_greedy(llm, cases) == [hf_greedy(ref, p, m) for p, m in cases]
    bf16 = generate_greedy(LLM(path, dtype="bfloat16", **kw), cases)
    assert [len(t) for t in bf16] == [8, 8, 8]
