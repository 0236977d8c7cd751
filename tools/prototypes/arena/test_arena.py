"""Checks of the arena prototype: round trips, LRU eviction, pins, a writer or a lock
holder killed mid-change, corruption, several processes at once.  Run:
``venv/bin/python -m pytest -q test_arena.py`` (or ``python test_arena.py``)."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shm_arena  # noqa: E402
from shm_arena import Arena, Geometry  # noqa: E402

G = Geometry(slot_bytes=64 << 10, slots=64)


def folder() -> str:
    return tempfile.mkdtemp(prefix="arena-test-", dir="/dev/shm")


def blocks(n: int, size: int = 64 << 10, seed: int = 0) -> tuple[list[bytes], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    keys = [rng.bytes(16) for _ in range(n)]
    data = [rng.integers(0, 256, size, np.uint8) for _ in range(n)]
    return keys, data


def run(fn, lock: str = "flock") -> None:
    d = folder()
    try:
        fn(d, lock)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _roundtrip(d: str, lock: str) -> None:
    a = Arena(d, G, lock=lock)
    keys, data = blocks(10)
    assert all(a.dump(keys, data))
    out = [np.zeros(64 << 10, np.uint8) for _ in keys]
    assert all(a.load(keys, out))
    assert all((x == y).all() for x, y in zip(out, data))
    assert a.lookup_prefix(keys) == 10 == a.lookup_prefix_loop(keys)
    assert a.lookup_prefix(keys[:3] + [b"x" * 16] + keys[3:]) == 3
    # another process's view (a second attach) sees them, as a restarted engine would
    b = Arena(d, G, lock=lock)
    assert b.lookup_prefix(keys) == 10
    a.remove(keys[5:])
    assert b.lookup_prefix(keys) == 5
    assert a.check() == [] and b.stats()["used"] == 5
    a.close()
    b.close()


def _lru(d: str, lock: str) -> None:
    a = Arena(d, G, lock=lock, evict_batch=1)
    keys, data = blocks(G.slots + 8)
    first = keys[: G.slots]
    assert all(a.dump(first, data[: G.slots]))
    out = [np.zeros(64 << 10, np.uint8)]
    assert a.load([first[0]], out)  # slot 0 now the most recently used
    assert all(a.dump(keys[G.slots :], data[G.slots :]))
    assert a.lookup_prefix([first[0]]) == 1  # kept: it was read
    assert a.lookup_prefix([first[1]]) == 0  # evicted: least recently used
    assert a.check() == []
    a.close()


def _pins(d: str, lock: str) -> None:
    a = Arena(d, G, lock=lock, evict_batch=G.slots)
    keys, data = blocks(G.slots)
    a.dump(keys, data)
    # pin every block as a reader in the middle of its copy would
    with a._locked():
        for k in keys:
            s = a._islot[a._find(*shm_arena._KEYS.unpack(k))]
            a._pins[s] += 1
            a._lease[s] = time.monotonic_ns() + 10**10
    more, mdata = blocks(1, seed=1)
    assert a.dump(more, mdata) == [False]  # nothing may be evicted: all are being read
    assert a.lookup_prefix(keys) == G.slots and a.check() == []
    a.close()


def _writer_killed(d: str, lock: str) -> None:
    a = Arena(d, G, lock=lock)
    keys, data = blocks(4)
    pid = os.fork()
    if pid == 0:  # a writer killed after taking slots and half-copying, before publishing
        c = Arena(d, G, lock=lock, populate=False)
        orig = shm_arena.copy_hashing

        def die(dst, src, chunk):
            dst[: len(dst) // 2] = src[: len(src) // 2]
            os.kill(os.getpid(), signal.SIGKILL)
            return orig(dst, src, chunk)

        shm_arena.copy_hashing = die
        c.dump(keys, data)
        os._exit(0)
    os.waitpid(pid, 0)
    assert a.lookup_prefix(keys) == 0  # nothing a reader takes
    writing = int((a._np["state"] == shm_arena.WRITING).sum())
    assert writing == 4
    # the slots come back once the writer is known dead (recovery or lease)
    a._sb[shm_arena.SB_DIRTY] = 1  # as if found dirty: run the recovery path
    with a._locked():
        pass
    assert int((a._np["state"] == shm_arena.WRITING).sum()) == 0 and a.check() == []
    a.close()


def _holder_killed(d: str, lock: str) -> None:
    a = Arena(d, G, lock=lock)
    keys, data = blocks(20)
    a.dump(keys, data)
    pid = os.fork()
    if pid == 0:  # dies holding the lock in the middle of removing blocks from the index
        c = Arena(d, G, lock=lock, populate=False)
        c._lock.acquire()
        c._sb[shm_arena.SB_DIRTY] = os.getpid()
        for k in keys[:10]:
            b = c._find(*shm_arena._KEYS.unpack(k))
            c._delete(b)  # index changed, columns not: inconsistent
        os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(pid, 0)
    t0 = time.perf_counter()
    out = [np.zeros(64 << 10, np.uint8) for _ in keys]
    assert all(a.load(keys, out))  # lock free again, index rebuilt from the columns
    assert time.perf_counter() - t0 < 1.0
    assert a.stats()["recoveries"] == 1 and a.check() == []
    a.close()


def _corruption(d: str, lock: str) -> None:
    a = Arena(d, G, lock=lock)
    keys, data = blocks(2)
    a.dump(keys, data)
    s = a._islot[a._find(*shm_arena._KEYS.unpack(keys[1]))]
    a.data[s * G.slot_bytes + 100] ^= 0xFF
    out = [np.zeros(64 << 10, np.uint8) for _ in keys]
    assert a.load(keys, out) == [True, False]
    assert a.lookup_prefix(keys) == 1 and a.check() == []  # the bad block is dropped
    a.close()


def _processes(d: str, lock: str) -> None:
    """Four processes dump and load overlapping keys into a small arena (constant
    eviction); every load that succeeds returns the right bytes."""
    g = Geometry(slot_bytes=16 << 10, slots=32)
    Arena(d, g, lock=lock).close()
    keys, data = blocks(64, 16 << 10)
    pids = []
    for w in range(4):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                c = Arena(d, g, lock=lock, evict_batch=4)
                rng = np.random.default_rng(w)
                out = np.zeros(16 << 10, np.uint8)
                for _ in range(300):
                    i = int(rng.integers(64))
                    c.dump([keys[i]], [data[i]])
                    j = int(rng.integers(64))
                    if c.load([keys[j]], [out])[0] and not (out == data[j]).all():
                        code = 3
            except Exception as exc:  # noqa: BLE001
                print("worker", w, repr(exc))
                code = 2
            os._exit(code)
        pids.append(pid)
    codes = [os.waitpid(p, 0)[1] for p in pids]
    assert codes == [0, 0, 0, 0], codes
    a = Arena(d, g, lock=lock)
    assert a.check() == [] and a.stats()["recoveries"] == 0
    a.close()


def _threads(d: str, lock: str) -> None:
    a = Arena(d, G, lock=lock, threads=2)
    keys, data = blocks(9)
    assert all(a.dump(keys, data))
    out = [np.zeros(64 << 10, np.uint8) for _ in keys]
    assert all(a.load(keys, out))
    assert all((x == y).all() for x, y in zip(out, data))
    b = Arena(d, G, lock=lock)  # a one-thread process checks the same sums
    assert all(b.load(keys, out))
    a.close()
    b.close()


def _churn(d: str, lock: str) -> None:
    """Many evictions: tombstones pile up, the index is rebuilt, nothing is lost or kept
    twice, and the newest blocks are there."""
    g = Geometry(slot_bytes=4096, slots=256)
    a = Arena(d, g, lock=lock, evict_batch=16)
    keys, data = blocks(3000, 4096)
    for s in range(0, 3000, 10):
        assert all(a.dump(keys[s : s + 10], data[s : s + 10]))
        assert a.check() == []
    assert a.stats()["index_rebuilds"] > 0
    assert a.lookup_prefix(keys[-200:]) == 200
    out = [np.zeros(4096, np.uint8) for _ in range(200)]
    assert all(a.load(keys[-200:], out))
    assert all((x == y).all() for x, y in zip(out, data[-200:]))
    a.close()


TESTS = [_threads, _churn, _roundtrip, _lru, _pins, _writer_killed, _holder_killed, _corruption, _processes]


def test_flock() -> None:
    for t in TESTS:
        run(t, "flock")


def test_robust() -> None:
    for t in TESTS:
        run(t, "robust")


def test_bulk() -> None:
    """Every test again with the numpy book-keeping for all batch sizes."""
    shm_arena.BULK_MIN = 1
    try:
        for t in TESTS:
            run(t, "flock")
    finally:
        shm_arena.BULK_MIN = 1 << 30


if __name__ == "__main__":
    for bulk in (1 << 30, 1):
        shm_arena.BULK_MIN = bulk
        for lock in ("flock", "robust"):
            for t in TESTS:
                run(t, lock)
                print("ok", lock, "bulk_min", bulk, t.__name__)
