#!/usr/bin/env bash
# The host tier's GPU checks in one call of a lent GPU machine (which has torch, Triton,
# numpy, attrs, xxhash, pyyaml, tqdm and pytest, reaches no registry, and misses blake3):
# the CUDA tests of the row tables, the mover, the staging and the device digests, then
# bench_tier (the vLLM worker's path, with its stages) and FastDeploy's mover against a
# pinned copy, every output under $OUT.
#
#   here, once:  bash tools/device_checks.sh --prepare   (blake3's wheel into .device/)
#   there:       run(command="bash tools/device_checks.sh", carry=[".device"], timeout_s=560)
#
# Each step has its own time limit, so that a slow one leaves the others their turn.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}

if [ "${1:-}" = "--prepare" ]; then
    grep -qx '/.device/' .git/info/exclude || echo '/.device/' >>.git/info/exclude
    exec "$PY" -m pip download blake3 --no-deps --only-binary=:all: --python-version "${DEVICE_PYTHON:-3.12}" \
        --platform manylinux_2_17_x86_64 -d .device/wheels
fi

OUT=${OUT:-/tmp/ucm-device-checks}
mkdir -p "$OUT"
"$PY" -m pip install --quiet --no-index --no-deps --target .device/site .device/wheels/*.whl
# ucm-core's compiled part, as its wheel hook builds it (packages/ucm-core/hatch_build.py)
(cd packages/ucm-core && cc -O3 -fPIC -shared -pthread -fvisibility=hidden \
    -o src/ucm/core/libucm_native.so native/*.c) || echo "no compiled part: Python copies"
export PYTHONPATH="$PWD/.device/site:$PWD/packages/ucm-core/src:$PWD/packages/ucm-kernels/src"
PYTHONPATH="$PYTHONPATH:$PWD/packages/ucm-lab/src:$PWD/packages/ucm-fastdeploy/src"
export PYTHONUNBUFFERED=1

{
    nvidia-smi --query-gpu=name,driver_version --format=csv
    lscpu | grep -E '^Model name|^CPU\(s\)'
    "$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
} 2>&1 | tee "$OUT/machine.txt"

# the harness's pytest plugin, named where ucm-lab is not installed (its entry point is not)
plugin=(-p ucm.lab.pytest_plugin)
"$PY" -c 'import importlib.metadata as m, sys
sys.exit(not any(e.name == "ucm_lab" for e in m.entry_points(group="pytest11")))' && plugin=()
tests=packages/ucm-kernels/tests
timeout 150 "$PY" -m pytest -q -p no:cacheprovider "${plugin[@]}" --import-mode=importlib \
    "$tests/test_row_table.py" "$tests/test_mover.py" "$tests/test_staging.py" \
    "$tests/test_digest.py" 2>&1 | tee "$OUT/tests.txt"

timeout 240 "$PY" -m ucm.lab.kernels.bench_tier --stages --repeat 3 \
    --sizes-kib 512,2048,8192,32768 --json 2>&1 | tee "$OUT/bench_tier.txt"

timeout 120 "$PY" -m ucm.lab.fastdeploy.bench_tier --device cuda --block-tokens 8 64 512 \
    --repeat 3 --json 2>&1 | tee "$OUT/fastdeploy_tier.txt"
