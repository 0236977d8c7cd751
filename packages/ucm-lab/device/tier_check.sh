#!/bin/bash
# The host tier on a GPU machine without vLLM (a lent device machine: torch and Triton,
# no registry): the worker's and FastDeploy's round trips on CUDA caches, FastDeploy's
# host-tier bench, then `bench_tier` (TIER_RUNS, 2) times.
# Run from the repository root, with the wheels the machine lacks in .whl/ (blake3).
# Writes its logs under $OUT when set.
set -u
OUT=${OUT:-/tmp/tier_check}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:packages/ucm-core/src:packages/ucm-kernels/src:packages/ucm-vllm/src:packages/ucm-fastdeploy/src:packages/ucm-lab/src
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
df -h /dev/shm | tail -1
nproc
python3 - <<'PY' 2>&1 | tee "$OUT/probe.txt"
# Is memory someone else mapped (a file in /dev/shm) pinned once registered, and how fast
# does a GPU copy into it, before and after?
import mmap, os, time, torch
from ucm.kernels import PinnedRegions
size = 256 << 20
fd = os.open("/dev/shm/ucm-probe", os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, size)
region = memoryview(mmap.mmap(fd, size, mmap.MAP_SHARED))
host = torch.frombuffer(region, dtype=torch.uint8)
host.fill_(1)
dev = torch.randint(0, 255, (size,), dtype=torch.uint8, device="cuda")
def gbs():
    host.copy_(dev, non_blocking=True); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        host.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * size / (time.perf_counter() - t) / 1e9
print("torch", torch.__version__, "pinned before:", host.is_pinned(), f"D2H {gbs():.1f} GB/s")
pinned = PinnedRegions()
t = time.perf_counter()
ok = pinned.register(region)
print("registered:", ok, f"in {time.perf_counter() - t:.3f} s;", "pinned after:", host.is_pinned(), f"D2H {gbs():.1f} GB/s")
assert torch.equal(host, dev.cpu())
pinned.close()
print("after unregister pinned:", host.is_pinned())
os.unlink("/dev/shm/ucm-probe")
PY
timeout 240 python3 -c "import sys; sys.modules['vllm'] = None; import pytest; sys.exit(pytest.main(['packages/ucm-vllm/tests/test_worker.py', 'packages/ucm-kernels/tests/test_staging.py', '-q', '-p', 'no:cacheprovider', '--import-mode=importlib', '-k', 'cuda']))" 2>&1 | tee "$OUT/pytest.txt" | tail -25
# FastDeploy's AttentionStore on CUDA caches (torch tensors stand in for paddle's, which
# reach the kernels as torch views through DLPack): the staged path and the host tier's
timeout 180 python3 -c "import sys, pytest; sys.exit(pytest.main(['packages/ucm-fastdeploy/tests/test_cuda.py', '-q', '-p', 'no:cacheprovider', '--import-mode=importlib', '--noconftest', '-p', 'ucm.lab.pytest_plugin']))" 2>&1 | tee "$OUT/pytest_fastdeploy.txt" | tail -25
timeout 200 python3 -m ucm.lab.fastdeploy.bench_tier --repeat "${FD_REPEAT:-5}" --json 2>&1 | tee "$OUT/bench_fastdeploy_tier.txt" | grep -v '^{'
for run in $(seq 1 "${TIER_RUNS:-2}"); do
  timeout 200 python3 -m ucm.lab.kernels.bench_tier --json 2>&1 | tee "$OUT/bench_tier$run.txt" | grep -v '^{'
done
rm -rf /dev/shm/ucm-bench-tier-* /dev/shm/ucm-bench-fd-tier-* /dev/shm/ucm-test-*
