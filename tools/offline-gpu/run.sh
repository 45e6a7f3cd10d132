#!/usr/bin/env bash
# The GPU checks, on a GPU machine that reaches no package index, from the
# sets tools/offline-gpu/bundle.sh packed (carried there under .offline/).
# Run from the repository root; results go to $OUT (default ./gpu-out).
#
#   tools/offline-gpu/run.sh base [tests] [gpu] [ttft]
#       carry .offline/base: the GPU tests (~3 min on an H200), `bench gpu`,
#       `bench ttft` (bf16, Llama-3-8B, two lengths; ~4 min); all three
#       when none is named
#   tools/offline-gpu/run.sh vllm
#       carry .offline/vllm: `bench connector --device cuda` through vLLM's
#       classes ($STEPS timed steps a case and engine, 60 by default)
#
# A device call runs 10 minutes at most: name fewer steps to fit.
# Each step runs under its own time limit and the next runs whatever it
# did; the exit status is the number of steps that failed. Extensions are
# built in place (again only if changed: a warm machine keeps them).
set -uo pipefail
cd "$(dirname "$0")/../.."
MODE=${1:-}
shift || true
WANT=${*:-tests gpu ttft}
if [ "$MODE" != base ] && [ "$MODE" != vllm ]; then
    echo "usage: tools/offline-gpu/run.sh base [tests] [gpu] [ttft] | vllm" >&2
    exit 2
fi
for w in $WANT; do
    case $w in tests | gpu | ttft) ;; *) echo "unknown step '$w'" >&2 && exit 2 ;; esac
done
wants() { [[ " $WANT " == *" $1 "* ]]; }
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
failed=0
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date -u +%H:%M:%S))"
    timeout "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1
    local rc=$?
    echo "== $name: rc $rc"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}
install_set() {  # install_set WHEEL_DIR: into $SITE, which goes on PYTHONPATH
    step install 120 "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$1"/*.whl
    export PYTHONPATH=$PWD:$SITE
    # Incremental: a second call on a warm machine rebuilds nothing.
    step build 180 "$PY" setup.py -q build_ext --inplace -j16
}
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true

case $MODE in
base)
    SITE=/tmp/kvs-site
    install_set .offline/base
    wants tests && step gpu-tests 300 "$PY" -m pytest -q -p no:cacheprovider -n 6 \
        tests/test_cuda_ext_build.py tests/test_cuda_ext_gpu.py tests/test_cuda_ext_layouts.py \
        tests/test_cuda_ext_vllm_layouts.py tests/test_gpu_client.py tests/test_hf_device.py \
        tests/test_bench_gpu.py tests/test_bench_ttft.py tests/test_vllm_connector_cuda.py \
        tests/test_vllm_connector_layouts.py tests/test_vllm_connector_tp_procs.py
    wants gpu && step bench-gpu 180 "$PY" -m kvsidecar bench gpu --json "$OUT/gpu.json"
    wants ttft && step bench-ttft 300 "$PY" -m kvsidecar bench ttft --device cuda --dtype bf16 \
        --model llama3-8b --lengths 4096,16384 --samples 1 --repeats 3 --json "$OUT/ttft.json"
    ;;
vllm)
    SITE=/tmp/kvs-vllm-site
    install_set .offline/vllm/wheels
    step unpack 60 tar -xzf .offline/vllm/vllm-py.tar.gz -C "$SITE"
    step import-vllm 120 "$PY" -c 'import bench.connector_engine, engine_shim.vllm_connector'
    step bench-connector 420 "$PY" -m bench.connector --device cuda --steps "${STEPS:-60}" \
        --json "$OUT/connector_gpu.json"
    ;;
esac
echo "steps failed: $failed"
exit "$failed"
