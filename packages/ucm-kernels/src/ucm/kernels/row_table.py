"""Host rows as one table: a region of host memory and each row's offset in it.

A store lends a batch its slots wherever they lie in its memory.  Once the memory has
turned over, no two slots of a batch follow each other (eviction frees the least recently
used, wherever they are), and rows made one tensor each cost the host tens of microseconds
apiece in Python (a view, its checks, a copy call of the driver's), longer than a 256 KiB
block takes to cross a GPU's link.  A :class:`RowTable` is the batch's rows as numbers:
one tensor over the region and an int64 offset a row, made and checked with numpy, with
no object a row.

:func:`copy_rows` moves every row between the table and a dense ``[rows, nbytes]`` tensor
(a GPU's scratch): one copy where the rows are one run, a copy a run where they are few,
else one launch of a kernel that reads or writes each row at its offset (on a GPU, host
memory registered with the driver is mapped into the device's address space; the same
kernel runs through Triton's interpreter on the CPU, and a torch copy a run stands in where
neither runs).
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

#: more runs than this go by one kernel launch rather than a copy call each (a call costs
#: the driver microseconds; a launch is one call whatever the rows)
FEW_RUNS = 4


@attrs.frozen(eq=False)
class RowTable:
    """``len(offsets)`` rows of ``nbytes`` bytes of ``base``, row ``i`` at byte
    ``offsets[i]``: each inside ``base``, none overlapping another (checked where made)."""

    #: the region: 1-D uint8, on the CPU (pinned, on a GPU host)
    base: torch.Tensor
    #: int64, on the CPU: each row's first byte in ``base``
    offsets: torch.Tensor
    nbytes: int

    @classmethod
    def of(cls, base: torch.Tensor, offsets: np.ndarray, nbytes: int) -> RowTable:
        """The rows at ``offsets`` (bytes into ``base``), checked: inside ``base``, apart
        from each other, ``nbytes`` positive.  ``ValueError`` naming the first bad row."""
        if base.dim() != 1 or base.dtype != torch.uint8 or base.device.type != "cpu":
            raise ValueError("a row table's base must be a 1-D uint8 tensor on the CPU")
        if nbytes <= 0:
            raise ValueError(f"rows of {nbytes} bytes: a row holds at least one")
        at = np.ascontiguousarray(offsets, dtype=np.int64).reshape(-1)
        outside = (at < 0) | (at > base.numel() - nbytes)
        if outside.any():
            i = int(outside.argmax())
            raise ValueError(
                f"row {i} ({nbytes} bytes at offset {int(at[i])}) lies outside the region "
                f"of {base.numel()} bytes"
            )
        order = np.sort(at)
        close = np.diff(order) < nbytes
        if close.any():
            i = int(close.argmax())
            raise ValueError(f"rows at offsets {int(order[i])} and {int(order[i + 1])} overlap")
        return cls(base, torch.from_numpy(at.copy()), nbytes)

    def __len__(self) -> int:
        return int(self.offsets.numel())

    @property
    def device(self) -> torch.device:
        return self.base.device

    def is_pinned(self) -> bool:
        return bool(self.base.is_pinned())

    def runs(self) -> list[tuple[int, int, int]]:
        """Maximal runs of rows lying one after another, in the table's order: ``(first
        row, rows, byte offset)`` each."""
        at = self.offsets.numpy()
        if at.size == 0:
            return []
        breaks = np.flatnonzero(np.diff(at) != self.nbytes) + 1
        starts = np.concatenate(([0], breaks))
        ends = np.concatenate((breaks, [at.size]))
        return [(int(s), int(e - s), int(at[s])) for s, e in zip(starts, ends)]

    def run_view(self, offset: int, rows: int) -> torch.Tensor:
        """``rows`` rows from byte ``offset`` as one ``[rows, nbytes]`` view of the base."""
        return self.base[offset : offset + rows * self.nbytes].view(rows, self.nbytes)


def copy_rows(dense: torch.Tensor, table: RowTable, to_table: bool, backend: str = "auto") -> None:
    """Copy dense ``[rows, nbytes]`` rows (contiguous, on the device or the CPU) into the
    table's rows (``to_table``) or out of them, queued on the current stream on a GPU.
    ``backend``: ``"auto"`` (on a GPU, the kernel where there are many runs), ``"triton"``
    (the kernel whatever the runs: a GPU, or the interpreter on the CPU) or ``"torch"`` (a
    copy a run; what ``"auto"`` does on the CPU, where a copy call costs no driver)."""
    count = len(table)
    if dense.shape != (count, table.nbytes) or dense.dtype != torch.uint8:
        raise ValueError(
            f"dense rows of shape {tuple(dense.shape)} ({dense.dtype}) for a table of "
            f"{count} rows of {table.nbytes} bytes: [rows, nbytes] uint8 expected"
        )
    if not dense.is_contiguous():
        raise ValueError("the dense rows must be contiguous")
    if count == 0:
        return
    runs = table.runs()
    if backend == "auto":
        from ucm.kernels.api import triton_available  # the copy kernels' rule: no cycle

        many = len(runs) > FEW_RUNS and dense.device.type == "cuda"
        backend = "triton" if many and triton_available(dense.device) else "torch"
    if backend == "triton":
        from ucm.kernels.triton_rows import copy_table_rows

        copy_table_rows(dense, table, to_table)
        return
    for first, rows, offset in runs:
        host, near = table.run_view(offset, rows), dense[first : first + rows]
        if to_table:
            host.copy_(near, non_blocking=True)
        else:
            near.copy_(host, non_blocking=True)
