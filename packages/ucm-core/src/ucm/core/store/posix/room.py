"""Making room in a posix store: this process's writes in flight against the count every
process shares (:mod:`.usage`), under the capacity policy (:mod:`.capacity`); eviction
passes, on the path of a dump that finds no room and in the background ahead of the
writers, one at a time across processes; and the count given back as blocks go.

:class:`Room` is a part of :class:`~ucm.core.store.posix.store.PosixStore` (its base), which
owns the state it works on: the shared count (``_usage``), the policy (``_capacity``), the
lock over both and over the blocks being read (``_lock``, ``_reading``), the folder
(``root``, ``_root_fd``), the passes' counter and watch (``_evicted``, ``_evictions``), the
background evictor's wake-up (``_evictor``), and whether the store counted itself yet
(``_counted``) or is closing (``_closed``).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter

from ucm.core.store.evictions import EvictionWatch
from ucm.core.store.posix.capacity import Capacity, sample_is_enough
from ucm.core.store.posix.config import PosixStoreConfig
from ucm.core.store.posix.layout import (
    BlockFile,
    ScanResult,
    block_folders,
    evict_lru,
    scan_store,
)
from ucm.core.store.posix.usage import SharedUsage

log = logging.getLogger(__name__)

#: Seconds a dump that needs room waits for another process's eviction pass.
EVICTION_WAIT_S = 10.0


class Room:
    """The capacity side of a posix store (see the module docstring)."""

    config: PosixStoreConfig
    root: str
    _root_fd: int
    _usage: SharedUsage | None
    _capacity: Capacity
    _lock: threading.Lock
    _reading: Counter[str]
    _evicted: int
    _evictions: EvictionWatch | None
    _evictor: threading.Event | None
    _counted: threading.Event
    _closed: bool

    def _take(self, size: int, used: int | None = None) -> bool:
        """Count ``size`` bytes in flight if they fit beside the store's count (read now
        unless given)."""
        assert self._usage is not None
        if used is None:
            used, _ = self._usage.read()
        with self._lock:
            return self._capacity.take(size, used)

    def _reserve(self, size: int) -> str | None:
        """Account ``size`` bytes about to be written; evict first if they would not fit."""
        capacity = self._capacity
        if capacity.limit is None:
            with self._lock:
                capacity.take(size, 0)
            return None
        refusal = capacity.refusal(size)
        if refusal:
            return refusal
        self._counted.wait()  # at once, unless no process has counted the store yet
        if self._take(size):
            return None
        assert self._usage is not None
        deadline = time.monotonic() + EVICTION_WAIT_S
        passes = 0
        while passes < 3:  # the room one pass makes may go to other writers first
            with self._usage.eviction(0) as mine:
                if self._take(size):  # another pass made room meanwhile
                    return None
                if mine:
                    passes += 1
                    if self._take(size, self._evict(size)):
                        return None
                    continue
            # Another pass runs (the background one, or another process's): it gives back
            # room as it goes, so this dump goes on as soon as there is enough.
            if time.monotonic() > deadline:
                return (
                    "store is full and the eviction under way (this process's background "
                    f"evictor's or another process's) freed too little in {EVICTION_WAIT_S} s"
                )
            time.sleep(0.002)
        return "store is full: every block is being read or written"

    def _evict(self, size: int) -> int:
        """Delete least recently used blocks to make room for ``size`` bytes, from a sample
        of the store's folders (:mod:`.capacity`); returns the bytes the store then holds."""
        assert self._usage is not None
        before = self._usage.read()
        with self._lock:
            reading = set(self._reading)
            need = self._capacity.pass_need(size, before[0])
        folders = block_folders(self._root_fd)
        random.shuffle(folders)  # the sample: the blocks spread evenly over the folders
        blocks: list[BlockFile] = []
        sampled = taken = 0
        batch = 4
        while taken < len(folders) and not sample_is_enough(sampled, need) and not self._closed:
            part = scan_store(
                self.root,
                stale_temp_seconds=self.config.stale_temp_seconds,
                folders=frozenset(folders[taken : taken + batch]),
            )
            blocks += part.blocks
            sampled += part.bytes
            taken, batch = taken + batch, batch * 2
        sample = ScanResult(blocks, [], 0)
        evictions = self._evictions
        names: list[str] | None = [] if evictions else None
        if taken >= len(folders):
            # The whole store was listed: an exact pass, which corrects the count too.
            target = max(0, sampled - need)
            remaining = evict_lru(
                sample, target, self._root_fd, skip=reading, stop=self._stopped, names=names
            )
            removed = (sampled - remaining[0], len(blocks) - remaining[1])
            with self._lock:
                self._evicted += removed[1]
            if evictions and names:
                evictions.evicted(names)
            return self._usage.resync(remaining, before, removed)[0]
        usage = self._usage

        def gone(nbytes: int, nblocks: int) -> None:  # given back as the pass goes
            usage.add(-nbytes, -nblocks)
            with self._lock:
                self._evicted += nblocks

        evict_lru(
            sample, sampled - need, self._root_fd, skip=reading, stop=self._stopped, gone=gone,
            names=names,
        )  # fmt: skip
        if evictions and names:
            evictions.evicted(names)
        return usage.read()[0]

    def _stopped(self) -> bool:
        """Whether the store is closing: a pass ends before its folder's descriptor goes."""
        return self._closed

    def _keep_room(self) -> None:
        """The background evictor: woken when a dump leaves less than the headroom free
        (:meth:`Capacity.needs_headroom`), it runs a pass unless another process is running
        one; dumps that find no room still evict themselves."""
        assert self._evictor is not None and self._usage is not None
        while True:
            self._evictor.wait()
            self._evictor.clear()
            while not self._closed and not self._counted.wait(0.1):
                pass  # a store nobody counted yet: its first scan is counting it
            if self._closed:
                return
            try:
                used, _ = self._usage.read()
                with self._lock:
                    room = not self._capacity.needs_headroom(used)
                if room:
                    continue
                with self._usage.eviction(0) as mine:
                    if mine:
                        self._evict(0)
            except (OSError, ValueError) as exc:  # ValueError: closed meanwhile
                if not self._closed:
                    log.warning("ucm posix store %s: eviction failed: %s", self.root, exc)

    def _release(self, size: int) -> None:
        with self._lock:
            self._capacity.finished(size)

    def _uncount(self, size: int) -> None:
        """A block of ``size`` bytes on disk was removed (counted after: a process killed in
        between leaves the count high, never low)."""
        if self._usage is not None:
            self._usage.add(-size, -1)
