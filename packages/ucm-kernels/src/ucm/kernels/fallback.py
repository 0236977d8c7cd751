"""The torch fallback, used where Triton cannot run (CPU tensors, no GPU, no triton).

The token range is cut at engine-block boundaries into a partial first block, the whole
blocks and a partial last block (at most three spans).  Per cache tensor and span:

* gather: one ``index_select`` into a temporary ``[S * blocks, H, tokens, P, D]`` and one
  permuted ``copy_`` into the payloads.  Few, large ops: on a GPU every op is a launch, on a
  CPU every op costs microseconds of dispatch.  On this project's 2-core CPU machine this
  ran about 1.5-2x faster than one slice ``copy_`` per (store block, engine block, layer);
* scatter on a GPU: the permuted copy into a temporary, then one ``index_copy_``;
* scatter on a CPU: one slice ``copy_`` per engine block, straight from the payload: one
  pass instead of two, measured here at 1.5-2x the temporary + ``index_copy_`` way.

On the CPU, a large gather splits the cache tensors over a small thread pool (the ops
release the GIL), each worker reusing its temporaries: up to 1.3x on 2 cores.  The
per-block scatter is bound by Python dispatch and gains nothing from threads.

Data is moved as same-width integers so that no float conversion can touch a bit.

Where every part of a payload is one contiguous run of cache memory (:mod:`ucm.kernels.
segments`: FastDeploy's layout, for one), both directions are plain memory copies of those
runs instead: about 9 GB/s here against 2-4 GB/s for the ``index_select`` way.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from ucm.kernels.segments import Segments, plan_segments
from ucm.kernels.validate import GATHER, TransferPlan

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# Below this many payload bytes a transfer runs on the calling thread: handing work to a
# pool costs more than it saves.
THREADED_MIN_BYTES = 8 * 2**20
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def as_bits(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory as integers of the same width (a view, strides kept)."""
    return tensor.view(_BITS[tensor.element_size()])


def run_fallback(
    plan: TransferPlan,
    workers: int | None = None,
    per_block: bool | None = None,
    runs: bool = True,
) -> None:
    """Execute ``plan`` on ``workers`` threads (default: by size and device); ``per_block``
    picks slice copies over ``index_copy_`` for scatter (default: on the CPU); ``runs``
    copies contiguous runs where the layout has them (false: the general way always)."""
    if runs:
        segments = plan_segments(plan)  # None off the CPU
        if segments is not None:
            copy_segments(plan, segments)
            return
    if per_block is None:
        per_block = plan.device.type == "cpu"
    if workers is None:
        workers = 1
        big = plan.layout.nbytes * plan.num_store_blocks >= THREADED_MIN_BYTES
        if plan.device.type == "cpu" and big and (plan.direction == GATHER or not per_block):
            workers = min(torch.get_num_threads(), 8)
    workers = max(1, min(workers, plan.layout.cache.num_caches))
    spans = _spans(plan)
    if workers == 1:
        _run_caches(plan, spans, range(plan.layout.cache.num_caches), per_block)
    else:
        futures = [
            _executor().submit(
                _run_caches, plan, spans, range(w, len(plan.caches), workers), per_block
            )
            for w in range(workers)
        ]
        for f in futures:
            f.result()  # re-raises a worker's exception
    if plan.scales is not None:
        copy_scales(plan)


def copy_segments(plan: TransferPlan, segments: Sequence[Segments]) -> None:
    """Run ``plan`` as copies between each payload and the cache runs it is made of."""
    gather = plan.direction == GATHER
    for raw, parts in zip(plan.raw, segments):
        payload = memoryview(raw.numpy())
        at = 0
        for part in parts:
            n = part.nbytes
            if gather:
                payload[at : at + n] = part
            else:
                part[:] = payload[at : at + n]
            at += n


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(
                max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="ucm-kernels"
            )
        return _pool


def _spans(plan: TransferPlan) -> list[tuple[int, int, int, int, int]]:
    """The range cut at engine-block boundaries, whole blocks merged:
    ``(first column, columns, offset in the block, tokens, payload token offset)``.

    At most three spans (a partial first block, whole middle blocks, a partial last one)."""
    lay = plan.layout
    n = lay.cache.block_size
    t0, t1 = lay.token_start, int(lay.token_end)  # type: ignore[arg-type]
    spans = []
    j, pos = lay.first_block, 0
    while j < lay.end_block:
        lo, hi = max(t0, j * n), min(t1, (j + 1) * n)
        cols = 1
        if lo == j * n and hi == (j + 1) * n:  # whole: extend over the following whole blocks
            while j + cols < lay.end_block and (j + cols + 1) * n <= t1:
                cols += 1
        spans.append((j, cols, lo - j * n, (hi - lo) * cols, pos))
        pos += (hi - lo) * cols
        j += cols
    return spans


def _rows(plan: TransferPlan, index: int) -> list[tuple[slice, torch.Tensor]]:
    """``(store-block slice, [S', H, t, P, D] view)`` pieces of cache tensor ``index``'s part
    of the payloads: one piece for stacked buffers, else one per store block."""
    lay = plan.layout
    spec = lay.cache
    shape = (spec.num_heads, lay.num_tokens, spec.parts, spec.head_dim)
    lo, hi = lay.tensor_offset(index), lay.tensor_offset(index + 1)
    if plan.stacked is not None:
        return [(slice(None), as_bits(plan.stacked[:, lo:hi]).view(-1, *shape))]
    return [(slice(s, s + 1), as_bits(d[lo:hi]).view(1, *shape)) for s, d in enumerate(plan.data)]


def _run_caches(plan: TransferPlan, spans: list, indices: range, per_block: bool) -> None:
    """Move the cache tensors ``indices`` (one worker's share), reusing temporaries."""
    gather = plan.direction == GATHER
    temps: dict[tuple[int, ...], torch.Tensor] = {}

    def temp(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        if shape not in temps:
            temps[shape] = torch.empty(shape, dtype=like.dtype, device=like.device)
        return temps[shape]

    for j, cols, off, ntok, pos in spans:
        per = ntok // cols  # tokens taken from each engine block of the span
        ids = plan.block_ids[:, j : j + cols]  # [S, cols]
        valid = None if plan.null_block_id is None else ids != plan.null_block_id
        if valid is not None and bool(valid.all()):
            valid = None
        host_ids = ids.tolist() if per_block and not gather else None
        ids, valid = ids.to(plan.device), None if valid is None else valid.to(plan.device)
        for i in indices:
            # never reshape the cache: a K/V-split view cannot merge P and D without a copy
            view = as_bits(plan.caches[i])[:, :, off : off + per]  # [B, H, per, P, D]
            for sel, payload in _rows(plan, i):
                count = payload.shape[0]
                sub = ids[sel].reshape(-1)
                part = payload[:, :, pos : pos + ntok].unflatten(2, (cols, per))
                if gather:
                    tmp = temp((count * cols, *view.shape[1:]), view)
                    torch.index_select(view, 0, sub, out=tmp)
                    if valid is not None:  # null blocks read as zeros
                        tmp[~valid[sel].reshape(-1)] = 0
                    part.copy_(tmp.view(count, cols, *tmp.shape[1:]).permute(0, 2, 1, 3, 4, 5))
                elif host_ids is not None:
                    rows = host_ids[sel]
                    for s, row in enumerate(rows):
                        for c, b in enumerate(row):
                            if b != plan.null_block_id:  # null blocks are never written
                                view[b].copy_(part[s, :, c])
                else:
                    tmp = temp((count * cols, *view.shape[1:]), view)
                    tmp.view(count, cols, *tmp.shape[1:]).copy_(part.permute(0, 2, 1, 3, 4, 5))
                    if valid is None:
                        view.index_copy_(0, sub, tmp)
                    else:  # null blocks are never written
                        keep = valid[sel].reshape(-1)
                        view.index_copy_(0, sub[keep], tmp[keep])


def copy_scales(plan: TransferPlan) -> None:
    """The scale part of the payload (small: a few bytes per engine block), both ways.

    Shared by the torch and Triton backends: it is a handful of tiny index ops, not worth a
    kernel."""
    assert plan.scales is not None and plan.scale_bytes is not None
    lay = plan.layout
    ids = plan.involved_ids().to(plan.device)  # [S, q]
    valid = None if plan.null_block_id is None else ids != plan.null_block_id
    count, q = ids.shape
    if plan.direction == GATHER:
        per = torch.stack([scale[ids] for scale in plan.scales], dim=1)  # [S, L, q, ...]
        if valid is not None:
            per[~valid[:, None].expand(count, len(plan.scales), q)] = 0
        flat = per.reshape(count, -1).contiguous().view(torch.uint8)
        for s in range(count):
            plan.scale_bytes[s].copy_(flat[s])
        return
    shape = lay.cache.scale_shape or ()
    dtype = lay.cache.scale_dtype
    raw = torch.stack(list(plan.scale_bytes))  # a fresh, aligned copy
    per = raw.view(dtype).view(count, len(plan.scales), q, *shape)
    for i, scale in enumerate(plan.scales):
        vals, b = per[:, i], ids
        if valid is not None:
            vals, b = vals[valid], b[valid]
        scale[b] = vals
