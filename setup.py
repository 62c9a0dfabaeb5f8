"""Compiles the C++ CPU kernels at install time: each kernel in the builds (avx512, avx2,
generic) this CPU can run, or in all three with TOKENMILL_KERNEL_ISAS=all (a wheel for other
machines), so a first start loads them instead of compiling for a minute. The run-time choice
between the builds (by the CPU's flags), the flags themselves and the install's choice live in
tokenmill/utils/cpp_extension.py, read here as a file so that no other tokenmill import (nor
its dependencies) is needed to build. The extensions are optional: without a compiler the
install still succeeds and the kernels compile on first use, or PyTorch ops stand in."""

import importlib.util
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

_spec = importlib.util.spec_from_file_location("cpp_extension",
                                               "tokenmill/utils/cpp_extension.py")
cpp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cpp)


def variant_source(name: str, isa: str) -> str:
    """A one-line source per (kernel, isa) that includes the kernel: each build then has an
    object file of its own (two builds of one source would share one, and race)."""
    path = os.path.join("build", "kernel_sources", f"{name}_{isa}.cpp")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(f'#include "{name}.cpp"\n')
    return path


def record_torch_version() -> None:
    """The torch the kernels are compiled against: the loader uses them only with it."""
    import torch

    os.makedirs("tokenmill/_C", exist_ok=True)
    with open(cpp.BUILD_INFO, "w") as f:
        f.write(torch.__version__ + "\n")


ext_modules = []
if os.environ.get("TOKENMILL_CPU_KERNELS", "1") != "0":
    record_torch_version()
    ext_modules = [
        CppExtension(f"tokenmill._C.{name}_{isa}", [variant_source(name, isa)],
                     include_dirs=[os.path.abspath("tokenmill/csrc")],
                     extra_compile_args=cpp.cflags(isa), extra_link_args=["-fopenmp"],
                     optional=True)
        for name in cpp.EXTENSIONS for isa in cpp.install_isas()]

class BuildKernels(BuildExtension.with_options(use_ninja=False)):
    """Kernels compile side by side, one per core (each is one translation unit). Without
    ninja: torch's ninja path writes one build.ninja per build directory, which parallel
    extension builds would share."""

    def finalize_options(self) -> None:
        super().finalize_options()
        self.parallel = self.parallel or os.cpu_count() or 1


setup(ext_modules=ext_modules, cmdclass={"build_ext": BuildKernels})
