"""Where one HostStager.dump of FastDeploy-shaped blocks (16 layers, K and V: 32 caches)
into registered host memory spends its time, on a GPU machine: the plan, the kernel launch,
the DMA copy, the wait; then cProfile of 16 such calls by cumulative time.

    python3 tools/device/stager_steps.py [--block-tokens 64] [--blocks 8]
"""

from __future__ import annotations

import argparse
import cProfile
import mmap
import os
import pstats
import time

import torch
from ucm.kernels import HostStager, PinnedRegions
from ucm.kernels.api import execute
from ucm.kernels.staging import _copy_rows
from ucm.kernels.validate import GATHER, build_plan, rebind_buffers

p = argparse.ArgumentParser()
p.add_argument("--block-tokens", type=int, default=64)
p.add_argument("--blocks", type=int, default=8)
args = p.parse_args()
layers, heads, dim, n, t = 16, 8, 128, args.blocks, args.block_tokens
nb = 64
caches = [
    torch.randn(nb, heads, t, dim, device="cuda").to(torch.bfloat16) for _ in range(2 * layers)
]
block = 2 * layers * heads * t * dim * 2
size = 4 * n * block
fd = os.open("/dev/shm/ucm-stager-steps", os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, size)
region = memoryview(mmap.mmap(fd, size, mmap.MAP_SHARED))
pinned = PinnedRegions()
assert pinned.register(region)
views = [region[i * block : (i + 1) * block] for i in range(n)]
rows = pinned.rows(views)
stager = HostStager("cuda")
ids = list(range(n))
for _ in range(3):
    stager.dump(caches, ids, rows).wait()
torch.cuda.synchronize()
spent = {k: 0.0 for k in ("plan", "scratch+launch", "dma enqueue", "wait", "whole dump()")}
R = 20
for _ in range(R):
    t0 = time.perf_counter()
    plan = build_plan(GATHER, caches, ids, rows, host_buffers=True)
    t1 = time.perf_counter()
    scratch = torch.empty(
        (plan.num_store_blocks, plan.layout.nbytes), dtype=torch.uint8, device="cuda"
    )
    execute(rebind_buffers(plan, scratch), "auto")
    t2 = time.perf_counter()
    _copy_rows(scratch, plan)
    t3 = time.perf_counter()
    torch.cuda.synchronize()
    t4 = time.perf_counter()
    stager.dump(caches, ids, rows).wait()
    t5 = time.perf_counter()
    for k, v in zip(spent, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
        spent[k] += v
mb = n * block / 2**20
print(f"{n} blocks of {block >> 10} KiB ({mb:.0f} MiB) a call; mean of {R}, ms:")
for k, v in spent.items():
    print(f"  {k:<16} {v / R * 1e3:8.3f}")
print(f"  dump() GB/s: {n * block / (spent['whole dump()'] / R) / 1e9:.1f}")
prof = cProfile.Profile()
prof.enable()
for _ in range(16):
    stager.dump(caches, ids, rows).wait()
prof.disable()
pstats.Stats(prof).sort_stats("cumulative").print_stats(12)

# Back to back, as a pipelined mover issues them: what does issuing a dump cost while the
# copies before it are still running?  (Time inside the kernel's table upload counted apart.)
import ucm.kernels.triton_copy as tc  # noqa: E402

inside = [0.0]
real_to_device = tc._to_device


def timed_to_device(*a, **k):
    t0 = time.perf_counter()
    try:
        return real_to_device(*a, **k)
    finally:
        inside[0] += time.perf_counter() - t0


tc._to_device = timed_to_device
for mode in ("waited", "back to back"):
    torch.cuda.synchronize()
    inside[0] = 0.0
    issue = 0.0
    t0 = time.perf_counter()
    for _ in range(R):
        t1 = time.perf_counter()
        handle = stager.dump(caches, ids, rows)
        issue += time.perf_counter() - t1
        if mode == "waited":
            handle.wait()
    torch.cuda.synchronize()
    whole = time.perf_counter() - t0
    print(
        f"{mode}: issue {issue / R * 1e3:.3f} ms a dump (table upload {inside[0] / R * 1e3:.3f}),"
        f" {n * block * R / whole / 1e9:.1f} GB/s"
    )
pinned.close()
os.unlink("/dev/shm/ucm-stager-steps")
