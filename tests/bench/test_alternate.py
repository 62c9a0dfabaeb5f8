"""tokenmill.bench.alternate: every round runs every way in turn, warm-up calls untimed."""

from __future__ import annotations

from tokenmill.bench.alternate import alternate


def test_rounds_alternate_and_report_every_way():
    log: list[str] = []
    result = alternate({"a": lambda: log.append("a"), "b": lambda: log.append("b")},
                       rounds=2, calls=3, warmup=1)
    assert log == ["a"] * 4 + ["b"] * 4 + ["a"] * 4 + ["b"] * 4
    assert list(result) == ["a", "b"] and all(t >= 0 for t in result.values())
