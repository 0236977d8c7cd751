"""Host buffers for store blocks, kept and reused across steps.

A store block travels through one host row of its payload size: the store reads into it and
the kernels scatter from it (a load), or the kernels gather into it and the store writes
from it (a dump).  Fresh memory costs more than the copy itself (the first touch of every
page faults, and pinning is a driver call), so rows are recycled: a load returns its rows
once scattered, a dump once the store has written them.  Rows are pinned when a GPU is
present, so that copies to and from it are asynchronous.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import torch
from ucm.kernels.staging import alloc_host_buffers


class RowPool:
    """Free rows by size; at most ``keep_bytes`` are kept, the rest are released."""

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes = keep_bytes
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._free_bytes = 0
        self._lock = threading.Lock()  # dumps give rows back from the store's threads

    def take(self, nbytes: int, count: int) -> list[torch.Tensor]:
        with self._lock:
            free = self._free[nbytes]
            rows = free[len(free) - min(count, len(free)) :]
            del free[len(free) - len(rows) :]
            self._free_bytes -= nbytes * len(rows)
        if len(rows) < count:
            rows += list(alloc_host_buffers(nbytes, count - len(rows)).unbind(0))
        return rows

    def give(self, rows: list[torch.Tensor]) -> None:
        with self._lock:
            for row in rows:
                if self._free_bytes + row.numel() > self.keep_bytes:
                    return  # released with the last reference
                self._free[row.numel()].append(row)
                self._free_bytes += row.numel()

    def reserve(self, nbytes: int, count: int) -> None:
        """Add ``count`` rows of ``nbytes``, touched now rather than on the first load."""
        if count > 0:
            block = alloc_host_buffers(nbytes, count)
            block.fill_(0)
            self.give(list(block.unbind(0)))

    @property
    def free_bytes(self) -> int:
        return self._free_bytes
