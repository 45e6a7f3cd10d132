"""The side environments the benchmarks and engine tests use, pinned.

Add an environment here (one `SideEnv` with its pip steps) rather than
installing a peer by hand anywhere else.
"""

from __future__ import annotations

from sideenv import SideEnv

LIBCACHESIM_VERSION = "0.3.3"
LIBCACHESIM = SideEnv(
    "libcachesim",
    ((f"libcachesim=={LIBCACHESIM_VERSION}",),),
    "libCacheSim's eviction algorithms for `bench replay`",
)

# What the project itself needs at run time (pyproject's dependencies), for
# environments that install an engine with --no-deps and then run kvsidecar's
# code beside it.
PROJECT_DEPS = (
    "numpy>=1.26,<3", "pyzmq>=26,<28", "posix_ipc>=1.1,<2", "psutil>=5.9,<8",
    "msgspec>=0.18,<0.23", "PyYAML>=6,<7", "xxhash>=3.4,<5", "prometheus-client>=0.20,<1",
    "msgpack>=1.0,<2", "redis>=5.0,<7", "hiredis>=2.3,<4", "pytest>=8", "hypothesis>=6.100",
)  # fmt: skip

VLLM_VERSION = "0.33.0"
VLLM = SideEnv(
    "vllm",
    (
        ("torch==2.13.0",),  # the CPU build, as in the project's environment
        (f"vllm=={VLLM_VERSION}", "--no-deps"),
        (
            *PROJECT_DEPS,
            "filelock", "typing_extensions", "sympy", "networkx", "jinja2", "fsspec",
            "regex", "cachetools", "sentencepiece", "tqdm", "blake3", "py-cpuinfo",
            "transformers>=5.16.1,<5.21", "pydantic", "cloudpickle", "cbor2", "pybase64",
            "einops", "requests", "openai", "pillow", "aiohttp", "oss-harmony", "uvloop",
            "xgrammar", "fastapi[standard]<0.137", "partial-json-parser", "llguidance",
        ),
    ),
    "vLLM's scheduler and connector classes on CPU (tests/test_vllm_*, bench connector)",
)  # fmt: skip

SGLANG_VERSION = "0.5.23"
SGLANG = SideEnv(
    "sglang",
    (
        # SGLang's own torch pin: it imports torchvision at import time, which
        # fails against the project's torch 2.13.
        ("torch==2.14.1", "torchvision==0.29.1"),
        (f"sglang=={SGLANG_VERSION}", "--no-deps"),
        (
            *PROJECT_DEPS,
            # SGLang's own pins where it has them, then what its imports need.
            "transformers==5.19.0", "apache-tvm-ffi==0.1.11", "compressed-tensors==0.18.0",
            "sentencepiece==0.2.1", "orjson", "pybase64", "requests", "triton", "packaging",
            "pillow", "starlette", "pydantic_core", "tqdm", "IPython", "pydantic", "aiohttp",
            "dill", "gguf",
        ),
    ),
    "SGLang's HiCache storage classes and host KV pools on CPU (tests/test_sglang_*, bench sglang)",
)  # fmt: skip

DYNAMO_VERSION = "1.6.1"
DYNAMO = SideEnv(
    "dynamo",
    # ai-dynamo-runtime holds the Rust KV indexer (dynamo._core.RadixTree), which
    # runs on CPU with no etcd or NATS; msgpack reads the events `bench router`
    # writes for it.
    ((f"ai-dynamo-runtime=={DYNAMO_VERSION}", "msgpack>=1.0,<2", "numpy>=1.26,<3"),),
    "NVIDIA Dynamo's KV indexer beside the router's (bench router)",
)

AIBRIX_VERSION = "0.8.0"
AIBRIX = SideEnv(
    "aibrix",
    (
        ("torch==2.13.0",),  # the CPU build; aibrix-kvcache's own pin would pull CUDA's
        (f"aibrix-kvcache=={AIBRIX_VERSION}", "--no-deps"),
        (
            "numpy>=1.26,<3", "pyzmq>=26,<28", "posix_ipc>=1.1,<2", "asyncio>=3.4.3",
            "cityhash>=0.4.8", "more-itertools>=10.7.0", "msgspec>=0.19.0", "netifaces",
            "requests>=2.26.0",
            "tqdm>=4.67.1", "pydantic>=2.10", "pyyaml", "sortedcontainers>=2.4.0", "uvloop",
            "validators>=0.35.0", "zstandard", "redis==6.0.0", "nvtx", "pyroscope-io",
            "rocksdict",
        ),
    ),
    "AIBrix's in-process L1 KV cache for `bench control`'s per-call rows",
)  # fmt: skip

LMCACHE_VERSION = "0.5.6"
LMCACHE = SideEnv(
    "lmcache",
    (
        ("torch==2.13.0",),  # the CPU build; lmcache's deps would pull CUDA's and cupy
        (f"lmcache=={LMCACHE_VERSION}", "--no-deps"),
        (
            "numpy>=1.26,<=2.2.6", "pyzmq>=26,<28", "posix_ipc>=1.1,<2", "aiofile", "aiofiles",
            "blake3", "aiohttp", "awscrt", "cryptography", "fastapi", "httpx",
            "huggingface_hub>=1.5.0", "msgspec",
            "numba", "nvtx", "opentelemetry-api>=1.20.0,<=1.40.0", "opentelemetry-sdk>=1.20.0",
            "opentelemetry-exporter-otlp>=1.20.0",
            "opentelemetry-exporter-prometheus>=0.50b0,<=0.61b0",
            "prometheus_client>=0.18.0,<=0.24.1", "psutil", "py-cpuinfo", "pyyaml", "redis",
            "safetensors", "setuptools>=77.0.3,<81", "setuptools_scm>=8", "sortedcontainers",
            "transformers>=5.4", "uvicorn", "httptools", "cachetools", "grpcio>=1.78.0",
            "protobuf>=6.31.1,<7", "google-api-core", "google-cloud-bigtable",
        ),
    ),
    "LMCache's multiprocess server (ZeroMQ + POSIX shm) for `bench control`'s per-call rows",
)  # fmt: skip

ALL: dict[str, SideEnv] = {
    env.name: env for env in (LIBCACHESIM, VLLM, SGLANG, DYNAMO, AIBRIX, LMCACHE)
}
