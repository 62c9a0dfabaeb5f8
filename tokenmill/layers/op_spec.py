"""What a module computes, stated for the fast paths that execute it elsewhere.

The fused CPU decode call (models/cpu_decode.py) runs whole decoder layers in C++. It must
compute what the modules compute, not a substitute, so it never looks at module types: each
module it may cover states its computation as an `OpSpec` (`op_spec()`), built from the same
attributes its `forward` reads: the op ("rms_norm", "gated_act", "attention", ...), the
variants this instance needs ("gated_act.gelu_tanh", "attention.window", "linear.bias", ...),
the values the op reads (weights, sizes, constants) and its parts (a block's norms, attention
and MLP). A fast path runs only when it implements every op and variant a spec tree requires
(`OpSpec.requires`) and declines otherwise, so a new variant, or a value it does not
implement, falls back to the modules.

Invariant (fail closed): a spec describes the methods of the class that states it, those its
`computes` names (`forward` and the helpers it calls). `spec_of` returns None for a module of
a subclass that redefines any of them below the class that wrote its `op_spec` (Qwen3's
attention adds q/k norms in its own forward; Granite's MLP scales its output): such a module
states nothing until it writes its own spec.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import nn


@dataclass(frozen=True)
class OpSpec:
    op: str  # the computation, e.g. "rms_norm"
    variants: frozenset[str] = frozenset()  # what this instance needs beyond the plain op
    params: Mapping[str, Any] = field(default_factory=dict)  # what the op reads
    parts: Mapping[str, OpSpec] = field(default_factory=dict)  # sub-computations, by role

    def requires(self) -> set[str]:
        """Every op and variant ("op.variant") of this spec and its parts."""
        need = {self.op} | {f"{self.op}.{v}" for v in self.variants}
        for part in self.parts.values():
            need |= part.requires()
        return need


class StatesOp(Protocol):
    computes: tuple[str, ...]  # the methods its spec describes

    def op_spec(self) -> OpSpec | None: ...


def spec_of(module: nn.Module | None) -> OpSpec | None:
    """The module's spec, or None when it states none (no `op_spec`, a subclass that changed
    what it computes, or a spec of a part that is None)."""
    if module is None:
        return None
    cls = type(module)
    owner = next((c for c in cls.__mro__ if "op_spec" in c.__dict__), None)
    if owner is None:
        return None
    described = set(getattr(owner, "computes", ("forward",)))
    if any(described & set(vars(c)) for c in cls.__mro__[:cls.__mro__.index(owner)]):
        return None  # a subclass redefines what the spec describes
    return module.op_spec()


def specs_of(**modules: nn.Module | None) -> dict[str, OpSpec] | None:
    """Each named module's spec, or None when any of them states none."""
    out = {name: spec_of(m) for name, m in modules.items()}
    return None if any(s is None for s in out.values()) else out
