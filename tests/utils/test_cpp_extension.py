"""The C++ kernels compiled at install time: the builds this CPU can run exist (all three with
TOKENMILL_KERNEL_ISAS=all), this CPU loads the one its flags allow, and the builds it can run
compute the same thing (the portable one has no AVX, the AVX2 one no AVX-512)."""

from __future__ import annotations

import importlib
import importlib.util
import shutil
import subprocess

import pytest
import torch

from tokenmill.quantization.blocks import pack_q4
from tokenmill.utils import cpp_extension


def test_runtime_isa_follows_the_cpu_flags(monkeypatch):
    for capability, vnni, isa in [("AVX512", True, "avx512"), ("AVX512", False, "avx2"),
                                  ("AVX2", True, "avx2"), ("DEFAULT", False, "generic")]:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        monkeypatch.setattr(cpp_extension, "cpu_flags",
                            lambda v=vnni: {"avx2", "fma"} | ({"avx512_vnni"} if v else set()))
        assert cpp_extension.runtime_isa() == isa
        assert ("-mavx2" in cpp_extension.cflags()) == (isa != "generic")
        assert ("-mavx512f" in cpp_extension.cflags()) == (isa == "avx512")


def test_install_builds_what_this_cpu_runs_unless_asked_for_all(monkeypatch):
    monkeypatch.setattr(cpp_extension, "runtime_isa", lambda: "avx2")
    monkeypatch.delenv(cpp_extension.INSTALL_ISAS_ENV, raising=False)
    assert cpp_extension.install_isas() == ["avx2", "generic"]
    monkeypatch.setattr(cpp_extension, "runtime_isa", lambda: "avx512")
    assert cpp_extension.install_isas() == ["avx512", "avx2", "generic"]
    monkeypatch.setattr(cpp_extension, "runtime_isa", lambda: "generic")
    assert cpp_extension.install_isas() == ["generic"]
    monkeypatch.setenv(cpp_extension.INSTALL_ISAS_ENV, "all")
    assert cpp_extension.install_isas() == ["avx512", "avx2", "generic"]
    monkeypatch.setenv(cpp_extension.INSTALL_ISAS_ENV, "avx2")
    with pytest.raises(ValueError, match="'native' or 'all'"):
        cpp_extension.install_isas()


def _installed(name: str, isa: str) -> bool:
    return importlib.util.find_spec(f"tokenmill._C.{name}_{isa}") is not None


@pytest.mark.parametrize("name", cpp_extension.EXTENSIONS)
def test_every_build_installed_and_they_agree(name):
    for isa in cpp_extension.runnable_isas():  # installed (only those this CPU can run
        # are loaded: a module's initialisation may itself use its ISA, vmovdqu8 in pybind11's)
        assert _installed(name, isa), isa
    builds = {isa: importlib.import_module(f"tokenmill._C.{name}_{isa}")
              for isa in cpp_extension.runnable_isas()}
    loaded = cpp_extension.load_cpu_extension(name)
    assert loaded is builds[cpp_extension.runtime_isa()]
    if name == "cpu_ops":
        x = torch.randn(3, 49152)
        x[1, 7] = x[1].max() + 1
        xs, w = torch.randn(3, 256), torch.randn(40, 256)
        for module in builds.values():
            assert module.argmax_rows(x).tolist() == x.argmax(-1).tolist()
            torch.testing.assert_close(module.linear(xs, 0, 0, [w], None), xs @ w.T)
        # int8 activations, decode-sized and batched (the AVX-512 build's VNNI GEMM, the
        # others' row kernels): every build computes the same numbers
        q = torch.randint(-127, 128, (40, 256), dtype=torch.int8)
        d = torch.rand(40, 8).half() * 0.01
        xb = torch.randn(37, 256)
        outputs = [module.linear(xb[:m], 1, 32, [q, d], None, True)
                   for module in builds.values() for m in (3, 37)]
        for i in range(2, len(outputs)):
            torch.testing.assert_close(outputs[i], outputs[i % 2], atol=1e-4, rtol=1e-5)
        # and 4-bit weights (the AVX2 build's own tiled GEMM from 12 rows)
        q4 = [pack_q4(torch.randint(0, 16, (40, 256))), d, torch.randn(40, 8).half() * 0.01]
        outputs = [module.linear(xb[:m], 2, 32, q4, None, True)
                   for module in builds.values() for m in (3, 37)]
        for i in range(2, len(outputs)):
            torch.testing.assert_close(outputs[i], outputs[i % 2], atol=1e-4, rtol=1e-5)
        # float activations, batched: the AVX-512 build rounds them to int16 per 32-block,
        # the others expand float32 tiles (relative error ~1e-5 of a block's largest value)
        floats = [module.linear(xb, 1, 32, [q, d], None, False) for module in builds.values()]
        for out in floats[1:]:
            torch.testing.assert_close(out, floats[0], atol=1e-3, rtol=1e-4)


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump")
@pytest.mark.parametrize("name", cpp_extension.EXTENSIONS)
def test_generic_build_uses_no_avx_registers(name):
    for isa, ymm, zmm in (("generic", False, False), ("avx2", True, False),
                          ("avx512", True, True)):
        if not _installed(name, isa):  # an AVX-512 build exists only where it was asked for
            assert isa not in cpp_extension.runnable_isas()
            continue
        path = importlib.util.find_spec(f"tokenmill._C.{name}_{isa}").origin
        asm = subprocess.run(["objdump", "-d", path], capture_output=True, text=True).stdout
        assert ("ymm" in asm, "zmm" in asm) == (ymm, zmm), (name, isa)


def test_builds_for_another_torch_are_not_loaded(monkeypatch, tmp_path):
    info = tmp_path / "torch_version.txt"
    info.write_text("1.0.0\n")
    monkeypatch.setattr(cpp_extension, "BUILD_INFO", str(info))
    with pytest.raises(ImportError, match="compiled against torch 1.0.0"):
        cpp_extension._installed_build("cpu_ops", "generic")
    info.write_text(torch.__version__ + "\n")
    assert cpp_extension._installed_build("cpu_ops", "generic").argmax_rows
