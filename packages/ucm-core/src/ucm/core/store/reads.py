"""Reads in place: stored blocks lent where they lie, for a copy straight out of them.

The mirror of :mod:`.writes`.  A store that keeps its blocks in this host's memory (the dram
store of scope ``host``) can lend a batch's blocks where they are: it pins their slots (no
eviction, no reuse while lent) and checks each block's seal there, and the caller copies
them out itself, for example a GPU's DMA engine straight into the engine's cache, with no
staging row and no copy on the store's threads.

What a reader relies on does not change: a block is used only once its seal matched, and a
block that fails it is dropped from the store when it is given back.  A caller that checks
the bytes it copies out itself (a GPU's copy kernels compute each block's digest as they
scatter it) asks for blocks lent unchecked (``open_reads(check=False)``): the store then
only pins them and hands out the digests they were stored with (:attr:`SlotReads.digests`),
and the caller names the blocks that failed (:meth:`SlotReads.drop`).  A store that signs
checks its MAC itself whatever is asked.  The slots are pinned
under a lease (the store's own, tens of seconds); a caller that kept a block past it finds
it out from :meth:`SlotReads.release` and must not use what it copied.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import numpy as np
from ucm.core.store.payload import addresses_of, view_bytes_of
from ucm.core.store.task import Task


class SlotReads(abc.ABC):
    """Blocks lent for a batch of keys.

    ``task``: one result per key, ``OK`` once the block in ``views[i]`` is checked (else
    why not: a miss, a block of another size or layout, one that fails its seal).
    ``views[i]``: key ``i``'s block, ``None`` where there is none to lend.  The caller waits
    for ``task``, copies out of the views whose result is ``OK``, then calls
    :meth:`release` exactly once, and never touches a view afterwards."""

    views: Sequence[memoryview | None]
    task: Task
    #: per key, the digest its block was stored with, where the blocks are lent unchecked
    #: (``open_reads(check=False)``: ``OK`` in ``task`` means lent, and the caller checks
    #: what it copies out against this); None where the store checked them itself
    digests: list[int | None] | None = None

    def addresses(self) -> np.ndarray:
        """Per key, where its view starts, as uint64 (0 where it has none): see
        :meth:`SlotWrites.addresses <ucm.core.store.writes.SlotWrites.addresses>`."""
        return addresses_of(self.views)

    def view_bytes(self) -> np.ndarray:
        """Per key, its view's length, as uint64 (0 where it has none): see
        :meth:`SlotWrites.view_bytes <ucm.core.store.writes.SlotWrites.view_bytes>`."""
        return view_bytes_of(self.views)

    def drop(self, indices: Sequence[int]) -> None:  # noqa: B027 - stores that check need none
        """Blocks the caller found corrupt as it copied them out (their digest is not the
        stored one): removed from the store when given back."""

    @abc.abstractmethod
    def release(self) -> list[bool]:
        """Give the blocks back.  Per key, whether its block stayed lent until now, so that
        what was copied out of it is the block checked (False where it was not lent, where
        its lease ran out, or where ``task`` is not done yet: then it is cancelled, and the
        blocks go back once the checks in progress end)."""
