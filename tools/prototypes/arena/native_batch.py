"""Is one compiled call per batch enough for the 256 KiB target? (issue 26, point 1)

Copies and hashes 1 GiB of 256 KiB blocks into pre-faulted memory and back, in batches of
128 dealt out to 1 or 2 threads, three ways in the same run: memcpy (one thread, the
baseline of ``ucm bench store``), the store's own routine (``move_sealed``: one xxh3 call
and one numpy copy per block, each releasing the GIL) and ``native_batch.c`` (one call per
thread per batch).  Prints ratios to memcpy, write / read.  Needs the project's venv and
``libnative_batch.so`` built beside this file (see native_batch.c).
"""

import ctypes
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from ucm.lab.core.bench import BATCH, _memcpy, _sealed_copies, aligned

HERE = os.path.dirname(os.path.abspath(__file__))
lib = ctypes.CDLL(os.path.join(HERE, "libnative_batch.so"))
move = lib.move_sealed_batch
move.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64,
                 ctypes.c_void_p]
SIZE, N = 256 * 1024, 4096
srcs = [aligned(SIZE) for _ in range(16)]
dsts = [aligned(SIZE) for _ in range(BATCH)]
pool = [aligned(SIZE) for _ in range(N)]


def address(buf):
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


A_SRC, A_DST, A_POOL = ([address(b) for b in bufs] for bufs in (srcs, dsts, pool))


def native(threads):
    def direction(into):
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            for s in range(0, N, BATCH):
                idx = range(s, s + BATCH)
                d = [A_POOL[i] if into else A_DST[i % BATCH] for i in idx]
                r = [A_SRC[i % 16] if into else A_POOL[i] for i in idx]

                def part(k):
                    dd, ss = d[k::threads], r[k::threads]
                    seals = np.zeros(len(dd), np.uint64)
                    move((ctypes.c_void_p * len(dd))(*dd), (ctypes.c_void_p * len(ss))(*ss),
                         SIZE, len(dd), seals.ctypes.data)

                list(ex.map(part, range(threads)))
        return time.perf_counter() - t0

    return direction(True), direction(False)


for _ in range(3):
    m = min((_memcpy(srcs, pool, dsts, N) for _ in range(3)), key=sum)
    for t in (1, 2):
        c = min((native(t) for _ in range(3)), key=sum)
        p = min((_sealed_copies(srcs, pool, dsts, N, t) for _ in range(3)), key=sum)
        print(f"threads {t}: native batch {m[0] / c[0]:.2f} / {m[1] / c[1]:.2f}   "
              f"move_sealed {m[0] / p[0]:.2f} / {m[1] / p[1]:.2f}")
