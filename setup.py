"""Build the optional C accelerators; all package metadata lives in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "sidecar._blake2chain",
            sources=["sidecar/_blake2chain.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "sidecar._nodeheap",
            sources=["sidecar/_nodeheap.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "shm._blockcopy",
            sources=["shm/_blockcopy.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
    ]
)
