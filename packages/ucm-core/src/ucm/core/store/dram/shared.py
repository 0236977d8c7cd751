"""The dram store's host scope: blocks in shared memory, seen by every process on the host.

An engine's lookups and its loads may run in different processes (vLLM asks its scheduler
process what is stored and moves blocks in its worker processes), and users expect host
memory to survive an engine restart, so the host scope keeps its blocks in one arena file
on a memory filesystem (:mod:`.arena`) that every process maps.  A dump or load is a copy
into or out of a slot, sealed and verified as it moves: the block's digest
(:mod:`ucm.core.digest`), or the keyed MAC of a signed store, over the block as it lies in
shared memory, checked on every load.

The arena's slots have one size, fixed by the first engine that writes: the block size
workers announce at start-up (``check_block_bytes``), or the first block dumped.  A store
whose arena holds other blocks and is in use elsewhere refuses at start-up with the
path to change; an arena nobody holds is replaced.

Copies run on ``threads`` threads, a batch's blocks dealt out among them: the compiled copies
release the GIL, so one thread's hashing overlaps another's copy and the store moves
blocks at memory speed with the checksum on.  Each thread reserves or pins its own share, a
chunk at a time, so the caller's thread (an engine's) only checks the batch and hands it
over.  A load's chunk, where the library is built and the store unsigned, is one compiled
call without the GIL from the first hold of the arena's lock to the last
(:meth:`Arena.load_compiled`): Python's share around each block's copy had become as long
as the copy.

A caller that can write blocks where they will live asks for the slots instead
(:meth:`SharedMemoryStore.open_writes`, :mod:`ucm.core.store.writes`): it copies into them
and commits, and the threads only seal and publish (with the digests a GPU computed as it
copied, without reading the bytes).  One that can read them where they lie (a GPU's DMA
engine, once the arena is registered with its driver: :meth:`host_memory`) borrows them
(:meth:`SharedMemoryStore.open_reads`, :mod:`ucm.core.store.reads`): the threads only check
their seals, or nobody here does (``check=False``: the GPU checks what it copies out).
"""

from __future__ import annotations

import functools
import itertools
import logging
import operator
import struct
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, cast

import numpy as np
import xxhash
from ucm.core.settings import ConfigError
from ucm.core.signing import signer_for
from ucm.core.store.base import Store, StoreUsage, check_batch, check_keys
from ucm.core.store.chunks import chunk_size
from ucm.core.store.dram.arena import (
    CORRUPT,
    LOADED,
    LOCK_WAIT_S,
    LOOKUP_WAIT_S,
    NOT_STORED,
    ROOM_FULL,
    ROOM_STORED,
    ROOM_TAKEN,
    Arena,
    ArenaBusy,
    ArenaMismatch,
    Geometry,
    Pinned,
    PinnedRows,
    reserved_of,
    vectorised,
)
from ucm.core.store.dram.config import DramStoreConfig
from ucm.core.store.dram.memfs import MEMORY_FILESYSTEMS, check_memory_filesystem, mount_of
from ucm.core.store.dram.sealing import Move, move_sealed_batch
from ucm.core.store.dram.sealing import compiled as copies_compiled
from ucm.core.store.dram.verify import seal_matches, verify_arena
from ucm.core.store.evictions import EvictionWatch
from ucm.core.store.folder import check_before_creating, check_store_folder, make_store_folder
from ucm.core.store.payload import Payload, address_of
from ucm.core.store.reads import SlotReads
from ucm.core.store.task import CANCELLED, MISS, OK, KeyResult, Status, Task
from ucm.core.store.writes import SlotWrites
from ucm.core.threads import store_pool

log = logging.getLogger(__name__)

_KEY = struct.Struct("<QQ")
#: after an open of the arena found its lock held past its wait, calls fail at once for
#: this long (each would otherwise make the engine's thread wait out the bound again)
RETRY_OPEN_S = 5.0


class SharedMemoryStore(Store):
    """A ``dram`` store of scope ``host``: an arena in ``config.path`` on a memory
    filesystem, refused at start-up where the path is on a disk, is open to other users or
    the filesystem is smaller than the capacity."""

    def __init__(self, config: DramStoreConfig) -> None:
        check_memory_filesystem(config.path, config.capacity_bytes)
        check_before_creating(config.path, shared=False)
        make_store_folder(config.path)
        self.root = check_store_folder(config.path, shared=False)
        self.config = config
        self._capacity = config.capacity_bytes
        self._signer = signer_for(config.secret)
        self._arena: Arena | None = None  # attached on first use: see check_block_bytes
        self._arena_lock = threading.Lock()
        self._pool = store_pool(config.threads, "ucm-shm")
        self._closed = False
        self._evictions = EvictionWatch()
        self._retry_open_at = 0.0  # an open that found the lock held is not retried before
        self._open_failure = ""

    tier = "host"

    @property
    def reads_from_memory(self) -> bool:
        return True

    @property
    def lends_blocks(self) -> bool:
        return True

    @property
    def evicted_blocks(self) -> int:
        arena = self._arena
        return 0 if arena is None else arena.evicted_here

    # -- the arena --

    def _attached(self) -> Arena | None:
        """The arena, attached if another process made one (an open that fails costs a few
        microseconds); None while there is none, or while it cannot be had at once."""
        arena = self._arena
        if arena is not None:
            return arena
        if not self._arena_lock.acquire(timeout=LOOKUP_WAIT_S):
            return None  # another thread is opening it (bounded): a miss meanwhile
        try:
            if self._arena is None and not self._closed:
                try:
                    attached = Arena.attach(self.root, self._capacity, data=False)
                except ArenaBusy:
                    return None
                self._arena = None if attached is None else self._adopt(attached)
            return self._arena
        finally:
            self._arena_lock.release()

    def _adopt(self, arena: Arena) -> Arena:
        arena.on_evicted = self._evicted  # what this process's passes evict, for the watch
        return arena

    def _evicted(self, key0: np.ndarray, key1: np.ndarray) -> None:
        if self._evictions:
            self._evictions.evicted(zip(key0.tolist(), key1.tolist()))

    def _eviction_names(self, keys: Sequence[bytes]) -> list[Hashable]:
        return list(self._words(keys))

    def _arena_for(self, nbytes: int) -> Arena:
        """The arena, made for blocks of ``nbytes`` if there is none yet; ``ConfigError``
        where the blocks cannot be held, ``ArenaBusy`` where its lock was not had within its
        wait (then every call fails at once for :data:`RETRY_OPEN_S`, not each after a wait)."""
        if nbytes > self._capacity:
            raise ConfigError(
                "store.capacity_gb",
                f"{self.config.capacity_gb} GiB cannot hold one block of {nbytes} bytes",
            )
        if not self._arena_lock.acquire(timeout=LOCK_WAIT_S):
            raise ArenaBusy(f"the arena in {self.root} is being opened by another thread")
        try:
            if self._closed:
                raise RuntimeError("the store is closed")
            if self._arena is None:
                if time.monotonic() < self._retry_open_at:
                    raise ArenaBusy(self._open_failure)
                geometry = Geometry.for_blocks(nbytes, self._capacity)
                try:
                    self._arena = self._adopt(Arena.open(self.root, geometry))
                except ArenaBusy as exc:
                    self._retry_open_at = time.monotonic() + RETRY_OPEN_S
                    self._open_failure = str(exc)
                    raise
                except (ArenaMismatch, PermissionError) as exc:
                    raise ConfigError("store.path", str(exc)) from None
                except OSError as exc:  # no room left in the memory filesystem
                    raise ConfigError(
                        "store.capacity_gb",
                        f"cannot reserve {self.config.capacity_gb:g} GiB in {self.root}: "
                        f"{exc.strerror} (other users of the filesystem took its room: "
                        "lower capacity_gb or enlarge the filesystem)",
                    ) from None
                log.info(
                    "ucm dram store %s: %d slots of %d bytes in shared memory",
                    self.root, geometry.slots, geometry.slot_bytes,
                )  # fmt: skip
            arena = self._arena
        finally:
            self._arena_lock.release()
        if nbytes > arena.geometry.slot_bytes:
            raise ConfigError(
                "store.path",
                f"the arena in {self.root} has slots of {arena.geometry.slot_bytes} "
                f"bytes, made for other blocks; blocks of {nbytes} bytes need their own path "
                f"(or, once no engine uses it, delete {self.root}/arena)",
            )
        arena.map_data()
        return arena

    def check_block_bytes(self, nbytes: int) -> None:
        try:
            self._arena_for(nbytes)
        except ArenaBusy as exc:  # start anyway: dumps fail and loads miss until it is had
            log.warning("ucm dram store %s: cannot open the arena yet: %s", self.root, exc)

    def _names(self, keys: Sequence[bytes]) -> bytes:
        """The keys as the arena's index holds them, end to end: keyed by the secret in a
        signed store, so that a prompt's block cannot be found by its key."""
        signer = self._signer
        return b"".join(keys if signer is None else [signer.name(bytes(k)) for k in keys])

    def _words(self, keys: Sequence[bytes]) -> list[tuple[int, int]]:
        return list(_KEY.iter_unpack(self._names(keys)))

    # -- dump --

    def dump(self, keys: Sequence[bytes], buffers: Sequence[object], layout: bytes = b"") -> Task:
        payloads = check_batch(keys, buffers, writable=False)
        if not keys:
            return Task.completed([])
        try:
            nbytes = max(p.nbytes for p in payloads)
            arena = self._arena_for(nbytes)
        except (ConfigError, ArenaBusy) as exc:
            return Task.completed([KeyResult(Status.ERROR, str(exc))] * len(keys))
        return self._spread(
            len(keys), nbytes, self._dump_chunk, arena, keys, payloads, _layout_word(layout)
        )

    def _spread(
        self,
        n: int,
        nbytes: int,
        run: Any,
        *args: Any,
        settled: list[KeyResult | None] | None = None,
        undo: Callable[[Sequence[int]], Any] | None = None,
    ) -> Task:
        """A task over ``n`` keys of blocks of up to ``nbytes``, those with a result in
        ``settled`` done at once, the others in chunks (:func:`chunk_size`) that the copy
        threads, and a thread that waits for the task (:meth:`Task.help_with`), take one at
        a time, each running ``run(task, chunk, *args)`` (a chunk's results).

        A thread takes its slots or pins a chunk at a time, under the arena's lock, while
        the others copy: the bookkeeping of one overlaps the copies of another (all of it
        up front, on the caller's thread, kept the copy threads waiting for half the time
        at 256 KiB blocks).  Chunks are taken, not dealt out: a thread on a busy core takes
        fewer.  A chunk not started when the task is cancelled is not; ``undo(chunk)``
        then lets go of what it held before it started."""
        task = Task(n)
        todo: Sequence[int] = range(n)
        if settled is not None:
            done = [i for i, r in enumerate(settled) if r is not None]
            task.set_results(done, [settled[i] for i in done])  # type: ignore[misc]
            todo = [i for i, r in enumerate(settled) if r is None]
        threads = self.config.threads
        size = chunk_size(len(todo), nbytes, threads)
        chunks = [todo[c : c + size] for c in range(0, len(todo), size)]
        if not chunks:
            return task
        taken = itertools.count()
        lock = threading.Lock()

        def take_one() -> bool:
            with lock:
                i = next(taken)
            if i >= len(chunks):
                return False
            chunk = chunks[i]
            task.run_keys(
                chunk,
                lambda: run(task, chunk, *args),
                None if undo is None else lambda: undo(chunk),
            )
            return True

        def take_all() -> None:
            while take_one():
                pass

        for _ in range(min(threads, len(chunks))):
            self._pool.submit(take_all)
        task.help_with(take_one)
        return task

    def _dump_chunk(
        self,
        task: Task,
        chunk: Sequence[int],
        arena: Arena,
        keys: Sequence[bytes],
        payloads: list[Payload],
        layout_word: int,
    ) -> list[KeyResult]:
        words = self._words([keys[i] for i in chunk])
        try:
            reserved = _reserve(arena, words)
        except ArenaBusy as exc:
            return [KeyResult(Status.ERROR, str(exc))] * len(chunk)
        results = _settled(reserved)
        slots: list[tuple[int, int]] = [got for got in reserved if not isinstance(got, bool)]
        slotted = [j for j, r in enumerate(results) if r is None]
        # each slot taken is published, or given back (length -1) where it was not filled
        written = [_unfilled(got) for got in slots]
        try:
            moves: list[Move] = []
            moved: list[tuple[int, int]] = []  # (index in slots, index in chunk) per move
            for w, (j, (slot, _gen)) in enumerate(zip(slotted, slots)):
                payload = payloads[chunk[j]]
                try:
                    moves.append((payload.parts, arena.slot(slot, payload.nbytes)))
                except (TypeError, ValueError) as exc:  # a deferred payload's views, made now
                    results[j] = KeyResult(Status.ERROR, str(exc))
                    continue
                moved.append((w, j))
            seals = move_sealed_batch(
                self._signer, [words[j] for _, j in moved], layout_word, moves, into=True
            )
            cancelled = task.cancelled  # a dump cancelled mid-way is not published
            for (w, j), (_parts, dst), seal in zip(moved, moves, seals):
                results[j] = CANCELLED if cancelled else OK
                if not cancelled:
                    written[w] = (*slots[w], dst.nbytes, layout_word, seal)
        finally:  # whatever happened
            published = self._publish(arena, written, [words[j] for j in slotted])
        for j, done in zip(slotted, published):
            if results[j] is OK and not done:
                results[j] = _LOST
        return results  # type: ignore[return-value]

    # -- writes in place --

    def open_writes(
        self, keys: Sequence[bytes], nbytes: int, layout: bytes = b""
    ) -> SlotWrites | None:
        check_keys(keys)
        layout_word = _layout_word(layout)
        try:
            arena = self._arena_for(nbytes)
            names, booked = self._names(keys), None
            if vectorised(len(keys)):
                words = np.frombuffer(names, "<u8").reshape(-1, 2)
                booked = arena.reserve_rows(words, _evict_batch(arena))
            if booked is None:  # (a small batch, no library, or a key twice: the loop)
                listed = list(_KEY.iter_unpack(names))
                reserved = _reserve(arena, listed)
        except (ConfigError, ArenaBusy) as exc:
            log.debug("ucm dram store: no room to write in place (%s)", exc)
            return None  # the caller dumps, and the dump reports what is wrong
        if booked is None:
            writes = _ArenaWrites.of_list(self, arena, listed, reserved, nbytes, layout_word)
        else:
            writes = _ArenaWrites.of_rows(self, arena, words, *booked, nbytes, layout_word)
        writes.takes_digests = self._signer is None
        return writes

    def _seal_chunk(
        self,
        task: Task,
        chunk: Sequence[int],
        arena: Arena,
        words: list[tuple[int, int]],
        reserved: list[Any],
        views: Sequence[memoryview],
        layout_word: int,
        digests: Sequence[int | None] | None,
    ) -> list[KeyResult]:
        """Seal and publish the blocks written in place into a chunk's slots: with the
        digests the caller computed as it copied them in, else read here."""
        written = [_unfilled(reserved[i]) for i in chunk]  # given back unless sealed
        try:
            if not task.cancelled:
                if digests is not None and self._signer is None:
                    seals = [int(digests[i]).to_bytes(8, "little") for i in chunk]  # type: ignore[arg-type]
                else:
                    moves: list[Move] = [((), views[i]) for i in chunk]
                    names = [words[i] for i in chunk]
                    seals = move_sealed_batch(self._signer, names, layout_word, moves, into=False)
                if not task.cancelled:
                    written = [
                        (*reserved[i], views[i].nbytes, layout_word, seal)
                        for i, seal in zip(chunk, seals)
                    ]
        finally:  # whatever happened
            published = self._publish(arena, written, [words[i] for i in chunk])
        return [
            OK if done else CANCELLED if w[2] < 0 else _LOST for w, done in zip(written, published)
        ]

    @staticmethod
    def _publish(arena: Arena, written: list[Any], words: list[tuple[int, int]]) -> list[bool]:
        if not written:
            return []
        try:
            return arena.publish(written, words)
        except ArenaBusy:  # given back unwritten at this process's next hold of the lock
            arena.owe_writes([(w[0], w[1]) for w in written])
            return [False] * len(written)

    # -- load --

    def load(self, keys: Sequence[bytes], buffers: Sequence[object], layout: bytes = b"") -> Task:
        payloads = check_batch(keys, buffers, writable=True)
        arena = self._attached()
        if arena is None or not keys:
            return Task.completed([MISS] * len(keys))
        arena.map_data()
        nbytes = max(p.nbytes for p in payloads)
        return self._spread(
            len(keys), nbytes, self._load_chunk, arena, keys, payloads, _layout_word(layout)
        )

    def _load_chunk(
        self,
        task: Task,
        chunk: Sequence[int],
        arena: Arena,
        keys: Sequence[bytes],
        payloads: list[Payload],
        layout_word: int,
    ) -> list[KeyResult]:
        words = self._words([keys[i] for i in chunk])
        if self._signer is None and copies_compiled():
            compiled = self._load_compiled(chunk, arena, words, payloads, layout_word)
            if compiled is not None:
                return compiled
        try:
            pinned = arena.pin(words)
        except ArenaBusy as exc:
            return [KeyResult(Status.ERROR, str(exc))] * len(chunk)
        results: list[KeyResult | None] = [None] * len(chunk)
        bad: list[Pinned] = []
        busy: KeyResult | None = None
        try:
            moves: list[Move] = []
            moved: list[int] = []  # index in chunk per move
            for j, (i, pin) in enumerate(zip(chunk, pinned)):
                payload = payloads[i]
                if pin is None:
                    results[j] = MISS
                elif pin.length != payload.nbytes or pin.layout != layout_word:
                    results[j] = _mismatch(pin, payload.nbytes, layout_word)
                else:
                    try:
                        moves.append((payload.parts, arena.slot(pin.slot, pin.length)))
                    except (TypeError, ValueError) as exc:  # a deferred payload's views
                        results[j] = KeyResult(Status.ERROR, str(exc))
                        continue
                    moved.append(j)
            names = [words[j] for j in moved]
            seals = move_sealed_batch(self._signer, names, layout_word, moves, into=False)
            checked = self._checked(seals, [pinned[j] for j in moved], bad)
            for j, result in zip(moved, checked):
                results[j] = result
        finally:  # every pin goes, whatever happened
            try:
                held = _unpin(arena, pinned, bad)
            except ArenaBusy as exc:  # released at this process's next hold of the lock
                busy = KeyResult(Status.ERROR, str(exc))
        if busy is not None:
            return [busy] * len(chunk)
        # a pin whose slot was reused meanwhile (its lease ran out): what was read is not it
        return [r if pin is None or h else MISS for r, pin, h in zip(results, pinned, held)]  # type: ignore[misc]

    def _load_compiled(
        self,
        chunk: Sequence[int],
        arena: Arena,
        words: list[tuple[int, int]],
        payloads: list[Payload],
        layout_word: int,
    ) -> list[KeyResult] | None:
        """A chunk's load in one compiled call, without the GIL (:meth:`Arena.load_compiled`);
        None where the arena answers in Python."""
        results: list[KeyResult | None] = [None] * len(chunk)
        parts: list[Sequence[memoryview]] = []
        taken: list[int] = []  # the places in the chunk of the keys asked for
        for j, i in enumerate(chunk):
            try:
                parts.append(payloads[i].parts)
            except (TypeError, ValueError) as exc:  # a deferred payload's views
                results[j] = KeyResult(Status.ERROR, str(exc))
                continue
            taken.append(j)
        try:
            done = arena.load_compiled(
                [words[j] for j in taken],
                [payloads[chunk[j]].nbytes for j in taken],
                parts,
                layout_word,
            )
        except ArenaBusy as exc:
            return [KeyResult(Status.ERROR, str(exc))] * len(chunk)
        if done is None:
            return None
        for k, (j, code) in enumerate(zip(taken, done.codes)):
            if code == LOADED:
                results[j] = OK
            elif code == NOT_STORED:
                results[j] = MISS
            elif code == CORRUPT:
                results[j] = self._corrupt()
            else:
                results[j] = _mismatch(done.pin(k), payloads[chunk[j]].nbytes, layout_word)
        return results  # type: ignore[return-value]

    # -- reads in place --

    def open_reads(
        self, keys: Sequence[bytes], nbytes: int, layout: bytes = b"", *, check: bool = True
    ) -> SlotReads | None:
        check_keys(keys)
        arena = self._attached()
        if arena is None or not keys or nbytes > arena.geometry.slot_bytes:
            return None  # the caller loads, and the load reports the misses (or the damage)
        arena.map_data()
        words = self._words(keys)
        layout_word = _layout_word(layout)
        unchecked = not check and self._signer is None  # the caller checks what it copies
        try:
            rows = arena.pin_rows(words) if unchecked and vectorised(len(keys)) else None
            if rows is not None:
                return _lent_unchecked(arena, rows, nbytes, layout_word)
            pinned = arena.pin(words)
        except ArenaBusy as exc:
            log.debug("ucm dram store: no blocks lent in place (%s)", exc)
            return None
        views: list[memoryview | None] = []
        settled: list[KeyResult | None] = []
        for pin in pinned:
            if pin is None:
                views.append(None)
                settled.append(MISS)
            elif pin.length != nbytes or pin.layout != layout_word:
                views.append(None)
                settled.append(_mismatch(pin, nbytes, layout_word))
            else:
                views.append(arena.slot(pin.slot, pin.length))
                settled.append(None)
        reads = _ArenaReads(arena, pinned, views)
        if unchecked:
            reads.digests = [
                None if view is None else int.from_bytes(pin.seal[:8], "little")  # type: ignore[union-attr]
                for view, pin in zip(views, pinned)
            ]
            reads.task = Task.completed([OK if r is None else r for r in settled])
            return reads
        reads.task = self._spread(
            len(keys), nbytes, self._check_chunk, arena, words, reads, layout_word, settled=settled
        )
        return reads

    def _check_chunk(
        self,
        task: Task,
        chunk: Sequence[int],
        arena: Arena,
        words: list[tuple[int, int]],
        reads: _ArenaReads,
        layout_word: int,
    ) -> list[KeyResult]:
        """Check the seals of a chunk of lent blocks where they lie."""
        moves: list[Move] = [((), reads.views[i]) for i in chunk]  # type: ignore[misc]
        names = [words[i] for i in chunk]
        seals = move_sealed_batch(self._signer, names, layout_word, moves, into=False)
        return self._checked(seals, [reads.pinned[i] for i in chunk], reads.bad)

    def _checked(
        self, seals: list[bytes], pins: Sequence[Pinned | None], bad: list[Pinned]
    ) -> list[KeyResult]:
        """Per pinned block, OK where its seal is the stored one, else corrupt and its pin
        added to ``bad`` (dropped from the store when unpinned)."""
        results = []
        for seal, pin in zip(seals, pins):
            assert pin is not None
            if seal_matches(seal, pin.seal):
                results.append(OK)
            else:
                bad.append(pin)
                results.append(self._corrupt())
        return results

    def _corrupt(self) -> KeyResult:
        what = "MAC" if self._signer is not None else "checksum"
        return KeyResult(Status.CORRUPT, f"the block in shared memory fails its {what}")

    def host_memory(self) -> list[memoryview]:
        arena = self._attached()
        if arena is None:
            return []
        arena.map_data()
        return [] if arena.data is None else [arena.data]

    # -- the rest --

    def _found(self, keys: Sequence[bytes]) -> np.ndarray:
        """Which keys the arena holds (a hint: a load checks again), all probed at once."""
        check_keys(keys)
        arena = self._attached()
        if arena is None or not keys:
            return np.zeros(len(keys), bool)
        try:
            return arena.found(np.frombuffer(self._names(keys), "<u8").reshape(-1, 2))
        except ArenaBusy as exc:  # a lookup is a hint: a busy store answers "not stored"
            log.debug("ucm dram store: lookup answered as misses (%s)", exc)
            return np.zeros(len(keys), bool)

    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        found: list[bool] = self._found(keys).tolist()
        return found

    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        found = self._found(keys)
        return int(found.argmin()) if not found.all() else len(keys)

    def remove(self, keys: Sequence[bytes]) -> int:
        check_keys(keys)
        arena = self._attached()
        if arena is None or not keys:
            return 0
        try:
            return arena.remove(self._words(keys))
        except ArenaBusy as exc:
            log.warning("ucm dram store %s: nothing removed: %s", self.root, exc)
            return 0

    def usage(self) -> StoreUsage:
        arena = self._attached()
        if arena is None:
            return StoreUsage(0, 0, self._capacity)
        stats = arena.stats()
        return StoreUsage(stats["blocks"], stats["bytes"], self._capacity)

    def close(self) -> None:
        with self._arena_lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        if self._arena is not None:
            self._arena.close()


class SlotViews(Sequence["memoryview | None"]):
    """A batch's views of its slots, each made when one is asked for: a GPU's copy asks for
    none (it takes the slots' addresses and lengths as arrays, :meth:`addresses` and
    :meth:`view_bytes`), where making a memoryview a slot cost the host tens of
    microseconds a step.  ``slots[i]``: key ``i``'s slot, -1 where it has no view; every
    view is ``nbytes`` long."""

    __slots__ = ("_addresses", "_arena", "nbytes", "slots")

    def __init__(self, arena: Arena, slots: np.ndarray | list[int], nbytes: int) -> None:
        if nbytes > arena.geometry.slot_bytes:  # (as Arena.slot refuses one view)
            raise ValueError(f"views of {nbytes} bytes are longer than the arena's slots")
        self._arena = arena
        self.slots = slots  # int64, or a small batch's list
        self.nbytes = nbytes
        self._addresses: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.slots)

    def __getitem__(self, k: int) -> memoryview | None:  # type: ignore[override]
        s = int(self.slots[range(len(self))[operator.index(k)]])  # an IndexError as a list's
        return None if s < 0 else self._arena.slot(s, self.nbytes)

    def __iter__(self) -> Iterator[memoryview | None]:
        arena, nbytes = self._arena, self.nbytes
        slots = self.slots.tolist() if isinstance(self.slots, np.ndarray) else self.slots
        return (None if s < 0 else arena.slot(s, nbytes) for s in slots)

    def addresses(self) -> np.ndarray:
        """Where each view starts in this process, as uint64 (0 where there is none):
        computed once (a step asks up to three times), not to be changed."""
        if self._addresses is None:
            self._addresses = _slot_addresses(self._arena, self.slots)
        return self._addresses

    def view_bytes(self) -> np.ndarray:
        """Each view's length, as uint64 (0 where there is none)."""
        return np.where(np.asarray(self.slots) >= 0, np.uint64(self.nbytes), np.uint64(0))


class _ArenaWrites(SlotWrites):
    """Slots of the arena reserved for a batch (see :meth:`SharedMemoryStore.open_writes`),
    kept as the reservation gave them: arrays (:meth:`of_rows`, a compiled reservation) or
    a tuple a key (:meth:`of_list`, a small batch's loop); each made from the other only
    where a way needs it."""

    def __init__(
        self, store: SharedMemoryStore, arena: Arena, views: SlotViews, layout_word: int
    ) -> None:
        self.views = self._views = views
        self._store = store
        self._arena = arena
        self._layout_word = layout_word
        self._ended = False

    @classmethod
    def of_rows(
        cls,
        store: SharedMemoryStore,
        arena: Arena,
        words: np.ndarray,
        codes: np.ndarray,
        rows: np.ndarray,
        nbytes: int,
        layout_word: int,
    ) -> _ArenaWrites:
        """The room :meth:`Arena.reserve_rows` reserved for the keys ``words`` (``(n, 2)``
        uint64): a code and a row (slot, gen) a key, no object a key."""
        slots = np.where(codes == ROOM_TAKEN, rows[:, 0].astype(np.int64), -1)
        writes = cls(store, arena, SlotViews(arena, slots, nbytes), layout_word)
        writes.__dict__.update(_key_words=words, _codes=codes, _rows=rows)
        return writes

    @classmethod
    def of_list(
        cls,
        store: SharedMemoryStore,
        arena: Arena,
        words: list[tuple[int, int]],
        reserved: list[Any],
        nbytes: int,
        layout_word: int,
    ) -> _ArenaWrites:
        """The room :meth:`Arena.reserve` reserved: ``(slot, gen)``, ``True`` (stored
        already) or ``False`` (no room) a key."""
        slots = [-1 if isinstance(got, bool) else got[0] for got in reserved]
        writes = cls(store, arena, SlotViews(arena, slots, nbytes), layout_word)
        writes.__dict__.update(_reserved=reserved, _words=words)
        return writes

    @functools.cached_property
    def _reserved(self) -> list[Any]:
        """A tuple a key, as :meth:`Arena.reserve` answers, for the key-by-key ways."""
        return reserved_of(self._codes, self._rows)

    @functools.cached_property
    def _words(self) -> list[tuple[int, int]]:
        return list(zip(*self._key_words.T.tolist()))

    @functools.cached_property
    def _codes(self) -> np.ndarray:
        reserved = self._reserved
        return np.fromiter(
            (ROOM_STORED if got is True else ROOM_FULL if got is False else ROOM_TAKEN
             for got in reserved), np.uint8, len(reserved),
        )  # fmt: skip

    @functools.cached_property
    def _rows(self) -> np.ndarray:
        rows = [(0, 0) if isinstance(got, bool) else got for got in self._reserved]
        return np.array(rows, np.uint64).reshape(len(rows), 2)

    @functools.cached_property
    def _key_words(self) -> np.ndarray:
        return np.array(self._words, np.uint64).reshape(len(self._words), 2)

    def _settled(self) -> list[KeyResult | None]:
        """Per key, its result where it has no slot to fill (see :func:`_settled`)."""
        if "_reserved" in self.__dict__:
            return _settled(self._reserved)
        return [
            None if c == ROOM_TAKEN else OK if c == ROOM_STORED else _FULL
            for c in self._codes.tolist()
        ]

    def _slotted(self) -> list[int]:
        """The keys given a slot."""
        if "_reserved" in self.__dict__:
            return [i for i, got in enumerate(self._reserved) if not isinstance(got, bool)]
        return np.flatnonzero(self._codes == ROOM_TAKEN).tolist()  # type: ignore[no-any-return]

    def addresses(self) -> np.ndarray:
        return self._views.addresses()

    def view_bytes(self) -> np.ndarray:
        return self._views.view_bytes()

    def _end(self) -> None:
        if self._ended:
            raise RuntimeError("these writes were committed or aborted already")
        self._ended = True

    def commit(self, digests: Sequence[int | None] | None = None) -> Task:
        self._end()
        n = len(self.views)
        settled = self._settled()
        if digests is not None and len(digests) != n:
            self._give_back(self._slotted())
            raise ValueError(f"{len(digests)} digests for {n} keys")
        if digests is not None and self.takes_digests:
            return self._book(digests, settled)
        nbytes = self._views.nbytes
        return self._store._spread(
            n, nbytes, self._store._seal_chunk, self._arena, self._words,
            self._reserved, self.views, self._layout_word, digests, settled=settled,
            undo=self._give_back,
        )  # fmt: skip

    def _book(self, digests: Sequence[int | None], settled: list[KeyResult | None]) -> Task:
        """Publish the batch with the caller's digests, here, in one hold of the lock: with
        no byte to read, handing it to the copy threads a chunk at a time only costs."""
        task = Task(len(self.views))
        done = [i for i, r in enumerate(settled) if r is not None]
        task.set_results(done, [settled[i] for i in done])  # type: ignore[misc]
        todo = [i for i, r in enumerate(settled) if r is None]
        views = cast("Sequence[memoryview]", self.views)  # None only for the settled keys

        def book() -> list[KeyResult]:
            return self._publish_booked(todo, digests) or self._store._seal_chunk(
                task, todo, self._arena, self._words, self._reserved, views,
                self._layout_word, digests,
            )  # fmt: skip

        if todo:
            task.run_keys(todo, book, lambda: self._give_back(todo))
        return task

    def _publish_booked(
        self, todo: list[int], digests: Sequence[int | None]
    ) -> list[KeyResult] | None:
        """A large batch's digests published as arrays, no object a key
        (:meth:`Arena.publish_booked`); None where that does not apply (a small batch, a
        key with no digest, anything unusual in the arena): the key-by-key way then."""
        if not vectorised(len(todo)):
            return None
        whole = len(todo) == len(self.views)
        try:
            found = np.asarray(digests if whole else [digests[i] for i in todo], np.uint64)
        except (TypeError, ValueError, OverflowError):  # a None, or not a digest
            return None
        if found.shape != (len(todo),):
            return None
        at = slice(None) if whole else np.array(todo, np.intp)  # (the keys with a slot)
        rows, words = self._rows[at], self._key_words[at]
        nbytes = self._views.nbytes  # one size a batch
        arena = self._arena
        try:
            published = arena.publish_booked(
                rows[:, 0], rows[:, 1], words, nbytes, self._layout_word, found
            )
        except ArenaBusy:  # given back unwritten at this process's next hold of the lock
            arena.owe_writes(list(zip(*rows.T.tolist())))
            return [_LOST] * len(todo)
        if published is None:
            return None
        return [OK if done else _LOST for done in published]

    def abort(self) -> None:
        self._end()
        self._give_back(self._slotted())

    def _give_back(self, slotted: Sequence[int]) -> None:
        written = [_unfilled(self._reserved[i]) for i in slotted]
        self._store._publish(self._arena, written, [self._words[i] for i in slotted])


def _lent_unchecked(arena: Arena, pins: PinnedRows, nbytes: int, layout_word: int) -> _ArenaReads:
    """A batch lent unchecked from its pins' rows, with no object a key (its views made
    when asked for): the blocks of the length and layout asked lent with their stored
    digests, the others settled (a miss, another length or layout) and given back with
    the rest."""
    rows, n = pins.rows, len(pins)
    fits = pins.held & (rows[:, 2] == nbytes) & (rows[:, 3] == layout_word)
    views = SlotViews(arena, np.where(fits, rows[:, 0].astype(np.int64), -1), nbytes)
    settled: list[KeyResult] = [OK] * n
    digests: list[int | None] = pins.digests().tolist()
    for k in np.flatnonzero(~fits).tolist():
        pin = pins[k]
        settled[k] = MISS if pin is None else _mismatch(pin, nbytes, layout_word)
        digests[k] = None
    reads = _ArenaReads(arena, pins, views)
    reads.digests = digests
    reads.task = Task.completed(settled)
    return reads


class _ArenaReads(SlotReads):
    """Slots of the arena pinned for a batch (see :meth:`SharedMemoryStore.open_reads`)."""

    def __init__(
        self,
        arena: Arena,
        pinned: list[Pinned | None] | PinnedRows,
        views: Sequence[memoryview | None],
    ) -> None:
        self.views = views
        self.pinned = pinned
        self.bad: list[Pinned] = []  # appended to by the checks, on the store's threads
        self._arena = arena
        self._released = False

    def addresses(self) -> np.ndarray:
        if isinstance(self.views, SlotViews):
            return self.views.addresses()
        slots = [None if v is None else p.slot for v, p in zip(self.views, self.pinned)]  # type: ignore[union-attr]
        return _slot_addresses(self._arena, slots)

    def view_bytes(self) -> np.ndarray:
        if isinstance(self.views, SlotViews):
            return self.views.view_bytes()
        return super().view_bytes()

    def drop(self, indices: Sequence[int]) -> None:
        self.bad.extend(self.pinned[i] for i in indices if self.pinned[i] is not None)  # type: ignore[misc]

    def release(self) -> list[bool]:
        if self._released:
            raise RuntimeError("these blocks were given back already")
        self._released = True
        if not self.task.done():
            self.task.cancel()  # checks not started are not; the blocks go once it is done
            self.task.add_done_callback(lambda _task: self._unpin())
            return [False] * len(self.views)
        held = self._unpin()
        results = self.task.wait(0)
        return [r.ok and h for r, h in zip(results, held)]

    def _unpin(self) -> list[bool]:
        try:
            return _unpin(self._arena, self.pinned, self.bad)
        except ArenaBusy:  # released at this process's next hold of the lock
            return [False] * len(self.pinned)


_FULL = KeyResult(Status.ERROR, "store is full: every slot is being read or written")
_LOST = KeyResult(Status.ERROR, "the slot was reclaimed before the block was published")


def _evict_batch(arena: Arena) -> int:
    """How many blocks a full arena evicts at a time: a 256th of it."""
    return max(1, arena.geometry.slots // 256)


def _reserve(arena: Arena, words: list[tuple[int, int]]) -> list[Any]:
    """Slots for ``words`` (see :meth:`Arena.reserve`), evicting a 256th of the arena at a
    time when it is full."""
    return arena.reserve(words, _evict_batch(arena))


def _slot_addresses(arena: Arena, slots: Sequence[int | None] | np.ndarray) -> np.ndarray:
    """Where each slot starts in this process, as uint64 (0 for None or -1): the slots a
    batch was given views of (reserved or pinned under the lock: in the arena)."""
    if isinstance(slots, np.ndarray):
        at = slots.astype(np.int64, copy=False)
    else:
        at = np.array([-1 if s is None else s for s in slots], dtype=np.int64)
    if at.size and int(at.max()) >= arena.geometry.slots:
        raise ValueError("a slot past the arena")  # (never from the arena's own books)
    assert arena.data is not None  # mapped: the views are of it
    start = address_of(arena.data) + at.clip(0).astype(np.uint64) * arena.geometry.slot_bytes
    return np.where(at < 0, np.uint64(0), start)


def _unfilled(reserved: tuple[int, int]) -> tuple[int, int, int, int, bytes]:
    """What :meth:`Arena.publish` takes to give a reserved slot back unwritten."""
    return (*reserved, -1, 0, b"")


def _settled(reserved: list[Any]) -> list[KeyResult | None]:
    """Per key of a reservation, its result where it has no slot to fill: ``True`` (stored
    already, or twice in the batch) is ``OK``, ``False`` (no slot could be freed) an error;
    None where it has one."""
    return [OK if got is True else _FULL if got is False else None for got in reserved]


def _unpin(
    arena: Arena, pinned: list[Pinned | None] | PinnedRows, bad: Sequence[Pinned]
) -> list[bool]:
    """Release a batch's pins (``None`` where a key had none), dropping the ``bad`` ones;
    per key, whether its pin held to the end (False where it had none).  ``ArenaBusy``
    where the lock was not had."""
    if isinstance(pinned, PinnedRows):
        try:
            return arena.unpin_rows(pinned, bad)
        except ArenaBusy:
            arena.owe_pins([pin for pin in pinned if pin is not None], bad)
            raise
    pins = [pin for pin in pinned if pin is not None]
    try:
        kept = iter(arena.unpin(pins, bad) if pins else [])
    except ArenaBusy:
        arena.owe_pins(pins, bad)
        raise
    return [pin is not None and next(kept) for pin in pinned]


def _mismatch(pin: Pinned, nbytes: int, layout_word: int) -> KeyResult:
    return KeyResult(
        Status.ERROR,
        f"stored block is {pin.length} bytes of layout {pin.layout:#x}, asked for "
        f"{nbytes} bytes of layout {layout_word:#x}",
    )


def _layout_word(layout: bytes) -> int:
    return xxhash.xxh3_64_intdigest(layout) if layout else 0


__all__ = [
    "MEMORY_FILESYSTEMS", "SharedMemoryStore", "mount_of", "seal_matches",
    "verify_arena",
]  # fmt: skip
