"""utils/huge_pages.py: zeroed huge-page tensors and the model-weight arena."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from tokenmill.utils import huge_pages


def _smaps_field(addr: int, field: str) -> str | None:
    """`field` of the /proc/self/smaps mapping that holds address `addr`."""
    inside = False
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for line in lines:
        head = line.split()[0] if line.split() else ""
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith(field + ":"):
            return line.split(":", 1)[1].strip()
    return None


def test_zeros_is_zero_aligned_and_writable():
    t = huge_pages.zeros((3, 1000, 700), torch.float32)
    assert t.shape == (3, 1000, 700) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert not t.any()
    t[1, 2, 3] = 5.0
    assert t.sum() == 5.0
    assert huge_pages.zeros((0, 4), torch.float32).shape == (0, 4)


@pytest.mark.skipif(not sys.platform.startswith("linux")
                    or huge_pages.thp_mode() not in ("madvise", "always"),
                    reason="no transparent huge pages on this system")
def test_zeros_is_advised_for_huge_pages():
    t = huge_pages.zeros((4 << 20,), torch.float32)  # 16 MiB
    assert _smaps_field(t.data_ptr(), "THPeligible") == "1"


def test_move_parameters_keeps_values_objects_and_ties():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(4096, 128), nn.Linear(128, 4096), nn.LayerNorm(8))
    model[1].weight = model[0].weight  # tied, as an LM head shares the embedding table
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    objects = {name: p for name, p in model.named_parameters()}
    small = model[2].weight.data_ptr()
    moved = huge_pages.move_parameters_to_huge_pages(model, min_bytes=1 << 14)
    after = dict(model.named_parameters())
    assert moved >= 4096 * 128 * 4 + 4096 * 4  # the table once, the bias
    for name, p in after.items():
        assert p is objects[name] and torch.equal(p, before[name])
    assert model[1].weight is model[0].weight
    table, bias = model[0].weight, model[1].bias
    # One arena: both moved parameters live in the same storage, cache-line aligned.
    assert table.untyped_storage().data_ptr() == bias.untyped_storage().data_ptr()
    assert table.data_ptr() % 64 == 0 and bias.data_ptr() % 64 == 0
    assert model[2].weight.data_ptr() == small  # under min_bytes: left where it was


def test_fresh_is_a_huge_page_mapping_from_one_huge_page_on():
    big = huge_pages.fresh((huge_pages.HUGE_PAGE,), torch.uint8)
    assert big.data_ptr() % huge_pages.HUGE_PAGE == 0
    small = huge_pages.fresh((1000, 3), torch.float32)
    assert small.shape == (1000, 3) and small.untyped_storage().nbytes() == 12000


def test_parameters_marked_keep_pages_stay_where_they_are():
    """Weights written once into fresh memory at load (GGUF tiles) are not copied again."""
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))
    kept = huge_pages.keep_pages(model[0].weight)
    where, values = kept.data_ptr(), kept.detach().clone()
    other = model[1].weight.data_ptr()
    huge_pages.move_parameters_to_huge_pages(model, min_bytes=1 << 10)
    assert model[0].weight is kept and kept.data_ptr() == where and torch.equal(kept, values)
    assert model[1].weight.data_ptr() != other  # the others went into the arena
    arena = model[1].weight.untyped_storage().data_ptr()
    assert model[0].bias.untyped_storage().data_ptr() == arena
