"""tokenmill.bench.kernel_builds: inside `using_kernels`, the engine's CPU steps (the fused
decode call and the modules' fused ops) call the given modules, and only there; versions built
side by side share no statics."""

from __future__ import annotations

from typing import Any

import pytest

import tokenmill.layers.cpu_ops as cpu_ops
import tokenmill.models.cpu_decode as cpu_decode
from tokenmill import LLM, SamplingParams
from tokenmill.bench.kernel_builds import SWAPPED, build_module, using_kernels


class CountingModule:
    """A built kernel module that counts the functions taken from it (and runs them)."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.taken = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.module, name)
        if callable(attr):
            self.taken += 1
        return attr


def test_steps_inside_use_the_given_kernels_and_outside_the_installed(tiny_model):
    if cpu_ops._ops() is None or cpu_decode._module() is None:
        pytest.skip("the CPU kernels are not built here")
    installed = {"cpu_ops": cpu_ops._ops(), "decode_layers_cpu": cpu_decode._module()}
    llm = LLM(tiny_model("llama")[0], max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(5, 25))}
    before = llm.generate([prompt], params)[0].outputs[0].token_ids

    built = {name: CountingModule(installed[name]) for name in SWAPPED}
    with using_kernels(built):
        inside = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert all(m.taken > 0 for m in built.values()), {n: m.taken for n, m in built.items()}
    assert inside == before  # the same kernels behind the wrapper: the same tokens

    taken = {name: m.taken for name, m in built.items()}
    assert cpu_ops._ops() is installed["cpu_ops"]
    assert cpu_decode._module() is installed["decode_layers_cpu"]
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == before
    assert {name: m.taken for name, m in built.items()} == taken


STATIC_IN_INLINE = """
#include <pybind11/pybind11.h>
// a static local of an inline function, as the kernels' per-thread scratch buffers are
inline int& counter() { static int c = %d; return c; }
int bump() { return ++counter(); }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("bump", &bump); }
"""


def test_two_builds_keep_their_own_statics(tmp_path):
    """Two versions built side by side (another csrc's kernels beside these) each keep their
    inline functions' statics: GCC's GNU unique symbols would bind both to the first loaded
    (a scratch struct of another layout: NaN from the old attention kernel in an A/B)."""
    builds = []
    for start in (0, 100):  # two versions: different sources, the same symbols
        folder = tmp_path / f"v{start}"
        folder.mkdir()
        (folder / "statics.cpp").write_text(STATIC_IN_INLINE % start)
        builds.append(build_module(folder / "statics.cpp", folder, "statics_test"))
    first, second = builds
    assert [first.bump() for _ in range(3)] == [1, 2, 3]
    assert second.bump() == 101
    assert first.bump() == 4
