"""layers/triton_ops.py against the layers' PyTorch code: compiled on a CUDA machine
(benchmarks/gpu_session.sh, bfloat16 too), interpreted on CPU tensors elsewhere
(TRITON_INTERPRET=1, tests/conftest.py; float32 and float16: the interpreter's bfloat16 cast
truncates instead of rounding, so bfloat16 is checked on the GPU only). Shapes whose widths are
not powers of two, strided views as the models pass them (q, k as views of the qkv output),
partial rotary and empty batches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.attention.triton_paged import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def _close(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    """Within one unit in the last place of the dtype, plus, where `scale` is given, a float32
    transcendental's error (a few ulps of float32) times it: act(gate) * up is 1 + erf(x) or
    x / (1 + e^-x) times gate * up, whose tiny values (1 + erf(-3) ~ 2e-5) keep the absolute
    error of erf or exp, not a relative one. Almost all values equal bit for bit in half
    precision."""
    diff = (got.float() - want.float()).abs()
    eps = torch.finfo(want.dtype).eps
    bound = want.float().abs().clamp(min=2**-14) * eps
    if want.dtype == torch.float32:
        bound = bound * 4  # the row sums' order
    if scale is not None:
        bound = bound + scale.float().abs() * (2**-16 if want.dtype != torch.float32 else 2**-21)
    assert (diff <= bound).all(), float((diff / bound).max())
    if want.dtype != torch.float32 and got.numel():
        assert (got == want).float().mean() > 0.95


def _hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return w * x32.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, hidden", [(1, 64), (7, 576), (3, 80), (0, 64)])
def test_rms_norm_and_residual_add(dtype, tokens, hidden):
    from tokenmill.layers import triton_ops

    g = torch.Generator().manual_seed(tokens * hidden)
    wide = torch.randn(tokens, hidden + 16, generator=g).to(DEVICE, dtype)
    x = wide[:, :hidden]  # a strided view, as a slice of a larger output
    res = torch.randn(tokens, hidden, generator=g).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(DEVICE, dtype)
    _close(triton_ops.rms_norm(x, w, 1e-5), _hf_rms_norm(x, w, 1e-5))
    out, total = triton_ops.rms_norm(x, w, 1e-6, residual=res)
    assert torch.equal(total, x + res)  # the sum rounded as PyTorch adds
    _close(out, _hf_rms_norm(x + res, w, 1e-6))
    # Gemma's (1 + w), applied in float32 before the one rounding
    from tokenmill.models.gemma import GemmaRMSNorm

    gemma = GemmaRMSNorm(hidden, 1e-6).to(DEVICE)
    gemma.weight.data = 0.1 * w.float()
    out, total = triton_ops.rms_norm(x, gemma.weight, 1e-6, res, unit_offset=True)
    assert torch.equal(total, x + res)
    _close(out, gemma._norm(x + res))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("tokens, inter", [(1, 96), (5, 1536), (0, 32)])
def test_gated_act(dtype, act, tokens, inter):
    from tokenmill.layers import triton_ops

    g = torch.Generator().manual_seed(inter + tokens)
    x = (3 * torch.randn(tokens, 2 * inter, generator=g)).to(DEVICE, dtype)
    gate, up = x.chunk(2, dim=-1)
    torch_act = {"silu": F.silu, "gelu": F.gelu,
                 "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[act]
    want = torch_act(gate) * up
    got = triton_ops.gated_act(x, act)
    assert got.shape == (tokens, inter) and got.dtype == dtype
    _close(got, want, scale=gate.float() * up.float())


def _torch_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    R = cos.shape[-1]
    x1, x2 = x[..., :R // 2], x[..., R // 2:R]
    rotated = x[..., :R] * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat([rotated, x[..., R:]], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, hq, hkv, d, r", [(1, 4, 2, 64, 64), (6, 9, 3, 64, 64),
                                                   (3, 8, 8, 96, 48), (0, 4, 2, 64, 64)])
def test_rotary_in_place(dtype, tokens, hq, hkv, d, r):
    from tokenmill.layers import triton_ops
    from tokenmill.layers.rotary import _table

    g = torch.Generator().manual_seed(d + tokens)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=g).to(DEVICE, dtype)
    q = qkv[:, :hq * d].view(tokens, hq, d)  # views of the fused projection, as models pass
    k = qkv[:, hq * d:(hq + hkv) * d].view(tokens, hkv, d)
    positions = torch.tensor([0, 1, 5, 17, 300, 4095][:tokens], dtype=torch.float32)
    cos, sin = _table(1.0 / 10000 ** (torch.arange(0, r, 2).float() / r), 1.0, positions)
    cos, sin = (t.unsqueeze(1).to(DEVICE, dtype) for t in (cos, sin))
    want_q, want_k = _torch_rotary(q, cos, sin), _torch_rotary(k, cos, sin)
    v_before = qkv[:, (hq + hkv) * d:].clone()
    triton_ops.rotary_(q, k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)  # same roundings, no transcendental
    assert torch.equal(qkv[:, (hq + hkv) * d:], v_before)  # v untouched


@pytest.mark.parametrize("kind", ["llama", "qwen3", "phi3-partial", "gemma2", "olmoe"])
def test_models_on_the_triton_ops_match_hf(tiny_model, monkeypatch, kind):
    """The layers' CUDA path end to end: on CPU the ops are routed to the interpreted kernels
    (as cuda_ops routes a CUDA tensor), with the Triton attention backend, which applies RoPE
    in its KV store (attention/triton_kv_store.py); greedy == HF. Llama-shaped norms and SiLU,
    Qwen3's per-head q/k norms (3-d views), half-rotated heads, Gemma 2's GELU-tanh and (1 + w)
    norms, OLMoE's all-heads norms and experts."""
    from tests.conftest import generate_greedy, hf_greedy, mixed_prompts
    from tokenmill import LLM
    from tokenmill.attention import triton_kv_store
    from tokenmill.layers import activation, layernorm, rotary, triton_ops
    from tokenmill.models import gemma

    calls: dict[str, int] = {}

    def counted(x: torch.Tensor):
        class Counting:
            def __getattr__(self, name):
                calls[name] = calls.get(name, 0) + 1
                return getattr(triton_ops, name)
        return Counting()

    for module in (activation, layernorm, rotary, gemma):
        monkeypatch.setattr(module, "cuda_ops", counted)
    fused_store = triton_kv_store.rotary_store_kv

    def counted_store(*args):
        calls["rotary_store_kv"] = calls.get("rotary_store_kv", 0) + 1
        return fused_store(*args)

    monkeypatch.setattr(triton_kv_store, "rotary_store_kv", counted_store)
    path, hf = tiny_model(kind)
    cases = [(p, min(m, 6)) for p, m in mixed_prompts(3, hf.config.vocab_size, seed=4,
                                                      max_len=40)]
    llm = LLM(path, attention_backend="triton", dtype="float32", max_num_batched_tokens=64)
    assert generate_greedy(llm, cases) == [hf_greedy(hf, p, m) for p, m in cases]
    assert min(calls.get(op, 0) for op in ("gated_act", "rotary_store_kv", "rms_norm")) > 0
    assert "rotary_" not in calls  # RoPE never ran as a launch of its own
