"""ctypes bindings to libkvcopy.so, the CUDA copy library (csrc/kvcopy.cu).

Loading the library needs no GPU, driver or torch: it is linked with a static
CUDA runtime. `probe()` is what tells whether this machine can run it; every
failure becomes one of two exceptions:
- `GpuUnavailable`: the library is not built, or there is no usable NVIDIA
  driver or GPU. `open_copier` then copies CUDA planes with torch
  (`copier.StagedBlockCopier`).
- `CudaError`: a CUDA call failed on a working GPU (a bug or bad input).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

LIB_PATH = Path(__file__).resolve().parent / "libkvcopy.so"
ABI_VERSION = 4

# Errors meaning "no usable GPU here" rather than "this call was wrong".
UNAVAILABLE_ERRORS = frozenset(
    {
        "cudaErrorInsufficientDriver",
        "cudaErrorNoDevice",
        "cudaErrorStubLibrary",
        "cudaErrorCallRequiresNewerDriver",
        "cudaErrorSystemDriverMismatch",
        "cudaErrorCompatNotSupportedOnDevice",
        "cudaErrorDevicesUnavailable",
        "cudaErrorInitializationError",
        "cudaErrorSystemNotReady",
    }
)
HOST_ALREADY_REGISTERED = "cudaErrorHostMemoryAlreadyRegistered"
NOT_READY = 600  # cudaErrorNotReady: what kv_event_query returns for pending work

_P = ctypes.c_void_p
_I = ctypes.c_int
_I64 = ctypes.c_int64
_SZ = ctypes.c_size_t
_SIGNATURES: dict[str, tuple[type | None, tuple[type, ...]]] = {
    "kv_abi_version": (_I, ()),
    "kv_runtime_version": (_I, ()),
    "kv_has_batch_memcpy": (_I, ()),
    "kv_error_name": (ctypes.c_char_p, (_I,)),
    "kv_error_string": (ctypes.c_char_p, (_I,)),
    "kv_driver_version": (_I, (ctypes.POINTER(_I),)),
    "kv_device_count": (_I, (ctypes.POINTER(_I),)),
    "kv_sm_count": (_I, (_I, ctypes.POINTER(_I))),
    "kv_host_register": (_I, (_I, _P, _SZ, ctypes.POINTER(_P))),
    "kv_host_device_pointer": (_I, (_I, _P, ctypes.POINTER(_P))),
    "kv_host_unregister": (_I, (_P,)),
    "kv_stage_index": (_I, (_P, _P, _I64, _I64, _P, _P, _I64, _I64, _I64, _I, _P, _P)),
    "kv_ops_create": (
        _I,
        (_I, _P, _P, _P, _I64, _I64, _I64, _P, _I64, _I64, _I64, _I64, ctypes.POINTER(_P)),
    ),
    "kv_ops_destroy": (_I, (_P,)),
    "kv_ops_run": (
        _I,
        (_P, _P, _P, _I64, _P, _I64, _I64, _P, _I, _P, _P, _I64, _P, ctypes.POINTER(_I)),
    ),
    "kv_index_ring": (_I, ()),
    "kv_event_record_new": (_I, (_I, _P, ctypes.POINTER(_P))),
    "kv_events_destroy": (_I, (_I, _P, _I64)),
    "kv_stream_wait_event": (_I, (_I, _P, _P)),
    "kv_event_synchronize": (_I, (_I, _P)),
    "kv_event_query": (_I, (_I, _P)),
    "kv_copy_dma": (
        _I,
        (_I, _P, _P, _SZ, _SZ, _I, _P, ctypes.POINTER(_I), ctypes.POINTER(_I)),
    ),
    "kv_memcpy": (_I, (_I, _P, _P, _SZ, _P)),
}


class GpuUnavailable(RuntimeError):
    """No GPU copy path on this machine: the library is not built, or there
    is no usable NVIDIA driver or GPU. Use the CPU path (shm.copy) instead."""


class CudaError(RuntimeError):
    """A CUDA call failed on a machine that has a working GPU."""

    def __init__(self, code: int, name: str, message: str, what: str) -> None:
        super().__init__(f"{what}: {name} ({message})")
        self.code = code
        self.name = name


@functools.cache
def load() -> ctypes.CDLL:
    """The library with its signatures set. Raises GpuUnavailable if it is
    not built or does not load."""
    if not LIB_PATH.exists():
        raise GpuUnavailable(
            f"{LIB_PATH.name} is not built: install the CUDA toolkit (nvcc on PATH or in "
            "$CUDA_HOME/bin) and rerun `pip install -e .`; see docs/gpu.md"
        )
    try:
        lib = ctypes.CDLL(str(LIB_PATH))
    except OSError as exc:
        raise GpuUnavailable(f"{LIB_PATH} does not load: {exc}") from exc
    stale = f"{LIB_PATH.name} is stale (built from older sources): rerun `pip install -e .`"
    try:
        abi = lib.kv_abi_version  # checked first: an older build may lack newer symbols
        abi.restype, abi.argtypes = ctypes.c_int, []
        if abi() != ABI_VERSION:
            raise GpuUnavailable(f"{stale}; its ABI is {abi()}, not {ABI_VERSION}")
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
    except AttributeError as exc:  # a symbol this version needs is missing
        raise GpuUnavailable(f"{stale}: {exc}") from None
    return lib


def error_name(code: int) -> str:
    name: bytes = load().kv_error_name(code)
    return name.decode()


def check(code: int, what: str) -> None:
    """Raise GpuUnavailable or CudaError for a nonzero cudaError_t."""
    if code == 0:
        return
    lib = load()
    name, message = lib.kv_error_name(code).decode(), lib.kv_error_string(code).decode()
    if name in UNAVAILABLE_ERRORS:
        driver = driver_version()
        found = (
            "no NVIDIA driver (libcuda.so.1) is installed"
            if driver is None
            else f"the driver supports CUDA {driver}"
        )
        raise GpuUnavailable(
            f"{what} failed with {name} ({message}): {found}; libkvcopy.so needs an NVIDIA "
            f"GPU and a driver for CUDA {runtime_version()} or newer. Without them, block "
            "copies of CUDA tensors take torch's staged path (cuda_ext.copier)"
        )
    raise CudaError(code, name, message, what)


@functools.cache
def probe() -> int:
    """The number of usable GPUs (>= 1). Raises GpuUnavailable if there is none."""
    lib = load()
    count = ctypes.c_int(0)
    check(lib.kv_device_count(ctypes.byref(count)), "cudaGetDeviceCount")
    if count.value < 1:
        raise GpuUnavailable("the CUDA driver reports no GPU")
    return count.value


def runtime_version() -> str:
    """The CUDA runtime the library was built with, e.g. "13.0"."""
    version = load().kv_runtime_version()
    return f"{version // 1000}.{version % 1000 // 10}"


def driver_version() -> str | None:
    """The installed driver's CUDA version, or None without a driver."""
    version = ctypes.c_int(0)
    load().kv_driver_version(ctypes.byref(version))
    return f"{version.value // 1000}.{version.value % 1000 // 10}" if version.value else None


def sm_count(device: int) -> int:
    count = ctypes.c_int(0)
    check(load().kv_sm_count(device, ctypes.byref(count)), "cudaDeviceGetAttribute")
    return count.value


def host_register(device: int, address: int, nbytes: int) -> tuple[int, bool]:
    """Pin and map [address, address + nbytes): (device address, whether we
    registered it). Memory someone else registered already is used as is."""
    lib = load()
    pointer = ctypes.c_void_p(0)
    code = lib.kv_host_register(device, address, nbytes, ctypes.byref(pointer))
    if code != 0 and lib.kv_error_name(code).decode() == HOST_ALREADY_REGISTERED:
        code = lib.kv_host_device_pointer(device, address, ctypes.byref(pointer))
        check(code, "cudaHostGetDevicePointer of memory registered elsewhere")
        return int(pointer.value or 0), False
    check(code, f"cudaHostRegister of {nbytes:,} bytes")
    return int(pointer.value or 0), True


def host_unregister(address: int) -> None:
    check(load().kv_host_unregister(address), "cudaHostUnregister")
