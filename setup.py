"""Build the optional C accelerators and the CUDA copy library; all package
metadata lives in pyproject.toml.

The CUDA library (cuda_ext/libkvcopy.so, see docs/gpu.md) has a plain C ABI
and is loaded with ctypes, so it needs neither torch's C++ headers nor a GPU
to build: nvcc from PATH or $CUDA_HOME/bin compiles it in a few seconds.
Without nvcc, or if nvcc fails, the install goes on without it (a warning
says so) and block copies take the CPU path (shm.copy).
"""

import os
import shutil
import subprocess

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import ExecError

# H100/H200 machine code, plus compute_80 PTX the driver compiles for any
# other GPU from A100 on.
NVCC_GENCODE = ("arch=compute_90,code=sm_90", "arch=compute_80,code=compute_80")
# cudart is linked statically (nvcc's default) and, like every symbol but the
# library's own kv_* functions, kept private: the library loads on machines
# without CUDA libraries and never binds to the engine's own libcudart.
NVCC_FLAGS = (
    "-O3",
    "-shared",
    "-Xcompiler=-fPIC,-fvisibility=hidden",
    "-Xlinker=--exclude-libs,ALL",
    "--threads=2",
)


class CudaLibrary(Extension):
    """A shared library that nvcc builds from .cu sources; not a Python module."""


def find_nvcc() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidate = os.path.join(cuda_home, "bin", "nvcc") if cuda_home else None
    if candidate and os.access(candidate, os.X_OK):
        return candidate
    return shutil.which("nvcc")


class BuildExt(build_ext):
    def get_ext_filename(self, fullname: str) -> str:
        libraries = {e.name.split(".")[-1] for e in self.extensions if isinstance(e, CudaLibrary)}
        if fullname.split(".")[-1] in libraries:
            return os.path.join(*fullname.split(".")) + ".so"
        return super().get_ext_filename(fullname)

    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, CudaLibrary):
            super().build_extension(ext)
            return
        nvcc = find_nvcc()
        if nvcc is None:
            self.warn(f"nvcc not found on PATH or in $CUDA_HOME/bin: {ext.name} not built")
            return
        output = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(output), exist_ok=True)
        gencode = [f"-gencode={g}" for g in NVCC_GENCODE]
        command = [nvcc, *NVCC_FLAGS, *gencode, "-o", output, *ext.sources]
        self.announce(" ".join(command), level=2)
        try:
            subprocess.run(command, check=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            # An optional extension: setuptools turns this into a warning.
            raise ExecError(f"nvcc failed: {exc}") from exc


setup(
    cmdclass={"build_ext": BuildExt},
    ext_modules=[
        Extension(
            "contract._blake2chain",
            sources=["contract/_blake2chain.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "sidecar.control._nodeheap",
            sources=["sidecar/control/_nodeheap.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "shm._blockcopy",
            sources=["shm/_blockcopy.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "sidecar.tiers.ssd._aio",
            sources=["sidecar/tiers/ssd/_aio.c"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Extension(
            "shm._hotindex",
            sources=["shm/_hotindex.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "router._cindex",
            sources=["router/_cindex.c", "router/_cindex_core.c"],
            depends=["router/_cindex.h"],
            extra_compile_args=["-O3", "-fvisibility=hidden"],
            optional=True,
        ),
        CudaLibrary("cuda_ext.libkvcopy", sources=["cuda_ext/csrc/kvcopy.cu"], optional=True),
    ],
)
