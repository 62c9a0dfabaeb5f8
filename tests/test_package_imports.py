"""The package's imports form no circle, counting the imports inside functions (so none of
them hides one) and the package __init__ each import runs; imports only for type checkers
(`if TYPE_CHECKING:`) are left out, as they never run."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import tokenmill

ROOT = Path(tokenmill.__file__).parent


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = ("tokenmill", *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    return {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
            and "TYPE_CHECKING" in ast.unparse(block.test) for n in ast.walk(block)}


def _imported(node: ast.AST, package: str, mods: dict[str, Path]) -> list[str]:
    """The tokenmill modules an import statement names (a name imported from a package is
    the submodule of that name if there is one, else the package)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    assert isinstance(node, ast.ImportFrom)
    base = node.module or ""
    if node.level:
        parts = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join([*parts, base] if base else parts)
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]


def import_graph() -> dict[str, set[str]]:
    """module → the tokenmill modules importing it executes (the root package left out: its
    __init__ is the public API, run before any submodule)."""
    mods = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        skip = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom) or id(node) in skip:
                continue
            for target in _imported(node, package, mods):
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                parts = target.split(".")
                for k in range(2, len(parts) + 1):  # the packages on the way run too
                    step = ".".join(parts[:k])
                    if step in mods and step != name and not name.startswith(step + "."):
                        graph[name].add(step)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_walk_sees_circles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    graph = import_graph()
    # function-local imports count: the CLI builds its bench subcommands on demand
    assert "tokenmill.bench.latency" in graph["tokenmill.cli"]
    # a submodule's import runs its package's __init__ on the way
    assert "tokenmill.attention" in graph["tokenmill.config"]


def test_config_is_a_leaf_of_data():
    """config.py reads no checkpoint: it imports neither the loaders, the models nor the
    factory above it."""
    below = import_graph()["tokenmill.config"]
    for name in below:
        assert not name.startswith(("tokenmill.model_loader", "tokenmill.models",
                                    "tokenmill.quantization", "tokenmill.config_factory",
                                    "tokenmill.config_model", "tokenmill.config_weights",
                                    "tokenmill.engine")), name


def test_the_models_do_not_build_the_fused_call():
    """The runner wraps a model in the fused CPU decode call (models/cpu_decode.py); the
    model classes import none of it."""
    graph = import_graph()
    for name in graph:
        if name.startswith("tokenmill.models.") and name != "tokenmill.models.cpu_decode":
            assert "tokenmill.models.cpu_decode" not in graph[name], name


def _imports_torch(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    return any(id(n) not in skip and (
        (isinstance(n, ast.Import) and any(a.name.split(".")[0] == "torch" for a in n.names))
        or (isinstance(n, ast.ImportFrom) and not n.level
            and (n.module or "").split(".")[0] == "torch")) for n in ast.walk(tree))


def test_core_is_pure_python():
    """core/ (the scheduler, the KV block manager and their requests) runs without torch and
    without the model side: what it imports, and what that imports, never imports torch."""
    graph, mods = import_graph(), _modules()
    reached, todo = set(), [m for m in mods if m.startswith("tokenmill.core")]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo.extend(graph.get(name, ()))
    model_side = ("tokenmill.attention", "tokenmill.layers", "tokenmill.models",
                  "tokenmill.worker", "tokenmill.model_loader", "tokenmill.quantization")
    assert not [m for m in reached if m.startswith(model_side)]
    assert not [m for m in reached if _imports_torch(mods[m])]
    assert _imports_torch(mods["tokenmill.spec_decode.cost_model"])  # the check can fail
