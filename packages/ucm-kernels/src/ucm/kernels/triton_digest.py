"""The Triton kernel of :func:`ucm.kernels.digest.row_digests`: each program sums the terms
of one chunk of one row (see :mod:`ucm.core.digest`), the chunks' sums added per row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from ucm.core.digest import P1

from ucm.kernels.digest import CHUNK_WORDS, as_int64


@triton.jit
def _chunk_sums(
    words,  # int64 [S, W] view: row s starts at words + s * row_stride
    out,  # int64 [S * chunks]
    nwords,
    row_stride,
    chunks,
    p1,
    CHUNK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    s = pid // chunks
    c = pid - s * chunks
    j = c * CHUNK + tl.arange(0, CHUNK).to(tl.int64)
    ok = j < nwords
    # unsigned words: logical shifts, products and sums modulo 2**64, as the definition's
    w = tl.load(words + s * row_stride + j, mask=ok, other=0).to(tl.uint64, bitcast=True)
    key = (j + 1).to(tl.uint64, bitcast=True) * p1.to(tl.uint64, bitcast=True)
    v = w ^ key
    hi = v >> 32
    lo = v - (hi << 32)  # no 64-bit constant: its type would be the compiler's guess
    term = lo * hi + ((w << 32) | (w >> 32))
    term = tl.where(ok, term, 0)
    tl.store(out + pid, tl.sum(term, axis=0).to(tl.int64, bitcast=True))


def row_sums(words: torch.Tensor) -> torch.Tensor:
    """Per row of ``words`` (int64 ``[S, W]``, rows contiguous), the sum of its terms."""
    count, nwords = words.shape
    chunks = triton.cdiv(nwords, CHUNK_WORDS)
    out = torch.empty(count * chunks, dtype=torch.int64, device=words.device)
    _chunk_sums[(count * chunks,)](
        words, out, nwords, words.stride(0), chunks, as_int64(P1), CHUNK=CHUNK_WORDS
    )
    return out.view(count, chunks).sum(1)
