"""Design measurements for the host tier (issue 26, point 1): each candidate against memcpy of
the same bytes in the same round, at 2 MiB and 256 KiB blocks, write and read, checksum on
and off.

  memcpy        numpy copyto into a pre-faulted pool (one slice per block) and back out
  arena         shm_arena.Arena: one pre-faulted /dev/shm file, fixed slots, shared index
  lmdb          LMDB on /dev/shm (writemap, no sync), payload db + a meta db for checksums
  files         one file per block on /dev/shm: tmp file + rename, open + preadv (the
                posix store's I/O pattern, without its capacity bookkeeping)
  ucm dram      the project's SharedMemoryStore itself (if /work/main is importable)

Every case runs once per round, in a shuffled order; a round's ratio is the memcpy time of
that round over the case's.  Printed: median GB/s, and the median ratio with its min-max
over the rounds (the machine is shared: the spread is the noise).  Then the parts:
xxh3 cost, copy+hash in chunks, lock costs, lookup of 512 keys, eviction pass, populate.

Run: venv/bin/python bench.py [--rounds 7] [--total-mib 512] [--quick]
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import shutil
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np
import xxhash

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import shm_arena  # noqa: E402
from shm_arena import Arena, Geometry, copy_hashing  # noqa: E402

BATCH = 128  # keys per dump/load call, as in `ucm bench store`
MIB = 1 << 20
SHM = "/dev/shm"
UCM_SRC = "/work/main/packages/ucm-core/src"


def prefaulted(nbytes: int) -> np.ndarray:
    """Page-aligned, pages faulted in.  Alignment matters on this CPU (AMD EPYC, glibc's
    `rep movsb`): a destination 16 bytes past a page boundary from a page-aligned source,
    as malloc's large blocks (np.empty) are, copies 64 KiB-1 MiB pieces ~4.5x slower."""
    a = np.frombuffer(mmap.mmap(-1, nbytes), np.uint8)
    a.fill(1)
    return a


def shm_folder(tag: str) -> str:
    return tempfile.mkdtemp(prefix=f"arena-bench-{tag}-", dir=SHM)


# -- cases: each has reset() (untimed), write() and read() returning seconds -----------------


class Memcpy:
    name = "memcpy"

    def __init__(self, srcs: list, dsts: list, n: int, size: int) -> None:
        self.srcs, self.dsts, self.n, self.size = srcs, dsts, n, size
        self.pool = prefaulted(n * size)

    def reset(self) -> None:
        pass

    def write(self) -> float:
        pool, srcs, size = self.pool, self.srcs, self.size
        t0 = time.perf_counter()
        for i in range(self.n):
            np.copyto(pool[i * size : (i + 1) * size], srcs[i % len(srcs)])
        return time.perf_counter() - t0

    def read(self) -> float:
        pool, dsts, size = self.pool, self.dsts, self.size
        t0 = time.perf_counter()
        for i in range(self.n):
            np.copyto(dsts[i % len(dsts)], pool[i * size : (i + 1) * size])
        return time.perf_counter() - t0

    def close(self) -> None:
        pass


class MemcpyThreads(Memcpy):
    """The same copies dealt out to two threads (numpy releases the GIL): how much more
    than one thread's memcpy the memory gives (the ceiling for a threaded store)."""

    name = "memcpy, 2 threads"

    def __init__(self, *args) -> None:
        super().__init__(*args)
        from concurrent.futures import ThreadPoolExecutor

        self.ex = ThreadPoolExecutor(1)

    def _two(self, one) -> float:
        t0 = time.perf_counter()
        f = self.ex.submit(lambda: [one(i) for i in range(1, self.n, 2)])
        for i in range(0, self.n, 2):
            one(i)
        f.result()
        return time.perf_counter() - t0

    def write(self) -> float:
        pool, srcs, size = self.pool, self.srcs, self.size
        return self._two(lambda i: np.copyto(pool[i * size : (i + 1) * size], srcs[i % len(srcs)]))

    def read(self) -> float:
        pool, dsts, size = self.pool, self.dsts, self.size
        return self._two(lambda i: np.copyto(dsts[i % len(dsts)], pool[i * size : (i + 1) * size]))

    def close(self) -> None:
        self.ex.shutdown()


class ArenaCase:
    def __init__(self, srcs, dsts, n, size, *, checksum=True, lock="flock", capacity=None,
                 name="arena", chunk=shm_arena.HASH_CHUNK, threads=1) -> None:  # fmt: skip
        self.name = name
        self.srcs, self.dsts, self.n, self.size, self.checksum = srcs, dsts, n, size, checksum
        self.folder = shm_folder("arena")
        slots = capacity or n
        self.arena = Arena(self.folder, Geometry(size, slots), lock=lock, hash_chunk=chunk,
                           evict_batch=max(BATCH, slots // 64), threads=threads)  # fmt: skip
        self.keys = [os.urandom(16) for _ in range(n)]

    def reset(self) -> None:
        self.arena.remove(self.keys)
        self.keys = [os.urandom(16) for _ in range(self.n)]

    def write(self) -> float:
        a, keys, srcs, cs = self.arena, self.keys, self.srcs, self.checksum
        t0 = time.perf_counter()
        for s in range(0, self.n, BATCH):
            batch = keys[s : s + BATCH]
            ok = a.dump(batch, [srcs[i % len(srcs)] for i in range(s, s + len(batch))], cs)
            if not all(ok):
                raise RuntimeError("arena dump failed")
        return time.perf_counter() - t0

    def read(self) -> float:
        a, keys, dsts, cs = self.arena, self.keys, self.dsts, self.checksum
        # an evicting arena holds only the newest part: read what it has
        if a.geometry.slots < self.n:
            keys = keys[self.n - a.geometry.slots :]
        t0 = time.perf_counter()
        for s in range(0, len(keys), BATCH):
            batch = keys[s : s + BATCH]
            if not all(a.load(batch, dsts[: len(batch)], cs)):
                raise RuntimeError("arena load failed")
        dt = time.perf_counter() - t0
        return dt * self.n / len(keys)  # per the same byte count as the others

    def close(self) -> None:
        self.arena.close()
        shutil.rmtree(self.folder, ignore_errors=True)


class LmdbCase:
    """LMDB: payloads in the main db (copied straight into the map: writemap), a meta db of
    key -> (length, xxh3).  No LRU or capacity eviction of its own (see the report)."""

    def __init__(self, srcs, dsts, n, size, *, checksum=True) -> None:
        import lmdb

        self.name = "lmdb" + ("" if checksum else " (no checksum)")
        self.srcs, self.dsts, self.n, self.size, self.checksum = srcs, dsts, n, size, checksum
        self.folder = shm_folder("lmdb")
        self.env = lmdb.open(self.folder, map_size=3 * n * (size + 8192) + (64 << 20),
                             writemap=True, sync=False, metasync=False, max_dbs=2,
                             readahead=False, meminit=False)  # fmt: skip
        self.meta = self.env.open_db(b"meta")
        self.keys = [os.urandom(16) for _ in range(n)]

    def reset(self) -> None:
        with self.env.begin(write=True) as txn:
            for k in self.keys:
                txn.delete(k)
                txn.delete(k, db=self.meta)
        self.keys = [os.urandom(16) for _ in range(self.n)]

    def write(self) -> float:
        env, meta, keys, srcs, cs = self.env, self.meta, self.keys, self.srcs, self.checksum
        pack = struct.Struct("<QQ").pack
        t0 = time.perf_counter()
        for s in range(0, self.n, BATCH):
            with env.begin(write=True) as txn:
                for i in range(s, min(s + BATCH, self.n)):
                    src = memoryview(srcs[i % len(srcs)])
                    txn.put(keys[i], src)
                    # hash the source after the copy: it is in cache (LMDB copies inside put)
                    txn.put(keys[i], pack(src.nbytes, xxhash.xxh3_64_intdigest(src) if cs else 0), db=meta)
        return time.perf_counter() - t0

    def read(self) -> float:
        env, meta, keys, dsts, cs = self.env, self.meta, self.keys, self.dsts, self.checksum
        unpack = struct.Struct("<QQ").unpack
        t0 = time.perf_counter()
        for s in range(0, self.n, BATCH):
            with env.begin(buffers=True) as txn:
                for j, i in enumerate(range(s, min(s + BATCH, self.n))):
                    buf = txn.get(keys[i])
                    length, want = unpack(txn.get(keys[i], db=meta))
                    dst = memoryview(dsts[j])
                    if cs:
                        if copy_hashing(dst, buf) != want:
                            raise RuntimeError("lmdb checksum")
                    else:
                        dst[:] = buf
        return time.perf_counter() - t0

    def close(self) -> None:
        self.env.close()
        shutil.rmtree(self.folder, ignore_errors=True)


class FilesCase:
    """File per block on tmpfs, as the posix store does it: a 4 KiB header with the payload's
    xxh3 then the payload; tmp + rename to publish; open(O_NOFOLLOW) + preadv to load."""

    HEADER = 4096

    def __init__(self, srcs, dsts, n, size, *, checksum=True) -> None:
        self.name = "files" + ("" if checksum else " (no checksum)")
        self.srcs, self.dsts, self.n, self.size, self.checksum = srcs, dsts, n, size, checksum
        self.folder = shm_folder("files")
        for i in range(256):
            os.mkdir(os.path.join(self.folder, f"{i:02x}"), 0o700)
        self.keys = [os.urandom(16).hex() for _ in range(n)]
        self.hdr = bytearray(self.HEADER)

    def _path(self, name: str) -> str:
        return f"{self.folder}/{name[:2]}/{name}"

    def reset(self) -> None:
        for k in self.keys:
            try:
                os.unlink(self._path(k))
            except FileNotFoundError:
                pass
        self.keys = [os.urandom(16).hex() for _ in range(self.n)]

    def write(self) -> float:
        keys, srcs, cs = self.keys, self.srcs, self.checksum
        head = struct.Struct("<4sQQ")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
        t0 = time.perf_counter()
        for i, k in enumerate(keys):
            src = memoryview(srcs[i % len(srcs)])
            hdr = head.pack(b"UCMB", src.nbytes, xxhash.xxh3_64_intdigest(src) if cs else 0)
            path = self._path(k)
            tmp = f"{path}.{os.getpid()}.tmp"
            fd = os.open(tmp, flags, 0o600)
            try:
                os.pwritev(fd, [hdr.ljust(self.HEADER, b"\0"), src], 0)
            finally:
                os.close(fd)
            os.rename(tmp, path)
        return time.perf_counter() - t0

    def read(self) -> float:
        keys, dsts, cs, hdr = self.keys, self.dsts, self.checksum, self.hdr
        head = struct.Struct("<4sQQ")
        t0 = time.perf_counter()
        for i, k in enumerate(keys):
            dst = memoryview(dsts[i % len(dsts)])
            fd = os.open(self._path(k), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            try:
                os.fstat(fd)  # the store checks it is a regular file
                os.preadv(fd, [hdr, dst], 0)
            finally:
                os.close(fd)
            magic, length, want = head.unpack_from(hdr)
            if cs and xxhash.xxh3_64_intdigest(dst) != want:
                raise RuntimeError("file checksum")
        return time.perf_counter() - t0

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


class UcmDramCase:
    """The project's own host-scope dram store (posix store on /dev/shm), through its
    dump/load API in batches, as `ucm bench store` drives it."""

    name = "ucm dram shared (today)"

    def __init__(self, srcs, dsts, n, size) -> None:
        from ucm.core.config import DramStoreConfig
        from ucm.core.store import SharedMemoryStore

        self.srcs, self.dsts, self.n = srcs, dsts, n
        self.folder = shm_folder("ucm")
        self.store = SharedMemoryStore(
            DramStoreConfig(capacity_gb=2 * n * size / (1 << 30), path=self.folder)
        )
        self.keys = [os.urandom(16) for _ in range(n)]

    def reset(self) -> None:
        self.store.remove(self.keys)
        self.keys = [os.urandom(16) for _ in range(self.n)]

    def write(self) -> float:
        st, keys, srcs = self.store, self.keys, self.srcs
        t0 = time.perf_counter()
        tasks = [
            st.dump(keys[s : s + BATCH], [srcs[i % len(srcs)] for i in range(s, min(s + BATCH, self.n))])
            for s in range(0, self.n, BATCH)
        ]
        for task in tasks:
            if not all(r.ok for r in st.wait(task)):
                raise RuntimeError("ucm dump failed")
        return time.perf_counter() - t0

    def read(self) -> float:
        st, keys, dsts = self.store, self.keys, self.dsts
        t0 = time.perf_counter()
        for s in range(0, self.n, BATCH):
            batch = keys[s : s + BATCH]
            if not all(r.ok for r in st.wait(st.load(batch, dsts[: len(batch)]))):
                raise RuntimeError("ucm load failed")
        return time.perf_counter() - t0

    def close(self) -> None:
        self.store.close()
        shutil.rmtree(self.folder, ignore_errors=True)


# -- the main table ----------------------------------------------------------------------


def fmt_ratio(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def main_table(size: int, total: int, rounds: int, with_ucm: bool) -> list[str]:
    n = max(BATCH, total // size)
    srcs = [prefaulted(size) for _ in range(16)]
    for i, s in enumerate(srcs):
        s[:8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)
    dsts = [prefaulted(size) for _ in range(BATCH)]
    memcpy = Memcpy(srcs, dsts, n, size)
    cases: list = [
        ArenaCase(srcs, dsts, n, size, name="arena (xxh3 fused)"),
        ArenaCase(srcs, dsts, n, size, checksum=False, name="arena (no checksum)"),
        ArenaCase(srcs, dsts, n, size, threads=2, name="arena (xxh3, 2 threads)"),
        MemcpyThreads(srcs, dsts, n, size),
        ArenaCase(srcs, dsts, n, size, lock="robust", name="arena robust-mutex (xxh3)"),
        ArenaCase(srcs, dsts, n, size, capacity=max(n // 2, BATCH), name="arena evicting (xxh3)"),
        LmdbCase(srcs, dsts, n, size),
        LmdbCase(srcs, dsts, n, size, checksum=False),
        FilesCase(srcs, dsts, n, size),
        FilesCase(srcs, dsts, n, size, checksum=False),
    ]
    if with_ucm:
        cases.append(UcmDramCase(srcs, dsts, n, size))
    times: dict[str, list[tuple[float, float]]] = {c.name: [] for c in [memcpy, *cases]}
    try:
        for r in range(rounds + 1):  # round 0 warms up (first faults, code paths), not kept
            order = [memcpy, *cases]
            random.shuffle(order)
            for c in order:
                c.reset()
                w = c.write()
                rd = c.read()
                if r:
                    times[c.name].append((w, rd))
    finally:
        for c in cases:
            c.close()
    gb = n * size / 1e9
    base = times["memcpy"]
    label = f"{size // MIB} MiB" if size >= MIB else f"{size >> 10} KiB"
    lines = [f"\n## {label} blocks: {n} blocks ({gb:.2f} GB) per case per round, {rounds} rounds"]
    lines.append(f"{'case':30} {'write GB/s':>10} {'read GB/s':>10}   {'write/memcpy':>18}   {'read/memcpy':>18}")
    for name, ts in times.items():
        w = statistics.median(gb / t[0] for t in ts)
        rd = statistics.median(gb / t[1] for t in ts)
        if name == "memcpy":
            lines.append(f"{name:30} {w:10.2f} {rd:10.2f}")
            continue
        wr = [b[0] / t[0] for b, t in zip(base, ts)]
        rr = [b[1] / t[1] for b, t in zip(base, ts)]
        lines.append(f"{name:30} {w:10.2f} {rd:10.2f}   {fmt_ratio(wr):>18}   {fmt_ratio(rr):>18}")
    return lines


# -- parts ----------------------------------------------------------------------------------


def med_spread(fn: Callable[[], float], reps: int) -> tuple[float, float, float]:
    xs = sorted(fn() for _ in range(reps))
    return statistics.median(xs), xs[0], xs[-1]


def part_hash(rounds: int) -> list[str]:
    import blake3

    lines = ["\n## xxh3_64 / keyed BLAKE3 cost (GB/s; median [min-max] of rounds)"]
    pool = prefaulted(512 * MIB)
    for size in (2 * MIB, 256 << 10):
        hot = prefaulted(size)
        mv = memoryview(hot)
        k = max(1, (64 * MIB) // size)

        def hot_run() -> float:
            t0 = time.perf_counter()
            for _ in range(k):
                xxhash.xxh3_64_intdigest(mv)
            return size * k / (time.perf_counter() - t0) / 1e9

        def cold_run() -> float:
            t0 = time.perf_counter()
            for off in range(0, pool.size, size):
                xxhash.xxh3_64_intdigest(memoryview(pool[off : off + size]))
            return pool.size / (time.perf_counter() - t0) / 1e9

        key = b"k" * 32

        def mac_run() -> float:
            t0 = time.perf_counter()
            for _ in range(max(1, k // 8)):
                blake3.blake3(mv, key=key).digest()
            return size * max(1, k // 8) / (time.perf_counter() - t0) / 1e9

        def us(gbps: float) -> float:
            return size / gbps / 1e3

        for what, fn in (("xxh3, cache-hot", hot_run), ("xxh3, from memory", cold_run),
                         ("keyed BLAKE3, cache-hot", mac_run)):  # fmt: skip
            m, lo, hi = med_spread(fn, rounds)
            lines.append(f"{size >> 10:5} KiB  {what:26} {m:6.1f} [{lo:.1f}-{hi:.1f}] GB/s  = {us(m):7.1f} us/block")
    return lines


def part_fused(rounds: int, total: int) -> list[str]:
    """memcpy alone vs copy then hash vs copy+hash in chunks, both directions; the ratio of
    each round is to that round's plain copy."""
    lines = ["\n## copy + xxh3 fused in chunks (ratio to plain memcpy, same round; median [min-max])"]
    for size in (2 * MIB, 256 << 10):
        n = total // size
        pool = memoryview(prefaulted(n * size))
        srcs = [memoryview(prefaulted(size)) for _ in range(16)]
        dsts = [memoryview(prefaulted(size)) for _ in range(BATCH)]
        variants: dict[str, Callable] = {"memcpy": None}
        variants["copy, then hash whole"] = "whole"
        for c in (16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10):
            if c < size:
                variants[f"fused, {c >> 10} KiB chunks"] = c
        res: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}

        def run(v) -> tuple[float, float]:
            t0 = time.perf_counter()
            for i in range(n):
                d, s = pool[i * size : (i + 1) * size], srcs[i % 16]
                if v is None:
                    d[:] = s
                elif v == "whole":
                    d[:] = s
                    xxhash.xxh3_64_intdigest(d)
                else:
                    copy_hashing(d, s, v)
            tw = time.perf_counter() - t0
            t0 = time.perf_counter()
            for i in range(n):
                d, s = dsts[i % BATCH], pool[i * size : (i + 1) * size]
                if v is None:
                    d[:] = s
                elif v == "whole":
                    d[:] = s
                    xxhash.xxh3_64_intdigest(d)
                else:
                    copy_hashing(d, s, v)
            return tw, time.perf_counter() - t0

        for r in range(rounds + 1):
            order = list(variants.items())
            random.shuffle(order)
            for name, v in order:
                t = run(v)
                if r:
                    res[name].append(t)
        label = f"{size // MIB} MiB" if size >= MIB else f"{size >> 10} KiB"
        gb = n * size / 1e9
        mw = statistics.median(gb / t[0] for t in res["memcpy"])
        mr = statistics.median(gb / t[1] for t in res["memcpy"])
        lines.append(f"{label} blocks (memcpy {mw:.1f} / {mr:.1f} GB/s in / out)")
        for name in variants:
            if name == "memcpy":
                continue
            wr = [b[0] / t[0] for b, t in zip(res["memcpy"], res[name])]
            rr = [b[1] / t[1] for b, t in zip(res["memcpy"], res[name])]
            lines.append(f"  {name:26} write {fmt_ratio(wr):>18}   read {fmt_ratio(rr):>18}")
    return lines


def part_locks(rounds: int) -> list[str]:
    lines = ["\n## lock and per-operation costs (us; median [min-max] of rounds)"]
    folder = shm_folder("locks")
    try:
        g = Geometry(4096, 4096)
        fl = Arena(folder, g, lock="flock")
        rb = Arena(folder, g, lock="robust")
        reps = 20000

        def pair(lock) -> float:
            t0 = time.perf_counter()
            for _ in range(reps):
                lock.acquire()
                lock.release()
            return (time.perf_counter() - t0) / reps * 1e6

        def section(a: Arena) -> float:
            t0 = time.perf_counter()
            for _ in range(reps):
                with a._locked():
                    pass
            return (time.perf_counter() - t0) / reps * 1e6

        block = np.ones(4096, np.uint8)
        out = np.zeros(4096, np.uint8)

        def one_op(a: Arena, op: str) -> float:
            keys = [os.urandom(16) for _ in range(2000)]
            t0 = time.perf_counter()
            for k in keys:
                a.dump([k], [block])
            td = time.perf_counter() - t0
            t0 = time.perf_counter()
            for k in keys:
                a.load([k], [out])
            tl = time.perf_counter() - t0
            a.remove(keys)
            return (td if op == "dump" else tl) / len(keys) * 1e6

        def batch_op(a: Arena, op: str) -> float:
            keys = [os.urandom(16) for _ in range(BATCH)]
            t0 = time.perf_counter()
            a.dump(keys, [block] * BATCH)
            td = time.perf_counter() - t0
            outs = [np.zeros(4096, np.uint8) for _ in range(BATCH)]
            t0 = time.perf_counter()
            a.load(keys, outs)
            tl = time.perf_counter() - t0
            a.remove(keys)
            return (td if op == "dump" else tl) / BATCH * 1e6

        rows = [
            ("flock acquire+release", lambda: pair(fl._lock)),
            ("robust mutex acquire+release", lambda: pair(rb._lock)),
            ("critical section, flock (+dirty word)", lambda: section(fl)),
            ("critical section, robust mutex", lambda: section(rb)),
            ("dump of one 4 KiB block, flock", lambda: one_op(fl, "dump")),
            ("load of one 4 KiB block, flock", lambda: one_op(fl, "load")),
            ("dump of one 4 KiB block, robust", lambda: one_op(rb, "dump")),
            ("load of one 4 KiB block, robust", lambda: one_op(rb, "load")),
            ("dump per block, batch 128, flock", lambda: batch_op(fl, "dump")),
            ("load per block, batch 128, flock", lambda: batch_op(fl, "load")),
        ]
        for name, fn in rows:
            m, lo, hi = med_spread(fn, rounds)
            lines.append(f"  {name:42} {m:7.2f} [{lo:.2f}-{hi:.2f}]")
        fl.close()
        rb.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return lines


def part_lookup_evict(rounds: int) -> list[str]:
    lines = ["\n## lookup_prefix of 512 keys, eviction pass, attach (ms; median [min-max])"]
    for slots in (32768, 262144):
        folder = shm_folder("lookup")
        try:
            g = Geometry(4096, slots)
            t0 = time.perf_counter()
            a = Arena(folder, g, populate=False, evict_batch=max(BATCH, slots // 256))
            create = time.perf_counter() - t0
            block = np.ones(64, np.uint8)  # payload size does not matter to the index
            keys = [os.urandom(16) for _ in range(slots)]
            for s in range(0, slots, 1024):
                a.dump(keys[s : s + 1024], [block] * len(keys[s : s + 1024]))
            probe = keys[:512]
            half = keys[:256] + [os.urandom(16)] + keys[256:511]
            assert a.lookup_prefix(probe) == 512 == a.lookup_prefix_loop(probe)
            assert a.lookup_prefix(half) == 256

            def timed(fn, arg, reps=50) -> float:
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn(arg)
                return (time.perf_counter() - t0) / reps * 1e3

            def locked_loop(arg) -> int:
                with a._locked():
                    return a.lookup_prefix_loop(arg)

            def evict_pass() -> float:
                now = time.monotonic_ns()
                with a._locked():
                    t0 = time.perf_counter()
                    freed = a._evict(a.evict_batch, now)
                    dt = time.perf_counter() - t0
                # refill so the next pass sees a full arena again
                more = [os.urandom(16) for _ in range(freed)]
                a.dump(more, [block] * freed)
                return dt * 1e3

            full = f"{slots} slots, full"
            for name, fn in (
                ("lookup 512 hits, numpy vectorised, no lock", lambda: timed(a.lookup_prefix, probe)),
                ("lookup 512 hits, Python loop, no lock", lambda: timed(a.lookup_prefix_loop, probe)),
                ("lookup 512 hits, Python loop, under flock", lambda: timed(locked_loop, probe)),
                ("lookup, miss at 257 (numpy)", lambda: timed(a.lookup_prefix, half)),
                (f"eviction pass ({a.evict_batch} LRU victims)", evict_pass),
            ):
                m, lo, hi = med_spread(fn, rounds)
                lines.append(f"  {full:20} {name:44} {m:7.3f} [{lo:.3f}-{hi:.3f}]")

            def recover() -> float:
                with a._locked():
                    t0 = time.perf_counter()
                    a._recover()
                    return (time.perf_counter() - t0) * 1e3

            m, lo, hi = med_spread(recover, 3)
            lines.append(f"  {full:20} {'recovery (index + free stack rebuilt)':44} {m:7.3f} [{lo:.3f}-{hi:.3f}]")
            assert a.check() == []
            meta_mib = g.meta_bytes / MIB
            lines.append(f"  {full:20} metadata {meta_mib:.1f} MiB ({g.meta_bytes / slots:.0f} B/slot); "
                         f"create (fallocate {g.file_bytes / MIB:.0f} MiB) {create * 1e3:.0f} ms")  # fmt: skip
            a.close()
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    # attach cost: MADV_POPULATE_WRITE of the data per process
    folder = shm_folder("populate")
    try:
        g = Geometry(2 * MIB, 512)  # 1 GiB
        a = Arena(folder, g, populate=False)
        ts = []
        for _ in range(rounds):
            b = Arena(folder, g, populate=True)
            ts.append(b.populate_s * 1e3)
            b.close()
        lines.append(f"  attach: MADV_POPULATE_WRITE of 1 GiB of slots (4 KiB pages) {fmt_ratio(ts)} ms")
        a.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--total-mib", type=int, default=512)
    ap.add_argument("--no-ucm", action="store_true", help="skip the project's own store")
    ap.add_argument("--only", choices=["table", "parts"], default=None)
    args = ap.parse_args()
    with_ucm = False
    if not args.no_ucm and os.path.isdir(UCM_SRC):
        sys.dont_write_bytecode = True  # read-only checkout: leave no __pycache__ there
        sys.path.append(UCM_SRC)
        try:
            import ucm.core.store  # noqa: F401

            with_ucm = True
        except ImportError as exc:
            print(f"(ucm not importable: {exc}; its row is skipped)")
    load = os.getloadavg()
    print(f"# host tier candidates vs memcpy; {os.cpu_count()} CPUs, load average {load[0]:.2f} at start")
    total = args.total_mib * MIB
    out: list[str] = []
    if args.only in (None, "table"):
        for size in (2 * MIB, 256 << 10):
            lines = main_table(size, total, args.rounds, with_ucm)
            print("\n".join(lines), flush=True)
            out += lines
    if args.only in (None, "parts"):
        for part in (lambda: part_hash(args.rounds), lambda: part_fused(args.rounds, total // 2),
                     lambda: part_locks(args.rounds), lambda: part_lookup_evict(args.rounds)):  # fmt: skip
            lines = part()
            print("\n".join(lines), flush=True)
    print(f"\nload average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
