"""Host rows of our own, kept and reused across steps, and the payloads a store moves.

A block that goes through rows (:attr:`~ucm.kernels.mover.Route.ROWS`) travels through one
host row of its payload size: the store reads into the row and the kernels scatter from it
(a load), or the kernels gather into it and the store writes from it (a dump).  Fresh
memory costs more than the copy itself (the first touch of every page faults, about
1.5 GB/s here against 9-10 GB/s for the copy, and pinning is a driver call), so rows are
recycled: a load gives its rows back once scattered, a dump once the store has written
them.
"""

from __future__ import annotations

import itertools
import threading
from collections import defaultdict
from collections.abc import Iterable, Sequence

import torch
from ucm.core import Payload

from ucm.kernels.segments import BlockSegments
from ucm.kernels.staging import alloc_host_buffers


class RowPool:
    """Free host rows (``[nbytes]`` uint8 tensors) by size and pinning; at most
    ``keep_bytes`` are kept, the rest are released with their last reference.  Thread-safe:
    dumps give rows back from the store's threads.

    Rows are kept in the runs they were given back in, and a request is served from one run
    where one is long enough: rows of one allocation, evenly spaced, let the copy kernels
    move a whole step in one operation (see ``TransferPlan.stacked``)."""

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes = keep_bytes
        self._free: dict[tuple[int, bool], list[list[torch.Tensor]]] = defaultdict(list)
        self._free_bytes = 0
        self._lock = threading.Lock()
        self._pin = torch.cuda.is_available()  # pinned by default where a GPU is (asked once)

    def take(self, nbytes: int, count: int, *, pin: bool | None = None) -> list[torch.Tensor]:
        """``count`` rows of ``nbytes``, reused where free; pinned when ``pin`` (``None``:
        when a GPU is there)."""
        pinned = self._pin if pin is None else bool(pin)
        rows: list[torch.Tensor] = []
        with self._lock:
            runs = self._free[(nbytes, pinned)]
            while runs and len(rows) < count:
                want = count - len(rows)
                # the shortest run that is long enough, else the longest
                long_enough = [i for i, run in enumerate(runs) if len(run) >= want]
                at = (
                    min(long_enough, key=lambda i: len(runs[i]))
                    if long_enough
                    else max(range(len(runs)), key=lambda i: len(runs[i]))
                )
                run = runs.pop(at)
                rows += run[:want]
                if len(run) > want:
                    runs.append(run[want:])
            self._free_bytes -= nbytes * len(rows)
        if len(rows) < count:
            rows += list(alloc_host_buffers(nbytes, count - len(rows), pin=pinned).unbind(0))
        return rows

    def give(self, rows: Iterable[torch.Tensor]) -> None:
        """Take ``rows`` back for reuse (the caller no longer touches them)."""
        runs = [
            (key, list(run))
            for key, run in itertools.groupby(rows, key=lambda r: (r.numel(), r.is_pinned()))
        ]
        with self._lock:
            for (nbytes, pinned), run in runs:
                keep = max(0, min(len(run), (self.keep_bytes - self._free_bytes) // nbytes))
                if keep:  # the rest is released with its last reference
                    self._free[(nbytes, pinned)].append(run[:keep])
                    self._free_bytes += nbytes * keep

    def reserve(self, nbytes: int, count: int, *, pin: bool | None = None) -> None:
        """Add ``count`` rows of ``nbytes``, touched now rather than on the first use."""
        if count > 0:
            block = alloc_host_buffers(nbytes, count, pin=self._pin if pin is None else pin)
            block.fill_(0)
            self.give(block.unbind(0))

    @property
    def free_bytes(self) -> int:
        return self._free_bytes


def row_buffers(rows: Sequence[torch.Tensor]) -> list[object]:
    """Host rows as the buffers a store reads into or writes from."""
    return [row.numpy() for row in rows]


def deferred_payloads(segments: BlockSegments, positions: Iterable[int]) -> list[Payload]:
    """The payloads of blocks ``positions`` of ``segments``, read and written in place in
    the cache: their views are made only when the store moves each one (see
    ``Payload.deferred``)."""
    return [Payload.deferred(segments.nbytes, segments, p) for p in positions]
