"""A rank's stored blocks as the mover's batches: the engine's cache tensors of each stored
KV-cache group, this rank's store key of each planned block, and its payload size.

Shared by the worker side's loads (:mod:`ucm.vllm.loads`) and dumps; no vLLM.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable
from typing import Any

import torch
from ucm.core import Store, scoped_keys
from ucm.kernels.mover import Batch, Caches
from ucm.vllm.layout import GroupLayout, ModelLayout
from ucm.vllm.plan import NULL_BLOCK, Item

LAYOUT_TAG = b"vllm-paged-kv-v1"  # in every block's header: what the payload's bytes are


class RankBlocks:
    """This rank's caches, keys and payload sizes of the blocks the step plan names."""

    def __init__(self, layout: ModelLayout) -> None:
        self.layout = layout
        self.caches: dict[int, Caches] = {}  # stored group -> its layers' cache tensors
        self._nbytes: dict[tuple[int, int], int] = {}

    def add_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for group in self.layout.stored_groups:
            missing = [n for n in group.layer_names if n not in kv_caches]
            if missing:
                raise ValueError(f"UCMConnector: no KV cache registered for layers {missing}")
            tensors = tuple(kv_caches[n] for n in group.layer_names)
            self.caches[group.index] = Caches(tensors, null_block=NULL_BLOCK)

    @property
    def device(self) -> torch.device:
        return next(iter(self.caches.values())).device

    def row_bytes(self, group: int, blocks: int) -> int:
        """Bytes of a payload of ``blocks`` engine blocks of ``group``."""
        size = self._nbytes.get((group, blocks))
        if size is None:
            size = self._nbytes[(group, blocks)] = self.caches[group].payload_nbytes(blocks)
        return size

    def stored_bytes(self, group: GroupLayout) -> int:
        """Bytes of one stored block of ``group``: a boundary's blocks (full attention) or
        its tail (a window)."""
        hybrid = self.layout.hybrid
        if group.kind == "full":
            return self.row_bytes(group.index, hybrid.blocks_per_boundary(group.index))
        return self.row_bytes(group.index, hybrid.tail_blocks[group.index] or 1)

    def item_bytes(self, item: Item) -> int:
        return self.row_bytes(item.group, len(item.block_ids))

    def group(self, item: Item) -> GroupLayout:
        return self.layout.groups[item.group]

    def full(self, item: Item) -> bool:
        return self.group(item).kind == "full"

    def keys(self, items: list[Item]) -> list[bytes]:
        """This rank's store keys of ``items``."""
        keys: list[bytes] = [b""] * len(items)
        for group, where in positions(items, lambda it: it.group).items():  # one scope each
            scope = self.layout.scope(self.layout.groups[group], self.layout.rank)
            for p, key in zip(where, scoped_keys([items[p].chain_key for p in where], scope)):
                keys[p] = key
        return keys

    def batch(
        self, store: Store, group: int, items: list[Item], keys: list[bytes] | None = None
    ) -> Batch:
        """``items`` (of one group and size) as the mover's batch."""
        return Batch(
            self.caches[group],
            [it.block_ids for it in items],
            self.keys(items) if keys is None else keys,
            store,
            LAYOUT_TAG,
            self.item_bytes(items[0]),
        )


def shape(item: Item) -> tuple[int, int]:
    """Items of one group and payload size: one kernel call moves them all."""
    return item.group, len(item.block_ids)


def positions(items: list[Item], key: Callable[[Item], Hashable]) -> dict[Any, list[int]]:
    """Positions of ``items`` by ``key``, in order."""
    out: dict[Any, list[int]] = defaultdict(list)
    for pos, item in enumerate(items):
        out[key(item)].append(pos)
    return out
