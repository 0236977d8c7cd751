"""Store-block payloads as views of the cache memory they live in, where the layout allows.

The canonical payload of a store block (:mod:`ucm.kernels.spec`) is, per cache tensor, an
``[H, t, C]`` array, then the scale entries.  When each cache tensor's part is one
contiguous run of its memory, the payload is just the concatenation of those runs (and the
scale entries'), so nothing needs to be copied at all: a store reads and writes them in
place, as a list of buffers per key.  FastDeploy's caches, ``[num_blocks, kv_heads,
block_size, head_dim]`` and contiguous, are such a layout.

A run is contiguous when the store block covers one engine block (``k = 1``) whose token
range is contiguous in memory (all of it when there are several heads), or, for a
single-head cache, several engine blocks (then one run per engine block).  Everything else,
and every cache off the CPU, gives ``None``: the caller stages through :func:`gather` and
:func:`scatter` instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import overload

import numpy as np
import torch
from ucm.core import address_of

from ucm.kernels.spec import PayloadLayout, make_layout
from ucm.kernels.validate import (
    CheckedCaches,
    TransferPlan,
    normalise_block_ids,
    normalise_caches,
)

#: one store block's payload: byte views whose concatenation it is
Segments = list[memoryview]


def block_segments(
    caches: Sequence[torch.Tensor] | CheckedCaches,
    block_ids: object,
    *,
    token_range: tuple[int, int] | None = None,
    null_block_id: int | None = None,
    scales: Sequence[torch.Tensor] | None = None,
) -> BlockSegments | None:
    """Per store block, the byte views of the caches that make up its payload, in payload
    order; ``None`` when the layout does not allow it (then use gather/scatter).

    Same arguments as :func:`ucm.kernels.gather`, checked the same way.  The views share the
    caches' memory: a store that loads into them writes the cache blocks directly.  Caches
    checked already (:func:`~ucm.kernels.validate.check_caches`) carry their scales.
    """
    memo = None
    if isinstance(caches, CheckedCaches):
        views, scale_views, spec = caches.views, caches.scales, caches.spec
        memo = caches.memo
    else:
        views, scale_views, spec = normalise_caches(caches, scales)
    ids = normalise_block_ids(block_ids, spec.num_blocks)
    layout = make_layout(spec, int(ids.shape[1]), token_range)
    return segments_of(views, scale_views, layout, ids, null_block_id, memo)


def plan_segments(plan: TransferPlan) -> BlockSegments | None:
    """:func:`block_segments` for a checked plan."""
    return segments_of(plan.caches, plan.scales, plan.layout, plan.block_ids, plan.null_block_id)


def segments_of(
    caches: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor] | None,
    layout: PayloadLayout,
    block_ids: torch.Tensor,
    null_block_id: int | None,
    memo: dict | None = None,
) -> BlockSegments | None:
    """The segments of ``[B, H, N, P, D]`` cache views; see :func:`block_segments`.  The
    caches' runs depend on the layout only: ``memo`` keeps them per layout (the caches'
    own, :class:`~ucm.kernels.validate.CheckedCaches`), a call then costs its block ids."""
    if caches[0].device.type != "cpu":
        return None
    involved = block_ids[:, layout.first_block : layout.end_block]
    if null_block_id is not None and bool((involved == null_block_id).any()):
        return None  # a null block reads as zeros and is never written: not memory
    key = ("runs", layout.first_block, layout.end_block, layout.token_start, layout.token_end)
    if memo is None or key not in memo:
        found = _runs(caches, scales, layout)
        if memo is None:
            return None if found is None else BlockSegments(*found, involved.tolist())
        memo[key] = found
    found = memo[key]
    return None if found is None else BlockSegments(*found, involved.tolist())


def _runs(
    caches: Sequence[torch.Tensor], scales: Sequence[torch.Tensor] | None, layout: PayloadLayout
) -> tuple[list, list] | None:
    """Per cache tensor (then per scale tensor): its bytes, the bytes of a block, and each
    involved engine block's (offset, length) in it; None where a run is not contiguous."""
    spec = layout.cache
    count = layout.num_involved_blocks
    if count > 1 and spec.num_heads > 1:
        return None  # heads are outermost in the payload: the blocks' runs interleave
    n = spec.block_size
    t0, t1 = layout.token_start, int(layout.token_end)  # type: ignore[arg-type]
    # per involved engine block j: its token range [lo, hi) within the block
    ranges = [
        (max(t0, j * n) - j * n, min(t1, (j + 1) * n) - j * n)
        for j in range(layout.first_block, layout.end_block)
    ]
    runs = []  # per cache: (flat bytes, bytes per block, [(offset, length) per j])
    for view in caches:
        if any(not view[0, :, lo:hi].is_contiguous() for lo, hi in ranges):
            return None
        size = view.element_size()
        places = [
            (lo * view.stride(2) * size, view[0, :, lo:hi].numel() * size) for lo, hi in ranges
        ]
        runs.append((_flat_bytes(view), view.stride(0) * size, places))
    for scale in scales or ():
        if not scale[0].is_contiguous():
            return None
        size = scale.element_size()
        entry = math.prod(scale.shape[1:]) * size
        runs.append((_flat_bytes(scale), scale.stride(0) * size, [(0, entry)]))
    return runs[: len(caches)], runs[len(caches) :]


class BlockSegments(Sequence[Segments]):
    """Per store block, the views its payload is made of, made when a block is asked for.

    Views cost a few microseconds a block (one per cache tensor); making them block by block,
    as a caller hands steps to a store, lets the first step start without waiting for the
    views of the last.  Indexing gives one block's list, slicing a list of them."""

    def __init__(
        self,
        data: list[tuple[memoryview, int, list[tuple[int, int]]]],
        scales: list[tuple[memoryview, int, list[tuple[int, int]]]],
        rows: list[list[int]],
    ) -> None:
        self._data = data
        self._scales = [(flat, step, places[0][1]) for flat, step, places in scales]
        self._rows = rows
        per_row = len(rows[0]) if rows else 0
        #: bytes of each block's payload (the sum of its views)
        self.nbytes = sum(n for _, _, places in data for _, n in places) + sum(
            n * per_row for _, _, n in self._scales
        )
        # one engine block per store block (FastDeploy's layout): a shorter way to the views
        self._single = (
            [(flat, step, places[0][0], places[0][1]) for flat, step, places in data]
            if all(len(places) == 1 for _, _, places in data)
            else None
        )

    def __len__(self) -> int:
        return len(self._rows)

    def part_caches(self) -> list[int] | None:
        """Per view of a block's payload, the cache tensor it lies in (the same for every
        block); None where the payload has scale entries too."""
        if self._scales:
            return None
        return [t for t, (_, _, places) in enumerate(self._data) for _ in places]

    def part_lengths(self) -> list[int]:
        """Each view's length in bytes (the views of :meth:`part_caches`)."""
        return [n for _, _, places in self._data for _, n in places]

    def part_addresses(self) -> np.ndarray:
        """Where each view of every block's payload starts in memory (uint64, ``[blocks,
        views]``): the views of :meth:`part_caches` and :meth:`part_lengths`, without making
        them (a compiled copy takes addresses)."""
        rows = np.array(self._rows, np.uint64).reshape(len(self._rows), -1)
        starts = []
        for flat, step, places in self._data:
            base = address_of(flat)
            starts += [
                base + off + rows[:, j] * np.uint64(step) for j, (off, _) in enumerate(places)
            ]
        return np.stack(starts, axis=1)

    @overload
    def __getitem__(self, index: int) -> Segments: ...

    @overload
    def __getitem__(self, index: slice) -> list[Segments]: ...

    def __getitem__(self, index: int | slice) -> Segments | list[Segments]:
        if isinstance(index, slice):
            return [self._block(row) for row in self._rows[index]]
        return self._block(self._rows[index])

    def _block(self, row: list[int]) -> Segments:
        if self._single is not None:
            b = row[0]
            parts = [
                flat[s : s + n] for flat, step, off, n in self._single for s in (b * step + off,)
            ]
        else:
            parts = [
                flat[b * step + off : b * step + off + n]
                for flat, step, places in self._data
                for b, (off, n) in zip(row, places)
            ]
        parts += [flat[b * step : b * step + n] for flat, step, n in self._scales for b in row]
        return parts


def _flat_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes from ``tensor``'s first element to its last, as one writable view."""
    span = 1 + sum((s - 1) * st for s, st in zip(tensor.shape, tensor.stride()))
    flat = torch.as_strided(tensor.detach(), (span,), (1,), tensor.storage_offset())
    return memoryview(flat.view(torch.uint8).numpy())
