"""The Triton copy kernel: paged cache <-> canonical payload, all layers in one launch.

One program copies a tile of ``BLOCK_T`` tokens x ``head_dim`` channels of one head, of one
cache tensor, of one store block.  The program id enumerates (store block, cache tensor,
head, token tile) in that order, which is the payload's own order, so neighbouring programs
write neighbouring bytes.

Why it is written this way:

* Many tensors, one launch: the cache tensors (layers) are separate allocations.  The kernel
  takes the first one as a base pointer and an int64 table of the others' element offsets
  from it (the same for the store-block buffers).  Pointer arithmetic across allocations is
  plain address arithmetic on a GPU, and the CPU interpreter addresses raw memory too.
  Tensors whose strides differ go to separate launches (one per stride pattern; one in all
  for an engine whose layers are alike).
* Bits, not values: everything is moved as same-width integers, so NaN payloads and fp8
  bytes pass unchanged and one compiled kernel serves every dtype of a width.
* Wide accesses: the innermost channel axis is the contiguous one in every engine layout;
  when the host proves all offsets and strides are multiples of 16 bytes it passes ``ALIGN``
  and the kernel says so with ``tl.multiple_of``, which lets the compiler emit 16-byte
  loads and stores even though the row addresses come from a table at run time.
* Offsets in int64: ``block id x block stride`` passes 2**31 on large caches.
* One table, one host-to-device copy: block ids, cache offsets, buffer offsets and payload
  offsets travel in a single int64 tensor.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ucm.kernels.fallback import as_bits, copy_scales
from ucm.kernels.validate import GATHER, TransferPlan


def interpreter_enabled() -> bool:
    """Whether ``triton.jit`` kernels of this process run in the CPU interpreter.

    Read when this module is imported (that is when ``@triton.jit`` decides)."""
    return _INTERPRETED


_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


@triton.jit
def _copy_kernel(
    cache_base,  # first cache tensor of the launch (integer view)
    cache_offs,  # [L] int64: element offset of each cache tensor from cache_base
    buf_base,  # first buffer's data part (integer view)
    buf_offs,  # [S] int64: element offset of each store block's buffer from buf_base
    pay_offs,  # [L] int64: element offset of each cache tensor's part inside a payload
    ids,  # [S, k] int64 engine block ids
    k,
    t0,  # first token of the range inside the store block
    num_tokens,  # tokens in the range
    block_size,
    num_heads,
    num_caches,
    num_tiles,  # token tiles per (store block, cache tensor, head)
    null_id,  # ids equal to this are skipped (-1: none)
    stride_b,
    stride_h,
    stride_n,
    stride_p,
    stride_d,
    PARTS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ALIGN: tl.constexpr,
    GATHER: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    tile = pid % num_tiles
    rest = pid // num_tiles
    h = rest % num_heads
    rest = rest // num_heads
    layer = rest % num_caches
    s = rest // num_caches

    u = tile * BLOCK_T + tl.arange(0, BLOCK_T)  # token index inside the range
    in_range = u < num_tokens
    tok = t0 + u
    j = tok // block_size
    n = tok - j * block_size
    b = tl.load(ids + s * k + j, mask=in_range, other=0)
    real = in_range & (b != null_id)

    src_row = tl.load(cache_offs + layer) + b * stride_b + h * stride_h + n * stride_n
    dst_row = (
        tl.load(buf_offs + s)
        + tl.load(pay_offs + layer)
        + (h * num_tokens + u) * (PARTS * HEAD_DIM)
    )
    # The alignment hints go on the row offsets themselves: a hint on a sum with a constant
    # zero term (p = 0, d0 = 0) is lost when the compiler folds that addition away.
    src_row = tl.multiple_of(src_row, ALIGN)
    dst_row = tl.multiple_of(dst_row, ALIGN)
    for p in tl.static_range(PARTS):
        for d0 in tl.static_range(0, HEAD_DIM, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            d_ok = d < HEAD_DIM
            src_ptr = cache_base + (src_row[:, None] + p * stride_p + d[None, :] * stride_d)
            dst_ptr = buf_base + (dst_row[:, None] + p * HEAD_DIM + d[None, :])
            if GATHER:
                # null blocks read as zeros and are written as zeros
                x = tl.load(src_ptr, mask=real[:, None] & d_ok[None, :], other=0)
                tl.store(dst_ptr, x, mask=in_range[:, None] & d_ok[None, :])
            else:
                mask = real[:, None] & d_ok[None, :]
                x = tl.load(dst_ptr, mask=mask, other=0)
                tl.store(src_ptr, x, mask=mask)


# Tiles of about this many bytes per program and channel part: big enough to keep a GPU's
# memory system busy (16-byte accesses, 4 warps: 8 per thread), small enough to give many
# programs per launch.  On an H100, tiles of 8-64 KiB and 4 or 8 warps all ran at 0.97-1.00
# of a device copy (512 MiB, 16- and 256-token blocks, HND and NHD): the kernel is not
# sensitive to them there.
_TILE_BYTES = 16384
_MAX_BLOCK_D = 256
_NUM_WARPS = 4


def _pow2_floor(x: int) -> int:
    return 1 << (x.bit_length() - 1)


def _alignment(values: list[int], itemsize: int) -> int:
    """Largest power of two (elements, at most 16 bytes' worth) dividing every value."""
    align = max(1, 16 // itemsize)
    for v in values:
        while align > 1 and v % align:
            align //= 2
    return align


def _to_device(ids: torch.Tensor, offsets: list[int], device: torch.device) -> torch.Tensor:
    """The block ids, then ``offsets``, as one int64 tensor on ``device``.  On a GPU through
    pinned memory and a non-blocking copy: a copy from pageable memory would block the host
    until the stream drains, so the next call could not be prepared while this one runs.
    (The caching host allocator keeps the pinned block until the copy has completed.)"""
    host = torch.cat((ids.reshape(-1), torch.tensor(offsets, dtype=torch.int64)))
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def run_triton(plan: TransferPlan) -> None:
    device = plan.device
    if device.type == "cpu" and not _INTERPRETED:
        raise RuntimeError(
            "the Triton backend needs a GPU, or TRITON_INTERPRET=1 set before ucm.kernels "
            "imports triton (the CPU interpreter); use backend='torch' for CPU tensors"
        )
    if device.type != "cpu" and _INTERPRETED:
        raise RuntimeError(
            "TRITON_INTERPRET=1 is set: the interpreter copies device tensors to the host, "
            "which breaks the kernel's cross-tensor addressing; unset it to run on the GPU"
        )
    lay = plan.layout
    spec = lay.cache
    itemsize = spec.itemsize
    caches = plan.caches
    data = plan.data

    # Group the cache tensors by stride pattern: one launch per group.  (Only addresses and
    # strides are read here, which the integer views share: host time per call counts, since
    # a large transfer's kernel takes a few hundred microseconds on a GPU.)
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, c in enumerate(caches):
        groups.setdefault(c.stride(), []).append(i)

    ids = plan.block_ids
    count, k = (int(x) for x in ids.shape)
    buf_base = as_bits(data[0])
    buf_ptr = buf_base.data_ptr()
    if plan.stacked is not None:  # rows evenly spaced: no per-row work
        step = plan.stacked.stride(0)
        buf_offs = list(range(0, count * step, step))
        buf_spacing = [step]  # what the offsets' alignment depends on
    else:
        buf_offs = [(d.data_ptr() - buf_ptr) // itemsize for d in data]
        buf_spacing = buf_offs
    head_dim = spec.head_dim
    block_d = min(_MAX_BLOCK_D, triton.next_power_of_2(head_dim))
    block_t = min(
        triton.next_power_of_2(lay.num_tokens),
        max(1, _pow2_floor(max(1, _TILE_BYTES // itemsize // block_d))),
    )
    num_tiles = triton.cdiv(lay.num_tokens, block_t)
    null_id = -1 if plan.null_block_id is None else plan.null_block_id
    tensor_numel = lay.tensor_numel

    for strides, members in groups.items():
        base = as_bits(caches[members[0]])
        base_ptr = base.data_ptr()
        cache_offs = [(caches[i].data_ptr() - base_ptr) // itemsize for i in members]
        pay_offs = [i * tensor_numel for i in members]
        table = _to_device(ids, cache_offs + buf_offs + pay_offs, device)
        t_ids, t_cache, t_buf, t_pay = torch.split(
            table, [count * k, len(members), count, len(members)]
        )
        if plan.keep is not None:  # a store block not kept reads as all null: skipped
            keep = plan.keep.view(count, 1).expand(count, k).reshape(-1)
            t_ids = torch.where(keep, t_ids, null_id)
        sb, sh, sn, sp, sd = strides
        shape = base.shape  # [B, H, N, P, D]
        # Strides of size-1 axes never multiply a non-zero index, so they need no alignment.
        used = [st for st, size in zip((sb, sh, sn, sp), shape[:4]) if size > 1]
        align = 1
        if sd == 1 or shape[4] == 1:
            align = _alignment(
                [base_ptr // itemsize, buf_ptr // itemsize, head_dim]
                + used
                + cache_offs
                + buf_spacing
                + pay_offs,
                itemsize,
            )
            if base_ptr % itemsize or buf_ptr % itemsize:
                align = 1
        grid = (count * len(members) * spec.num_heads * num_tiles,)
        _copy_kernel[grid](
            base,
            t_cache,
            buf_base,
            t_buf,
            t_pay,
            t_ids,
            k,
            lay.token_start,
            lay.num_tokens,
            spec.block_size,
            spec.num_heads,
            len(members),
            num_tiles,
            null_id,
            sb,
            sh,
            sn,
            sp,
            sd,
            PARTS=spec.parts,
            HEAD_DIM=head_dim,
            BLOCK_T=block_t,
            BLOCK_D=block_d,
            ALIGN=align,
            GATHER=plan.direction == GATHER,
            num_warps=_NUM_WARPS,
        )
    if plan.scales is not None:  # the kept blocks' only (a rare layout: the verdicts read here)
        copy_scales(plan.kept())
