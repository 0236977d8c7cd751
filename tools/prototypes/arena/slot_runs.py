"""How contiguous a batch's slots are once the host arena has turned over many times: a GPU
copies a run of slots that follow each other in one DMA copy, and every other slot on its
own.  4096 slots of 4 KiB; batches of 16, 32 or 64 new blocks, each followed by three loads
of 8 random blocks among the last 3000 stored (re-read prefixes move their recency).

    python slot_runs.py [exact]
"""
import ctypes
import os
import random
import shutil
import uuid

import sys

import numpy as np
from ucm.core.config import DramStoreConfig
from ucm.core.store import SharedMemoryStore

size = 4096
path = f"/dev/shm/ucm-contig-{uuid.uuid4().hex[:8]}"
store = SharedMemoryStore(DramStoreConfig(path=path, capacity_gb=4096 * size / 2**30))
if sys.argv[1:] == ["exact"]:  # slot by slot, exact LRU, with group_evict.patch applied
    from ucm.core.store.dram import arena as arena_module

    arena_module.EVICT_GROUP_MIN = 1 << 40
rng = random.Random(1)
misses = loads = 0
stored = []
runs_by_round = []
for _ in range(400):
    n = rng.choice([16, 32, 64])
    keys = [os.urandom(16) for _ in range(n)]
    w = store.open_writes(keys, size)
    addrs = [ctypes.addressof(ctypes.c_char.from_buffer(v)) for v in w.views if v is not None]
    d = np.diff(addrs)
    runs = 1 + int((d != size).sum())
    runs_by_round.append((n, runs))
    for v in w.views:
        if v is not None:
            v[:8] = b"x" * 8
    store.wait(w.commit())
    del w, addrs
    stored.extend(keys)
    # requests re-read some older prefixes (recency moves)
    for _ in range(3):
        k = rng.sample(stored[-3000:], 8)
        got = store.wait(store.load(k, [bytearray(size) for _ in k]))
        loads += len(k)
        misses += sum(not r.ok for r in got)
print("evicted", store.evicted_blocks, f"re-reads missed {misses / loads:.3f}")
for lo, hi in ((0, 50), (100, 200), (300, 400)):
    part = runs_by_round[lo:hi]
    print(f"rounds {lo}-{hi}: blocks per run {sum(n for n, _ in part) / sum(r for _, r in part):.1f}")
store.close(); shutil.rmtree(path, ignore_errors=True)
