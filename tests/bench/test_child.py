"""bench/child.py: a child's one RESULT line comes back as the value it printed; a child that
fails or prints none raises with its stderr."""

from __future__ import annotations

import sys

import pytest

from tokenmill.bench.child import ChildFailed, run_child


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_the_printed_result_comes_back():
    code = ("from tokenmill.bench.child import print_result; print('noise'); "
            "print_result({'a': [1, 2.5], 'b': None})")
    assert run_child(_python(code)) == {"a": [1, 2.5], "b": None}


@pytest.mark.parametrize("code", ["import sys; sys.stderr.write('boom'); sys.exit(3)",
                                  "import sys; sys.stderr.write('boom'); print('no result')"])
def test_a_failed_child_raises_with_its_stderr(code):
    with pytest.raises(ChildFailed, match="boom"):
        run_child(_python(code))
