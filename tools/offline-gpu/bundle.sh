#!/usr/bin/env bash
# Packs what the GPU checks need onto a GPU machine that reaches no package
# index (the device machines lent to this project: Python 3.12, CUDA torch,
# nothing to download from). Run it here, from anywhere in the checkout,
# after `.venv` exists and `kvsidecar bench connector` has installed vLLM's
# side environment once. It writes two sets, each under the 64 MiB a device
# call may carry (git-ignored):
#   .offline/base/   wheels of the project's runtime dependencies, of
#                    transformers (HF tests, `bench ttft`) and of pytest,
#                    xdist and hypothesis (the GPU tests), without what
#                    they need in turn: the GPU machine has numpy, torch,
#                    huggingface_hub, tokenizers and the like already
#   .offline/vllm/   wheels of every distribution that importing vLLM's
#                    scheduler and the connector loads, at the side
#                    environment's versions, less what the GPU machine
#                    has (torch and what it needs, numpy, and what
#                    transformers needs);
#                    and vllm-py.tar.gz, vLLM's own Python files:
#                    `bench connector` runs vLLM's scheduler and connector
#                    classes, never its compiled kernels, which stay out
# Then, on the GPU machine: tools/offline-gpu/run.sh (see there).
# Usage: tools/offline-gpu/bundle.sh [the GPU machine's Python version, 3.12]
set -euo pipefail
cd "$(dirname "$0")/../.."
PYV=${1:-3.12}
OUT=.offline
SIDE_PY=${KVSIDECAR_SIDE_ENVS:-$HOME/.cache/kvsidecar/side-envs}/vllm/bin/python
if [ ! -x "$SIDE_PY" ]; then
    echo "no vLLM side environment at $SIDE_PY: run 'kvsidecar bench connector' once" >&2
    exit 2
fi
rm -rf "$OUT"
mkdir -p "$OUT/base" "$OUT/vllm/wheels"
platforms=()
for p in manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 \
         manylinux_2_31 manylinux_2_34; do
    platforms+=(--platform "${p}_x86_64")
done
download() {  # download DIR REQUIREMENT...
    local dir=$1
    shift
    .venv/bin/pip download -q --no-deps --only-binary=:all: --python-version "$PYV" \
        --implementation cp "${platforms[@]}" -d "$dir" "$@"
}

# The project's runtime dependencies but numpy, and the HF extra's transformers.
project() {  # project EXPRESSION: pyproject.toml's [project] table is `p`
    .venv/bin/python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; $1"
}
mapfile -t deps < <(project 'print("\n".join(d for d in p["dependencies"] if not d.startswith("numpy")))')
transformers=$(project 'print(next(d for d in p["optional-dependencies"]["hf"] if d.startswith("transformers")))')
# run.sh's GPU tests: pytest, xdist and hypothesis with what they need, at
# this checkout's versions (a GPU machine's Python need not have them).
mapfile -t testing < <(.venv/bin/python -c 'import importlib.metadata as md
for d in ("pytest", "pytest-xdist", "execnet", "pluggy", "iniconfig", "pygments",
          "hypothesis", "sortedcontainers", "attrs"):
    print(f"{d}=={md.version(d)}")')
download "$OUT/base" "${deps[@]}" "$transformers" "${testing[@]}"

# What importing vLLM's scheduler and kvsidecar's connector loads, pinned as
# the side environment has it.
mapfile -t vdeps < <(PYTHONPATH=$PWD "$SIDE_PY" - <<'PY'
import importlib.metadata as md
import re
import sys

import bench.connector_engine  # noqa: F401  (vLLM's Scheduler, factory, mixin)
import engine_shim.vllm_connector  # noqa: F401

site = next(p for p in sys.path if p.endswith("site-packages"))
tops = {m.split(".")[0] for m, mod in list(sys.modules.items())
        if (getattr(mod, "__file__", None) or "").startswith(site)}
dists = md.packages_distributions()
def name(req: str) -> str:
    return re.split(r"[ ;<>=!~\[]", req, maxsplit=1)[0].lower().replace("_", "-")
def needs(dist: str, seen: set[str]) -> set[str]:  # dist and what it needs, transitively
    key = name(dist)
    if key in seen:
        return seen
    seen.add(key)
    try:
        reqs = md.requires(dist) or ()
    except md.PackageNotFoundError:
        return seen
    for r in reqs:
        if "extra ==" not in r:
            needs(name(r), seen)
    return seen
# Torch and what it needs are there, numpy, and what transformers needs
# (the HF tests ran there on 2026-11-27 with only transformers carried).
on_the_gpu_machine = needs("torch", set()) | {
    "triton", "numpy", "setuptools", "huggingface-hub", "hf-xet", "tokenizers",
    "safetensors", "regex", "tqdm", "pyyaml", "packaging",
}
for dist in sorted({d for t in tops for d in dists.get(t, ())} - {"vllm"}):
    if dist.lower().replace("_", "-") not in on_the_gpu_machine:
        print(f"{dist}=={md.version(dist)}")
PY
)
# and the project's own runtime dependencies (the sidecar's, which vLLM's
# imports do not load), so that this set needs no other.
download "$OUT/vllm/wheels" "${vdeps[@]}" "${deps[@]}"

site=$("$SIDE_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
(cd "$site" && find vllm -path vllm/third_party -prune -o -type f \( -name '*.py' -o -name '*.json' \) -print \
    | tar -czf - -T - vllm-*.dist-info) > "$OUT/vllm/vllm-py.tar.gz"

du -sh "$OUT/base" "$OUT/vllm"
