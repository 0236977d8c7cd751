"""A host-shared block arena: one pre-faulted file in shared memory, fixed-size slots, and a
shared index, for the ``dram`` store of scope ``host`` (issue 26, point 1).  Prototype.

Why: the file-per-block store on tmpfs pays, per block, a create, fresh zeroed pages, a
rename, an open and a read through the kernel.  Here every process maps one file once,
its pages already allocated (``posix_fallocate``) and in the process's page tables
(``MADV_POPULATE_WRITE``), and a dump or load is a ``memcpy`` into or out of a slot plus a
few word updates in shared metadata under a short lock.

File layout (``<folder>/arena``, one file; sections page-aligned; integers little-endian)::

    superblock   one page: magic, version, geometry, counters, the lock's words
    columns      per slot, one array each (column-wise so numpy scans one dense array):
                 state u32, pins u32, gen u32, owner u32, key0 u64, key1 u64,
                 length u64, checksum u64, last_used u64, lease i64
    free stack   u32 per slot: the slot numbers that are FREE (top in the superblock)
    index        open addressing, linear probing, 2+ buckets per slot:
                 key0 u64, key1 u64, slot u32 (EMPTY = 0xffffffff, TOMB = 0xfffffffe);
                 deletions leave tombstones (so eviction deletes in bulk, vectorised)
                 and the index is rebuilt from the columns when they pass 1/4
    data         slots x slot_bytes (starts 2 MiB-aligned, for huge pages where enabled)

Truth and what is derived from it: the columns are the truth.  The index and the free
stack are derived, and rebuilt from the columns whenever a process died holding the lock
(``dirty`` is set on entry and cleared on exit of every critical section).  So the lock
never has to be "robust" about its data, only about its ownership: an ``flock`` (default)
or a robust pthread mutex, both released by the kernel when their holder dies.

A slot's life: FREE -> WRITING (allocated under the lock, owned by a pid, with a lease)
-> filled and hashed outside the lock -> READY (under the lock: columns first, then the
index entry: "publish" is the ``state`` store and the index insert in one critical
section) -> FREE (evicted or removed: ``gen`` bumped, index entry deleted).  A writer
killed mid-block leaves a WRITING slot that no index entry names; it is reclaimed once
its lease runs out or its pid is gone.

Readers pin: a load takes the lock once per batch to find the slots, bump ``pins`` (with a
lease, so a reader killed while pinned releases the slot after ``PIN_LEASE_NS``) and
``last_used``; copies and verifies outside the lock; and takes the lock again to unpin,
where a changed ``gen`` (slot reclaimed because the pin's lease ran out) makes the result
a miss.  Eviction never takes a pinned slot whose lease runs.

Nothing read from shared memory sizes an allocation: the geometry comes from the caller's
configuration and must match the file's, a slot number is checked against ``slots``
before use, a stored length against ``slot_bytes`` and the caller's buffer.

``lookup_prefix`` reads the index without the lock (a seqlock: the index's sequence word
is odd while a writer changes it, and a reader retries when it changed under it): it is a
hint, as any lookup across processes is, and the load checks again under the lock.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import mmap
import os
import stat
import struct
import time
from collections.abc import Sequence
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import xxhash

MAGIC = int.from_bytes(b"UCMARNA1", "little")
VERSION = 1
PAGE = 4096
DATA_ALIGN = 2 << 20
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+
KEY_BYTES = 16

FREE, WRITING, READY = 0, 1, 2
EMPTY = 0xFFFFFFFF  # an index bucket never used since the last rebuild: probes stop here
TOMB = 0xFFFFFFFE  # a deleted entry: probes go on; an insert may take it

#: a reader or writer that holds a slot longer than this is presumed dead
PIN_LEASE_NS = 30_000_000_000
WRITE_LEASE_NS = 30_000_000_000
#: bytes copied then hashed at a time while the chunk is still in the L2 cache
HASH_CHUNK = 256 << 10
#: batches of at least this many keys keep their books with numpy instead of key by key.
#: Off: measured here (CPython 3.11, batches of 128) the numpy path costs 4.5-10 us per
#: block in the lock against 3-5 us key by key (probe rounds and per-call overhead); kept,
#: tested, for a compiled successor.  Eviction is vectorised regardless.
BULK_MIN = 1 << 30
#: vectorised probe rounds before the last few keys finish one by one
VECTOR_ROUNDS = 2

# superblock words (u64 index into the first page)
SB_MAGIC, SB_VERSION, SB_SLOT_BYTES, SB_SLOTS, SB_BUCKETS = 0, 1, 2, 3, 4
SB_TICK, SB_DIRTY, SB_FREE_TOP, SB_SEQ, SB_USED, SB_EVICTED, SB_RECOVERIES = 5, 6, 7, 8, 9, 10, 11
SB_TOMBS, SB_REBUILDS = 12, 13
SB_MUTEX_BYTE = 512  # where a robust pthread mutex lives, if that lock is chosen

_KEYS = struct.Struct("<QQ")


def _round(n: int, align: int) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class Geometry:
    """What the configuration fixes (never read from the file, only checked against it)."""

    slot_bytes: int
    slots: int

    @property
    def buckets(self) -> int:
        b = 1
        while b < 2 * self.slots:  # load factor <= 0.5: short probes, fast misses
            b <<= 1
        return b

    def sections(self) -> dict[str, tuple[int, int]]:
        """name -> (offset, bytes) of every section of the file."""
        out: dict[str, tuple[int, int]] = {}
        at = PAGE  # the superblock
        n, b = self.slots, self.buckets
        for name, width, count in (
            ("state", 4, n), ("pins", 4, n), ("gen", 4, n), ("owner", 4, n),
            ("key0", 8, n), ("key1", 8, n), ("length", 8, n), ("checksum", 8, n),
            ("last_used", 8, n), ("lease", 8, n), ("free", 4, n),
            ("ik0", 8, b), ("ik1", 8, b), ("islot", 4, b),
        ):  # fmt: skip
            out[name] = (at, width * count)
            at = _round(at + width * count, PAGE)
        at = _round(at, DATA_ALIGN)
        out["data"] = (at, self.slot_bytes * n)
        return out

    @property
    def meta_bytes(self) -> int:
        return self.sections()["data"][0]

    @property
    def file_bytes(self) -> int:
        off, size = self.sections()["data"]
        return off + size


# -- locks: both are released by the kernel when their holder dies -------------------------


class FlockLock:
    """``flock`` on a lock file beside the arena: two system calls per critical section."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)

    def acquire(self) -> bool:
        """Returns True: an flock gives no sign that its last holder died (``dirty`` does)."""
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return True

    def release(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        os.close(self.fd)


class RobustMutex:
    """A process-shared robust pthread mutex in the superblock, through ctypes: no system
    call when uncontended; ``EOWNERDEAD`` when the holder died (then made consistent; the
    arena's ``dirty`` word decides whether to rebuild)."""

    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    SIZE = 40  # sizeof(pthread_mutex_t) on x86-64 glibc
    EOWNERDEAD = errno.EOWNERDEAD

    def __init__(self, meta: mmap.mmap, create: bool) -> None:
        self._buf = (ctypes.c_char * self.SIZE).from_buffer(meta, SB_MUTEX_BYTE)
        self._ptr = ctypes.addressof(self._buf)
        lib = self._libc
        if create:
            attr = ctypes.create_string_buffer(8)
            lib.pthread_mutexattr_init(attr)
            lib.pthread_mutexattr_setpshared(attr, 1)  # PTHREAD_PROCESS_SHARED
            lib.pthread_mutexattr_setrobust(attr, 1)  # PTHREAD_MUTEX_ROBUST
            if lib.pthread_mutex_init(ctypes.c_void_p(self._ptr), attr):
                raise OSError("pthread_mutex_init failed")
        self._lock = lib.pthread_mutex_lock
        self._unlock = lib.pthread_mutex_unlock
        self._consistent = lib.pthread_mutex_consistent
        self._arg = ctypes.c_void_p(self._ptr)

    def acquire(self) -> bool:
        rc = self._lock(self._arg)
        if rc == self.EOWNERDEAD:
            self._consistent(self._arg)
            return True
        if rc:
            raise OSError(rc, os.strerror(rc))
        return True

    def release(self) -> None:
        self._unlock(self._arg)

    def close(self) -> None:
        del self._buf  # the exported buffer must go before the mmap closes


# -- copies that hash what they move while it is in the cache -------------------------------


def copy_hashing(dst: memoryview, src: memoryview, chunk: int = HASH_CHUNK) -> int:
    """Copy ``src`` into ``dst`` (same size) ``chunk`` bytes at a time, hashing each chunk of
    the destination right after it is written (from L2, not memory).  Returns xxh3-64 of
    the whole (streaming xxh3 equals the one-shot digest)."""
    n = src.nbytes
    if n <= chunk:
        dst[:] = src
        return xxhash.xxh3_64_intdigest(dst)
    h = xxhash.xxh3_64()
    for off in range(0, n, chunk):
        d = dst[off : off + chunk]
        d[:] = src[off : off + chunk]
        h.update(d)
    return h.intdigest()


def copy_hashing_nogil(dst: memoryview, src: memoryview, chunk: int, checksum: bool) -> int:
    """:func:`copy_hashing` with numpy copies, which release the GIL (a memoryview slice
    assignment holds it), for use from several threads at once."""
    d = np.frombuffer(dst, np.uint8)
    s = np.frombuffer(src, np.uint8)
    if not checksum:
        np.copyto(d, s)
        return 0
    n = s.size
    if n <= chunk:
        np.copyto(d, s)
        return xxhash.xxh3_64_intdigest(dst)
    h = xxhash.xxh3_64()
    for off in range(0, n, chunk):
        np.copyto(d[off : off + chunk], s[off : off + chunk])
        h.update(dst[off : off + chunk])
    return h.intdigest()


class ArenaFull(Exception):
    """No slot could be freed (all pinned or being written)."""


class Arena:
    """The shared arena in ``folder`` (created if absent, attached if present)."""

    def __init__(
        self,
        folder: str,
        geometry: Geometry,
        *,
        lock: str = "flock",
        populate: bool = True,
        evict_batch: int | None = None,
        evict_sample: int = 0,
        hash_chunk: int = HASH_CHUNK,
        threads: int = 1,
    ) -> None:
        self.geometry = geometry
        self.folder = folder
        self.hash_chunk = hash_chunk
        self.pid = os.getpid()
        # evict this many at once (at least), so the O(slots) scan is amortised
        self.evict_batch = evict_batch or max(16, geometry.slots // 256)
        # >0: pick victims among a random sample of this many slots (approximate LRU).
        # Off: measured slower than the exact scan (262,144 slots: 4.9 ms against 3.3 ms
        # for 1,024 victims; random numbers and gathers cost more than a dense scan)
        self.evict_sample = evict_sample
        # >1: blocks of a batch are copied and hashed by this many threads (numpy and
        # xxhash release the GIL), so one thread's hash overlaps another's copy
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads - 1) if threads > 1 else None
        os.makedirs(folder, mode=0o700, exist_ok=True)
        st = os.stat(folder, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise PermissionError(f"{folder} is not a folder only this user can use")
        self._flock = FlockLock(os.path.join(folder, "arena.lock"))  # also guards creation
        fcntl.flock(self._flock.fd, fcntl.LOCK_EX)
        try:
            fd, created = self._open_or_create(os.path.join(folder, "arena"))
        finally:
            fcntl.flock(self._flock.fd, fcntl.LOCK_UN)
        self._fd = fd
        meta_bytes = geometry.meta_bytes
        self._meta = mmap.mmap(fd, meta_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        # data: a second mapping, so a process that only looks up (vLLM's scheduler) need
        # not map, nor fault in, the slots at all
        self._dmap = mmap.mmap(
            fd, geometry.slot_bytes * geometry.slots, mmap.MAP_SHARED,
            mmap.PROT_READ | mmap.PROT_WRITE, offset=meta_bytes,
        )  # fmt: skip
        self.populate_s = 0.0
        if populate:
            t0 = time.perf_counter()
            try:
                self._dmap.madvise(MADV_POPULATE_WRITE)
            except OSError:  # an older kernel: touch a byte per page
                view = np.frombuffer(self._dmap, np.uint8)
                view[::PAGE] = view[::PAGE]
            self.populate_s = time.perf_counter() - t0
        self.data = memoryview(self._dmap)
        self._map_columns()
        if lock == "flock":
            self._lock: FlockLock | RobustMutex = self._flock
        elif lock == "robust":
            self._lock = RobustMutex(self._meta, create=created)
        else:
            raise ValueError(lock)

    # -- opening --

    def _open_or_create(self, path: str) -> tuple[int, bool]:
        """The arena file, checked (a regular file of ours, of this geometry and version),
        or a fresh one published by rename (a process killed while creating leaves only a
        temporary file).  Caller holds the creation lock."""
        g = self.geometry
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            fd = -1
        if fd >= 0:
            st = os.fstat(fd)
            ok = (
                stat.S_ISREG(st.st_mode)
                and st.st_uid == os.geteuid()
                and not st.st_mode & 0o077
                and st.st_size == g.file_bytes
            )
            if ok:
                head = os.pread(fd, 40, 0)
                words = struct.unpack("<5Q", head) if len(head) == 40 else ()
                ok = words == (MAGIC, VERSION, g.slot_bytes, g.slots, g.buckets)
            if ok:
                return fd, False
            os.close(fd)  # another geometry or version: replaced (its blocks are lost)
        tmp = f"{path}.tmp.{os.getpid()}"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            # allocate every page now: a write into a hole of a full tmpfs is a SIGBUS
            os.posix_fallocate(fd, 0, g.file_bytes)
            meta = mmap.mmap(fd, g.meta_bytes, mmap.MAP_SHARED)
            sb = np.frombuffer(meta, "<u8", count=PAGE // 8)
            sections = g.sections()
            off, size = sections["islot"]
            np.frombuffer(meta, "<u4", count=size // 4, offset=off)[:] = EMPTY
            off, size = sections["free"]
            # free stack: slot n-1 at the bottom, so slot 0 is handed out first
            np.frombuffer(meta, "<u4", count=size // 4, offset=off)[:] = np.arange(
                g.slots - 1, -1, -1, dtype=np.uint32
            )
            sb[SB_SLOT_BYTES], sb[SB_SLOTS], sb[SB_BUCKETS] = g.slot_bytes, g.slots, g.buckets
            sb[SB_FREE_TOP] = g.slots
            sb[SB_VERSION] = VERSION
            sb[SB_MAGIC] = MAGIC  # last: a file without it is not an arena
            del sb
            meta.close()
            os.rename(tmp, path)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        return fd, True

    def _map_columns(self) -> None:
        """numpy views (vector work) and memoryview casts (scalar work: 3-5x cheaper per
        item than numpy scalars) over every section."""
        meta = self._meta
        self._sb = memoryview(meta)[:PAGE].cast("Q")
        self._np: dict[str, np.ndarray] = {}
        self._mv: dict[str, memoryview] = {}
        for name, (off, size) in self.geometry.sections().items():
            if name == "data":
                continue
            width = 4 if name in ("state", "pins", "gen", "owner", "free", "islot") else 8
            code = {4: "I", 8: "Q"}[width]
            dtype = {4: "<u4", 8: "<u8"}[width]
            if name == "lease":  # a deadline in CLOCK_MONOTONIC ns (host-wide), signed
                code, dtype = "q", "<i8"
            self._np[name] = np.frombuffer(meta, dtype, count=size // width, offset=off)
            self._mv[name] = memoryview(meta)[off : off + size].cast(code)
        m = self._mv
        self._state, self._pins, self._gen, self._owner = m["state"], m["pins"], m["gen"], m["owner"]
        self._k0, self._k1, self._len, self._sum = m["key0"], m["key1"], m["length"], m["checksum"]
        self._used, self._lease, self._free = m["last_used"], m["lease"], m["free"]
        self._ik0, self._ik1, self._islot = m["ik0"], m["ik1"], m["islot"]
        self._mask = self.geometry.buckets - 1

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
        if isinstance(self._lock, RobustMutex):
            self._lock.close()
        for attr in ("_sb", "_state", "_pins", "_gen", "_owner", "_k0", "_k1", "_len", "_sum",
                     "_used", "_lease", "_free", "_ik0", "_ik1", "_islot", "data"):  # fmt: skip
            getattr(self, attr).release()
        for v in self._mv.values():
            v.release()
        self._np.clear()
        self._mv.clear()
        self._meta.close()
        self._dmap.close()
        os.close(self._fd)
        self._flock.close()

    # -- the critical section --

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the lock; rebuild the derived structures first if the last holder died in
        the middle of a change (``dirty`` still set)."""
        self._lock.acquire()
        try:
            sb = self._sb
            if sb[SB_DIRTY]:
                self._recover()
            sb[SB_DIRTY] = self.pid
            yield
            sb[SB_DIRTY] = 0
        finally:
            self._lock.release()

    def _seq_begin(self) -> None:
        self._sb[SB_SEQ] += 1  # odd: the index is changing

    def _seq_end(self) -> None:
        self._sb[SB_SEQ] += 1

    # -- the index (caller holds the lock) --

    def _find(self, k0: int, k1: int) -> int:
        """Bucket holding the key, or -1."""
        ik0, ik1, islot, mask = self._ik0, self._ik1, self._islot, self._mask
        i = k0 & mask
        while True:
            s = islot[i]
            if s == EMPTY:
                return -1
            if s != TOMB and ik0[i] == k0 and ik1[i] == k1:
                return i
            i = (i + 1) & mask

    def _insert(self, k0: int, k1: int, slot: int) -> None:
        """Add a key known to be absent (``_find`` said so under the same lock)."""
        ik0, ik1, islot, mask = self._ik0, self._ik1, self._islot, self._mask
        i = k0 & mask
        while True:
            s = islot[i]
            if s == EMPTY:
                break
            if s == TOMB:
                self._sb[SB_TOMBS] -= 1
                break
            i = (i + 1) & mask
        islot[i] = TOMB  # a lock-free reader must not match the new key on the old slot
        ik0[i], ik1[i] = k0, k1
        islot[i] = slot  # last: the entry is whole before a lock-free reader can take it

    def _delete(self, i: int) -> None:
        """Remove bucket ``i``: a tombstone (the index is rebuilt when they pile up)."""
        self._islot[i] = TOMB
        self._sb[SB_TOMBS] += 1

    def _maybe_rebuild(self) -> None:
        if self._sb[SB_TOMBS] > self.geometry.buckets // 4:
            self._rebuild_index()
            self._sb[SB_REBUILDS] += 1

    def _rebuild_index(self) -> None:
        """The index afresh from the READY slots (vectorised)."""
        st = self._np["state"]
        ready = np.flatnonzero(st == READY)
        self._seq_begin()
        self._np["islot"][:] = EMPTY
        _bulk_insert(self._np["ik0"], self._np["ik1"], self._np["islot"],
                     self._np["key0"][ready], self._np["key1"][ready], ready.astype(np.uint32))  # fmt: skip
        self._sb[SB_TOMBS] = 0
        self._seq_end()

    # -- slots (caller holds the lock) --

    def _free_slot(self, s: int) -> None:
        self._state[s] = FREE
        self._pins[s] = 0
        self._gen[s] = (self._gen[s] + 1) & 0xFFFFFFFF
        top = self._sb[SB_FREE_TOP]
        self._free[top] = s
        self._sb[SB_FREE_TOP] = top + 1

    def _take_slot(self, now: int) -> int:
        top = self._sb[SB_FREE_TOP]
        if top == 0:
            self._evict(self.evict_batch, now)
            top = self._sb[SB_FREE_TOP]
            if top == 0:
                raise ArenaFull("every slot is pinned or being written")
        top -= 1
        self._sb[SB_FREE_TOP] = top
        s = self._free[top]
        if s >= self.geometry.slots:
            raise RuntimeError("corrupt free stack")  # never index with an unchecked number
        return s

    def _evict(self, count: int, now: int) -> int:
        """Free the ``count`` least recently used slots that nobody reads (and reclaim the
        slots of writers whose lease ran out).  Vectorised: one pass over the columns (or
        over a random sample of them, for large arenas), the index entries turned into
        tombstones in bulk, the free stack pushed in one slice."""
        npc = self._np
        st, pins, lease, used = npc["state"], npc["pins"], npc["lease"], npc["last_used"]
        n = st.size
        sampled = bool(self.evict_sample) and n > self.evict_sample
        if sampled:
            # approximate LRU (as Redis does): the oldest among a random sample
            cand = np.random.randint(0, n, self.evict_sample)  # repeats removed below
            c_st, c_lease, c_pins = st[cand], lease[cand], pins[cand]
        else:  # exact LRU: the dense columns as they are (no gathers)
            cand, c_st, c_lease, c_pins = None, st, lease, pins
        expired = c_lease < now
        ok = ((c_st == READY) & ((c_pins == 0) | expired)) | ((c_st == WRITING) & expired)
        victims = np.flatnonzero(ok) if cand is None else cand[ok]
        if victims.size > count:
            victims = victims[np.argpartition(used[victims], count - 1)[:count]]
        if sampled:
            victims = np.unique(victims)
        if victims.size == 0:
            return 0
        was_ready = victims[st[victims] == READY]
        self._seq_begin()
        if was_ready.size:
            buckets = _bulk_find(npc["ik0"], npc["ik1"], npc["islot"],
                                 npc["key0"][was_ready], npc["key1"][was_ready], want_bucket=True)  # fmt: skip
            buckets = buckets[buckets != EMPTY]
            npc["islot"][buckets] = TOMB
            self._sb[SB_TOMBS] += buckets.size
            self._sb[SB_USED] -= was_ready.size
        st[victims] = FREE
        pins[victims] = 0
        npc["gen"][victims] += np.uint32(1)
        top = self._sb[SB_FREE_TOP]
        npc["free"][top : top + victims.size] = victims
        self._sb[SB_FREE_TOP] = top + victims.size
        self._seq_end()
        self._sb[SB_EVICTED] += victims.size
        self._maybe_rebuild()
        return int(victims.size)

    def _recover(self) -> None:
        """A holder died mid-change: rebuild the index and the free stack from the columns
        (vectorised; a few ms for 256k slots)."""
        st = self._np["state"]
        now = time.monotonic_ns()
        # writers that are gone (or out of lease): their slots are free again
        for s in np.flatnonzero(st == WRITING).tolist():
            if self._lease[s] < now or not _alive(self._owner[s]):
                st[s] = FREE
        self._seq_begin()
        islot = self._np["islot"]
        islot[:] = EMPTY
        ready = np.flatnonzero(st == READY)
        k0, k1 = self._np["key0"][ready], self._np["key1"][ready]
        # duplicates (two writers published one key): keep the most recently used
        order = np.lexsort((-self._np["last_used"][ready].astype(np.int64), k1, k0))
        dup = np.zeros(ready.size, bool)
        if ready.size > 1:
            s0, s1 = k0[order], k1[order]
            dup[order[1:]] = (s0[1:] == s0[:-1]) & (s1[1:] == s1[:-1])
        st[ready[dup]] = FREE
        ready, k0, k1 = ready[~dup], k0[~dup], k1[~dup]
        _bulk_insert(self._np["ik0"], self._np["ik1"], islot, k0, k1, ready.astype(np.uint32))
        self._sb[SB_TOMBS] = 0
        free = np.flatnonzero(st == FREE).astype(np.uint32)[::-1]
        self._np["free"][: free.size] = free
        self._np["pins"][st == FREE] = 0
        self._sb[SB_FREE_TOP] = free.size
        self._sb[SB_USED] = ready.size
        self._sb[SB_RECOVERIES] += 1
        self._seq_end()
        self._sb[SB_SEQ] &= ~1  # even again whatever the dead holder left

    # -- the store's operations --

    def _move(self, moves: list[tuple[memoryview, memoryview]], checksum: bool) -> list[int]:
        """Copy each (dst, src); return each one's xxh3 (0 without ``checksum``).  With
        ``threads`` > 1 the blocks are dealt out to the threads in turn."""
        chunk = self.hash_chunk
        if self._pool is None or len(moves) < 2:
            if not checksum:
                for d, s in moves:
                    d[:] = s
                return [0] * len(moves)
            return [copy_hashing(d, s, chunk) for d, s in moves]
        t = self.threads

        def part(k: int) -> list[int]:
            return [copy_hashing_nogil(d, s, chunk, checksum) for d, s in moves[k::t]]

        futures = [self._pool.submit(part, k) for k in range(1, t)]
        parts = [part(0)] + [f.result() for f in futures]
        out = [0] * len(moves)
        for k, got in enumerate(parts):
            out[k::t] = got
        return out

    def dump(self, keys: Sequence[bytes], srcs: Sequence, checksum: bool = True) -> list[bool]:
        """Store each ``srcs[i]`` under ``keys[i]``; True where stored now or already."""
        n = len(keys)
        if n >= BULK_MIN:
            return self._dump_bulk(keys, srcs, checksum)
        kk = [_KEYS.unpack(k) for k in keys]
        slots: list[int] = [-1] * n
        gens: list[int] = [0] * n
        now = time.monotonic_ns()
        sb, state, gen = self._sb, self._state, self._gen
        ok = [True] * n
        with self._locked():
            for i, (k0, k1) in enumerate(kk):
                if self._find(k0, k1) >= 0:
                    continue  # stored already
                try:
                    s = self._take_slot(now)
                except ArenaFull:  # the rest of the batch is not stored
                    ok[i:] = [False] * (n - i)
                    break
                state[s] = WRITING
                self._owner[s] = self.pid
                self._lease[s] = now + WRITE_LEASE_NS
                self._k0[s], self._k1[s] = k0, k1
                slots[i], gens[i] = s, gen[s]
        # copies and hashes, outside the lock: the slots are ours
        sb_bytes = self.geometry.slot_bytes
        data = self.data
        moves: list[tuple[memoryview, memoryview]] = []
        for i, s in enumerate(slots):
            if s < 0:
                continue
            src = memoryview(srcs[i]).cast("B")
            nbytes = src.nbytes
            if nbytes > sb_bytes:
                raise ValueError(f"a block of {nbytes} bytes does not fit a {sb_bytes}-byte slot")
            moves.append((data[s * sb_bytes : s * sb_bytes + nbytes], src))
            self._len[s] = nbytes
        sums = iter(self._move(moves, checksum))
        for s in slots:
            if s >= 0:
                self._sum[s] = next(sums)
        with self._locked():
            self._seq_begin()
            for i, s in enumerate(slots):
                if s < 0:
                    continue
                if state[s] != WRITING or gen[s] != gens[i] or self._owner[s] != self.pid:
                    ok[i] = False  # our lease ran out and the slot was reclaimed
                    continue
                k0, k1 = kk[i]
                if self._find(k0, k1) >= 0:
                    self._free_slot(s)  # another process published the key meanwhile
                    continue
                tick = sb[SB_TICK] + 1
                sb[SB_TICK] = tick
                self._used[s] = tick
                self._lease[s] = 0
                state[s] = READY  # publish: the one store that makes the slot whole
                self._insert(k0, k1, s)
                sb[SB_USED] += 1
            self._seq_end()
        return ok

    def load(self, keys: Sequence[bytes], dsts: Sequence, checksum: bool = True) -> list[bool]:
        """Fill ``dsts[i]`` with the block of ``keys[i]``; True where found and verified."""
        n = len(keys)
        if n >= BULK_MIN:
            return self._load_bulk(keys, dsts, checksum)
        slots: list[int] = [-1] * n
        gens: list[int] = [0] * n
        now = time.monotonic_ns()
        sb, state, pins, gen = self._sb, self._state, self._pins, self._gen
        with self._locked():
            for i, key in enumerate(keys):
                k0, k1 = _KEYS.unpack(key)
                b = self._find(k0, k1)
                if b < 0:
                    continue
                s = self._islot[b]
                if state[s] != READY:
                    continue
                pins[s] += 1
                self._lease[s] = max(self._lease[s], now + PIN_LEASE_NS)
                tick = sb[SB_TICK] + 1
                sb[SB_TICK] = tick
                self._used[s] = tick
                slots[i], gens[i] = s, gen[s]
        ok = [False] * n
        bad: list[int] = []
        sb_bytes = self.geometry.slot_bytes
        data = self.data
        moves: list[tuple[memoryview, memoryview]] = []
        moved: list[int] = []
        for i, s in enumerate(slots):
            if s < 0:
                continue
            dst = memoryview(dsts[i]).cast("B")
            nbytes = self._len[s]
            if nbytes != dst.nbytes or nbytes > sb_bytes:
                continue  # another size than asked for: a miss (nothing sized from it)
            moves.append((dst, data[s * sb_bytes : s * sb_bytes + nbytes]))
            moved.append(i)
        for i, got in zip(moved, self._move(moves, checksum)):
            good = not checksum or got == self._sum[slots[i]]
            if not good:
                bad.append(i)
            ok[i] = good
        with self._locked():
            for i, s in enumerate(slots):
                if s < 0:
                    continue
                if gen[s] != gens[i]:
                    ok[i] = False  # our pin's lease ran out and the slot was reused
                    continue
                if pins[s]:
                    pins[s] -= 1
                if pins[s] == 0:
                    self._lease[s] = 0
            if bad:
                self._seq_begin()
                for i in bad:
                    s = slots[i]
                    if gen[s] == gens[i] and state[s] == READY and pins[s] == 0:
                        b = self._find(self._k0[s], self._k1[s])
                        if b >= 0 and self._islot[b] == s:
                            self._delete(b)
                        sb[SB_USED] -= 1
                        self._free_slot(s)
                self._seq_end()
        return ok

    # -- the same, with the books kept by numpy over the whole batch --

    def _push_free(self, slots: np.ndarray) -> None:
        """FREE these slots (caller holds the lock and has dropped their index entries)."""
        npc = self._np
        npc["state"][slots] = FREE
        npc["pins"][slots] = 0
        npc["gen"][slots] += np.uint32(1)
        top = self._sb[SB_FREE_TOP]
        npc["free"][top : top + slots.size] = slots
        self._sb[SB_FREE_TOP] = top + slots.size

    def _dump_bulk(self, keys: Sequence[bytes], srcs: Sequence, checksum: bool) -> list[bool]:
        n = len(keys)
        sb_bytes = self.geometry.slot_bytes
        views = [memoryview(x).cast("B") for x in srcs]
        if any(v.nbytes > sb_bytes for v in views):
            raise ValueError(f"a block does not fit a {sb_bytes}-byte slot")
        q = np.frombuffer(b"".join(keys), "<u8").reshape(n, 2)
        k0, k1 = q[:, 0].copy(), q[:, 1].copy()
        npc, sb, pid = self._np, self._sb, self.pid
        st, gen, owner = npc["state"], npc["gen"], npc["owner"]
        ok = np.ones(n, bool)
        now = time.monotonic_ns()
        with self._locked():
            present = _bulk_find(npc["ik0"], npc["ik1"], npc["islot"], k0, k1) != EMPTY
            if len(set(keys)) == n:
                idx = np.flatnonzero(~present)
            else:  # a key twice in one batch: written once
                want = np.zeros(n, bool)
                want[np.unique(q.view("V16").ravel(), return_index=True)[1]] = True
                idx = np.flatnonzero(want & ~present)
            top = sb[SB_FREE_TOP]
            if top < idx.size:
                self._evict(max(idx.size - top, self.evict_batch), now)
                top = sb[SB_FREE_TOP]
                if top < idx.size:  # all the rest pinned or being written: store what fits
                    ok[idx[top:]] = False
                    idx = idx[:top]
            m = idx.size
            slots = npc["free"][top - m : top][::-1].astype(np.int64)
            if m and slots.max() >= self.geometry.slots:
                raise RuntimeError("corrupt free stack")  # never index with an unchecked number
            sb[SB_FREE_TOP] = top - m
            st[slots] = WRITING
            owner[slots] = pid
            npc["lease"][slots] = now + WRITE_LEASE_NS
            npc["key0"][slots], npc["key1"][slots] = k0[idx], k1[idx]
            gens = gen[slots].copy()
        # copies and hashes, outside the lock: the slots are ours
        data = self.data
        moves = [
            (data[s * sb_bytes : s * sb_bytes + views[i].nbytes], views[i])
            for i, s in zip(idx.tolist(), slots.tolist())
        ]
        npc["length"][slots] = [v.nbytes for _, v in moves]
        npc["checksum"][slots] = self._move(moves, checksum)
        with self._locked():
            self._seq_begin()
            mine = (st[slots] == WRITING) & (gen[slots] == gens) & (owner[slots] == pid)
            ok[idx[~mine]] = False  # our lease ran out and the slots were reclaimed
            slots, idx = slots[mine], idx[mine]
            again = _bulk_find(npc["ik0"], npc["ik1"], npc["islot"], k0[idx], k1[idx]) != EMPTY
            if again.any():  # another process published these keys meanwhile
                self._push_free(slots[again])
                slots, idx = slots[~again], idx[~again]
            tick = sb[SB_TICK]
            npc["last_used"][slots] = np.arange(tick + 1, tick + 1 + slots.size, dtype=np.uint64)
            sb[SB_TICK] = tick + slots.size
            npc["lease"][slots] = 0
            st[slots] = READY  # publish: READY, then the index entries
            sb[SB_TOMBS] -= _bulk_insert(npc["ik0"], npc["ik1"], npc["islot"], k0[idx], k1[idx],
                                         slots.astype(np.uint32))  # fmt: skip
            sb[SB_USED] += slots.size
            self._seq_end()
        return ok.tolist()

    def _load_bulk(self, keys: Sequence[bytes], dsts: Sequence, checksum: bool) -> list[bool]:
        n = len(keys)
        q = np.frombuffer(b"".join(keys), "<u8").reshape(n, 2)
        npc, sb = self._np, self._sb
        st, pins, gen, lease = npc["state"], npc["pins"], npc["gen"], npc["lease"]
        now = time.monotonic_ns()
        with self._locked():
            found = _bulk_find(npc["ik0"], npc["ik1"], npc["islot"], q[:, 0], q[:, 1])
            idx = np.flatnonzero(found != EMPTY)
            slots = found[idx].astype(np.int64)
            if slots.size and slots.max() >= self.geometry.slots:
                raise RuntimeError("corrupt index")  # never index with an unchecked number
            ready = st[slots] == READY
            idx, slots = idx[ready], slots[ready]
            np.add.at(pins, slots, 1)
            lease[slots] = np.maximum(lease[slots], now + PIN_LEASE_NS)
            tick = sb[SB_TICK]
            npc["last_used"][slots] = np.arange(tick + 1, tick + 1 + slots.size, dtype=np.uint64)
            sb[SB_TICK] = tick + slots.size
            gens = gen[slots].copy()
            lens = npc["length"][slots].tolist()
            want = npc["checksum"][slots].tolist()
        sb_bytes = self.geometry.slot_bytes
        data = self.data
        ok = [False] * n
        moves: list[tuple[memoryview, memoryview]] = []
        moved: list[tuple[int, int]] = []
        for j, (i, s) in enumerate(zip(idx.tolist(), slots.tolist())):
            dst = memoryview(dsts[i]).cast("B")
            nbytes = lens[j]
            if nbytes != dst.nbytes or nbytes > sb_bytes:
                continue  # another size than asked for: a miss (nothing sized from it)
            moves.append((dst, data[s * sb_bytes : s * sb_bytes + nbytes]))
            moved.append((i, j))
        bad: list[int] = []
        for (i, j), got in zip(moved, self._move(moves, checksum)):
            if not checksum or got == want[j]:
                ok[i] = True
            else:
                bad.append(j)
        with self._locked():
            same = gen[slots] == gens
            for i in idx[~same].tolist():
                ok[i] = False  # our pin's lease ran out and the slot was reused
            held, count = np.unique(slots[same], return_counts=True)
            p = pins[held]
            pins[held] = np.where(p > count, p - count, 0)
            lease[held[pins[held] == 0]] = 0
            if bad:  # failed verification: drop the block unless someone else reads it
                self._seq_begin()
                for j in bad:
                    s = int(slots[j])
                    if gen[s] == gens[j] and st[s] == READY and pins[s] == 0:
                        b = self._find(self._k0[s], self._k1[s])
                        if b >= 0 and self._islot[b] == s:
                            self._delete(b)
                        sb[SB_USED] -= 1
                        self._free_slot(s)
                self._seq_end()
        return ok

    def remove(self, keys: Sequence[bytes]) -> None:
        with self._locked():
            self._seq_begin()
            for key in keys:
                b = self._find(*_KEYS.unpack(key))
                if b < 0:
                    continue
                s = self._islot[b]
                if self._pins[s] and self._lease[s] >= time.monotonic_ns():
                    continue  # being read: left for eviction
                self._delete(b)
                self._sb[SB_USED] -= 1
                self._free_slot(s)
            self._seq_end()
            self._maybe_rebuild()

    # -- lookups: without the lock --

    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are stored (numpy: all keys probed at once)."""
        if not keys:
            return 0
        q = np.frombuffer(b"".join(keys), "<u8").reshape(-1, 2)
        for _ in range(8):
            seq = self._sb[SB_SEQ]
            if seq & 1:
                continue
            found = _bulk_find(self._np["ik0"], self._np["ik1"], self._np["islot"], q[:, 0], q[:, 1])
            hit = found != EMPTY
            slots = found[hit]
            hit[hit] = self._np["state"][slots] == READY
            if self._sb[SB_SEQ] == seq:
                miss = np.flatnonzero(~hit)
                return int(miss[0]) if miss.size else len(keys)
        with self._locked():  # a writer kept changing the index: ask under the lock
            return self.lookup_prefix_loop(keys)

    def lookup_prefix_loop(self, keys: Sequence[bytes]) -> int:
        """The same, key by key, stopping at the first miss (for comparison)."""
        for i, key in enumerate(keys):
            k0, k1 = _KEYS.unpack(key)
            b = self._find(k0, k1)
            if b < 0 or self._state[self._islot[b]] != READY:
                return i
        return len(keys)

    # -- inspection --

    def stats(self) -> dict[str, int]:
        sb = self._sb
        return {
            "slots": self.geometry.slots, "slot_bytes": self.geometry.slot_bytes,
            "used": sb[SB_USED], "free": sb[SB_FREE_TOP], "evicted": sb[SB_EVICTED],
            "recoveries": sb[SB_RECOVERIES], "tombstones": sb[SB_TOMBS],
            "index_rebuilds": sb[SB_REBUILDS],
        }  # fmt: skip

    def check(self) -> list[str]:
        """Consistency of index, columns and free stack (``ucm store verify``'s core)."""
        problems = []
        st = self._np["state"]
        islot = self._np["islot"]
        named = islot[islot < TOMB]
        if named.size and (named.max() >= self.geometry.slots):
            problems.append("index names a slot out of range")
        ready = np.flatnonzero(st == READY)
        if set(named.tolist()) != set(ready.tolist()):
            problems.append(f"index names {named.size} slots, {ready.size} are READY")
        top = self._sb[SB_FREE_TOP]
        free = self._np["free"][:top]
        if set(free.tolist()) != set(np.flatnonzero(st == FREE).tolist()):
            problems.append("free stack differs from the FREE slots")
        return problems


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _bulk_find(ik0: np.ndarray, ik1: np.ndarray, islot: np.ndarray, k0: np.ndarray, k1: np.ndarray,
               want_bucket: bool = False) -> np.ndarray:
    """Slot (or bucket) of every key, EMPTY where absent: all keys advance one probe per
    round, so the Python overhead is per round (the longest probe), not per key; the few
    keys left after ``VECTOR_ROUNDS`` rounds finish one by one."""
    mask = np.uint64(islot.size - 1)
    pos = k0 & mask
    out = np.full(k0.size, EMPTY, np.uint64 if want_bucket else np.uint32)
    todo = np.arange(k0.size)
    rounds = 0
    while todo.size:
        rounds += 1
        if rounds > VECTOR_ROUNDS and todo.size <= 16:
            m = int(mask)
            for t in todo.tolist():
                a, b, i = int(k0[t]), int(k1[t]), int(pos[t])
                while True:
                    sl = int(islot[i])
                    if sl == EMPTY:
                        break
                    if sl < TOMB and int(ik0[i]) == a and int(ik1[i]) == b:
                        out[t] = i if want_bucket else sl
                        break
                    i = (i + 1) & m
            break
        p = pos[todo]
        s = islot[p]
        match = (s < TOMB) & (ik0[p] == k0[todo]) & (ik1[p] == k1[todo])
        out[todo[match]] = p[match] if want_bucket else s[match]
        todo = todo[(s != EMPTY) & ~match]
        pos[todo] = (pos[todo] + np.uint64(1)) & mask
    return out


def _bulk_insert(ik0: np.ndarray, ik1: np.ndarray, islot: np.ndarray, k0: np.ndarray, k1: np.ndarray, slots: np.ndarray) -> int:
    """Insert keys known to be absent and distinct: each round, every pending key takes its
    current bucket if free (EMPTY or TOMB; the first of several contenders wins), the rest
    probe on.  Key words are written before the slot word (lock-free readers match on a
    slot below TOMB only).  Returns how many tombstones were taken."""
    mask = np.uint64(islot.size - 1)
    pos = k0 & mask
    todo = np.arange(k0.size)
    tombs = 0
    while todo.size:
        p = pos[todo]
        free = islot[p] >= TOMB
        cand = todo[free]
        _, first = np.unique(pos[cand], return_index=True)
        win = cand[first]
        at = pos[win]
        tombs += int((islot[at] == TOMB).sum())
        ik0[at], ik1[at] = k0[win], k1[win]
        islot[at] = slots[win]
        won = np.zeros(k0.size, bool)
        won[win] = True
        todo = todo[~won[todo]]
        pos[todo] = (pos[todo] + np.uint64(1)) & mask
    return tombs
