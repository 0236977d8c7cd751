"""Block digests computed where the blocks are: :mod:`ucm.core.digest` over payload rows on
a GPU, so the host tier only books and checks numbers and no host thread reads the bytes.

A dump gathers its blocks into rows on the device before one DMA copy takes them to the
host (:mod:`ucm.kernels.staging`); the rows are summed there, at the device memory's speed
(a few percent of the time the link takes to move them), and the digests travel with the
rows.  A load's rows come over the link into device memory, are summed, and only the rows
whose digest is the one the block was stored with are scattered into the cache.

The digest is a sum of per-word terms (see :mod:`ucm.core.digest`), so one program sums a
chunk of a row on its own and the chunks' sums add up: thousands of programs a batch.  The
arithmetic is that of int64 tensors, which wrap modulo 2**64 like the definition's
unsigned words (a logical shift is an arithmetic one with the sign's bits taken back off):
the device's digests are the CPU's bit for bit (tested, through the Triton interpreter and
on a GPU; the Triton kernel works in uint64, whose shifts are logical everywhere).
"""

from __future__ import annotations

import torch
from ucm.core.digest import MIX, P1, P2, block_digest

#: words a program sums (16 KiB of a row)
CHUNK_WORDS = 2048
#: words the torch fallback sums at once (bounds its temporaries)
_TORCH_WORDS = 1 << 20


def as_int64(x: int) -> int:
    """An unsigned 64-bit value as the int64 with its bits."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


def unsigned(x: int) -> int:
    """The unsigned 64-bit value of an int64's bits (a digest as :mod:`ucm.core.digest`
    gives it)."""
    return x & ((1 << 64) - 1)


def _high(v: torch.Tensor) -> torch.Tensor:
    """The high 32 bits of each int64 as a non-negative value (a logical shift)."""
    return (v >> 32) & 0xFFFFFFFF


def _terms(w: torch.Tensor, first: int) -> torch.Tensor:
    """Each word's term (see :mod:`ucm.core.digest`), words ``[first, first + n)`` of their
    rows."""
    key = torch.arange(first + 1, first + 1 + w.shape[-1], dtype=torch.int64, device=w.device)
    v = w ^ (key * as_int64(P1))
    return (v & 0xFFFFFFFF) * _high(v) + ((w << 32) | _high(w))


def _finish(total: torch.Tensor, nbytes: int) -> torch.Tensor:
    """:func:`ucm.core.digest.finish` on int64 tensors."""
    h = total ^ as_int64(nbytes * P2)
    h = h ^ ((h >> 37) & 0x7FFFFFF)
    h = h * as_int64(MIX)
    return h ^ _high(h)


def row_digests(rows: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Each row's digest, as the int64 with its bits (:func:`unsigned` gives the digest), on
    the rows' device.  ``rows``: ``[S, nbytes]`` uint8, each row contiguous, ``nbytes`` a
    multiple of 8 (a block of the caches' dtype).  ``backend``: ``"triton"`` (a GPU, or the
    interpreter), ``"auto"`` (Triton on a GPU; on the CPU the compiled library, row by row),
    or another of the copy kernels' backends (``"torch"``, ``"reference"``: torch ops)."""
    if rows.dim() != 2 or rows.dtype != torch.uint8 or rows.stride(1) != 1:
        raise ValueError("rows must be a [S, nbytes] uint8 tensor with contiguous rows")
    count, nbytes = rows.shape
    if nbytes % 8 or rows.stride(0) % 8 or rows.data_ptr() % 8:
        raise ValueError(f"rows of {nbytes} bytes: a digest on the device takes whole words")
    if backend == "auto" and rows.device.type == "cpu":
        return torch.tensor(
            [as_int64(block_digest(row.numpy())) for row in rows], dtype=torch.int64
        )
    if count == 0:
        return torch.zeros(0, dtype=torch.int64, device=rows.device)
    words = rows.view(torch.int64)  # rows apart in one storage too: their strides are whole words
    if backend == "auto":
        from ucm.kernels.api import triton_available  # the copy kernels' rule: no cycle

        backend = "triton" if triton_available(rows.device) else "torch"
    if backend != "triton":
        total = torch.zeros(count, dtype=torch.int64, device=rows.device)
        for at in range(0, words.shape[1], _TORCH_WORDS):
            total += _terms(words[:, at : at + _TORCH_WORDS], at).sum(1)
    else:
        from ucm.kernels.triton_digest import row_sums

        total = row_sums(words)
    return _finish(total, nbytes)
