"""utils/file_maps.py: which tensors are a file's pages, and huge_pages leaving them in place."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from tokenmill.utils.file_maps import file_map_ranges, file_mapped_bytes, is_file_mapped
from tokenmill.utils.huge_pages import move_parameters_to_huge_pages

pytestmark = pytest.mark.skipif(not file_map_ranges(), reason="needs Linux's /proc/self/maps")


@pytest.fixture
def mapped(tmp_path) -> torch.Tensor:
    path = tmp_path / "weights.bin"
    np.arange(1 << 20, dtype=np.float32).tofile(path)
    return torch.from_numpy(np.memmap(path, dtype=np.float32, mode="c"))


def test_a_files_pages_are_told_from_anonymous_memory(mapped):
    ranges = file_map_ranges()
    assert is_file_mapped(mapped, ranges)
    assert is_file_mapped(mapped[1000:2000], ranges)
    assert not is_file_mapped(mapped.clone(), ranges)
    assert not is_file_mapped(torch.zeros(0), ranges)
    assert file_mapped_bytes([mapped[:10], torch.ones(100), mapped]) == 40 + mapped.numel() * 4


def test_huge_pages_leave_mapped_parameters_where_they_are(mapped):
    module = nn.Module()
    module.mapped = nn.Parameter(mapped, requires_grad=False)
    module.own = nn.Parameter(torch.arange(1 << 20, dtype=torch.float32), requires_grad=False)
    where, own_where = module.mapped.data_ptr(), module.own.data_ptr()
    moved = move_parameters_to_huge_pages(module)
    assert moved == 4 << 20  # only the anonymous one
    assert module.mapped.data_ptr() == where and module.own.data_ptr() != own_where
    assert torch.equal(module.mapped, module.own)
