"""The plain torch reference: one slice copy per (store block, cache tensor, engine block).

Written to be obviously right rather than fast; the tests hold the Triton kernels and the
torch fallback to it bit for bit.  Same-dtype ``copy_`` moves bits (no arithmetic), so NaN
payloads and fp8 bytes survive.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ucm.kernels.validate import GATHER, SCATTER, TransferPlan, build_plan


def gather_reference(
    caches: Sequence[torch.Tensor],
    block_ids: object,
    buffers: torch.Tensor | Sequence[torch.Tensor],
    **options: Any,
) -> None:
    """:func:`ucm.kernels.gather` done by the reference (same keyword options)."""
    run_reference(build_plan(GATHER, caches, block_ids, buffers, **options))


def scatter_reference(
    caches: Sequence[torch.Tensor],
    block_ids: object,
    buffers: torch.Tensor | Sequence[torch.Tensor],
    **options: Any,
) -> None:
    """:func:`ucm.kernels.scatter` done by the reference (same keyword options)."""
    run_reference(build_plan(SCATTER, caches, block_ids, buffers, **options))


def run_reference(plan: TransferPlan) -> None:
    lay = plan.layout
    spec = lay.cache
    n = spec.block_size
    t0, t1 = lay.token_start, int(lay.token_end)  # type: ignore[arg-type]
    shape = (spec.num_heads, lay.num_tokens, spec.parts, spec.head_dim)
    gather = plan.direction == GATHER
    for s in range(plan.num_store_blocks):
        ids = [int(x) for x in plan.block_ids[s]]
        for i, cache in enumerate(plan.caches):
            part = plan.data[s][lay.tensor_offset(i) : lay.tensor_offset(i + 1)].view(shape)
            for j in range(lay.first_block, lay.end_block):
                lo, hi = max(t0, j * n), min(t1, (j + 1) * n)  # tokens of block j in range
                seg = part[:, lo - t0 : hi - t0]
                null = ids[j] == plan.null_block_id
                if gather:
                    if null:
                        seg.zero_()
                    else:
                        seg.copy_(cache[ids[j], :, lo - j * n : hi - j * n])
                elif not null:
                    cache[ids[j], :, lo - j * n : hi - j * n].copy_(seg)
        if plan.scales is None or plan.scale_bytes is None:
            continue
        size = spec.scale_entry_nbytes
        for i, scale in enumerate(plan.scales):
            for q, j in enumerate(range(lay.first_block, lay.end_block)):
                off = lay.scale_offset(i, q) - lay.data_nbytes
                chunk = plan.scale_bytes[s][off : off + size]
                null = ids[j] == plan.null_block_id
                if gather:
                    if null:
                        chunk.zero_()
                    else:
                        chunk.copy_(scale[ids[j]].contiguous().reshape(-1).view(torch.uint8))
                elif not null:
                    # clone: the chunk may sit at an offset not aligned for the scale dtype
                    value = chunk.clone().view(scale.dtype).view(scale[ids[j]].shape)
                    scale[ids[j]].copy_(value)
