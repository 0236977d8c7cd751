#!/bin/bash
# `ucm bench store` on a lent GPU machine's host (16 cores): the host tier's ratios to memcpy
# on a server rather than the 2-vCPU development VM.  ucm-lab is on PYTHONPATH only (no
# entry points there), so the bench is called directly.
set -u
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:packages/ucm-core/src:packages/ucm-lab/src PYTHONUNBUFFERED=1
lscpu | grep -E "Model name|^CPU\(s\)"
${PY:-python3} -c "from ucm.core.store.dram import sealing; print('compiled copies:', sealing.compiled(), sealing.LIBRARY)"
${PY:-python3} -c "
import argparse, sys
from ucm.lab.core.bench import run_store_bench
sys.exit(run_store_bench(argparse.Namespace(path='/tmp/ucm-bench', total_gb=float(sys.argv[1]),
    block_kib=[2048, 256], repeat=int(sys.argv[2]), kind='local', master=None, signed=False,
    json=False)))" "${1:-1}" "${2:-3}" 2>&1 | grep -v "it/s\]$"
