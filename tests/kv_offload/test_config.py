"""The KV tiers' options: vLLM's spellings, every combination that cannot run refused at
start-up with a message naming it, an unwritable directory refused, a disk that fills up
turning the disk tier off (with a warning, reported in the stats) while serving goes on."""

from __future__ import annotations

import errno
import logging

import pytest

from tests.conftest import generate_greedy
from tests.kv_offload.test_tiers import SMALL_POOL, repeat_workload
from tokenmill import LLM
from tokenmill.engine_args import engine_config
from tokenmill.kv_offload.config import KVTransferConfig, parse_offloading_size


def test_sizes_and_transfer_json():
    assert parse_offloading_size(2) == parse_offloading_size("2") == 2 << 30
    assert parse_offloading_size("512MiB") == 512 << 20
    assert parse_offloading_size(0.5) == 1 << 29
    with pytest.raises(ValueError):
        parse_offloading_size(0)
    ok = {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": {"shared_storage_path": "/x"}}
    t = KVTransferConfig.parse(ok)
    assert t.produces and t.consumes and t.shared_storage_path == "/x"
    for bad, message in [(ok | {"kv_connector": "NixlConnector"}, "kv_connector"),
                         (ok | {"kv_role": "producer"}, "kv_role"),
                         (ok | {"kv_connector_extra_config": {}}, "shared_storage_path"),
                         (ok | {"kv_buffer": 1}, "unknown field")]:
        with pytest.raises(ValueError, match=message):
            KVTransferConfig.parse(bad)


@pytest.mark.parametrize("options, message", [
    ({"kv_offloading_backend": "native"}, "needs kv_offloading_size"),
    ({"kv_offloading_backend": "native", "kv_offloading_size": 1,
      "kv_offloading_dir": "/tmp/x"}, "disk tier's"),
    ({"kv_offloading_size": 1, "enable_prefix_caching": False}, "enable_prefix_caching"),
    ({"kv_offloading_size": "1KiB"}, "holds no block"),
    ({"kv_offloading_size": 1, "pipeline_parallel_size": 2}, "pipeline_parallel_size"),
    ({"kv_offloading_size": 1, "kv_offloading_dir": "/tmp/x", "tensor_parallel_size": 2},
     "tensor_parallel_size"),
])
def test_what_cannot_run_is_refused(tiny_model, options, message):
    with pytest.raises(ValueError, match=message):
        engine_config(tiny_model("llama")[0], **options)


def test_a_draft_model_is_refused(tiny_model):
    path = tiny_model("llama")[0]
    with pytest.raises(ValueError, match="draft model"):
        engine_config(path, kv_offloading_size=1, speculative_config={
            "method": "draft_model", "model": path, "num_speculative_tokens": 2})


def test_an_unwritable_directory_is_a_startup_error(tiny_model, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="not writable"):
        LLM(tiny_model("llama")[0], kv_offloading_size=1, kv_offloading_dir=str(blocker / "kv"))


def test_a_full_disk_turns_the_disk_tier_off(tiny_model, tmp_path, monkeypatch, caplog):
    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("tokenmill.kv_offload.file_store.write_block", full)
    path, _ = tiny_model("llama")
    first, repeat = repeat_workload()
    baseline = LLM(path, **SMALL_POOL)
    llm = LLM(path, **SMALL_POOL, kv_offloading_size=1, kv_offloading_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="tokenmill.kv_offload.file_store"):
        assert (generate_greedy(llm, first + repeat)
                == generate_greedy(baseline, first + repeat))
    assert llm.engine.stats().kv_disk_tier_available is False
    assert "the disk store is off" in caplog.text
    assert not list(tmp_path.rglob("*.kv"))
