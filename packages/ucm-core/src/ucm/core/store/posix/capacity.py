"""The posix store's capacity policy, apart from its I/O: what one process counts against
the limit, when a block fits, how far an eviction pass goes, and which blocks it takes
first.  Pure (no files, no locks: the store holds its lock around every call), so it is
tested alone.

Capacity is shared by every process using the directory: when the store's count (kept for
all of them, :mod:`.usage`) and this process's writes in flight would pass the limit, the
store deletes least recently used blocks (recency is the file's mtime, which every load
refreshes).  Blocks this process is reading are skipped.

A pass does not list the whole store: with millions of blocks that takes seconds, on the
path of the dump that needs room.  It lists block folders picked at random (the folders
split the blocks evenly: they are named by the keys' first byte) until the sample holds
:data:`SAMPLE_FACTOR` times what the pass must free, then deletes the sample's oldest
blocks: blocks from the oldest ``1 / SAMPLE_FACTOR`` of the store, an approximation of LRU
whose cost follows what is freed, not what is stored.  One pass frees ``evict_fraction``
of the capacity (1 % by default) beyond what is over the limit.  A small store is sampled
whole, and its pass is exact.  Each process's store runs passes in the background once
less than ``evict_fraction`` of the capacity is free, so a dump rarely waits for one.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Protocol, TypeVar

import attrs


class StoredBlock(Protocol):
    """What the policy needs of a block found on disk."""

    @property
    def name(self) -> str: ...

    @property
    def mtime_ns(self) -> int: ...


@attrs.define
class Capacity:
    """The limit (``None``: none) and the bytes this process is writing now; what the
    store holds is counted for every process in the store itself (:mod:`.usage`)."""

    limit: int | None
    evict_fraction: float
    inflight_bytes: int = 0
    largest: int = 0  # the largest block this process has written: what a pass makes room for

    def refusal(self, size: int) -> str | None:
        """Why a block of ``size`` bytes can never be stored, or None."""
        if self.limit is not None and size > self.limit:
            return f"a block of {size} bytes is larger than the capacity ({self.limit} bytes)"
        return None

    def take(self, size: int, used: int) -> bool:
        """Count ``size`` bytes about to be written, if they fit beside the ``used`` bytes
        the store holds."""
        self.largest = max(self.largest, size)
        if self.limit is not None and used + self.inflight_bytes + size > self.limit:
            return False
        self.inflight_bytes += size
        return True

    def finished(self, size: int) -> None:
        """A write of ``size`` bytes ended (its block published or not)."""
        self.inflight_bytes -= size

    def needs_headroom(self, used: int) -> bool:
        """Whether, with ``used`` bytes stored and this process's writes in flight, less than
        ``evict_fraction`` of the capacity is free: the background evictor's cue (one of its
        passes frees that much again, so writers keep finding room)."""
        if self.limit is None:
            return False
        return used + self.inflight_bytes > self.limit * (1 - self.evict_fraction)

    def pass_need(self, size: int, used: int) -> int:
        """The bytes one eviction pass frees, with ``used`` bytes stored, to make room for
        ``size`` more: what is over the limit, and ``evict_fraction`` of the capacity
        besides (at least :data:`ROOM_BLOCKS` of the largest blocks written: in a small
        store, room for one block would go to the other writers first), so that the next
        writes find room."""
        assert self.limit is not None, "an unlimited store never evicts"
        over = max(0, used + self.inflight_bytes + size - self.limit)
        room = ROOM_BLOCKS * max(size, self.largest)
        return over + max(int(self.limit * self.evict_fraction), room)


#: a pass frees room for at least this many blocks of the size that needed it
ROOM_BLOCKS = 16
#: a pass samples this many times what it frees, and frees the sample's oldest blocks
SAMPLE_FACTOR = 4


def sample_is_enough(sampled_bytes: int, need: int) -> bool:
    """Whether a sample of ``sampled_bytes`` is large enough to free ``need`` bytes of its
    oldest blocks."""
    return sampled_bytes >= SAMPLE_FACTOR * need


B = TypeVar("B", bound=StoredBlock)


def eviction_order(blocks: Iterable[B], skip: Collection[str] = frozenset()) -> Sequence[B]:
    """The blocks an eviction pass may delete, least recently used first (``skip``: names
    of blocks being read)."""
    return sorted((b for b in blocks if b.name not in skip), key=lambda b: b.mtime_ns)
