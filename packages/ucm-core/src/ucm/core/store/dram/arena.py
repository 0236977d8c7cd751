"""The host tier's memory: one pre-faulted file in shared memory, fixed-size slots and a
shared index, mapped by every process that opens the store.

Why: the file-per-block store on tmpfs paid, per block, a create, fresh zeroed pages, a
rename, an open and a read through the kernel (0.13-0.29 of memcpy for writes).  Here each
process maps one file once, its pages allocated when the file is made (``posix_fallocate``)
and entered in the process's page tables (``MADV_POPULATE_WRITE``), so a dump or a load is a
copy into or out of a slot plus a few word updates in shared memory under a short lock.
The file's format is in :mod:`.layout`, the index in :mod:`.index`.

The columns are the truth; the index and the free stack are derived from them, and rebuilt
whenever a process died holding the lock (``dirty`` is set on entry to and cleared on exit
from every critical section).  The lock is an ``flock``, which the kernel releases when its
holder dies, so it never stays held by the dead; every wait for it is bounded, opening
included (:mod:`.files`).

A slot's life: FREE -> WRITING (taken under the lock by a writer) -> filled and sealed
outside the lock -> READY (under the lock: the state word, then the index entry) -> FREE
(evicted or removed: ``gen`` bumped, index entry deleted).  A WRITING slot is its writer's
until the writer publishes it, gives it back or dies, never on a clock: a copy into it may
land late, and must never be sealed under somebody else's key.  Whether a writer lives is
asked of the lock it holds while it lives (:mod:`.writers`), never of a pid.  A reader pins
the slots of its batch (with a lease, so that a reader killed while pinned frees them
later), copies and verifies outside the lock, and unpins; a changed ``gen`` means its pin's
lease ran out and the slot was reused: a miss.  Eviction never takes a pinned slot whose
lease runs, and never a slot being written by a live writer.

A load takes a block only from a slot whose own key columns name the key asked for (the
index is a hint: an entry pointing at another slot serves nothing), and only once its seal
matches.

Lookups read the index without the lock under a sequence word (odd while a writer changes
the index; a reader retries when it moved): a lookup is a hint, as across processes any
is, and the load checks again under the lock.

What a process of the same user can still do: it can write the file, so it can damage any
block (a load then fails its seal: a miss) and it can stop while holding the lock (every
wait is bounded: misses and errors, not hangs).  It can also shorten the file, after which
touching a page past the new end is a SIGBUS in every process that maps it: each critical
section and each lookup first checks the file's size and refuses a short file with
:class:`ArenaDamaged`, which narrows that to a race (see ``docs/security.md``).
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import mmap
import operator
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np
from ucm.core.native import NATIVE, NATIVE_HELD
from ucm.core.store.dram.files import (
    LOCK_FILE,
    ArenaBusy,
    check_folder,
    file_size,
    flock_until,
    open_own_or_create,
    unlock,
)
from ucm.core.store.dram.index import (
    EMPTY,
    LONG_WALK,
    TOMB,
    Index,
    bulk_find,
    bulk_insert,
    homes,
)
from ucm.core.store.dram.layout import (
    ARENA_FILE,
    COLUMNS,
    FREE,
    INDEX_COLUMNS,
    PAGE,
    READY,
    SB_BYTES,
    SB_DIRTY,
    SB_EVICTED,
    SB_FREE_TOP,
    SB_REBUILDS,
    SB_RECOVERIES,
    SB_SALT,
    SB_SEQ,
    SB_TICK,
    SB_TOMBS,
    SB_USED,
    SEAL_BYTES,
    WRITING,
    Geometry,
    attach_fd,
    create,
    file_geometry,
    unused,
)
from ucm.core.store.dram.writers import WriterLocks
from ucm.core.store.payload import address_of

__all__ = [
    "ARENA_FILE", "Arena", "ArenaBusy", "ArenaDamaged", "ArenaMismatch", "Geometry",
    "LEASE_NS", "LOCK_WAIT_S", "LOOKUP_WAIT_S", "Pinned", "READY", "ROOM_FULL", "ROOM_STORED",
    "ROOM_TAKEN", "WRITING", "homes",
]  # fmt: skip

#: a reader holding a pin longer than this is presumed gone: its slot may be evicted (the
#: reader then finds the slot's ``gen`` changed, and what it read is a miss)
LEASE_NS = 30_000_000_000
#: batches of at least this many keys are reserved, published and pinned with numpy (a fixed
#: cost of 100-200 us, under the loop's from about 64 keys on a small VM) where nothing
#: unusual happens (no duplicate key, every slot as expected); the others key by key
VECTOR_MIN_KEYS = 64
#: mixes a key's two words into one, to find a batch's repeated keys with a 1-D unique
_PAIR_MIX = 0x9E3779B97F4A7C15
#: batches of at least this many keys keep their write books in one compiled call each,
#: as arrays, where the library is built; smaller ones go key by key (a compiled call's
#: fixed cost, its arrays and their addresses, is about the loop's for 8 keys)
COMPILED_MIN_KEYS = 8
#: the compiled library (``native/arena_pins.c``, ``arena_books.c``: a batch's pins and
#: unpins, reservation and publication in one call each, holding the GIL), None in a
#: pure-Python wheel (tests set it None)
_LIBRARY = NATIVE_HELD
#: the sections the compiled calls read and write, in the order of their ``cols`` argument
#: (``native/arena.h``)
_COMPILED_COLUMNS = ("state", "pins", "gen", "key0", "key1", "length", "layout", "last_used",
                     "lease", "seal", "ik0", "ik1", "islot", "owner", "free")  # fmt: skip
#: what a reservation's rows say of a key (:meth:`Arena.reserve_rows`,
#: ``native/arena_books.c``): a slot taken for it, stored already, no slot could be freed
ROOM_TAKEN, ROOM_STORED, ROOM_FULL = 0, 1, 2
_CORRUPT_STACK = (1 << 64) - 1
#: what the compiled publication says of the call
_P_LONG_WALK, _P_CORRUPT = 1, 2
#: the longest wait for the lock on the engine's path (a holder stopped, not killed, would
#: otherwise stall every process of the host); the call then fails as a miss or an error
LOCK_WAIT_S = 2.0
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+
#: a lookup's wait, where writers kept the index changing: it is a hint, a miss is cheap
LOOKUP_WAIT_S = 0.05


def vectorised(keys: int) -> bool:
    """Whether a batch of ``keys`` is booked and lent as arrays, no object a key: from
    :data:`COMPILED_MIN_KEYS` where the compiled calls are built, else from
    :data:`VECTOR_MIN_KEYS` (numpy's fixed cost)."""
    return keys >= (COMPILED_MIN_KEYS if _LIBRARY is not None else VECTOR_MIN_KEYS)


def _compiled(keys: int) -> bool:
    """Whether a batch of ``keys`` keeps its books in compiled calls."""
    return _LIBRARY is not None and keys >= COMPILED_MIN_KEYS


def reserved_of(codes: np.ndarray, rows: np.ndarray) -> list[tuple[int, int] | bool]:
    """:meth:`Arena.reserve_rows`' codes and rows as :meth:`Arena.reserve` answers:
    ``(slot, gen)``, ``True`` (stored already) or ``False`` (no room) a key."""
    if not codes.any():  # every key given a slot: the usual batch
        return list(zip(*rows.T.tolist()))
    out: list[tuple[int, int] | bool] = (codes == ROOM_STORED).tolist()
    taken = np.flatnonzero(codes == ROOM_TAKEN)
    for i, s, gen in zip(taken.tolist(), *rows[taken].T.tolist()):
        out[i] = (s, gen)
    return out


def _distinct(words: np.ndarray) -> bool:
    """Whether no key of ``words`` (``(n, 2)`` uint64) appears twice; False too where two
    keys' words mix alike (a 1-D unique: numpy's fixed cost, a set below 32 keys)."""
    n = len(words)
    if n < 32:
        return n < 2 or len(set(map(tuple, words.tolist()))) == n
    return bool(np.unique(words[:, 0] ^ (words[:, 1] * np.uint64(_PAIR_MIX))).size == n)


class ArenaMismatch(Exception):
    """The folder's arena has another geometry and another process uses it."""


class ArenaDamaged(ArenaBusy):
    """The arena file is shorter than its geometry (another process of this user cut it):
    touching its missing pages would be a SIGBUS, so it is not touched."""


class Pinned(NamedTuple):
    """A slot a load pinned: where its block is and what its columns said of it (a tuple:
    a batch makes one per block, under the lock)."""

    slot: int
    gen: int
    length: int
    layout: int
    seal: bytes


#: what :meth:`Arena.load_compiled` says of each key, and of the call (arena_loads.c)
NOT_STORED, LOADED, OTHER_BLOCK, CORRUPT = 0, 1, 2, 3
_LOAD_DONE, _LOAD_BUSY = 0, 1
_F_LONG_WALK, _F_UNPINNED_LATER = 1, 2


def _pin_of(row: Sequence[int], seals: bytes, k: int) -> Pinned:
    """The pin of row ``k`` (slot, gen, length, layout) of a compiled call, its seal the
    ``k``-th 32 bytes of ``seals``."""
    slot, gen, length, layout = row
    return Pinned(slot, gen, length, layout, seals[SEAL_BYTES * k : SEAL_BYTES * (k + 1)])


class PinnedRows(Sequence["Pinned | None"]):
    """A batch's pins as the compiled call left them: a row a key (slot, ``slots`` where
    the key has no pin; gen, length, layout) and a seal each, a :class:`Pinned` made only
    where one is asked for (a batch lent to a GPU's copy asks for none: its slots, lengths
    and digests are read from the rows at once)."""

    __slots__ = ("held", "rows", "seals")

    def __init__(self, rows: np.ndarray, seals: bytes, slots: int) -> None:
        self.rows = rows  # (n, 4) uint64
        self.seals = seals  # SEAL_BYTES a key
        self.held = rows[:, 0] < slots  # the keys pinned

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def __getitem__(self, k: int) -> Pinned | None:  # type: ignore[override]
        k = range(len(self))[operator.index(k)]  # an IndexError past the end, as a list's
        return _pin_of(self.rows[k].tolist(), self.seals, k) if self.held[k] else None

    def __iter__(self) -> Iterator[Pinned | None]:
        table, seals = self.rows.tolist(), self.seals
        return (
            _pin_of(row, seals, k) if h else None
            for k, (row, h) in enumerate(zip(table, self.held))
        )

    def digests(self) -> np.ndarray:
        """Each key's stored digest, the first word of its seal (uint64)."""
        return np.frombuffer(self.seals, "<u8").reshape(len(self), SEAL_BYTES // 8)[:, 0]


class LoadedChunk(NamedTuple):
    """What :meth:`Arena.load_compiled` did: a code a key (``LOADED``, ``NOT_STORED``,
    ``OTHER_BLOCK``: stored with another length or layout, ``CORRUPT``: dropped from the
    arena), and the rows of the pins it took, made into a :class:`Pinned` only when asked
    (:meth:`pin`: most loads never ask)."""

    codes: list[int]
    rows: np.ndarray  # (n, 4) uint64: slot (``slots`` where none), gen, length, layout
    seals: bytes  # 32 bytes a key

    def pin(self, k: int) -> Pinned:
        return _pin_of(self.rows[k].tolist(), self.seals, k)


class ProcessLock:
    """The lock this process's threads take over an arena before its ``flock`` (which does
    not exclude threads that share one open file): the compiled library's mutex where it is
    built, so that its loads (:meth:`Arena.load_compiled`) take the very same lock, else a
    ``threading.Lock``.  Waits are bounded (:meth:`acquire`); only the GIL-free wait lets
    it go."""

    def __init__(self) -> None:
        self._handle = NATIVE_HELD.ucm_lock_new() if NATIVE_HELD is not None else None
        self._lock = threading.Lock() if not self._handle else None

    @property
    def handle(self) -> int | None:
        """The compiled mutex (None: a ``threading.Lock``)."""
        return self._handle

    def acquire(self, timeout: float) -> bool:
        if self._lock is not None:
            return self._lock.acquire(timeout=timeout)
        assert NATIVE is not None and NATIVE_HELD is not None
        if NATIVE_HELD.ucm_lock_try(self._handle):  # free: taken holding the GIL
            return True
        deadline = time.monotonic_ns() + int(timeout * 1e9)
        return bool(NATIVE.ucm_lock_until(self._handle, deadline))  # waits without the GIL

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
        else:
            assert NATIVE_HELD is not None
            NATIVE_HELD.ucm_lock_release(self._handle)

    def close(self) -> None:
        """Mark the arena closed for the compiled loads (the caller holds the lock)."""
        if self._handle:
            assert NATIVE_HELD is not None
            NATIVE_HELD.ucm_lock_close(self._handle)

    def __enter__(self) -> ProcessLock:
        self.acquire(1e9)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:  # nobody can hold or wait for it any more
        if getattr(self, "_handle", None) and NATIVE_HELD is not None:
            NATIVE_HELD.ucm_lock_free(self._handle)
            self._handle = None


class Arena:
    """The arena file of ``folder``, mapped.  Thread-safe (one lock per process over the
    file's ``flock``, which does not exclude threads that share one open file)."""

    def __init__(self, folder: str, fd: int, geometry: Geometry, *, data: bool) -> None:
        self.folder = folder
        self._what = f"the arena in {folder}"  # (what a lock's wait names when it runs out)
        self.geometry = geometry
        self._file_bytes = geometry.file_bytes  # (a property that adds up the sections)
        self._fd = fd
        self._lock_fd = open_own_or_create(os.path.join(folder, LOCK_FILE))
        self._writers = WriterLocks(folder)
        self._owner_word = 0  # this writer's number + 1, once it has one
        self._thread_lock = ProcessLock()
        self._closed = False
        #: slots (slot, gen) this process reserved and pins it holds, to give back at its
        #: next hold of the lock (a hold that failed could not)
        self._owed_writes: collections.deque[tuple[int, int]] = collections.deque()
        self._owed_pins: collections.deque[tuple[Pinned, bool]] = collections.deque()
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
        cls,
        folder: str,
        geometry: Geometry,
        *,
        data: bool = True,
        replace_unused: bool = True,
        wait_s: float = LOCK_WAIT_S,
    ) -> Arena:
        """The arena of ``folder`` made for ``geometry``, created if absent.  One of another
        geometry is replaced if no other process has it open, else :class:`ArenaMismatch`;
        :class:`ArenaBusy` where the lock was not had within ``wait_s``."""
        check_folder(folder)
        lock_fd = open_own_or_create(os.path.join(folder, LOCK_FILE))
        deadline = time.monotonic() + wait_s
        try:
            flock_until(lock_fd, deadline, f"the arena in {folder}")  # one process at once
            path = os.path.join(folder, ARENA_FILE)
            fd = attach_fd(path, deadline)
            if fd is not None:
                found = file_geometry(fd)
                if found == geometry:
                    return cls(folder, fd, geometry, data=data)
                if not replace_unused or not unused(fd):
                    os.close(fd)
                    raise ArenaMismatch(
                        f"{path} holds {found.slots if found else '?'} slots of "
                        f"{found.slot_bytes if found else '?'} bytes, in use by another "
                        f"process; blocks of {geometry.slot_bytes} bytes need their own path"
                    )
                os.close(fd)
            fd = create(path, geometry)
            return cls(folder, fd, geometry, data=data)
        finally:
            os.close(lock_fd)

    @classmethod
    def attach(
        cls, folder: str, capacity_bytes: int, *, data: bool = True, wait_s: float = LOOKUP_WAIT_S
    ) -> Arena | None:
        """The arena another process made in ``folder``, or None where there is none (or
        one this process's capacity could not hold: never mapped from what the file says
        alone).  :class:`ArenaBusy` where it is being replaced past ``wait_s``."""
        path = os.path.join(folder, ARENA_FILE)
        try:
            check_folder(folder)
            fd = attach_fd(path, time.monotonic() + wait_s)
        except (FileNotFoundError, PermissionError):
            return None
        if fd is None:
            return None
        found = file_geometry(fd)
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
        widths = {name: (width, dtype) for name, width, dtype in (*COLUMNS, *INDEX_COLUMNS)}
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
        self._salt = int(self._sb[SB_SALT])
        # the superblock's and the sections' addresses, for the compiled calls: the mapping
        # lives until close(), and the calls run under the lock, never after it
        sb = np.frombuffer(meta, "<u8", count=PAGE // 8)
        self._columns = np.array(
            [sb.ctypes.data, *(self.np[name].ctypes.data for name in _COMPILED_COLUMNS)],
            np.uint64,
        )
        self._columns_at: int = self._columns.ctypes.data  # (asked of numpy: 1.5 us a time)
        del sb
        self._index = Index(mv["ik0"], mv["ik1"], mv["islot"], self._salt, self.geometry.buckets)
        self._islot = mv["islot"]

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
            self._thread_lock.close()
            self.np.clear()
            self._index = None  # type: ignore[assignment]
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
            self._writers.close()

    # -- the critical section --

    @contextmanager
    def locked(self, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
        """Hold the lock (at most ``wait_s`` waiting, else :class:`ArenaBusy`); rebuild the
        derived structures first if the last holder died mid-change (``dirty`` set), give
        back what this process owes, and rebuild the index on the way out where tombstones
        piled up or a walk ran long."""
        deadline = time.monotonic() + wait_s
        if not self._thread_lock.acquire(timeout=wait_s):
            raise ArenaBusy(f"the arena in {self.folder} stayed locked for {wait_s} s")
        try:
            if self._closed:
                raise ArenaBusy("the arena is closed")
            self._check_size()
            flock_until(self._lock_fd, deadline, self._what)
            try:
                sb = self._sb
                if sb[SB_DIRTY]:
                    self._recover()
                sb[SB_DIRTY] = 1
                if self._owed_writes or self._owed_pins:
                    self._pay_back()
                yield
                if self._index.long_walk or sb[SB_TOMBS] > self._index.buckets // 4:
                    self._rebuild_index()
                sb[SB_DIRTY] = 0
            finally:
                unlock(self._lock_fd)
        finally:
            self._thread_lock.release()

    def _check_size(self) -> None:
        # nothing reads this descriptor at its offset
        if file_size(self._fd) < self._file_bytes:
            raise ArenaDamaged(
                f"{self.folder}/{ARENA_FILE} is shorter than its geometry: another process of "
                f"uid {os.geteuid()} cut it; every engine using it must be restarted (see "
                "docs/security.md)"
            )

    def _seq_begin(self) -> None:
        self._sb[SB_SEQ] += 1  # odd: the index is changing

    def _seq_end(self) -> None:
        self._sb[SB_SEQ] += 1

    # -- the index (caller holds the lock) --

    def _unindex(self, s: int) -> None:
        """Drop slot ``s``'s index entry (a tombstone: the index is rebuilt when they pile up)
        and free it."""
        b = self._index.find(self._k0[s], self._k1[s])
        if b >= 0 and self._islot[b] == s:
            self._islot[b] = TOMB
            self._sb[SB_TOMBS] += 1
        self._sb[SB_USED] -= 1
        self._sb[SB_BYTES] -= self._len[s]
        self._free_slot(s)

    def _rebuild_index(self) -> None:
        """The index afresh from the READY slots (vectorised)."""
        npc = self.np
        ready = np.flatnonzero(npc["state"] == READY)
        self._seq_begin()
        npc["islot"][:] = 0xFFFFFFFF
        bulk_insert(self._salt, npc["ik0"], npc["ik1"], npc["islot"], npc["key0"][ready],
                    npc["key1"][ready], ready.astype(np.uint32))  # fmt: skip
        self._sb[SB_TOMBS] = 0
        self._sb[SB_REBUILDS] += 1
        self._index.long_walk = False
        self._seq_end()

    # -- slots (caller holds the lock) --

    def _free_slot(self, s: int) -> None:
        self._state[s] = FREE
        self._pins[s] = 0
        self._lease[s] = 0
        self._owner[s] = 0
        self._gen[s] = (self._gen[s] + 1) & 0xFFFFFFFF
        top = self._sb[SB_FREE_TOP]
        self._free[top] = s
        self._sb[SB_FREE_TOP] = top + 1

    def _take_slot(self, now: int, evict_batch: int, keep: Sequence[int] = ()) -> int:
        """A FREE slot (evicting the least recently used first if none is, none of the
        slots ``keep``), or -1."""
        top = self._sb[SB_FREE_TOP]
        if top == 0:
            self._evict(evict_batch, now, np.array(keep, np.int64))
            top = self._sb[SB_FREE_TOP]
            if top == 0:
                return -1
        if top > self.geometry.slots:
            raise RuntimeError("corrupt free stack")
        top -= 1
        self._sb[SB_FREE_TOP] = top
        s: int = self._free[top]
        if s >= self.geometry.slots or self._state[s] != FREE:
            raise RuntimeError("corrupt free stack")  # never index with an unchecked number
        return s

    def _writer(self) -> int:
        """This process's owner word (its writer number + 1), taken on first use; slots an
        earlier, dead holder of the number left WRITING are freed then (caller holds the
        lock)."""
        number, fresh = self._writers.number()
        word = number + 1
        if fresh or word != self._owner_word:
            npc = self.np
            left = np.flatnonzero((npc["state"] == WRITING) & (npc["owner"] == word))
            for s in sorted(left.tolist(), reverse=True):
                self._free_slot(s)
            self._owner_word = word
        return word

    def _dead_writing(self) -> np.ndarray:
        """The WRITING slots whose writer is dead (its lock is free; caller holds the
        arena's lock, so no new holder of a number takes its slots meanwhile)."""
        npc = self.np
        writing = np.flatnonzero(npc["state"] == WRITING)
        if not writing.size:
            return writing
        owners = npc["owner"][writing]
        dead = [o for o in np.unique(owners).tolist() if not self._writers.alive(o - 1)]
        return writing[np.isin(owners, dead)] if dead else writing[:0]

    def _evict(self, count: int, now: int, keep: np.ndarray | None = None) -> int:
        """Free the ``count`` least recently used slots nobody reads (and the slots of
        writers that died), none of the slots ``keep``: one vectorised pass over the dense
        columns, the index entries turned to tombstones in bulk, the free stack pushed in
        one slice."""
        npc = self.np
        st, pins, lease = npc["state"], npc["pins"], npc["lease"]
        victims = np.flatnonzero((st == READY) & ((pins == 0) | (lease < now)))
        if keep is not None and keep.size:
            victims = victims[~np.isin(victims, keep)]
        if victims.size > count:
            victims = victims[np.argpartition(npc["last_used"][victims], count - 1)[:count]]
        was_ready = victims
        victims = np.concatenate([victims, self._dead_writing()])
        if victims.size == 0:
            return 0
        self._seq_begin()
        if was_ready.size:
            buckets = bulk_find(self._salt, npc["ik0"], npc["ik1"], npc["islot"],
                                npc["key0"][was_ready],
                                npc["key1"][was_ready], want_bucket=True)  # fmt: skip
            buckets = buckets[buckets != 0xFFFFFFFF]
            npc["islot"][buckets] = TOMB
            self._sb[SB_TOMBS] += buckets.size
            self._sb[SB_USED] -= was_ready.size
            self._sb[SB_BYTES] -= int(npc["length"][was_ready].sum())
        st[victims] = FREE
        pins[victims] = 0
        lease[victims] = 0
        npc["owner"][victims] = 0
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
        return int(was_ready.size)

    def _recover(self) -> None:
        """A holder died mid-change: rebuild the index, the free stack and the counts from
        the columns (vectorised; a few ms for 256k slots)."""
        npc = self.np
        st = npc["state"]
        st[self._dead_writing()] = FREE  # a live writer keeps its slots, whatever its pid
        bad = np.flatnonzero(st > READY)
        st[bad] = FREE  # no such state: a damaged column
        self._seq_begin()
        islot = npc["islot"]
        islot[:] = 0xFFFFFFFF
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
        bulk_insert(self._salt, npc["ik0"], npc["ik1"], islot, k0, k1, ready.astype(np.uint32))
        self._sb[SB_TOMBS] = 0
        self._index.long_walk = False
        free = np.flatnonzero(st == FREE)
        npc["gen"][free] += np.uint32(1)  # a pin or a write on a reclaimed slot must see it
        npc["free"][: free.size] = free[::-1].astype(np.uint32)
        npc["pins"][free] = 0
        npc["lease"][free] = 0
        npc["owner"][free] = 0
        self._sb[SB_FREE_TOP] = free.size
        self._sb[SB_USED] = ready.size
        self._sb[SB_BYTES] = int(npc["length"][ready].sum())
        self._sb[SB_RECOVERIES] += 1
        self._seq_end()
        self._sb[SB_SEQ] &= ~1  # even again, whatever the dead holder left

    # -- what a failed hold of the lock left owed --

    def owe_writes(self, reserved: Sequence[tuple[int, int]]) -> None:
        """Give these reserved ``(slot, gen)`` back unwritten at this process's next hold of
        the lock (this one could not be had; nobody else may take them meanwhile)."""
        self._owed_writes.extend(reserved)

    def owe_pins(self, pinned: Sequence[Pinned], bad: Sequence[Pinned] = ()) -> None:
        """Release these pins (dropping the ``bad`` slots) at the next hold of the lock."""
        dropped = {id(p) for p in bad}
        self._owed_pins.extend((p, id(p) in dropped) for p in pinned)

    def _pay_back(self) -> None:
        word = self._owner_word
        self._seq_begin()
        while self._owed_writes:
            s, gen = self._owed_writes.popleft()
            if self._state[s] == WRITING and self._gen[s] == gen and self._owner[s] == word:
                self._free_slot(s)
        while self._owed_pins:
            p, drop = self._owed_pins.popleft()
            self._unpin_one(p, drop, time.monotonic_ns())
        self._seq_end()

    # -- the operations --

    def reserve(
        self, keys: Sequence[tuple[int, int]], evict_batch: int, wait_s: float = LOCK_WAIT_S
    ) -> list[tuple[int, int] | bool]:
        """For each key: ``(slot, gen)`` taken for writing, ``True`` where it is stored
        already (or appears twice in the batch), ``False`` where no slot could be freed."""
        now = time.monotonic_ns()
        out: list[tuple[int, int] | bool] = []
        seen: set[tuple[int, int]] = set()
        twice = len(set(keys)) != len(keys) if _compiled(len(keys)) else True
        with self.locked(wait_s):
            word = self._writer()
            if not twice:  # (a key twice: the loop, which answers the second "stored")
                return self._reserve_compiled(keys, word, now, evict_batch)
            if len(keys) >= VECTOR_MIN_KEYS:
                reserved = self._reserve_all(keys, word, now, evict_batch)
                if reserved is not None:
                    return reserved
            find = self._index.find
            stored: list[int] = []  # their slots: not evicted for the keys after them
            for k0, k1 in keys:
                if (k0, k1) in seen:
                    out.append(True)
                    continue
                at = find(k0, k1)
                if at >= 0:
                    stored.append(int(self._index.islot[at]))
                    out.append(True)
                    continue
                s = self._take_slot(now, evict_batch, stored)
                if s < 0:
                    out.append(False)
                    continue
                seen.add((k0, k1))
                self._state[s] = WRITING
                self._owner[s] = word
                self._lease[s] = 0  # a writer's slot has no lease: it is its until it dies
                self._k0[s], self._k1[s] = k0, k1
                out.append((s, self._gen[s]))
        return out

    def reserve_rows(
        self, words: np.ndarray, evict_batch: int, wait_s: float = LOCK_WAIT_S
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """:meth:`reserve` as the compiled call leaves it, no object a key: the keys as an
        ``(n, 2)`` array of their words; per key a code (``ROOM_TAKEN``, ``ROOM_STORED``,
        ``ROOM_FULL``, uint8) and a row (the slot and its gen where taken, uint64).  None
        where the library is not built, the batch is small (:data:`COMPILED_MIN_KEYS`) or
        a key appears twice (then :meth:`reserve`)."""
        words = np.ascontiguousarray(words, np.uint64).reshape(-1, 2)
        if not _compiled(len(words)) or not _distinct(words):
            return None  # (a key twice: the loop, which answers the second "stored")
        now = time.monotonic_ns()
        with self.locked(wait_s):
            return self._reserve_arrays(words.reshape(-1), self._writer(), now, evict_batch)

    def _reserve_compiled(
        self, keys: Sequence[tuple[int, int]], word: int, now: int, evict_batch: int
    ) -> list[tuple[int, int] | bool]:
        """:meth:`reserve`'s loop in compiled calls (caller holds the lock; no key twice)."""
        n = len(keys)
        words = np.fromiter(itertools.chain.from_iterable(keys), np.uint64, 2 * n)
        return reserved_of(*self._reserve_arrays(words, word, now, evict_batch))

    def _reserve_arrays(
        self, words: np.ndarray, word: int, now: int, evict_batch: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """The compiled reservation of the keys ``words`` (``2n`` contiguous uint64; caller
        holds the lock; no key twice): one call for the batch, and where the free slots run
        out, an eviction (sparing the blocks said to be stored so far, as the loop does) and
        a call for the rest.  Each key's code and row."""
        assert _LIBRARY is not None
        n, g = words.size // 2, self.geometry
        rows = np.zeros((n, 2), np.uint64)
        codes = np.zeros(n, np.uint8)
        walk = ctypes.c_uint64(0)
        done = full = 0
        # bounded: a round after an eviction settles a key at least (one that frees nothing
        # makes the next round answer "full" for the rest)
        while done < n:
            settled = _LIBRARY.ucm_arena_reserve(
                self._columns_at, g.slots, g.buckets, self._salt, n - done,
                words[2 * done :].ctypes.data, word, full, rows[done:].ctypes.data,
                codes[done:].ctypes.data, ctypes.byref(walk),
            )  # fmt: skip
            if settled == _CORRUPT_STACK:
                raise RuntimeError("corrupt free stack")  # the books mended at the next hold
            done += settled
            if done < n:
                stored = rows[:done, 0][codes[:done] == ROOM_STORED].astype(np.int64)
                self._evict(evict_batch, now, stored)
                full = int(self._sb[SB_FREE_TOP] == 0)
        self._index.long_walk |= walk.value > LONG_WALK
        return codes, rows

    def _reserve_all(
        self, keys: Sequence[tuple[int, int]], word: int, now: int, evict_batch: int
    ) -> list[tuple[int, int] | bool] | None:
        """:meth:`reserve`'s loop with numpy (caller holds the lock), where nothing unusual
        happens: no key twice, and free slots for every key not stored once the least
        recently used are evicted, in one pass for the batch (a full arena is a busy
        server's steady state: the loop's pass each ``evict_batch`` keys, and its Python a
        key, cost 5-7 ms a batch of 512 MiB); else None (the loop handles it, and reports a
        damaged free stack)."""
        npc, sb = self.np, self._sb
        if len(set(keys)) != len(keys):
            return None
        words = np.array(keys, dtype=np.uint64).reshape(-1, 2)
        found = bulk_find(
            self._salt, npc["ik0"], npc["ik1"], npc["islot"], words[:, 0], words[:, 1]
        )
        new = np.flatnonzero(found == EMPTY)  # the others are stored already
        n, top = new.size, int(sb[SB_FREE_TOP])
        if top > self.geometry.slots:
            return None
        if top < n:  # the loop's evictions at once, sparing the blocks said to be stored
            self._evict(max(evict_batch, n - top), now, found[found != EMPTY].astype(np.int64))
            top = int(sb[SB_FREE_TOP])
            if top < n or top > self.geometry.slots:
                return None
        taken = npc["free"][top - n : top][::-1].astype(np.int64)  # popped from the top
        if (taken >= self.geometry.slots).any():
            return None
        if (npc["state"][taken] != FREE).any() or np.unique(taken).size != n:
            return None
        sb[SB_FREE_TOP] = top - n
        npc["state"][taken] = WRITING
        npc["owner"][taken] = word
        npc["lease"][taken] = 0  # a writer's slot has no lease: it is its until it dies
        npc["key0"][taken], npc["key1"][taken] = words[new, 0], words[new, 1]
        out: list[tuple[int, int] | bool] = [True] * len(keys)
        for i, got in zip(new.tolist(), zip(taken.tolist(), npc["gen"][taken].tolist())):
            out[i] = got
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
        stored: False where the slot was given back or is no longer this writer's (it died
        in the meantime, as far as the others could tell); True, the slot given back, where
        another process published the key first."""
        out = []
        sb = self._sb
        if _compiled(len(written)):
            n = len(written)
            table = np.array([w[:3] for w in written], np.int64).reshape(n, 3)
            held = table[:, :2].astype(np.uint64)  # (a negative slot wraps past the arena)
            layouts = np.fromiter((w[3] for w in written), np.uint64, n)
            seals = b"".join(w[4].ljust(SEAL_BYTES, b"\0") for w in written)
            words = np.fromiter(itertools.chain.from_iterable(keys), np.uint64, 2 * n)
            with self.locked(wait_s):
                return self._publish_compiled(
                    held, table[:, 2], layouts, seals, words, self._owner_word
                )
        with self.locked(wait_s):
            word = self._owner_word
            if word and len(written) >= VECTOR_MIN_KEYS:
                published = self._publish_all(written, keys, word)
                if published is not None:
                    return published
            find, insert = self._index.find, self._index.insert
            self._seq_begin()
            for (s, gen, length, layout, seal), (k0, k1) in zip(written, keys):
                mine = (
                    word
                    and self._state[s] == WRITING
                    and self._gen[s] == gen
                    and self._owner[s] == word
                    and self._k0[s] == k0
                    and self._k1[s] == k1
                )
                if not mine:
                    out.append(False)
                    continue
                if length < 0 or find(k0, k1) >= 0:
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
                try:
                    if insert(k0, k1, s):
                        sb[SB_TOMBS] -= 1
                except RuntimeError:  # a damaged index: rebuilt on the way out
                    self._free_slot(s)
                    out.append(False)
                    continue
                self._owner[s] = 0
                self._state[s] = READY  # publish: the one store that makes the slot whole
                sb[SB_USED] += 1
                sb[SB_BYTES] += length
                out.append(True)
            self._seq_end()
        return out

    def _publish_compiled(
        self,
        held: np.ndarray,
        lengths: np.ndarray | int,
        layouts: np.ndarray | int,
        seals: bytes | np.ndarray,
        words: np.ndarray,
        word: int,
    ) -> list[bool]:
        """:meth:`publish`'s loop in one compiled call (caller holds the lock): block ``i``
        of slot ``held[i, 0]`` at gen ``held[i, 1]`` (uint64), ``lengths[i]`` bytes (-1:
        given back) of layout word ``layouts[i]`` (or one length and layout for all), under
        the key of ``words`` (``2n`` uint64), its seal the ``i``-th 32 bytes of ``seals``, or
        its 8-byte digest where ``seals`` holds 8 bytes a block."""
        assert _LIBRARY is not None
        n, g = len(held), self.geometry
        held = np.ascontiguousarray(held, np.uint64)
        words = np.ascontiguousarray(words, np.uint64)
        sealed = np.frombuffer(seals, np.uint8) if isinstance(seals, bytes) else seals
        sealed = np.ascontiguousarray(sealed).view(np.uint8).reshape(-1)
        each = None if np.ndim(lengths) == 0 else np.ascontiguousarray(lengths, np.int64)
        kinds = None if np.ndim(layouts) == 0 else np.ascontiguousarray(layouts, np.uint64)
        if held.shape != (n, 2) or words.size != 2 * n:
            raise ValueError("a publication takes a slot, a gen and a key a block")
        if (each is not None and each.size != n) or (kinds is not None and kinds.size != n):
            raise ValueError("a publication takes one length and layout a block, or one")
        if sealed.size not in (8 * n, SEAL_BYTES * n):
            raise ValueError(f"a publication takes {SEAL_BYTES} bytes of seal a block, or 8")
        out = np.zeros(n, np.uint8)
        self._seq_begin()
        flags = _LIBRARY.ucm_arena_publish(
            self._columns_at, g.slots, g.buckets, self._salt, n, held.ctypes.data,
            None if each is None else each.ctypes.data, int(lengths) if each is None else 0,  # type: ignore[arg-type]
            None if kinds is None else kinds.ctypes.data, int(layouts) if kinds is None else 0,  # type: ignore[arg-type]
            sealed.ctypes.data, sealed.size // n if n else SEAL_BYTES, words.ctypes.data,
            word, out.ctypes.data,
        )  # fmt: skip
        if flags & _P_CORRUPT:  # the books mended at the next hold (dirty stays set)
            raise RuntimeError("corrupt free stack")
        self._seq_end()
        self._index.long_walk |= bool(flags & _P_LONG_WALK)
        return out.astype(bool).tolist()  # type: ignore[no-any-return]

    def _publish_all(
        self,
        written: Sequence[tuple[int, int, int, int, bytes]],
        keys: Sequence[tuple[int, int]],
        word: int,
    ) -> list[bool] | None:
        """:meth:`publish`'s loop with numpy (caller holds the lock), where nothing unusual
        happens: every slot still this writer's for its key, every length given, no key
        twice and none published meanwhile; else None (the loop handles it)."""
        slots = np.array([w[0] for w in written], dtype=np.int64)
        gens = np.array([w[1] for w in written], dtype=np.uint64)
        lengths = np.array([w[2] for w in written], dtype=np.int64)
        layouts = np.array([w[3] for w in written], dtype=np.uint64)
        seals = np.array([w[4].ljust(SEAL_BYTES, b"\0") for w in written], "V32")
        words = np.array(keys, dtype=np.uint64).reshape(-1, 2)
        return self._publish_arrays(slots, gens, lengths, layouts, seals, words, word)

    def publish_booked(
        self,
        slots: np.ndarray,
        gens: np.ndarray,
        words: np.ndarray,
        length: int,
        layout: int,
        digests: np.ndarray,
        wait_s: float = LOCK_WAIT_S,
    ) -> list[bool] | None:
        """:meth:`publish` for reserved slots written with blocks of one length and layout
        whose digests the writer gives (each slot's seal), as arrays: no object a key.
        None where anything is unusual (then :meth:`publish`, which handles it)."""
        n = slots.size
        if not (gens.size == digests.size == n and words.shape == (n, 2)):
            raise ValueError("publish_booked takes one gen, key and digest a slot")
        compiled = _compiled(n)
        found = np.ascontiguousarray(digests, "<u8")
        if compiled:  # one length, layout and 8-byte digest a block, as given
            held = np.empty((n, 2), np.uint64)
            held[:, 0], held[:, 1] = slots, gens
        else:
            seals = np.zeros((n, SEAL_BYTES), np.uint8)
            seals[:, :8] = found.view(np.uint8).reshape(n, 8)
        with self.locked(wait_s):
            word = self._owner_word
            if not word:
                return None
            if compiled:
                return self._publish_compiled(held, length, layout, found, words, word)
            return self._publish_arrays(
                slots.astype(np.int64),
                gens.astype(np.uint64),
                np.full(n, length, np.int64),
                np.full(n, layout, np.uint64),
                seals.view("V32").reshape(n),
                words.astype(np.uint64),
                word,
            )

    def _publish_arrays(
        self,
        slots: np.ndarray,
        gens: np.ndarray,
        lengths: np.ndarray,
        layouts: np.ndarray,
        seals: np.ndarray,
        words: np.ndarray,
        word: int,
    ) -> list[bool] | None:
        """The body of :meth:`_publish_all` over arrays (caller holds the lock)."""
        npc, sb = self.np, self._sb
        if (lengths < 0).any() or (slots < 0).any() or (slots >= self.geometry.slots).any():
            return None
        if np.unique(slots).size != slots.size:
            return None
        if not _distinct(words):  # (a key twice: the loop then)
            return None
        mine = (
            (npc["state"][slots] == WRITING)
            & (npc["gen"][slots] == gens)
            & (npc["owner"][slots] == word)
            & (npc["key0"][slots] == words[:, 0])
            & (npc["key1"][slots] == words[:, 1])
        )
        if not mine.all():
            return None
        found = bulk_find(
            self._salt, npc["ik0"], npc["ik1"], npc["islot"], words[:, 0], words[:, 1]
        )
        if (found != EMPTY).any():
            return None
        self._seq_begin()
        npc["length"][slots] = lengths
        npc["layout"][slots] = layouts
        npc["seal"][slots] = seals
        tick = int(sb[SB_TICK])
        npc["last_used"][slots] = np.arange(tick + 1, tick + 1 + slots.size, dtype=np.uint64)
        sb[SB_TICK] = tick + slots.size
        npc["lease"][slots] = 0
        inserted = bulk_insert(self._salt, npc["ik0"], npc["ik1"], npc["islot"],
                               words[:, 0], words[:, 1], slots.astype(np.uint32))  # fmt: skip
        sb[SB_TOMBS] -= inserted.tombs
        index = self._index
        index.long_walk |= inserted.rounds > LONG_WALK or inserted.left.size > 0
        ok = np.ones(slots.size, bool)
        ok[inserted.left] = False  # no bucket: a damaged index, rebuilt on the way out
        for s in slots[~ok].tolist():
            self._free_slot(s)
        npc["owner"][slots[ok]] = 0
        npc["state"][slots[ok]] = READY  # publish: the one store that makes the slots whole
        sb[SB_USED] += int(ok.sum())
        sb[SB_BYTES] += int(lengths[ok].sum())
        self._seq_end()
        return ok.tolist()

    def pin(
        self, keys: Sequence[tuple[int, int]], wait_s: float = LOCK_WAIT_S
    ) -> list[Pinned | None]:
        """Pin the stored keys' slots for reading (and mark them used): only a READY slot
        whose own key columns are the key's (the index entry is a hint)."""
        now = time.monotonic_ns()
        out: list[Pinned | None] = []
        sb = self._sb
        slots = self.geometry.slots
        words = (
            np.array(keys, dtype=np.uint64).reshape(-1, 2)
            if len(keys) >= VECTOR_MIN_KEYS and _LIBRARY is None
            else None
        )
        with self.locked(wait_s):
            if _LIBRARY is not None:
                return self._pin_compiled(keys, now)
            if words is not None:
                pinned = self._pin_all(words, now)
                if pinned is not None:
                    return pinned
            find, islot = self._index.find, self._islot
            for k0, k1 in keys:
                b = find(k0, k1)
                s = islot[b] if b >= 0 else slots
                if s >= slots or self._state[s] != READY or self._k0[s] != k0 or self._k1[s] != k1:
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

    def pin_rows(
        self, keys: Sequence[tuple[int, int]], wait_s: float = LOCK_WAIT_S
    ) -> PinnedRows | None:
        """:meth:`pin` as the compiled call's rows, no object a key; None where the library
        is not built (then :meth:`pin`).  Given back with :meth:`unpin_rows`."""
        if _LIBRARY is None:
            return None
        now = time.monotonic_ns()
        with self.locked(wait_s):
            return self._pin_rows(keys, now)

    def _pin_compiled(self, keys: Sequence[tuple[int, int]], now: int) -> list[Pinned | None]:
        """:meth:`pin`'s loop in one compiled call (caller holds the lock)."""
        return list(self._pin_rows(keys, now))

    def _pin_rows(self, keys: Sequence[tuple[int, int]], now: int) -> PinnedRows:
        """The compiled pins (caller holds the lock)."""
        assert _LIBRARY is not None
        n, slots = len(keys), self.geometry.slots
        words = np.fromiter(itertools.chain.from_iterable(keys), np.uint64, 2 * n)
        rows = np.empty((n, 4), np.uint64)
        seals = ctypes.create_string_buffer(SEAL_BYTES * n)
        longest = _LIBRARY.ucm_arena_pin(
            self._columns_at, slots, self.geometry.buckets, self._salt, n,
            words.ctypes.data, now + LEASE_NS, rows.ctypes.data, seals,
        )  # fmt: skip
        self._index.long_walk |= longest > LONG_WALK
        return PinnedRows(rows, seals.raw, slots)

    def load_compiled(
        self,
        keys: Sequence[tuple[int, int]],
        nbytes: Sequence[int],
        parts: Sequence[Sequence[memoryview]],
        layout: int,
        wait_s: float = LOCK_WAIT_S,
    ) -> LoadedChunk | None:
        """Load blocks in one compiled call that lets go of the GIL throughout
        (``native/arena_loads.c``): key ``i``'s block, ``nbytes[i]`` bytes of layout word
        ``layout``, lands in ``parts[i]`` (flat byte views, their lengths adding up to it),
        copied under a pin and checked against its seal as it lands.  None where the
        library is not built, this process owes the arena books, or the arena is closed,
        cut short or being mended: :meth:`pin` and the copies in Python answer then.
        :class:`ArenaBusy` where the lock was not had within ``wait_s``."""
        lock = self._thread_lock.handle
        if _LIBRARY is None or NATIVE is None or not lock or self._closed:
            return None
        if self._owed_writes or self._owed_pins or self.data is None:
            return None
        n = len(keys)
        try:  # held: the sections and the slots stay mapped while the call uses them
            meta, data = memoryview(self._meta), self.data[:]
        except ValueError:  # closed meanwhile
            return None
        try:
            words = np.fromiter(itertools.chain.from_iterable(keys), np.uint64, 2 * n)
            flat = [part for block in parts for part in block]
            pieces = np.array([[address_of(p) for p in flat], [p.nbytes for p in flat]],
                              np.uint64).reshape(2, -1)  # fmt: skip
            counts = np.fromiter(map(len, parts), np.uint64, n)
            sizes = np.fromiter(nbytes, np.uint64, n)
            rows = np.empty((n, 4), np.uint64)
            seals = ctypes.create_string_buffer(SEAL_BYTES * n)
            codes = np.zeros(n, np.uint8)
            flags = ctypes.c_uint64(0)
            g = self.geometry
            done = NATIVE.ucm_arena_load_chunk(
                lock, self._lock_fd, self._fd, self._file_bytes, self._columns_at,
                g.slots, g.buckets, self._salt, address_of(data), g.slot_bytes,
                n, words.ctypes.data, sizes.ctypes.data, layout, counts.ctypes.data,
                pieces[0].ctypes.data, pieces[1].ctypes.data, LEASE_NS, int(wait_s * 1e9),
                rows.ctypes.data, seals, codes.ctypes.data, ctypes.byref(flags),
            )  # fmt: skip
        finally:
            meta.release()
            data.release()
        if done == _LOAD_BUSY:
            raise ArenaBusy(f"the arena in {self.folder} stayed locked for {wait_s} s")
        if done != _LOAD_DONE:
            return None
        loaded = LoadedChunk(codes.tolist(), rows, seals.raw)
        if flags.value & _F_UNPINNED_LATER:  # let go at this process's next hold
            self.owe_pins([p for p in PinnedRows(rows, loaded.seals, g.slots) if p is not None])
            raise ArenaBusy(f"the arena in {self.folder} stayed locked for {wait_s} s")
        bad = [loaded.pin(k) for k, code in enumerate(loaded.codes) if code == CORRUPT]
        if flags.value & _F_LONG_WALK or bad:
            # the index rebuilt on the way out of the lock; the failed blocks dropped
            # unless another reader holds them (else the next load that fails drops them)
            self._index.long_walk |= bool(flags.value & _F_LONG_WALK)
            try:
                self.unpin([], bad, wait_s)
            except ArenaBusy:
                pass
        return loaded

    def _pin_all(self, words: np.ndarray, now: int) -> list[Pinned | None] | None:
        """:meth:`pin`'s loop with numpy (caller holds the lock); None where a key appears
        twice (the loop counts each pin)."""
        npc, sb = self.np, self._sb
        found = bulk_find(
            self._salt, npc["ik0"], npc["ik1"], npc["islot"], words[:, 0], words[:, 1]
        )
        hit = found < self.geometry.slots
        at = found[hit].astype(np.int64)
        hit[hit] = (
            (npc["state"][at] == READY)
            & (npc["key0"][at] == words[hit, 0])
            & (npc["key1"][at] == words[hit, 1])
        )
        at = found[hit].astype(np.int64)
        if np.unique(at).size != at.size:
            return None
        npc["pins"][at] += 1
        npc["lease"][at] = np.maximum(npc["lease"][at], now + LEASE_NS)
        tick = int(sb[SB_TICK])
        npc["last_used"][at] = np.arange(tick + 1, tick + 1 + at.size, dtype=np.uint64)
        sb[SB_TICK] = tick + at.size
        seals = npc["seal"][at].tolist()  # bytes, one a slot
        rows = zip(
            at.tolist(),
            npc["gen"][at].tolist(),
            npc["length"][at].tolist(),
            npc["layout"][at].tolist(),
            seals,
        )
        made = iter([Pinned(*row) for row in rows])
        return [next(made) if h else None for h in hit.tolist()]

    def unpin(
        self, pinned: Sequence[Pinned], bad: Sequence[Pinned] = (), wait_s: float = LOCK_WAIT_S
    ) -> list[bool]:
        """Release the pins; drop the ``bad`` slots (failed verification) unless another
        reader holds them.  For each pin, whether the slot was still the one pinned (else
        its lease ran out and it was reused: what was read is not the block)."""
        now = time.monotonic_ns()
        with self.locked(wait_s):
            if _LIBRARY is not None and pinned:
                held = np.fromiter(itertools.chain.from_iterable((p.slot, p.gen) for p in pinned),
                                   np.uint64, 2 * len(pinned))  # fmt: skip
                out = self._unpin_compiled(held.reshape(-1, 2))
            else:
                out = self._unpin_each(pinned, now)
            self._drop_bad(bad, now)
        return out

    def unpin_rows(
        self, pins: PinnedRows, bad: Sequence[Pinned] = (), wait_s: float = LOCK_WAIT_S
    ) -> list[bool]:
        """:meth:`unpin` of :meth:`pin_rows`' pins: per key, whether its pin held to the end
        (False where it had none)."""
        now = time.monotonic_ns()
        out = np.zeros(len(pins), bool)
        with self.locked(wait_s):
            if _LIBRARY is not None:
                out[pins.held] = self._unpin_compiled(pins.rows[pins.held][:, :2])
            else:  # (the library taken away since: tests)
                held = [p for p in pins if p is not None]
                out[pins.held] = self._unpin_each(held, now)
            self._drop_bad(bad, now)
        return out.tolist()  # type: ignore[no-any-return]

    def _unpin_compiled(self, held: np.ndarray) -> list[bool]:
        """Release the pins ``held`` ((n, 2): slot, gen) in one compiled call (caller holds
        the lock); whether each slot was still the one pinned."""
        assert _LIBRARY is not None
        held = np.ascontiguousarray(held, np.uint64)
        n = held.shape[0]
        if not n:
            return []
        kept = ctypes.create_string_buffer(n)
        _LIBRARY.ucm_arena_unpin(self._columns_at, self.geometry.slots, n, held.ctypes.data, kept)
        return [bool(b) for b in kept.raw]

    def _unpin_each(self, pinned: Sequence[Pinned], now: int) -> list[bool]:
        out = []
        for p in pinned:
            same = self._gen[p.slot] == p.gen
            out.append(same)
            if same:
                self._unpin_one(p, False, now)
        return out

    def _drop_bad(self, bad: Sequence[Pinned], now: int) -> None:
        if bad:
            self._seq_begin()
            for p in bad:
                self._unpin_one(p, True, now, pinned=False)
            self._seq_end()

    def _unpin_one(self, p: Pinned, drop: bool, now: int, *, pinned: bool = True) -> None:
        s = p.slot
        if self._gen[s] != p.gen:
            return
        if pinned:
            if self._pins[s]:
                self._pins[s] -= 1
            if self._pins[s] == 0:
                self._lease[s] = 0
        if drop and self._state[s] == READY and not self._pins[s]:
            self._unindex(s)

    def remove(self, keys: Sequence[tuple[int, int]], wait_s: float = LOCK_WAIT_S) -> int:
        """Delete the keys (a slot being read is left to eviction); how many were stored."""
        removed = 0
        now = time.monotonic_ns()
        with self.locked(wait_s):
            self._seq_begin()
            freed = []
            for k0, k1 in keys:
                b = self._index.find(k0, k1)
                if b < 0:
                    continue
                s = self._islot[b]
                if s >= self.geometry.slots or self._state[s] != READY:
                    continue
                removed += 1
                if self._pins[s] and self._lease[s] >= now:
                    continue
                freed.append(s)
            for s in sorted(set(freed), reverse=True):  # taken again in rising order
                self._unindex(s)
            self._seq_end()
        return removed

    def evict(self, count: int, wait_s: float = LOCK_WAIT_S) -> int:
        """Evict up to ``count`` least recently used blocks (``ucm store gc``)."""
        with self.locked(wait_s):
            return self._evict(count, time.monotonic_ns())

    # -- lookups: without the lock --

    def found(self, keys: np.ndarray, wait_s: float = LOOKUP_WAIT_S) -> np.ndarray:
        """Which keys (an (n, 2) array of u64 words) are stored, as a bool array;
        :class:`ArenaBusy` where the index kept changing and the lock was not had within
        ``wait_s``."""
        npc = self.np
        self._check_size()
        for _ in range(64):
            seq = self._sb[SB_SEQ]
            if seq & 1:
                time.sleep(0)
                continue
            slots = bulk_find(
                self._salt, npc["ik0"], npc["ik1"], npc["islot"], keys[:, 0], keys[:, 1]
            )
            hit = slots < self.geometry.slots
            at = slots[hit]
            hit[hit] = (
                (npc["state"][at] == READY)
                & (npc["key0"][at] == keys[hit, 0])
                & (npc["key1"][at] == keys[hit, 1])
            )
            if self._sb[SB_SEQ] == seq:
                return hit
        with self.locked(wait_s):  # writers kept changing the index: ask under the lock
            out = np.zeros(len(keys), bool)
            for i, (k0, k1) in enumerate(keys.tolist()):
                b = self._index.find(k0, k1)
                s = self._islot[b] if b >= 0 else self.geometry.slots
                out[i] = (
                    s < self.geometry.slots
                    and self._state[s] == READY
                    and self._k0[s] == k0
                    and self._k1[s] == k1
                )
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
