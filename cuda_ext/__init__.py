"""The GPU data plane: block copies between an engine's paged KV cache and
the shared-memory CPU tier (docs/gpu.md).

- `layouts`: every engine layout (vLLM flash, FlashInfer, cross-layer, MLA,
  block-major, and vLLM 0.33's strided views) as a list of block-major planes;
- `runs`: a strided tensor's blocks as contiguous runs, and the check that
  planes never share a byte;
- `copier`: argument checks shared by both copiers, and the CPU copier
  (shm.copy) that CPU tensors and CI use;
- `gpu`: the CUDA copier over libkvcopy.so (csrc/kvcopy.cu, built by nvcc
  at install time), with per-layer events;
- `_lib`: the ctypes bindings, and `GpuUnavailable` where no GPU can run it.

Nothing here is imported by the sidecar daemon.
"""

from cuda_ext._lib import CudaError, GpuUnavailable

__all__ = ["CudaError", "GpuUnavailable"]
