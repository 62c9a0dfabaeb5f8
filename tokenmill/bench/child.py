"""A benchmark's measurement in a child process of its own (its own peak RSS, heap and threads),
handed back to the parent as one `RESULT <json>` line on the child's stdout."""

from __future__ import annotations

import json
import subprocess
from typing import Any

PREFIX = "RESULT "


class ChildFailed(RuntimeError):
    """The child exited non-zero or printed no result; the message is its whole stderr."""


def print_result(result: Any) -> None:
    """In the child: hand `result` (JSON-serialisable) to the parent."""
    print(PREFIX + json.dumps(result), flush=True)


def run_child(cmd: list[str], env: dict[str, str] | None = None) -> Any:
    """In the parent: run `cmd` to its end and return the result it printed."""
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [x for x in out.stdout.splitlines() if x.startswith(PREFIX)]
    if out.returncode or not lines:
        raise ChildFailed(out.stderr)
    return json.loads(lines[0][len(PREFIX):])
