"""Writes in place: blocks an engine copies straight into a store's memory.

A store that keeps its blocks in this host's memory (the dram store of scope ``host``) can
hand out the memory a batch's blocks will live in.  The engine's copy kernel gathers its
cache blocks there, and the store only seals and publishes them: one copy of each block
instead of two (into a staging row, then the store's copy into its own memory), and none of
the store's copying on its threads.

The room is reserved as a dump's is, so nothing changes for a reader: a block is published
only once sealed (a writer killed while its kernel runs leaves slots nobody reads, reclaimed
when their lease ends), and it is checked on every load.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import numpy as np
from ucm.core.store.payload import addresses_of, view_bytes_of
from ucm.core.store.task import Task


class SlotWrites(abc.ABC):
    """Room reserved for a batch of blocks.

    ``views[i]`` is where key ``i``'s block goes, as many bytes as were asked for; ``None``
    where there is nothing to write: :meth:`commit` then gives that key's result (stored
    already: ``OK``; no room: an error).  The caller fills the views, then calls exactly one
    of :meth:`commit` and :meth:`abort`, and never touches a view afterwards."""

    views: Sequence[memoryview | None]
    #: whether :meth:`commit` books digests the caller computed instead of reading the
    #: bytes (False for a store that signs: it computes its MAC from the bytes)
    takes_digests: bool = False

    def addresses(self) -> np.ndarray:
        """Per key, where its view starts, as uint64 (0 where it has none): the views as one
        table of numbers, for a copy that takes every row's address at once (a GPU's:
        :mod:`ucm.kernels.row_table`) rather than an object a row.  Good while the views
        are."""
        return addresses_of(self.views)

    def view_bytes(self) -> np.ndarray:
        """Per key, its view's length, as uint64 (0 where it has none): with
        :meth:`addresses`, the views as numbers (a store may make its views only when one
        is asked for)."""
        return view_bytes_of(self.views)

    @abc.abstractmethod
    def commit(self, digests: Sequence[int | None] | None = None) -> Task:
        """Seal and publish what the views hold, on the store's threads: one result per key,
        as a dump's.  ``digests``: per key, the digest (:mod:`ucm.core.digest`) of what its
        view holds, computed as it was copied in (a GPU's copy kernels; None where a key
        has no view; or, where every key has one, a uint64 array of them): a store that
        :attr:`takes_digests` seals with them and never reads
        the bytes (and may publish them before it returns: there is nothing to copy),
        another ignores them."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Give the room back unwritten (the copy into it failed)."""
