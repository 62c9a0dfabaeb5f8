"""tokenmill.bench.alternate: every round runs every way in turn, warm-up calls untimed, and
each way's figure is the median over rounds of its seconds per timed call."""

from __future__ import annotations

from tokenmill.bench import alternate as alternate_module
from tokenmill.bench.alternate import alternate


def test_rounds_alternate_and_report_every_way(monkeypatch):
    """On a clock that only the calls advance: "a" takes 1 s a call, "b" 3 s, except one slow
    round of "b" (9 s), which the median leaves out; warm-up calls would add their time."""
    clock = [0.0]
    monkeypatch.setattr(alternate_module.time, "perf_counter", lambda: clock[0])
    log: list[str] = []
    b_calls = iter([3.0] * 4 + [9.0] * 4 + [3.0] * 4)

    def a() -> None:
        log.append("a")
        clock[0] += 1.0

    def b() -> None:
        log.append("b")
        clock[0] += next(b_calls)

    result = alternate({"a": a, "b": b}, rounds=3, calls=3, warmup=1)
    assert log == (["a"] * 4 + ["b"] * 4) * 3
    assert result == {"a": 1.0, "b": 3.0}
