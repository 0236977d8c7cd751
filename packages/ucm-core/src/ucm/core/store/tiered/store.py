"""The tiered store: a local tier (DRAM, or a posix store on a local disk) over a store
further away (a shared disk, a Mooncake cluster).

Dumps go to both tiers.  The local tier takes them from the caller's buffers; the backing
store gets its copy from the local tier afterwards, on a thread of its own
(:mod:`.behind`), so that the engine waits for a memory copy and not for a disk or a
network; past the write-behind budget, or where the local tier failed a block, the backing
store is written from the caller's buffers and the dump waits for it (write-through).
Loads are served by the local tier where possible; the rest come from the backing store and
are promoted into the local tier once verified there.  Blocks written in place
(``open_writes``, where the local tier hands out its memory and writes go behind) land in
the local tier and go below from there.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
from ucm.core.settings import GIB, ConfigError
from ucm.core.store.base import Store, StoreUsage, check_batch, check_keys
from ucm.core.store.dram.process import DramStore
from ucm.core.store.dram.shared import SharedMemoryStore
from ucm.core.store.kinds import create_store
from ucm.core.store.reads import SlotReads
from ucm.core.store.task import CANCELLED, KeyResult, Status, Task
from ucm.core.store.tiered.behind import WriteBehind
from ucm.core.store.tiered.config import TieredStoreConfig
from ucm.core.store.writes import SlotWrites


def open_tiered_store(settings: TieredStoreConfig) -> TieredStore:
    """The tiered store its settings describe: both tiers opened, the front first."""
    behind = None if settings.write_behind_gb is None else int(settings.write_behind_gb * GIB)
    front = create_store(settings.front)
    try:
        backing = create_store(settings.backing)
    except BaseException:
        front.close()
        raise
    return TieredStore(front, backing, write_behind_bytes=behind)


class TieredStore(Store):
    def __init__(
        self, front: Store, backing: Store, *, write_behind_bytes: int | None = None
    ) -> None:
        self.front = front
        self.backing = backing
        self.behind = (
            None if write_behind_bytes is None else WriteBehind(front, backing, write_behind_bytes)
        )

    def dump(self, keys: Sequence[bytes], buffers: Sequence[object], layout: bytes = b"") -> Task:
        payloads = check_batch(keys, buffers, writable=False)
        local = self.front.dump(keys, payloads, layout)
        if self.behind is None:
            below = self.backing.dump(keys, payloads, layout)
            # The backing store's results; done once neither tier reads the buffers any more.
            return _after(below, local)
        whole = Task(len(keys))
        whole.add_part(local)
        behind = self.behind

        def after_local(done: Task) -> None:
            results = done.wait(0)
            held = [i for i, r in enumerate(results) if r.ok]
            queued = behind.offer(
                [keys[i] for i in held], [payloads[i].nbytes for i in held], layout
            )
            # the held blocks go below behind the caller's back, unless the queue is full
            through = [i for i, r in enumerate(results) if not (queued and r.ok)]
            if queued:
                for i in held:
                    whole.set_result(i, results[i])
            if not through:
                return
            if whole.cancelled:  # the caller may have taken its buffers back already
                for i in through:
                    whole.set_result(i, CANCELLED)
                return
            # write through: the backing store's results, from the caller's buffers
            below = self.backing.dump(
                [keys[i] for i in through], [payloads[i] for i in through], layout
            )
            _forward(whole, through, below)

        local.add_done_callback(after_local)
        return whole

    def open_writes(
        self, keys: Sequence[bytes], nbytes: int, layout: bytes = b""
    ) -> SlotWrites | None:
        """Room in the local tier (where it has memory to hand out).  The backing store gets
        its copy from the local tier, as a dump's written behind: queued, or copied at once
        when the queue is full.  Without a write-behind queue every dump is written below
        from the caller's buffers, which a write in place does not keep: None, and the
        caller dumps."""
        if self.behind is None:
            return None
        writes = self.front.open_writes(keys, nbytes, layout)
        return None if writes is None else _TieredWrites(self, writes, keys, nbytes, layout)

    def open_reads(
        self, keys: Sequence[bytes], nbytes: int, layout: bytes = b"", *, check: bool = True
    ) -> SlotReads | None:
        """The local tier's blocks, where it holds every one of ``keys`` (a block only the
        backing store holds is promoted by a load: None, and the caller loads)."""
        if not keys or not all(self.front.lookup(keys)):
            return None
        return self.front.open_reads(keys, nbytes, layout, check=check)

    def host_memory(self) -> list[memoryview]:
        return self.front.host_memory()

    def _copy_below(self, keys: list[bytes], nbytes: int, layout: bytes) -> Task:
        """Copy blocks the local tier holds to the backing store now: the write-through of
        a block written in place (read back from the local tier: its only copy)."""
        whole = Task(len(keys))
        copies = [bytearray(nbytes) for _ in keys]  # the caller's size, not one read
        read = self.front.load(keys, copies, layout)
        whole.add_part(read)

        def after_read(done: Task) -> None:
            results = done.wait(0)
            held = [i for i, r in enumerate(results) if r.ok]
            lost = [i for i, r in enumerate(results) if not r.ok]
            whole.set_results(lost, [results[i] for i in lost])
            if not held:
                return
            below = self.backing.dump([keys[i] for i in held], [copies[i] for i in held], layout)
            _forward(whole, held, below)

        read.add_done_callback(after_read)
        return whole

    def load(self, keys: Sequence[bytes], buffers: Sequence[object], layout: bytes = b"") -> Task:
        views = check_batch(keys, buffers, writable=True)
        whole = Task(len(keys))
        front_results: list[KeyResult] = []
        first = self.front.load(keys, views, layout)
        whole.add_part(first)

        def after_front(done: Task) -> None:
            results = done.wait(0)
            front_results[:] = results
            rest = [i for i, r in enumerate(results) if not r.ok]
            for i, result in enumerate(results):
                if result.ok:
                    whole.set_result(i, result)
            if not rest:
                return
            if whole.cancelled:  # the caller may have taken the buffers back already
                for i in rest:
                    whole.set_result(i, CANCELLED)
                return
            below = self.backing.load([keys[i] for i in rest], [views[i] for i in rest], layout)
            whole.add_part(below)
            below.add_done_callback(lambda task: after_backing(task, rest))

        def after_backing(done: Task, rest: list[int]) -> None:
            results = done.wait(0)
            good = [] if done.cancelled else [i for i, r in zip(rest, results) if r.ok]
            # Promote what was verified below; the results wait for the promotion, which
            # reads the caller's buffers.
            promote = self.front.dump([keys[i] for i in good], [views[i] for i in good], layout)
            whole.add_part(promote)

            def finish(_: Task) -> None:
                for i, result in zip(rest, results):
                    # a miss below says less than why the local tier refused (a block
                    # written behind may not be below yet)
                    if result.status is Status.MISS and front_results[i].status is Status.ERROR:
                        result = front_results[i]
                    whole.set_result(i, result)

            promote.add_done_callback(finish)

        first.add_done_callback(after_front)
        return whole

    @property
    def lends_blocks(self) -> bool:
        return self.front.lends_blocks  # those its local tier holds

    @property
    def reads_from_memory(self) -> bool:
        """Where both tiers do and the local tier is memory: a load then writes the caller's
        buffers from memory, and the promotions that read them copy into memory, so a
        cancelled load ends at once (:meth:`Task.cancel` waits for the read below that the
        local tier's answer started, and for the promotion after it)."""
        return (
            self.front.tier == "host"
            and self.front.reads_from_memory
            and self.backing.reads_from_memory
        )

    @property
    def tier(self) -> str:  # type: ignore[override]
        return self.front.tier

    def tiers(self, keys: Sequence[bytes]) -> list[str]:
        in_front = self.front.lookup(keys)
        missing = [k for k, hit in zip(keys, in_front) if not hit]
        below = iter(self.backing.tiers(missing)) if missing else iter(())
        return [self.front.tier if hit else next(below) for hit in in_front]

    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        in_front = self.front.lookup(keys)
        missing = [k for k, hit in zip(keys, in_front) if not hit]
        below = iter(self.backing.lookup(missing)) if missing else iter(())
        return [hit or next(below) for hit in in_front]

    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        check_keys(keys)
        in_front = self.front.lookup(keys)
        n = 0
        while n < len(keys):
            if in_front[n]:
                n += 1
                continue
            # The backing store holds every dumped key unless it evicted it: ask it for the
            # run of keys up to the next local hit in one call.
            end = next((j for j in range(n, len(keys)) if in_front[j]), len(keys))
            found = self.backing.lookup_prefix(keys[n:end])
            n += found
            if n < end:
                return n
        return n

    def remove(self, keys: Sequence[bytes]) -> int:
        if self.behind is not None:  # not written below after this
            self.behind.forget(keys)
        in_front = self.front.lookup(keys)
        self.front.remove(keys)
        below = self.backing.lookup(keys)
        self.backing.remove(keys)
        return sum(a or b for a, b in zip(in_front, below))

    def check_block_bytes(self, nbytes: int) -> None:
        try:
            self.front.check_block_bytes(nbytes)
        except ConfigError as exc:
            tier = "dram" if isinstance(self.front, (DramStore, SharedMemoryStore)) else "local"
            raise ConfigError(exc.key.replace("store.", f"store.{tier}.", 1), exc.problem) from None
        try:
            self.backing.check_block_bytes(nbytes)
        except ConfigError as exc:
            raise ConfigError(exc.key.replace("store.", "store.backing.", 1), exc.problem) from None

    def usage(self) -> StoreUsage:
        """The backing store's usage: the local tier only caches what it holds."""
        return self.backing.usage()

    @property
    def reachable(self) -> bool:
        return self.backing.reachable  # the local tier is on this host

    @property
    def evicted_blocks(self) -> int:
        return self.backing.evicted_blocks  # what the local tier drops, the backing holds

    def close(self) -> None:
        if self.behind is not None:
            self.behind.close()
        self.backing.close()
        self.front.close()


class _TieredWrites(SlotWrites):
    """Room in the local tier for a batch, whose blocks go below once committed."""

    def __init__(
        self,
        store: TieredStore,
        inner: SlotWrites,
        keys: Sequence[bytes],
        nbytes: int,
        layout: bytes,
    ) -> None:
        self.views = inner.views
        self.takes_digests = inner.takes_digests
        self._store = store
        self._inner = inner
        self._keys = [bytes(k) for k in keys]
        self._nbytes = nbytes
        self._layout = layout

    def addresses(self) -> np.ndarray:
        return self._inner.addresses()

    def view_bytes(self) -> np.ndarray:
        return self._inner.view_bytes()

    def abort(self) -> None:
        self._inner.abort()

    def commit(self, digests: Sequence[int | None] | None = None) -> Task:
        store, keys, nbytes, layout = self._store, self._keys, self._nbytes, self._layout
        assert store.behind is not None
        behind = store.behind
        local = self._inner.commit(digests)
        whole = Task(len(keys))
        whole.add_part(local)

        def after_local(done: Task) -> None:
            results = done.wait(0)
            held = [i for i, r in enumerate(results) if r.ok]
            queued = behind.offer([keys[i] for i in held], [nbytes] * len(held), layout)
            # a block the local tier refused is nowhere to be copied from: its result stands
            settled = [i for i, r in enumerate(results) if queued or not r.ok]
            whole.set_results(settled, [results[i] for i in settled])
            if queued or not held:
                return
            # the queue is full: below now, and the caller waits for it (back-pressure)
            _forward(whole, held, store._copy_below([keys[i] for i in held], nbytes, layout))

        local.add_done_callback(after_local)
        return whole


def _forward(whole: Task, positions: list[int], part: Task) -> None:
    """Make ``part`` a sub-task of ``whole`` whose results are ``whole``'s at ``positions``."""
    whole.add_part(part)
    part.add_done_callback(lambda done: whole.set_results(positions, done.wait(0)))


def _after(main: Task, other: Task) -> Task:
    """A task with ``main``'s results, done when ``other`` is done too."""
    whole = Task(len(main))
    whole.add_part(main)
    whole.add_part(other)
    pending = [2]
    lock = threading.Lock()

    def finish(_: Task) -> None:
        with lock:
            pending[0] -= 1
            if pending[0]:
                return
        for i, result in enumerate(main.wait(0)):
            whole.set_result(i, result)

    main.add_done_callback(finish)
    other.add_done_callback(finish)
    return whole
