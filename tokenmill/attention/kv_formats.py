"""KV cache formats: one registered object per format, under vLLM's `kv_cache_dtype` names.

A format says how one cache row (one token's K or V for one KV head, head_dim values) is
stored: the row's width R and storage dtype, how float values are rounded into a row and read
back, and the fixed per-layer state it needs. Everything else asks the registry: the option's
check (config.py), the CLI's choices, the cache's layout and sizing (kv_cache.py), the torch
paths that write and read rows, and the Triton kernels' KV_FORMAT code.

    "auto"             the model's dtype, R = head_dim (ModelDtypeKV); config_factory resolves
                       it to "bfloat16" where the products are bf16 or the weights are a GGUF
                       file's blocks (llama.cpp's 16-bit cache)
    "float32"          float32 values, R = head_dim: a float32 model's K and V as computed (its
                       "auto" before that resolution; Float32KV)
    "bfloat16"         bfloat16 values, R = head_dim: a float32 model's cache (a bf16
                       checkpoint computed in float32) at half the bytes; written rounded to
                       nearest even, read widened exactly (BFloat16KV)
    "int8"             int8 values then their float32 scale's 4 bytes, R = head_dim + 4:
                       one symmetric scale per token and KV head, x = q * max|x| / 127 (Int8KV)
    "fp8" / "fp8_e4m3" float8_e4m3fn values, R = head_dim, x = e4m3 * head_scale: one scale
                       per layer, K / V and KV head, fixed for the cache's life (Fp8E4M3KV)

Invariants:
- A cache tensor's storage dtype names its format (`format_of_storage`): the C++ kernels
  (csrc/kv_formats.h) and the torch paths dispatch on it, so one tensor is only ever read in
  the format it was written in. A float storage reads as the values it holds, in its own
  dtype; a reader computing in another dtype widens them (kv_cache.as_float's `dtype`).
- A block is self-contained: whatever a row needs besides its own bytes is fixed for the
  cache's life (fp8's head scales, the key rotation), so copy-on-write, swap and prefix-cache
  reuse move raw blocks without knowing the format.
- Quantized formats store keys rotated (kv_cache.key_rotation); `quantized` says which.

Adding a format is one class here, its row code in csrc/kv_formats.h and a KV_FORMAT branch
in the Triton kernels; `PLANNED_KV_FORMATS` names vLLM's formats not built yet, which are
refused as such rather than as unknown.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

INT8_SCALE_BYTES = 4  # an int8 row's float32 scale
FP8_MAX = 448.0  # e4m3fn's largest finite value

# vLLM's names of formats not built yet: an error says so (and what is built)
PLANNED_KV_FORMATS = ("fp8_e5m2",)


class KVFormat(ABC):
    """One KV cache row format. `kernel_id` is the Triton kernels' KV_FORMAT constant."""

    name: str
    aliases: tuple[str, ...] = ()
    quantized: bool = True
    kernel_id: int

    def check_available(self) -> None:
        """ValueError when this torch or machine cannot hold the format (start-up check);
        most formats need nothing beyond torch."""
        return None

    @abstractmethod
    def row(self, head_dim: int, model_dtype: torch.dtype) -> tuple[int, torch.dtype]:
        """(R, storage dtype) of one row."""

    @abstractmethod
    def quantize(self, x: torch.Tensor, head_scales: torch.Tensor | None) -> torch.Tensor:
        """(…, Hkv, D) values → (…, Hkv, R) rows; head_scales (Hkv,): fp8's, else None."""

    @abstractmethod
    def dequantize(self, rows: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        """(…, Hkv, R) rows → (…, Hkv, D) values (float32 for a quantized format); scales:
        fp8's head scales shaped to broadcast against the rows, else None."""

    def head_scales(self, num_layers: int, num_kv_heads: int,
                    device: torch.device) -> torch.Tensor | None:
        """The format's fixed per-layer scales, (num_layers, 2, Hkv) float32; None if none."""
        return None

    def bytes_view(self, t: torch.Tensor) -> torch.Tensor:
        """`t` as torch's index and copy ops take it (fp8: its bytes)."""
        return t


class ModelDtypeKV(KVFormat):
    name = "auto"
    quantized = False
    kernel_id = 0

    def row(self, head_dim: int, model_dtype: torch.dtype) -> tuple[int, torch.dtype]:
        return head_dim, model_dtype

    def quantize(self, x: torch.Tensor, head_scales: torch.Tensor | None) -> torch.Tensor:
        return x

    def dequantize(self, rows: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        return rows


class Float32KV(KVFormat):
    """A float32 model's cache named explicitly (the exact choice where "auto" resolves to
    bfloat16): the same storage and reads as "auto" on a float32 model, so a float32 tensor
    still reads as "auto" (format_of_storage)."""

    name = "float32"
    quantized = False
    kernel_id = 0

    def row(self, head_dim: int, model_dtype: torch.dtype) -> tuple[int, torch.dtype]:
        return head_dim, torch.float32

    def quantize(self, x: torch.Tensor, head_scales: torch.Tensor | None) -> torch.Tensor:
        return x.float()

    def dequantize(self, rows: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        return rows


class HalfKV(KVFormat):
    """Half-precision rows (`storage`) of a cache computed in float32: written rounded to
    nearest even (torch's .to, as the kernels write), read widened exactly. Not quantized:
    every value keeps its own exponent, so no outlier channel sets a step."""

    quantized = False
    storage: torch.dtype

    def row(self, head_dim: int, model_dtype: torch.dtype) -> tuple[int, torch.dtype]:
        return head_dim, self.storage

    def quantize(self, x: torch.Tensor, head_scales: torch.Tensor | None) -> torch.Tensor:
        return x.to(self.storage)

    def dequantize(self, rows: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        return rows


class BFloat16KV(HalfKV):
    """bfloat16 rows (8 bits of mantissa): a float32 model's cache at half the bytes; Triton's
    own KV_FORMAT (its interpreter's cast truncates, so the kernel rounds in integers)."""

    name = "bfloat16"
    kernel_id = 3
    storage = torch.bfloat16


class Float16KV(HalfKV):
    """float16 rows (11 bits of mantissa): a float16 checkpoint's cache kept in float16 on CPU
    (computed in float32), as vLLM keeps an fp16 model's; the range (65504) is the model's
    own. Triton reads and writes it as any float cache (kernel_id 0: the storage's dtype)."""

    name = "float16"
    kernel_id = 0
    storage = torch.float16


class Int8KV(KVFormat):
    name = "int8"
    kernel_id = 1

    def row(self, head_dim: int, model_dtype: torch.dtype) -> tuple[int, torch.dtype]:
        return head_dim + INT8_SCALE_BYTES, torch.int8

    def quantize(self, x: torch.Tensor, head_scales: torch.Tensor | None) -> torch.Tensor:
        scale = x.float().abs().amax(dim=-1, keepdim=True) / 127.0  # (…, 1)
        q = (x.float() / scale.clamp(min=torch.finfo(torch.float32).tiny)).round_().clamp_(
            -127, 127).to(torch.int8)
        return torch.cat([q, scale.contiguous().view(torch.int8)], dim=-1)

    def dequantize(self, rows: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        scale = rows[..., -INT8_SCALE_BYTES:].contiguous().view(torch.float32)  # (…, 1)
        return rows[..., :-INT8_SCALE_BYTES].float() * scale


class Fp8E4M3KV(KVFormat):
    name = "fp8"
    aliases = ("fp8_e4m3",)
    kernel_id = 2

    def check_available(self) -> None:
        if getattr(torch, "float8_e4m3fn", None) is None:
            raise ValueError(f"kv_cache_dtype 'fp8' needs torch.float8_e4m3fn, which torch "
                             f"{torch.__version__} does not have; use 'int8' or 'auto'")

    def row(self, head_dim: int, model_dtype: torch.dtype) -> tuple[int, torch.dtype]:
        self.check_available()
        return head_dim, torch.float8_e4m3fn

    def quantize(self, x: torch.Tensor, head_scales: torch.Tensor | None) -> torch.Tensor:
        assert head_scales is not None, "an fp8 cache needs its head scales"
        return (x.float() / head_scales.view(-1, 1)).clamp_(-FP8_MAX, FP8_MAX).to(
            torch.float8_e4m3fn)

    def dequantize(self, rows: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        assert scales is not None, "an fp8 cache needs its head scales"
        return rows.float() * scales

    def head_scales(self, num_layers: int, num_kv_heads: int,
                    device: torch.device) -> torch.Tensor | None:
        # 1.0, vLLM's default when a checkpoint carries none (kv_cache.py's module doc)
        return torch.ones(num_layers, 2, num_kv_heads, dtype=torch.float32, device=device)

    def bytes_view(self, t: torch.Tensor) -> torch.Tensor:
        # index_copy_ has no float8 kernel on every torch and device (2.11's CPU)
        return t.view(torch.uint8)


KV_FORMATS: dict[str, KVFormat] = {f.name: f for f in (ModelDtypeKV(), Float32KV(), BFloat16KV(),
                                                         Float16KV(), Int8KV(), Fp8E4M3KV())}
_BY_NAME = {alias: f for f in KV_FORMATS.values() for alias in (f.name, *f.aliases)}


def kv_format_names() -> tuple[str, ...]:
    """Every accepted `kv_cache_dtype`, aliases included (the CLI's choices)."""
    return tuple(_BY_NAME)


def kv_format(name: str) -> KVFormat:
    """The format `name` (or an alias) names; ValueError naming the built ones otherwise."""
    fmt = _BY_NAME.get(name)
    if fmt is not None:
        return fmt
    known = " or ".join(repr(n) for n in _BY_NAME)
    if name in PLANNED_KV_FORMATS:
        raise ValueError(f"kv_cache_dtype {name!r} is not built yet; use {known}")
    raise ValueError(f"kv_cache_dtype must be {known}, got {name!r}")


def op_variant(storage: torch.dtype) -> str:
    """The attention op's variant (layers/op_spec.py) naming a cache of this storage, as the
    fused CPU decode call lists what it reads: "kv_" + the format's name, or for a cache in
    the model's dtype that dtype's ("kv_float32")."""
    fmt = format_of_storage(storage)
    return f"kv_{str(storage).removeprefix('torch.') if fmt.name == 'auto' else fmt.name}"


def format_of_storage(dtype: torch.dtype) -> KVFormat:
    """The format a cache tensor of storage `dtype` holds: bfloat16 storage is "bfloat16" and
    float16 storage "float16" (under a model of that dtype, "auto" is the same bytes and reads
    alike), another float "auto"."""
    if dtype == torch.bfloat16:
        return KV_FORMATS["bfloat16"]
    if dtype == torch.float16:
        return KV_FORMATS["float16"]
    if dtype == torch.int8:
        return KV_FORMATS["int8"]
    if dtype == getattr(torch, "float8_e4m3fn", None):
        return KV_FORMATS["fp8"]
    return KV_FORMATS["auto"]
