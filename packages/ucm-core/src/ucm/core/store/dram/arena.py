"""The host tier's memory: one pre-faulted file in shared memory, fixed-size slots and a
shared index, mapped by every process that opens the store.

Why: the file-per-block store on tmpfs paid, per block, a create, fresh zeroed pages, a
rename, an open and a read through the kernel (0.13-0.29 of memcpy for writes).  Here each
process maps one file once, its pages allocated when the file is made (``posix_fallocate``)
and entered in the process's page tables (``MADV_POPULATE_WRITE``), so a dump or a load is a
copy into or out of a slot plus a few word updates in shared memory under a short lock.
The design and its measurements (against LMDB and the file-per-block store) are in
``tools/prototypes/arena``.

File layout (``<folder>/arena``; sections page-aligned; integers little-endian)::

    superblock   one page: magic, version, geometry, counters
    columns      one array per slot field (numpy scans a dense array):
                 state u32, pins u32, gen u32, owner u32, key0 u64, key1 u64, length u64,
                 layout u64, last_used u64, lease i64, seal 32 bytes
    free stack   u32 per slot: the FREE slot numbers (its top is a superblock word)
    index        open addressing, linear probing, a power of two >= 2 buckets per slot:
                 key0 u64, key1 u64, slot u32 (EMPTY, or TOMB for a deleted entry); a
                 key's home bucket is a hash of key0 salted by a random superblock word
    data         slots x slot_bytes, 2 MiB-aligned (huge pages where the mount has them)

The columns are the truth; the index and the free stack are derived from them, and rebuilt
whenever a process died holding the lock (``dirty`` is set on entry to and cleared on exit
from every critical section).  The lock is an ``flock``, which the kernel releases when its
holder dies, so it never stays held by the dead; waits for it are bounded.

A slot's life: FREE -> WRITING (taken under the lock by a pid, with a lease) -> filled and
sealed outside the lock -> READY (under the lock: the state word, then the index entry)
-> FREE (evicted or removed: ``gen`` bumped, index entry deleted).  A writer killed mid-block
leaves a WRITING slot that no index entry names, reclaimed once its lease ends or its pid is
gone.  A reader pins the slots of its batch (with a lease, so that a reader killed while
pinned frees them later), copies and verifies outside the lock, and unpins; a changed
``gen`` means its pin's lease ran out and the slot was reused: a miss.  Eviction never
takes a pinned slot whose lease runs.

Nothing read from the file sizes an allocation or a mapping without a check: a process
that attaches takes the geometry from the superblock only within its own configured
capacity and the file's real size, a slot number is checked against ``slots`` before use,
a stored length against ``slot_bytes`` and the caller's buffer.

Lookups read the index without the lock under a sequence word (odd while a writer changes
the index; a reader retries when it moved): a lookup is a hint, as across processes any
is, and the load checks again under the lock.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import attrs
import numpy as np

MAGIC = int.from_bytes(b"UCMARNA1", "little")
VERSION = 2  # 2: a key's home bucket is a salted hash of it, no longer its low bits
PAGE = 4096
DATA_ALIGN = 2 << 20
SEAL_BYTES = 32
#: a slot's start and size are multiples of this (copies of aligned memory are fastest)
SLOT_ALIGN = 64
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+
ARENA_FILE = "arena"
LOCK_FILE = "arena.lock"

FREE, WRITING, READY = 0, 1, 2
EMPTY = 0xFFFFFFFF  # a bucket unused since the last rebuild: probes stop here
TOMB = 0xFFFFFFFE  # a deleted entry: probes go on; an insert may take it

#: a reader or writer holding a slot longer than this is presumed dead
LEASE_NS = 30_000_000_000
#: the longest wait for the lock on the engine's path (a holder stopped, not killed, would
#: otherwise stall every process of the host); the call then fails as a miss or an error
LOCK_WAIT_S = 2.0
#: vectorised probe rounds before the last few keys finish one by one
_VECTOR_ROUNDS = 2

# superblock words (u64 index into the first page)
SB_MAGIC, SB_VERSION, SB_SLOT_BYTES, SB_SLOTS, SB_BUCKETS = 0, 1, 2, 3, 4
SB_TICK, SB_DIRTY, SB_FREE_TOP, SB_SEQ, SB_USED, SB_EVICTED, SB_RECOVERIES = 5, 6, 7, 8, 9, 10, 11
SB_TOMBS, SB_REBUILDS, SB_BYTES, SB_SALT = 12, 13, 14, 15

#: Fibonacci hashing: a key's home bucket is the top bits of (key0 ^ salt) * _MIX.  Block keys
#: are hashes of prompts, which a client chooses: were the home their low bits, a client could
#: search for prompts whose keys share them and make every probe in the index walk one long
#: run under the lock, stalling every engine on the host.  The salt, random per arena and kept
#: in its owner-only file, hides which keys collide.
_MIX = 0x9E3779B97F4A7C15
_M64 = (1 << 64) - 1

_WORDS = struct.Struct("<5Q")
_COLUMNS = (  # name, bytes per slot, numpy dtype
    ("state", 4, "<u4"), ("pins", 4, "<u4"), ("gen", 4, "<u4"), ("owner", 4, "<u4"),
    ("key0", 8, "<u8"), ("key1", 8, "<u8"), ("length", 8, "<u8"), ("layout", 8, "<u8"),
    ("last_used", 8, "<u8"), ("lease", 8, "<i8"), ("seal", SEAL_BYTES, "V32"),
    ("free", 4, "<u4"),
)  # fmt: skip


class ArenaBusy(Exception):
    """The lock was not had within :data:`LOCK_WAIT_S` (a holder stopped, not dead)."""


class ArenaMismatch(Exception):
    """The folder's arena has another geometry and another process uses it."""


def _round(n: int, align: int) -> int:
    return (n + align - 1) // align * align


@attrs.frozen
class Geometry:
    """An arena's shape, fixed when its file is made."""

    slot_bytes: int
    slots: int

    @classmethod
    def for_blocks(cls, block_bytes: int, capacity_bytes: int) -> Geometry:
        slot = _round(max(block_bytes, 1), SLOT_ALIGN)
        return cls(slot, capacity_bytes // slot)

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
        for name, width, _ in _COLUMNS:
            out[name] = (at, width * n)
            at = _round(at + width * n, PAGE)
        for name, width in (("ik0", 8), ("ik1", 8), ("islot", 4)):
            out[name] = (at, width * b)
            at = _round(at + width * b, PAGE)
        out["data"] = (_round(at, DATA_ALIGN), self.slot_bytes * n)
        return out

    @property
    def meta_bytes(self) -> int:
        return self.sections()["data"][0]

    @property
    def file_bytes(self) -> int:
        off, size = self.sections()["data"]
        return off + size

    def words(self) -> tuple[int, ...]:
        return (MAGIC, VERSION, self.slot_bytes, self.slots, self.buckets)


class Pinned(NamedTuple):
    """A slot a load pinned: where its block is and what its columns said of it (a tuple:
    a batch makes one per block, under the lock)."""

    slot: int
    gen: int
    length: int
    layout: int
    seal: bytes


def check_folder(folder: str) -> None:
    """Refuse ``folder`` unless it is a real folder of this user that nobody else can write
    (a block decides what the model says; the store checks the whole path at start-up)."""
    st = os.stat(folder, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise PermissionError(
            f"{folder} must be a folder (not a link) of uid {os.geteuid()} that no one else "
            f"can write (it is {stat.filemode(st.st_mode)}, uid {st.st_uid})"
        )


def _open_own(path: str, flags: int) -> int:
    """Open a regular file of this user's that nobody else can use, never through a link."""
    fd = os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        os.close(fd)
        raise PermissionError(f"{path} is not a file of uid {os.geteuid()} closed to others")
    return fd


class Arena:
    """The arena file of ``folder``, mapped.  Thread-safe (one lock per process over the
    file's ``flock``, which does not exclude threads that share one open file)."""

    def __init__(self, folder: str, fd: int, geometry: Geometry, *, data: bool) -> None:
        self.folder = folder
        self.geometry = geometry
        self.pid = os.getpid()
        self._fd = fd
        self._lock_fd = _open_own_lock(folder)
        self._thread_lock = threading.Lock()
        self._closed = False
        self.evicted_here = 0  # blocks this process's passes evicted
        #: told the names (key0, key1 columns) of the blocks this process's passes evict
        self.on_evicted: Callable[[np.ndarray, np.ndarray], None] | None = None
        self._meta = mmap.mmap(fd, geometry.meta_bytes, mmap.MAP_SHARED)
        self._dmap: mmap.mmap | None = None
        self.data: memoryview | None = None
        self._data_lock = threading.Lock()
        self._map_columns()
        if data:
            self.map_data()

    # -- opening --

    @classmethod
    def open(
        cls, folder: str, geometry: Geometry, *, data: bool = True, replace_unused: bool = True
    ) -> Arena:
        """The arena of ``folder`` made for ``geometry``, created if absent.  One of another
        geometry is replaced if no other process has it open, else :class:`ArenaMismatch`."""
        check_folder(folder)
        lock_fd = _open_own_lock(folder)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)  # creation and replacement, one process at once
            path = os.path.join(folder, ARENA_FILE)
            fd = _attach_fd(path)
            if fd is not None:
                found = _file_geometry(fd)
                if found == geometry:
                    return cls(folder, fd, geometry, data=data)
                if not replace_unused or not _unused(fd):
                    os.close(fd)
                    raise ArenaMismatch(
                        f"{path} holds {found.slots if found else '?'} slots of "
                        f"{found.slot_bytes if found else '?'} bytes, in use by another "
                        f"process; blocks of {geometry.slot_bytes} bytes need their own path"
                    )
                os.close(fd)
            fd = _create(path, geometry)
            return cls(folder, fd, geometry, data=data)
        finally:
            os.close(lock_fd)

    @classmethod
    def attach(cls, folder: str, capacity_bytes: int, *, data: bool = True) -> Arena | None:
        """The arena another process made in ``folder``, or None where there is none (or
        one this process's capacity could not hold: never mapped from what the file says
        alone)."""
        path = os.path.join(folder, ARENA_FILE)
        try:
            check_folder(folder)
            fd = _attach_fd(path)
        except (FileNotFoundError, PermissionError):
            return None
        if fd is None:
            return None
        found = _file_geometry(fd)
        if found is None or found.slot_bytes * found.slots > capacity_bytes:
            os.close(fd)
            return None
        return cls(folder, fd, found, data=data)

    def map_data(self) -> None:
        """Map the slots and enter their pages in this process's tables (a process that only
        looks up, such as vLLM's scheduler, never does)."""
        if self._dmap is not None:
            return
        with self._data_lock:
            if self._dmap is not None:
                return
            g = self.geometry
            dmap = mmap.mmap(self._fd, g.slot_bytes * g.slots, mmap.MAP_SHARED,
                             offset=g.meta_bytes)  # fmt: skip
            try:
                dmap.madvise(MADV_POPULATE_WRITE)
            except (OSError, ValueError):  # an older kernel: the pages fault in on first use
                pass
            self._dmap = dmap
            self.data = memoryview(dmap)

    def _map_columns(self) -> None:
        """numpy views (vector work) and memoryview casts (scalar work: several times cheaper
        per item than numpy scalars) over every section."""
        meta = self._meta
        self._views: list[memoryview] = []
        self._sb = self._cast(memoryview(meta)[:PAGE], "Q")
        self.np: dict[str, np.ndarray] = {}
        mv: dict[str, memoryview] = {}
        codes = {"<u4": "I", "<u8": "Q", "<i8": "q"}
        widths = {name: (width, dtype) for name, width, dtype in _COLUMNS}
        widths.update(ik0=(8, "<u8"), ik1=(8, "<u8"), islot=(4, "<u4"))
        for name, (off, size) in self.geometry.sections().items():
            if name == "data":
                continue
            width, dtype = widths[name]
            self.np[name] = np.frombuffer(meta, dtype, count=size // width, offset=off)
            raw = memoryview(meta)[off : off + size]
            if name == "seal":
                self._views.append(raw)
                mv[name] = raw
            else:
                mv[name] = self._cast(raw, codes[dtype])
        self._state, self._pins, self._gen = mv["state"], mv["pins"], mv["gen"]
        self._owner, self._k0, self._k1 = mv["owner"], mv["key0"], mv["key1"]
        self._len, self._layout, self._used = mv["length"], mv["layout"], mv["last_used"]
        self._lease, self._seal, self._free = mv["lease"], mv["seal"], mv["free"]
        self._ik0, self._ik1, self._islot = mv["ik0"], mv["ik1"], mv["islot"]
        self._mask = self.geometry.buckets - 1
        self._salt = int(self._sb[SB_SALT])
        self._shift = _home_shift(self.geometry.buckets)

    def _cast(self, view: memoryview, code: str) -> Any:
        self._views.append(view)
        cast = view.cast(code)  # type: ignore[call-overload]
        self._views.append(cast)
        return cast

    def close(self) -> None:
        with self._thread_lock:
            if self._closed:
                return
            self._closed = True
            self.np.clear()
            for view in reversed(self._views):
                view.release()
            with self._data_lock:
                if self.data is not None:
                    self.data.release()
                maps = [self._meta] if self._dmap is None else [self._meta, self._dmap]
            for mapping in maps:
                try:
                    mapping.close()
                except BufferError:  # a view still held somewhere: unmapped when it goes
                    pass
            os.close(self._fd)
            os.close(self._lock_fd)

    # -- the critical section --

    @contextmanager
    def locked(self, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
        """Hold the lock (at most ``wait_s`` waiting, else :class:`ArenaBusy`); rebuild the
        derived structures first if the last holder died mid-change (``dirty`` set)."""
        deadline = time.monotonic() + wait_s
        if not self._thread_lock.acquire(timeout=wait_s):
            raise ArenaBusy(f"the arena in {self.folder} stayed locked for {wait_s} s")
        try:
            if self._closed:
                raise ArenaBusy("the arena is closed")
            _flock_until(self._lock_fd, deadline, self.folder)
            try:
                sb = self._sb
                if sb[SB_DIRTY]:
                    self._recover()
                sb[SB_DIRTY] = self.pid
                yield
                sb[SB_DIRTY] = 0
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        finally:
            self._thread_lock.release()

    def _seq_begin(self) -> None:
        self._sb[SB_SEQ] += 1  # odd: the index is changing

    def _seq_end(self) -> None:
        self._sb[SB_SEQ] += 1

    # -- the index (caller holds the lock) --

    def _home(self, k0: int) -> int:
        """A key's home bucket (what :func:`_homes` computes for many)."""
        return ((k0 ^ self._salt) * _MIX & _M64) >> self._shift

    def _find(self, k0: int, k1: int) -> int:
        """The bucket holding the key, or -1."""
        ik0, ik1, islot, mask = self._ik0, self._ik1, self._islot, self._mask
        i = self._home(k0)
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
        i = self._home(k0)
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

    def _unindex(self, s: int) -> None:
        """Drop slot ``s``'s index entry (a tombstone: the index is rebuilt when they pile up)
        and free it."""
        b = self._find(self._k0[s], self._k1[s])
        if b >= 0 and self._islot[b] == s:
            self._islot[b] = TOMB
            self._sb[SB_TOMBS] += 1
        self._sb[SB_USED] -= 1
        self._sb[SB_BYTES] -= self._len[s]
        self._free_slot(s)

    def _maybe_rebuild(self) -> None:
        if self._sb[SB_TOMBS] > self.geometry.buckets // 4:
            self._rebuild_index()
            self._sb[SB_REBUILDS] += 1

    def _rebuild_index(self) -> None:
        """The index afresh from the READY slots (vectorised)."""
        npc = self.np
        ready = np.flatnonzero(npc["state"] == READY)
        self._seq_begin()
        npc["islot"][:] = EMPTY
        _bulk_insert(self._salt, npc["ik0"], npc["ik1"], npc["islot"], npc["key0"][ready],
                     npc["key1"][ready], ready.astype(np.uint32))  # fmt: skip
        self._sb[SB_TOMBS] = 0
        self._seq_end()

    # -- slots (caller holds the lock) --

    def _free_slot(self, s: int) -> None:
        self._state[s] = FREE
        self._pins[s] = 0
        self._lease[s] = 0
        self._gen[s] = (self._gen[s] + 1) & 0xFFFFFFFF
        top = self._sb[SB_FREE_TOP]
        self._free[top] = s
        self._sb[SB_FREE_TOP] = top + 1

    def _take_slot(self, now: int, evict_batch: int) -> int:
        """A FREE slot (evicting the least recently used first if none is), or -1."""
        top = self._sb[SB_FREE_TOP]
        if top == 0:
            self._evict(evict_batch, now)
            top = self._sb[SB_FREE_TOP]
            if top == 0:
                return -1
        top -= 1
        self._sb[SB_FREE_TOP] = top
        s: int = self._free[top]
        if s >= self.geometry.slots:
            raise RuntimeError("corrupt free stack")  # never index with an unchecked number
        return s

    def _evict(self, count: int, now: int) -> int:
        """Free the ``count`` least recently used slots nobody reads (and reclaim those of
        writers whose lease ran out): one vectorised pass over the dense columns, the index
        entries turned to tombstones in bulk, the free stack pushed in one slice."""
        npc = self.np
        st, pins, lease = npc["state"], npc["pins"], npc["lease"]
        expired = lease < now
        ok = ((st == READY) & ((pins == 0) | expired)) | ((st == WRITING) & expired)
        victims = np.flatnonzero(ok)
        if victims.size > count:
            victims = victims[np.argpartition(npc["last_used"][victims], count - 1)[:count]]
        if victims.size == 0:
            return 0
        was_ready = victims[st[victims] == READY]
        self._seq_begin()
        if was_ready.size:
            buckets = _bulk_find(self._salt, npc["ik0"], npc["ik1"], npc["islot"],
                                 npc["key0"][was_ready],
                                 npc["key1"][was_ready], want_bucket=True)  # fmt: skip
            buckets = buckets[buckets != EMPTY]
            npc["islot"][buckets] = TOMB
            self._sb[SB_TOMBS] += buckets.size
            self._sb[SB_USED] -= was_ready.size
            self._sb[SB_BYTES] -= int(npc["length"][was_ready].sum())
        st[victims] = FREE
        pins[victims] = 0
        lease[victims] = 0
        npc["gen"][victims] += np.uint32(1)
        top = self._sb[SB_FREE_TOP]
        # pushed highest first, so that a batch takes them in rising order: blocks written
        # together then lie one after another, and a GPU copies such a run in one call
        npc["free"][top : top + victims.size] = np.sort(victims)[::-1]
        self._sb[SB_FREE_TOP] = top + victims.size
        self._seq_end()
        self._sb[SB_EVICTED] += was_ready.size
        self.evicted_here += int(was_ready.size)
        if self.on_evicted is not None and was_ready.size:
            self.on_evicted(npc["key0"][was_ready], npc["key1"][was_ready])
        self._maybe_rebuild()
        return int(was_ready.size)

    def _recover(self) -> None:
        """A holder died mid-change: rebuild the index, the free stack and the counts from
        the columns (vectorised; a few ms for 256k slots)."""
        npc = self.np
        st = npc["state"]
        now = time.monotonic_ns()
        for s in np.flatnonzero(st == WRITING).tolist():  # writers gone or out of lease
            if self._lease[s] < now or not _alive(self._owner[s]):
                st[s] = FREE
        self._seq_begin()
        islot = npc["islot"]
        islot[:] = EMPTY
        ready = np.flatnonzero(st == READY)
        k0, k1 = npc["key0"][ready], npc["key1"][ready]
        # a key published twice (the holder died between two steps): keep the newest
        order = np.lexsort((-npc["last_used"][ready].astype(np.int64), k1, k0))
        dup = np.zeros(ready.size, bool)
        if ready.size > 1:
            s0, s1 = k0[order], k1[order]
            dup[order[1:]] = (s0[1:] == s0[:-1]) & (s1[1:] == s1[:-1])
        st[ready[dup]] = FREE
        ready, k0, k1 = ready[~dup], k0[~dup], k1[~dup]
        _bulk_insert(self._salt, npc["ik0"], npc["ik1"], islot, k0, k1, ready.astype(np.uint32))
        self._sb[SB_TOMBS] = 0
        free = np.flatnonzero(st == FREE)
        npc["gen"][free] += np.uint32(1)  # a pin or a write on a reclaimed slot must see it
        npc["free"][: free.size] = free[::-1].astype(np.uint32)
        npc["pins"][free] = 0
        npc["lease"][free] = 0
        self._sb[SB_FREE_TOP] = free.size
        self._sb[SB_USED] = ready.size
        self._sb[SB_BYTES] = int(npc["length"][ready].sum())
        self._sb[SB_RECOVERIES] += 1
        self._seq_end()
        self._sb[SB_SEQ] &= ~1  # even again, whatever the dead holder left

    # -- the operations --

    def reserve(
        self, keys: Sequence[tuple[int, int]], evict_batch: int, wait_s: float = LOCK_WAIT_S
    ) -> list[tuple[int, int] | bool]:
        """For each key: ``(slot, gen)`` taken for writing, ``True`` where it is stored
        already (or appears twice in the batch), ``False`` where no slot could be freed."""
        now = time.monotonic_ns()
        out: list[tuple[int, int] | bool] = []
        seen: set[tuple[int, int]] = set()
        with self.locked(wait_s):
            for k0, k1 in keys:
                if (k0, k1) in seen or self._find(k0, k1) >= 0:
                    out.append(True)
                    continue
                s = self._take_slot(now, evict_batch)
                if s < 0:
                    out.append(False)
                    continue
                seen.add((k0, k1))
                self._state[s] = WRITING
                self._owner[s] = self.pid
                self._lease[s] = now + LEASE_NS
                self._k0[s], self._k1[s] = k0, k1
                out.append((s, self._gen[s]))
        return out

    def slot(self, s: int, nbytes: int) -> memoryview:
        """The first ``nbytes`` of slot ``s`` (the data must be mapped)."""
        if self.data is None:
            raise RuntimeError("the arena's data is not mapped")
        if not 0 <= s < self.geometry.slots or nbytes > self.geometry.slot_bytes:
            raise ValueError(f"slot {s} of {nbytes} bytes is out of the arena")
        start = s * self.geometry.slot_bytes
        return self.data[start : start + nbytes]

    def publish(
        self,
        written: Sequence[tuple[int, int, int, int, bytes]],
        keys: Sequence[tuple[int, int]],
        wait_s: float = LOCK_WAIT_S,
    ) -> list[bool]:
        """Make the reserved slots readable: each ``(slot, gen, length, layout, seal)``;
        a length of -1 gives the slot back unwritten.  For each, whether the key is now
        stored: False where the slot was given back or is no longer this writer's (its
        lease ran out); True, the slot given back, where another process published the key
        first."""
        out = []
        sb = self._sb
        with self.locked(wait_s):
            self._seq_begin()
            for (s, gen, length, layout, seal), (k0, k1) in zip(written, keys):
                mine = (
                    self._state[s] == WRITING and self._gen[s] == gen and self._owner[s] == self.pid
                )
                if not mine:
                    out.append(False)
                    continue
                if length < 0 or self._find(k0, k1) >= 0:
                    self._free_slot(s)  # cancelled, failed, or the key published meanwhile
                    out.append(length >= 0)
                    continue
                self._len[s] = length
                self._layout[s] = layout
                self._seal[s * SEAL_BYTES : (s + 1) * SEAL_BYTES] = seal.ljust(SEAL_BYTES, b"\0")
                tick = sb[SB_TICK] + 1
                sb[SB_TICK] = tick
                self._used[s] = tick
                self._lease[s] = 0
                self._state[s] = READY  # publish: the one store that makes the slot whole
                self._insert(k0, k1, s)
                sb[SB_USED] += 1
                sb[SB_BYTES] += length
                out.append(True)
            self._seq_end()
        return out

    def pin(
        self, keys: Sequence[tuple[int, int]], wait_s: float = LOCK_WAIT_S
    ) -> list[Pinned | None]:
        """Pin the stored keys' slots for reading (and mark them used)."""
        now = time.monotonic_ns()
        out: list[Pinned | None] = []
        sb = self._sb
        with self.locked(wait_s):
            for k0, k1 in keys:
                b = self._find(k0, k1)
                s = self._islot[b] if b >= 0 else EMPTY
                if s >= self.geometry.slots or self._state[s] != READY:
                    out.append(None)
                    continue
                self._pins[s] += 1
                self._lease[s] = max(self._lease[s], now + LEASE_NS)
                tick = sb[SB_TICK] + 1
                sb[SB_TICK] = tick
                self._used[s] = tick
                seal = bytes(self._seal[s * SEAL_BYTES : (s + 1) * SEAL_BYTES])
                out.append(Pinned(s, self._gen[s], self._len[s], self._layout[s], seal))
        return out

    def unpin(
        self, pinned: Sequence[Pinned], bad: Sequence[Pinned] = (), wait_s: float = LOCK_WAIT_S
    ) -> list[bool]:
        """Release the pins; drop the ``bad`` slots (failed verification) unless another
        reader holds them.  For each pin, whether the slot was still the one pinned (else
        its lease ran out and it was reused: what was read is not the block)."""
        out = []
        with self.locked(wait_s):
            for p in pinned:
                s = p.slot
                same = self._gen[s] == p.gen
                out.append(same)
                if not same:
                    continue
                if self._pins[s]:
                    self._pins[s] -= 1
                if self._pins[s] == 0:
                    self._lease[s] = 0
            if bad:
                self._seq_begin()
                for p in bad:
                    s = p.slot
                    if self._gen[s] == p.gen and self._state[s] == READY and not self._pins[s]:
                        self._unindex(s)
                self._seq_end()
        return out

    def remove(self, keys: Sequence[tuple[int, int]], wait_s: float = LOCK_WAIT_S) -> int:
        """Delete the keys (a slot being read is left to eviction); how many were stored."""
        removed = 0
        now = time.monotonic_ns()
        with self.locked(wait_s):
            self._seq_begin()
            freed = []
            for k0, k1 in keys:
                b = self._find(k0, k1)
                if b < 0:
                    continue
                s = self._islot[b]
                removed += 1
                if self._pins[s] and self._lease[s] >= now:
                    continue
                freed.append(s)
            for s in sorted(set(freed), reverse=True):  # taken again in rising order
                self._unindex(s)
            self._seq_end()
            self._maybe_rebuild()
        return removed

    def evict(self, count: int, wait_s: float = LOCK_WAIT_S) -> int:
        """Evict up to ``count`` least recently used blocks (``ucm store gc``)."""
        with self.locked(wait_s):
            return self._evict(count, time.monotonic_ns())

    # -- lookups: without the lock --

    def found(self, keys: np.ndarray) -> np.ndarray:
        """Which keys (an (n, 2) array of u64 words) are stored, as a bool array."""
        npc = self.np
        for _ in range(64):
            seq = self._sb[SB_SEQ]
            if seq & 1:
                time.sleep(0)
                continue
            slots = _bulk_find(
                self._salt, npc["ik0"], npc["ik1"], npc["islot"], keys[:, 0], keys[:, 1]
            )
            hit = slots < self.geometry.slots
            hit[hit] = npc["state"][slots[hit]] == READY
            if self._sb[SB_SEQ] == seq:
                return hit
        with self.locked():  # writers kept changing the index: ask under the lock
            out = np.zeros(len(keys), bool)
            for i, (k0, k1) in enumerate(keys.tolist()):
                b = self._find(k0, k1)
                out[i] = b >= 0 and self._state[self._islot[b]] == READY
            return out

    # -- inspection --

    def stats(self) -> dict[str, int]:
        sb = self._sb
        return {
            "slots": self.geometry.slots, "slot_bytes": self.geometry.slot_bytes,
            "blocks": sb[SB_USED], "bytes": sb[SB_BYTES], "free_slots": sb[SB_FREE_TOP],
            "evicted": sb[SB_EVICTED], "recoveries": sb[SB_RECOVERIES],
            "tombstones": sb[SB_TOMBS], "index_rebuilds": sb[SB_REBUILDS],
            "writing": int((self.np["state"] == WRITING).sum()),
            "pinned": int((self.np["pins"] > 0).sum()),
        }  # fmt: skip

    def check(self) -> list[str]:
        """Disagreements between the index, the columns and the free stack."""
        problems = []
        npc = self.np
        st, islot = npc["state"], npc["islot"]
        named = islot[islot < TOMB]
        if named.size and named.max() >= self.geometry.slots:
            problems.append("the index names a slot out of range")
        ready = np.flatnonzero(st == READY)
        if set(named.tolist()) != set(ready.tolist()):
            problems.append(f"the index names {named.size} slots, {ready.size} are ready")
        top = self._sb[SB_FREE_TOP]
        if top > self.geometry.slots:
            problems.append("the free stack is longer than the arena")
        elif set(npc["free"][:top].tolist()) != set(np.flatnonzero(st == FREE).tolist()):
            problems.append("the free stack differs from the free slots")
        if self._sb[SB_USED] != ready.size:
            problems.append(f"the block count says {self._sb[SB_USED]}, {ready.size} are ready")
        return problems

    def ready_slots(self) -> list[int]:
        return np.flatnonzero(self.np["state"] == READY).tolist()


def _open_own_lock(folder: str) -> int:
    path = os.path.join(folder, LOCK_FILE)
    try:
        try:
            return _open_own(path, os.O_RDWR)
        except FileNotFoundError:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            os.close(fd)
            return _open_own(path, os.O_RDWR)
    except PermissionError:
        raise
    except OSError as exc:  # ELOOP: a link planted where the lock goes
        raise PermissionError(f"{path} cannot be opened as a file of ours: {exc}") from None


def _flock_until(fd: int, deadline: float, folder: str) -> None:
    """``flock`` within the deadline: at once when free, else polled (a stopped holder must
    not stall the engine beyond the bound)."""
    pause = 20e-6
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise ArenaBusy(f"the arena in {folder} stayed locked past its wait") from None
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)


def _attach_fd(path: str) -> int | None:
    """The arena file, opened and marked in use (a shared ``flock`` held while it is open:
    a replacement needs nobody to hold one), or None where absent."""
    try:
        fd = _open_own(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP: a link planted where the arena goes
        raise PermissionError(f"{path} cannot be opened as a file of ours: {exc}") from None
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def _unused(fd: int) -> bool:
    """Whether no other process holds the arena open (our shared lock becomes exclusive)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _file_geometry(fd: int) -> Geometry | None:
    """The geometry the file's superblock names, if it is an arena of this version whose
    size agrees with it."""
    head = os.pread(fd, _WORDS.size, 0)
    if len(head) != _WORDS.size:
        return None
    magic, version, slot_bytes, slots, buckets = _WORDS.unpack(head)
    if magic != MAGIC or version != VERSION or not slots or slot_bytes % SLOT_ALIGN:
        return None
    geometry = Geometry(slot_bytes, slots)
    if geometry.buckets != buckets or os.fstat(fd).st_size != geometry.file_bytes:
        return None
    return geometry


def _create(path: str, geometry: Geometry) -> int:
    """A fresh arena file, published by rename (a process killed while making it leaves
    only a temporary file).  Caller holds the creation lock."""
    g = geometry
    tmp = f"{path}.tmp.{os.getpid()}"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        # every page now: a write into a hole of a full tmpfs would be a SIGBUS
        os.posix_fallocate(fd, 0, g.file_bytes)
        meta = mmap.mmap(fd, g.meta_bytes, mmap.MAP_SHARED)
        try:
            sections = g.sections()
            off, size = sections["islot"]
            np.frombuffer(meta, "<u4", count=size // 4, offset=off)[:] = EMPTY
            off, size = sections["free"]
            # the free stack: slot n-1 at the bottom, so that slot 0 is handed out first
            free = np.frombuffer(meta, "<u4", count=size // 4, offset=off)
            free[:] = np.arange(g.slots - 1, -1, -1, dtype=np.uint32)
            del free
            sb = memoryview(meta)[:PAGE].cast("Q")
            sb[SB_SLOT_BYTES], sb[SB_SLOTS], sb[SB_BUCKETS] = g.slot_bytes, g.slots, g.buckets
            sb[SB_FREE_TOP] = g.slots
            sb[SB_SALT] = int.from_bytes(os.urandom(8), "little")
            sb[SB_VERSION] = VERSION
            sb[SB_MAGIC] = MAGIC  # last: a file without it is not an arena
            sb.release()
        finally:
            meta.close()
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.rename(tmp, path)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    return fd


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


def _home_shift(buckets: int) -> int:
    """How far a 64-bit product is shifted to leave a bucket number (``buckets`` a power
    of two, at least 2)."""
    return 65 - buckets.bit_length()


def _homes(salt: int, k0: np.ndarray, buckets: int) -> np.ndarray:
    """The home buckets of keys, as :meth:`Arena._find` computes one (uint64 products wrap)."""
    mixed = (k0.astype(np.uint64) ^ np.uint64(salt)) * np.uint64(_MIX)
    return mixed >> np.uint64(_home_shift(buckets))


def _bulk_find(
    salt: int,
    ik0: np.ndarray,
    ik1: np.ndarray,
    islot: np.ndarray,
    k0: np.ndarray,
    k1: np.ndarray,
    want_bucket: bool = False,
) -> np.ndarray:
    """The slot (or bucket) of every key, EMPTY where absent: all keys advance one probe a
    round, so the Python overhead is per round (the longest probe), not per key; the few
    keys left after ``_VECTOR_ROUNDS`` rounds finish one by one."""
    mask = np.uint64(islot.size - 1)
    pos = _homes(salt, k0, islot.size)
    out = np.full(k0.size, EMPTY, np.uint64 if want_bucket else np.uint32)
    todo = np.arange(k0.size)
    rounds = 0
    while todo.size:
        rounds += 1
        if rounds > _VECTOR_ROUNDS and todo.size <= 16:
            m = int(mask)
            for t in todo.tolist():
                a, b, i = int(k0[t]), int(k1[t]), int(pos[t])
                for _ in range(islot.size):
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
        if rounds > islot.size:  # a full index without an empty bucket (never, at <= 0.5)
            break
    return out


def _bulk_insert(
    salt: int,
    ik0: np.ndarray,
    ik1: np.ndarray,
    islot: np.ndarray,
    k0: np.ndarray,
    k1: np.ndarray,
    slots: np.ndarray,
) -> int:
    """Insert keys known to be absent and distinct: each round, every pending key takes its
    bucket if free (EMPTY or TOMB; the first of several contenders wins), the others probe
    on.  Key words are written before the slot word (lock-free readers match on a slot below
    TOMB only).  Returns how many tombstones were taken."""
    mask = np.uint64(islot.size - 1)
    pos = _homes(salt, k0, islot.size)
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
