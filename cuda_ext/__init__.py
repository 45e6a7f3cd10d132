"""CUDA kernels for GPU<->host block copies (arrives with the GPU data-plane issue)."""
