"""Two checkouts of tokenmill, alternated in one run: `tokenmill bench latency` and
`tokenmill bench throughput --workload uniform` from each tree in turn, every round, so the
machine's drift hits both alike (the way a refactor is shown not to cost speed).

    git worktree add /tmp/before <commit>      # and copy tokenmill/_C/*.so if csrc/ is equal
    python benchmarks/compare_trees.py /tmp/before . --rounds 3

Each command runs in its tree (`python -m tokenmill.cli` with the tree as working directory,
so that tree's package is the one imported) with this interpreter; the medians over rounds are
printed side by side with their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tokenmill.bench.machine import describe_machine

COMMANDS = {
    "latency decode tok/s": (["bench", "latency", "--repeats", "3"],
                             lambda r: r["tokenmill"]["decode_tokens_per_s"]),
    "latency TTFT ms": (["bench", "latency", "--repeats", "3"],
                        lambda r: 1e3 * r["tokenmill"]["ttft_s"]),
    "uniform total tok/s": (["bench", "throughput", "--workload", "uniform"],
                            lambda r: r["results"]["tokenmill"]["total_tokens_per_s"]),
}


def run_in(tree: Path, argv: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "tokenmill.cli", *argv, "--json", out.name],
                       cwd=tree, check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    print(describe_machine())
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    figures: dict[tuple[str, str], list[float]] = {}
    commands = {tuple(argv): [] for argv, _ in COMMANDS.values()}
    for round_ in range(args.rounds):
        for argv in commands:
            for name, tree in trees.items():
                result = run_in(tree, list(argv))
                for label, (label_argv, figure) in COMMANDS.items():
                    if tuple(label_argv) == argv:
                        figures.setdefault((label, name), []).append(figure(result))
        print(f"round {round_ + 1} done", flush=True)
    print(f"\n{'figure':<24}{'before':>10}{'after':>10}{'after/before':>14}   (medians of "
          f"{args.rounds} rounds; per round: before, after)")
    for label in COMMANDS:
        b = statistics.median(figures[(label, "before")])
        a = statistics.median(figures[(label, "after")])
        rounds = ", ".join(f"{x:.1f}/{y:.1f}" for x, y in zip(
            figures[(label, "before")], figures[(label, "after")], strict=True))
        print(f"{label:<24}{b:>10.1f}{a:>10.1f}{a / b:>14.3f}   {rounds}")


if __name__ == "__main__":
    main()
