"""The F32 copy of a GGUF file given to llama.cpp: same metadata, every tensor dequantized."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest

from tokenmill.bench.gguf_f32 import f32_copy


@pytest.mark.slow
def test_f32_copy_has_the_dequantized_weights_and_same_metadata(smollm2_path, tmp_path,
                                                                  monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    path = f32_copy(smollm2_path)
    assert path.startswith(str(tmp_path)) and path.endswith(".F32.gguf")
    src, out = gguf.GGUFReader(smollm2_path), gguf.GGUFReader(path)

    assert out.fields["general.file_type"].contents() == gguf.LlamaFileType.ALL_F32
    skip = {"general.file_type"}
    src_fields = {n: f.contents() for n, f in src.fields.items()
                  if not n.startswith("GGUF.") and n not in skip}
    out_fields = {n: f.contents() for n, f in out.fields.items()
                  if not n.startswith("GGUF.") and n not in skip}
    assert out_fields == src_fields  # tokenizer, chat template, hyperparameters

    assert [t.name for t in out.tensors] == [t.name for t in src.tensors]
    quantized = 0
    for s, o in zip(src.tensors, out.tensors, strict=True):
        assert o.tensor_type == gguf.GGMLQuantizationType.F32
        assert list(o.shape) == list(s.shape)
        np.testing.assert_array_equal(np.asarray(o.data),
                                      gguf.quants.dequantize(s.data, s.tensor_type))
        quantized += s.tensor_type != gguf.GGMLQuantizationType.F32
    assert quantized > 200  # the source really was quantized

    mtime = os.stat(path).st_mtime_ns
    assert f32_copy(smollm2_path) == path and os.stat(path).st_mtime_ns == mtime  # cached


@pytest.mark.slow
def test_off_grid_copy_moves_each_weight_within_half_a_step(smollm2_path, tmp_path,
                                                            monkeypatch):
    """The perturbed copy (spec_decode.py --target offgrid): each quantized weight moved by
    less than half its 32-block's step, so the file stays a faithful quantization of it;
    float tensors (the norms) unchanged."""
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    path = f32_copy(smollm2_path, perturb_seed=0)
    assert path.endswith(".F32.offgrid0.gguf")
    src, out = gguf.GGUFReader(smollm2_path), gguf.GGUFReader(path)
    q41 = next(i for i, t in enumerate(src.tensors)
               if t.tensor_type == gguf.GGMLQuantizationType.Q4_1)
    norm = next(i for i, t in enumerate(src.tensors)
                if t.tensor_type == gguf.GGMLQuantizationType.F32)
    exact = gguf.quants.dequantize(src.tensors[q41].data, src.tensors[q41].tensor_type)
    moved = np.asarray(out.tensors[q41].data).reshape(-1, 32) - exact.reshape(-1, 32)
    blocks = exact.reshape(-1, 32)
    half_step = (blocks.max(axis=1) - blocks.min(axis=1)) / 15 / 2
    assert (np.abs(moved) <= half_step[:, None] + 1e-7).all()
    assert np.abs(moved).mean() > 0.2 * half_step.mean()  # really moved: uniform, mean 1/2
    np.testing.assert_array_equal(np.asarray(out.tensors[norm].data),
                                  np.asarray(src.tensors[norm].data))
    assert f32_copy(smollm2_path, perturb_seed=0) == path  # cached
    assert f32_copy(smollm2_path) != path  # the exact copy is another file
