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

ALL: dict[str, SideEnv] = {env.name: env for env in (LIBCACHESIM, VLLM, SGLANG, DYNAMO)}
