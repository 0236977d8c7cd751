"""The tiered store: a DRAM tier over a slower store.

Dumps go to both tiers (write-through: the backing store decides the result, since it is
what outlives the process).  Loads are served from DRAM where possible; the rest come from
the backing store and are promoted into DRAM once verified there.
"""

from __future__ import annotations

from collections.abc import Sequence

from ucm.core.config import ConfigError
from ucm.core.store.base import Store, StoreUsage, Task, check_batch, check_keys
from ucm.core.store.dram import DramStore


class TieredStore(Store):
    def __init__(self, dram: DramStore, backing: Store) -> None:
        self.dram = dram
        self.backing = backing

    def dump(self, keys: Sequence[bytes], buffers: Sequence[object], layout: bytes = b"") -> Task:
        check_batch(keys, buffers, writable=False)
        self.dram.dump(keys, buffers, layout)
        return self.backing.dump(keys, buffers, layout)

    def load(self, keys: Sequence[bytes], buffers: Sequence[object], layout: bytes = b"") -> Task:
        views = check_batch(keys, buffers, writable=True)
        from_dram = self.dram.load(keys, views, layout).wait(0)
        rest = [i for i, r in enumerate(from_dram) if not r.ok]
        if not rest:
            return Task.completed(from_dram)
        hits = [i for i, r in enumerate(from_dram) if r.ok]
        below = self.backing.load([keys[i] for i in rest], [views[i] for i in rest], layout)

        def promote(done: Task) -> None:
            if done.cancelled:  # the caller may have taken the buffers back already
                return
            good = [i for i, r in zip(rest, done.wait(0)) if r.ok]
            self.dram.dump([keys[i] for i in good], [views[i] for i in good], layout)

        below.add_done_callback(promote)
        return Task.combine(
            len(keys), [(hits, Task.completed([from_dram[i] for i in hits])), (rest, below)]
        )

    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        in_dram = self.dram.lookup(keys)
        missing = [k for k, hit in zip(keys, in_dram) if not hit]
        below = iter(self.backing.lookup(missing)) if missing else iter(())
        return [hit or next(below) for hit in in_dram]

    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        check_keys(keys)
        in_dram = self.dram.lookup(keys)
        n = 0
        while n < len(keys):
            if in_dram[n]:
                n += 1
                continue
            # The backing store holds every dumped key unless it evicted it: ask it for the
            # run of keys up to the next DRAM hit in one call.
            end = next((j for j in range(n, len(keys)) if in_dram[j]), len(keys))
            found = self.backing.lookup_prefix(keys[n:end])
            n += found
            if n < end:
                return n
        return n

    def remove(self, keys: Sequence[bytes]) -> int:
        in_dram = self.dram.lookup(keys)
        self.dram.remove(keys)
        below = self.backing.lookup(keys)
        self.backing.remove(keys)
        return sum(a or b for a, b in zip(in_dram, below))

    def check_block_bytes(self, nbytes: int) -> None:
        try:
            self.dram.check_block_bytes(nbytes)
        except ConfigError as exc:
            raise ConfigError(exc.key.replace("store.", "store.dram.", 1), exc.problem) from None
        try:
            self.backing.check_block_bytes(nbytes)
        except ConfigError as exc:
            raise ConfigError(exc.key.replace("store.", "store.backing.", 1), exc.problem) from None

    def usage(self) -> StoreUsage:
        """The backing store's usage: the DRAM tier only caches what it holds."""
        return self.backing.usage()

    def close(self) -> None:
        self.backing.close()
        self.dram.close()
