"""The posix store's capacity policy, apart from its I/O: what one process counts against
the limit, when a block fits, how far an eviction pass goes, and which blocks it takes
first.  Pure (no files, no locks: the store holds its lock around every call), so it is
tested alone.

Capacity is shared by every process using the directory: when the store's count (kept for
all of them, :mod:`.usage`) and this process's writes in flight would pass the limit, the
store scans the directory and deletes the least recently used blocks (recency is the file's
mtime, which every load refreshes) until ``evict_fraction`` of the capacity is free.  Blocks
this process is reading are skipped.
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

    def refusal(self, size: int) -> str | None:
        """Why a block of ``size`` bytes can never be stored, or None."""
        if self.limit is not None and size > self.limit:
            return f"a block of {size} bytes is larger than the capacity ({self.limit} bytes)"
        return None

    def take(self, size: int, used: int) -> bool:
        """Count ``size`` bytes about to be written, if they fit beside the ``used`` bytes
        the store holds."""
        if self.limit is not None and used + self.inflight_bytes + size > self.limit:
            return False
        self.inflight_bytes += size
        return True

    def eviction_target(self, size: int) -> int:
        """The bytes an eviction pass leaves on disk to make room for ``size`` more: down to
        ``1 - evict_fraction`` of the limit, less what is being written."""
        assert self.limit is not None, "an unlimited store never evicts"
        floor = int(self.limit * (1 - self.evict_fraction))
        return max(0, floor - size - self.inflight_bytes)

    def finished(self, size: int) -> None:
        """A write of ``size`` bytes ended (its block published or not)."""
        self.inflight_bytes -= size


B = TypeVar("B", bound=StoredBlock)


def eviction_order(blocks: Iterable[B], skip: Collection[str] = frozenset()) -> Sequence[B]:
    """The blocks an eviction pass may delete, least recently used first (``skip``: names
    of blocks being read)."""
    return sorted((b for b in blocks if b.name not in skip), key=lambda b: b.mtime_ns)
