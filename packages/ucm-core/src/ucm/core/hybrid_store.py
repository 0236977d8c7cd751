"""Hybrid models: what to write to the stores, by which rank, and the two stores.

:func:`plan_dump` plans the writes of one step (terms as in :mod:`ucm.core.hybrid`).
:func:`split_store_config` makes a full-attention and a window store out of one store
configuration.  They are kept apart so that neither evicts the other: window tails may be
written at every boundary but only the one at the hit is ever loaded, while every
full-attention block of the prefix is.  ``wa_capacity_fraction`` (default 0.5) of the
capacity goes to the window store.  :class:`HybridSettings` holds both settings.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
from ucm.core.config import HybridSettings
from ucm.core.hybrid import BlockRef, HybridLayout, tail_range
from ucm.core.settings import ConfigError, check_int
from ucm.core.store.kinds import StoreSettings
from ucm.core.store.split import FA_SUBDIR, WA_SUBDIR


@attrs.frozen
class DumpPlan:
    """What this rank writes after one step; ``dumped`` is the new progress to keep.

    ``full_blocks``: canonical blocks written for every full group; ``window_boundaries``:
    boundaries whose tails are written for every window group storing one; ``full`` and
    ``window`` spell them out per group (group-major).
    """

    start: int
    dumped: int
    full_blocks: tuple[int, ...]
    window_boundaries: tuple[int, ...]
    full: tuple[BlockRef, ...]
    window: tuple[BlockRef, ...]

    @property
    def blocks(self) -> tuple[BlockRef, ...]:
        return self.full + self.window


def key_rank(key: int, world_size: int) -> int:
    """The rank that writes chain key ``key`` of a replicated cache (split dumps)."""
    return key % world_size


def plan_dump(
    layout: HybridLayout,
    *,
    dumped: int,
    computed_tokens: int,
    chain_blocks: int,
    block_wise: bool = True,
    rank: int = 0,
    world_size: int = 1,
    split: bool = False,
    wa_after: int = 0,
) -> DumpPlan:
    """The blocks to write once ``computed_tokens`` tokens are computed.

    ``dumped``: boundaries planned before (the previous plan's ``dumped``, or the hit the
    request started from); ``chain_blocks``: keys in the request's chain.  New boundaries are
    ``dumped + 1 .. end`` with ``end = min(computed_tokens // T, chain_blocks)``.  Window
    tails: at each of them (``block_wise``), or only at ``end``; never at or below
    ``wa_after`` (boundaries whose tails the engine no longer holds, such as those inside its
    own prefix-cache hit).  ``split`` (caches replicated on every rank): this rank writes only
    the keys ``i`` with ``i % world_size == rank``, so a tail at ``b`` goes with block ``b - 1``;
    otherwise every rank writes everything (its own shard).
    """
    for name, value in (("dumped", dumped), ("computed_tokens", computed_tokens)):
        check_int(name, value, 0)
    check_int("chain_blocks", chain_blocks, 0)
    check_int("wa_after", wa_after, 0)
    check_int("world_size", world_size, 1)
    if check_int("rank", rank, 0) >= world_size:
        raise ConfigError("rank", f"must be below world_size {world_size}, got {rank}")
    end = min(computed_tokens // layout.boundary_tokens, chain_blocks)
    if end <= dumped:
        return DumpPlan(dumped, dumped, (), (), (), ())
    first_tail = max(dumped, wa_after) + 1
    if block_wise:
        bounds: Sequence[int] = range(first_tail, end + 1)
    else:
        bounds = (end,) if end >= first_tail else ()
    blocks: Sequence[int] = range(dumped, end) if layout.full_groups else ()
    if not layout.tail_groups:
        bounds = ()
    if split and world_size > 1:
        blocks = [s for s in blocks if key_rank(s, world_size) == rank]
        bounds = [b for b in bounds if key_rank(b - 1, world_size) == rank]
    full = []
    for g in layout.full_groups:
        k = layout.blocks_per_boundary(g)
        full += [BlockRef(g, s, range(s * k, (s + 1) * k)) for s in blocks]
    window = [
        BlockRef(g, b - 1, tail_range(layout, g, b)) for g in layout.tail_groups for b in bounds
    ]
    return DumpPlan(dumped, end, tuple(blocks), tuple(bounds), tuple(full), tuple(window))


# --- the two stores ----------------------------------------------------------------------


def split_store_config(
    config: StoreSettings, wa_fraction: float = 0.5
) -> tuple[StoreSettings, StoreSettings]:
    """The (full-attention, window) store configurations made from one, by its kind's
    ``split``: posix: subdirectories ``fa`` and ``wa`` of its path, the capacity split (no
    limit stays no limit); dram: the capacity split (and the path, in shared memory);
    mooncake: key prefixes ``fa/`` and ``wa/``, the segment split; tiered: both tiers
    split.  The two capacities never add up to more than the original.  ``wa_fraction`` is
    the window store's share, in (0, 1).
    """
    if (
        isinstance(wa_fraction, bool)
        or not isinstance(wa_fraction, (int, float))
        or not 0 < wa_fraction < 1
    ):
        raise ConfigError(
            "wa_capacity_fraction", f"must be a number between 0 and 1, got {wa_fraction!r}"
        )
    if not isinstance(config, StoreSettings):
        raise TypeError(f"not a store configuration: {config!r}")
    return config.split(wa_fraction)


__all__ = [
    "FA_SUBDIR",
    "WA_SUBDIR",
    "DumpPlan",
    "HybridSettings",
    "key_rank",
    "plan_dump",
    "split_store_config",
]
