"""The dram store of scope ``process``: blocks in this process's memory (private: the host
scope, shared memory, is ``shared.py`` over the arena of ``arena.py``), least recently used
evicted first.

Copies are plain memcpy on the caller's thread (a few hundred microseconds for a 2 MiB
block), so tasks come back already complete.

Memory comes from a pool of large slabs (:class:`SlabPool`) populated when they are mapped,
carved into blocks and recycled by size: fresh pages cost a fault and a zeroing each, which on a VM
is several times slower than the copy itself.  A full store of uniform blocks therefore
allocates nothing; with ``preallocate`` even the first fill does not.
"""

from __future__ import annotations

import mmap
import threading
from collections import OrderedDict
from collections.abc import Sequence

from ucm.core.settings import ConfigError
from ucm.core.store.base import Store, StoreUsage, check_batch, check_keys
from ucm.core.store.dram.config import DramStoreConfig
from ucm.core.store.evictions import EvictionWatch
from ucm.core.store.payload import Payload, copy_parts, fill_parts
from ucm.core.store.task import MISS, OK, KeyResult, Status, Task

SLAB_BYTES = 64 << 20
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def _map(size: int) -> mmap.mmap:
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)


class SlabPool:
    """Block-sized pieces of populated memory, recycled by size; at most ``limit`` bytes mapped."""

    def __init__(self, limit: int, *, preallocate: bool = False) -> None:
        self.limit = limit
        self._slabs: list[mmap.mmap] = []
        self._mapped = 0
        self._free: dict[int, list[memoryview]] = {}
        self._bump: tuple[memoryview, int] | None = None  # current slab and its next offset
        if preallocate:
            while self._mapped + SLAB_BYTES <= limit:
                self._new_slab(SLAB_BYTES, keep=True)

    def _new_slab(self, size: int, keep: bool = False) -> memoryview:
        slab = _map(size)
        self._slabs.append(slab)
        self._mapped += size
        view = memoryview(slab)
        if keep:  # an untouched preallocated slab, carved on demand
            self._free.setdefault(-1, []).append(view)
        return view

    def alloc(self, size: int) -> memoryview | None:
        free = self._free.get(size)
        if free:
            return free.pop()
        if self._bump is not None:
            slab, offset = self._bump
            if offset + size <= slab.nbytes:
                self._bump = (slab, offset + size)
                return slab[offset : offset + size]
        spare = self._free.get(-1)
        if spare and size <= SLAB_BYTES:
            self._bump = (spare.pop(), size)
            return self._bump[0][:size]
        slab_size = max(SLAB_BYTES, size)
        if self._mapped + slab_size > self.limit + SLAB_BYTES:
            return None
        self._bump = (self._new_slab(slab_size), size)
        return self._bump[0][:size]

    def release(self, piece: memoryview) -> None:
        self._free.setdefault(piece.nbytes, []).append(piece)

    def reset(self) -> None:
        """Every block is gone: carve the slabs afresh (heals fragmentation across sizes)."""
        self._free = {-1: [memoryview(s) for s in self._slabs]}
        self._bump = None


class DramStore(Store):
    def __init__(self, config: DramStoreConfig | None = None) -> None:
        self.config = config or DramStoreConfig()
        self._capacity = self.config.capacity_bytes
        self._pool = SlabPool(self._capacity, preallocate=self.config.preallocate)
        self._blocks: OrderedDict[bytes, tuple[bytes, memoryview]] = OrderedDict()
        self._bytes = 0
        self._evicted = 0
        self._evictions = EvictionWatch()
        # Copies happen under the lock, so eviction never frees a block being read.
        self._lock = threading.Lock()

    tier = "host"

    @property
    def reads_from_memory(self) -> bool:
        return True

    def dump(self, keys: Sequence[bytes], buffers: Sequence[object], layout: bytes = b"") -> Task:
        views = check_batch(keys, buffers, writable=False)
        return Task.completed([self._put(bytes(k), v, layout) for k, v in zip(keys, views)])

    @property
    def evicted_blocks(self) -> int:
        return self._evicted

    def _evict_one(self) -> None:
        key, (_, old) = self._blocks.popitem(last=False)
        self._bytes -= old.nbytes
        self._evicted += 1
        self._pool.release(old)
        if self._evictions:
            self._evictions.evicted([key])

    def _put(self, key: bytes, payload: Payload, layout: bytes) -> KeyResult:
        size = payload.nbytes
        if size > self._capacity:
            return KeyResult(
                Status.ERROR,
                f"a block of {size} bytes is larger than the capacity ({self._capacity} bytes)",
            )
        parts = _parts(payload)
        if isinstance(parts, KeyResult):
            return parts
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return OK
            while self._bytes + size > self._capacity:
                self._evict_one()
            buf = self._pool.alloc(size)
            while buf is None and self._blocks:
                self._evict_one()
                buf = self._pool.alloc(size)
            if buf is None:
                self._pool.reset()
                buf = self._pool.alloc(size)
            if buf is None:  # pragma: no cover - the arena maps at least one block's worth
                return KeyResult(Status.ERROR, "out of memory for the dram store")
            copy_parts(parts, buf)
            self._blocks[key] = (layout, buf)
            self._bytes += size
            return OK

    def load(self, keys: Sequence[bytes], buffers: Sequence[object], layout: bytes = b"") -> Task:
        views = check_batch(keys, buffers, writable=True)
        return Task.completed([self._get(bytes(k), v, layout) for k, v in zip(keys, views)])

    def _get(self, key: bytes, out: Payload, layout: bytes) -> KeyResult:
        with self._lock:
            entry = self._blocks.get(key)
            if entry is None:
                return MISS
            stored_layout, buf = entry
            if stored_layout != layout or buf.nbytes != out.nbytes:
                return KeyResult(
                    Status.ERROR,
                    f"stored block is {buf.nbytes} bytes of layout {stored_layout!r}, "
                    f"asked for {out.nbytes} bytes of layout {layout!r}",
                )
            parts = _parts(out)
            if isinstance(parts, KeyResult):
                return parts
            self._blocks.move_to_end(key)
            fill_parts(parts, buf)
            return OK

    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        check_keys(keys)
        with self._lock:
            return [bytes(k) in self._blocks for k in keys]

    def remove(self, keys: Sequence[bytes]) -> int:
        check_keys(keys)
        removed = 0
        with self._lock:
            for key in keys:
                entry = self._blocks.pop(bytes(key), None)
                if entry is not None:
                    self._bytes -= entry[1].nbytes
                    self._pool.release(entry[1])
                    removed += 1
        return removed

    def check_block_bytes(self, nbytes: int) -> None:
        if self._capacity < nbytes:
            raise ConfigError(
                "store.capacity_gb",
                f"{self.config.capacity_gb} GiB cannot hold one block of {nbytes} bytes",
            )

    def usage(self) -> StoreUsage:
        with self._lock:
            return StoreUsage(len(self._blocks), self._bytes, self._capacity)

    def close(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._bytes = 0
            self._pool.reset()


def _parts(payload: Payload) -> tuple[memoryview, ...] | KeyResult:
    """The payload's views, or the error of a deferred payload that cannot make them."""
    try:
        return payload.parts
    except (TypeError, ValueError) as exc:
        return KeyResult(Status.ERROR, str(exc))
