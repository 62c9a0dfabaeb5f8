"""HostSyncs counts torch's sync-debug warnings by the innermost line under its roots, lets
other warnings through, and restores what it changed. On CUDA (benchmarks/gpu_session.sh) a
real `.item()` and a pageable copy are counted and an asynchronous op is not."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from tokenmill.utils.host_syncs import OUTSIDE, PACKAGE_ROOT, SYNC_MESSAGE, HostSyncs

TESTS_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = "tests/utils/test_host_syncs.py"


def _warn_sync() -> None:
    warnings.warn(SYNC_MESSAGE, UserWarning, stacklevel=1)


def _line_of(fn) -> int:
    return fn.__code__.co_firstlineno + 1  # the body's single line


def test_sync_warnings_are_counted_by_their_innermost_site_under_the_roots():
    with HostSyncs(roots=[TESTS_ROOT], mode_on=False) as syncs:
        for _ in range(3):  # the same site three times: each counted ("always")
            _warn_sync()
    assert syncs.sites == {f"{HERE}:{_line_of(_warn_sync)} _warn_sync": 3}
    assert syncs.total == 3


def test_a_sync_outside_the_roots_is_counted_as_outside():
    with HostSyncs(roots=[PACKAGE_ROOT], mode_on=False) as syncs:
        _warn_sync()
    assert syncs.sites == {OUTSIDE: 1}


def test_other_warnings_pass_through_and_the_hook_is_removed_on_exit():
    shown = warnings.showwarning
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with HostSyncs(roots=[TESTS_ROOT], mode_on=False) as syncs:
            warnings.warn("something else", DeprecationWarning, stacklevel=1)
            _warn_sync()
        _warn_sync()  # after the block: an ordinary warning again
    assert [str(w.message) for w in seen] == ["something else", SYNC_MESSAGE]
    assert syncs.total == 1
    assert warnings.showwarning is shown


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_device_syncs_are_counted_on_cuda():
    x = torch.ones(4, device="cuda")
    before = torch.cuda.get_sync_debug_mode()
    with HostSyncs(roots=[TESTS_ROOT]) as syncs:
        y = x * 2  # queued: no sync
        value = y.sum().item()  # one sync
        host = y.cpu()  # a copy into pageable memory: one sync
    assert value == 8 and host.tolist() == [2.0] * 4
    assert syncs.total == 2, syncs.sites
    assert all(site.startswith(HERE) for site in syncs.sites)
    assert torch.cuda.get_sync_debug_mode() == before
