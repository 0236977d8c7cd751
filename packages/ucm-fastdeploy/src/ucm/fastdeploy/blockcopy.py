"""Block copies on the CPU for caches that are already in the canonical order.

In FastDeploy's layout, ``[num_blocks, kv_heads, block_size, head_dim]`` and contiguous,
block ``b`` of one cache tensor is one contiguous run of bytes, and it is exactly that
tensor's part of the kernels' canonical payload (``[H, tokens, C]``); a block's fp8 scale
entry ``scale[b]`` is contiguous too.  So a store block's payload is the concatenation of
``2 x layers`` contiguous runs (then the scale runs), and a gather or scatter is that many
plain memory copies.

The kernels' torch fallback does the general case (any strides and token ranges) with an
``index_select`` into a temporary and a permuted copy: measured here at about 3 GB/s for
this layout, against about 9-10 GB/s for plain row copies, which decides whether the
adapter keeps up with the disk.  So :class:`BlockCopier` handles this one case and
everything else (GPU caches, other strides) goes through ``ucm.kernels``; the tests hold
both to the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from ucm.fastdeploy.tensors import CacheSet


class BlockCopier:
    """Whole-block copies between contiguous CPU caches and ``[S, nbytes]`` buffers."""

    def __init__(self, cs: CacheSet) -> None:
        if not self.applies(cs):
            raise ValueError("BlockCopier needs contiguous CPU caches and scales")
        self.parts = [_rows(t) for t in cs.caches] + [_rows(t) for t in cs.scales or ()]
        self.nbytes = sum(p.shape[1] for p in self.parts)
        if self.nbytes != cs.nbytes:  # the canonical layout has nothing else in it
            raise AssertionError(f"payload is {cs.nbytes} bytes, the parts {self.nbytes}")

    @staticmethod
    def applies(cs: CacheSet) -> bool:
        tensors = [*cs.caches, *(cs.scales or ())]
        return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)

    def gather(self, block_ids: Sequence[int], buf: torch.Tensor) -> None:
        out = buf.numpy()
        for s, b in enumerate(block_ids):
            row, at = out[s], 0
            for part in self.parts:
                n = part.shape[1]
                row[at : at + n] = part[b]
                at += n

    def scatter(self, block_ids: Sequence[int], buf: torch.Tensor) -> None:
        src = buf.numpy()
        for s, b in enumerate(block_ids):
            row, at = src[s], 0
            for part in self.parts:
                n = part.shape[1]
                part[b] = row[at : at + n]
                at += n


def _rows(t: torch.Tensor) -> np.ndarray:
    """``[num_blocks, bytes per block]`` uint8 over the tensor's own memory."""
    flat = t.reshape(t.shape[0], -1)  # a view: the tensor is contiguous
    return flat.view(torch.uint8).numpy()
