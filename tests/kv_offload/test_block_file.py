"""Block files: a block comes back exactly; anything else (absent, truncated, a flipped byte,
another model's identity, dtype or shape, a file renamed to another key, a writer killed
before its rename) reads as None."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kv_offload.block_file import read_block, write_block
from tokenmill.kv_offload.block_paths import block_exists, block_path

KEY, OTHER = bytes(range(16)), bytes(range(1, 17))
SHAPE = (2, 2, 4, 1, 8)


@pytest.fixture
def block():
    return torch.randn(SHAPE)


def test_round_trip(tmp_path, block):
    size = write_block(tmp_path, KEY, "model-a", block)
    assert block_path(tmp_path, KEY).stat().st_size == size and block_exists(tmp_path, KEY)
    got = read_block(tmp_path, KEY, "model-a", torch.float32, SHAPE)
    assert torch.equal(got, block)
    assert not list(tmp_path.rglob(".tmp-*"))


def test_every_kind_of_wrong_file_reads_as_none(tmp_path, block):
    assert read_block(tmp_path, KEY, "model-a", torch.float32, SHAPE) is None  # absent
    write_block(tmp_path, KEY, "model-a", block)
    path = block_path(tmp_path, KEY)
    good = path.read_bytes()
    assert read_block(tmp_path, KEY, "model-b", torch.float32, SHAPE) is None  # identity
    assert read_block(tmp_path, KEY, "model-a", torch.bfloat16, SHAPE) is None  # dtype
    assert read_block(tmp_path, KEY, "model-a", torch.float32, (2, 2, 4, 2, 4)) is None
    for bad in (good[:-1], good[:10], good[:len(good) // 2], b"",
                good[:-3] + bytes([good[-3] ^ 1]) + good[-2:],  # a flipped payload bit
                good.replace(b'"crc32": ', b'"crc32": 1', 1)):
        path.write_bytes(bad)
        assert read_block(tmp_path, KEY, "model-a", torch.float32, SHAPE) is None
    other = block_path(tmp_path, OTHER)  # a good file under another key's name
    other.parent.mkdir(parents=True, exist_ok=True)
    other.write_bytes(good)
    assert read_block(tmp_path, OTHER, "model-a", torch.float32, SHAPE) is None


def test_a_failed_write_leaves_nothing(tmp_path, block, monkeypatch):
    def killed(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("os.replace", killed)
    with pytest.raises(OSError):
        write_block(tmp_path, KEY, "model-a", block)
    assert not block_exists(tmp_path, KEY) and not list(tmp_path.rglob("*.kv"))


def test_the_disk_tier_keeps_to_its_size_least_recently_used_out(tmp_path, block):
    from tokenmill.kv_offload.file_store import FileStore

    one = write_block(tmp_path / "probe", KEY, "model-a", block)
    tier = FileStore("disk", str(tmp_path / "kv"), 3 * one, "model-a", torch.float32,
                     SHAPE)
    keys = [bytes([i]) * 16 for i in range(5)]
    for key in keys[:3]:
        tier.write_async(key, block)
    tier.flush()
    tier.touch(keys[0])  # read: the most recently used
    for key in keys[3:]:
        tier.write_async(key, block)
    tier.flush()
    assert tier.num_bytes == 3 * one
    assert torch.equal(tier.read(keys[4]), block) and tier.read(keys[1]) is None
    assert [block_exists(tier.directory, k) for k in keys] == [True, False, False, True, True]
    tier.close()
    again = FileStore("disk", str(tmp_path / "kv"), 2 * one, "model-a",  # a restart,
                      torch.float32, SHAPE)  # a smaller budget
    assert again.num_bytes == 2 * one
    assert sum(block_exists(again.directory, k) for k in keys) == 2
    assert not block_exists(again.directory, keys[1])
    again.close()
