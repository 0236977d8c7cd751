"""Hybrid models: full-attention and window KV-cache groups, and what to look up, load and dump.

Engine-neutral: an adapter describes each KV-cache group of its model as a :class:`KVGroup`
and asks the planners here which store blocks to look up, load and dump; it keeps the keys,
the block tables and the data.

Terms.  ``T = boundary_tokens`` is the store block size (a multiple of every group's engine
block size).  Boundary ``b`` (1-based) is token ``b * T``, the end of canonical block
``b - 1``.  One token chain of keys serves a request (:func:`ucm.core.keys.block_keys`): chain
key ``i`` names the prefix up to the end of canonical block ``i``.  A full-attention group
stores canonical block ``s`` (``T // block_tokens`` engine blocks) under chain key ``s``; a
window group stores its *tail* at boundary ``b`` (the engine blocks holding the last
``tail_tokens`` tokens before it) under chain key ``b - 1``, in its own namespace or store.
Engine-block indices are positions in the group's block table for the request.

Rules (docs/hybrid.md has the pictures):

- lookup: full groups by longest stored prefix; window groups only at boundaries inside it;
  the usable hit is the largest boundary where every group agrees (:func:`usable_hit`);
- load: every hit block of full groups, and only the tail at the hit boundary of window groups
  (:func:`plan_load`);
- dump: every new canonical block of full groups; window tails at every boundary
  (block-wise) or at the last boundary each prefill chunk reaches
  (:func:`ucm.core.hybrid_store.plan_dump`); with tensor parallelism and replicated caches,
  key ``i`` is written by rank ``i % world_size``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
from ucm.core.settings import ConfigError, check_int, int_at_least, non_negative_number, one_of

FULL = "full"
WINDOW = "window"


@attrs.frozen
class KVGroup:
    """One KV-cache group: layers sharing a block table and an attention kind.

    ``kind``: ``"full"`` (every token of the prefix is attended to) or ``"window"`` (sliding
    window, chunked local attention, compressor state: only the last ``window_tokens`` are).
    ``compress_ratio``: tokens per compressed entry (1: none).  ``bytes_per_token_layer`` and
    ``num_layers`` are informational (sizing, logs).
    """

    kind: str = attrs.field(validator=one_of(FULL, WINDOW))
    block_tokens: int = attrs.field(validator=int_at_least(1))
    window_tokens: int = attrs.field(default=0, validator=int_at_least(0))
    compress_ratio: int = attrs.field(default=1, validator=int_at_least(1))
    bytes_per_token_layer: float = attrs.field(default=0, validator=non_negative_number)
    num_layers: int = attrs.field(default=0, validator=int_at_least(0))

    def __attrs_post_init__(self) -> None:
        if self.kind == WINDOW and self.window_tokens <= 0:
            raise ConfigError(
                "window_tokens", f"a window group needs a window > 0, got {self.window_tokens}"
            )
        if self.kind == FULL and self.window_tokens != 0:
            raise ConfigError(
                "window_tokens", f"a full-attention group has no window, got {self.window_tokens}"
            )

    @property
    def tail_tokens(self) -> int | None:
        """Tokens before a boundary that a window group needs to resume there (full: None).

        ``window_tokens``, or ``window_tokens - compress_ratio`` for compressor state (never
        below 0: a window no larger than the ratio needs nothing stored).
        """
        if self.kind == FULL:
            return None
        if self.compress_ratio == 1:
            return self.window_tokens
        return max(0, self.window_tokens - self.compress_ratio)

    @property
    def tail_blocks(self) -> int | None:
        """Engine blocks holding ``tail_tokens`` before a boundary (full: None)."""
        tail = self.tail_tokens
        return None if tail is None else -(-tail // self.block_tokens)


@attrs.frozen
class HybridLayout:
    """The KV-cache groups of a model (in the engine's order) and the store block size.

    A layout needs at least one group that stores something: a full group, or a window group
    with ``tail_blocks > 0``.  A layout of window groups only is allowed: its hits are bounded
    by the request's chain (pass the chain length as ``fa_prefix``), and each is proven by the
    stored tails, whose keys name the whole prefix.
    """

    groups: tuple[KVGroup, ...] = attrs.field(converter=tuple)
    boundary_tokens: int = attrs.field(validator=int_at_least(1))

    def __attrs_post_init__(self) -> None:
        if not self.groups:
            raise ConfigError("groups", "a layout needs at least one KV-cache group")
        for i, group in enumerate(self.groups):
            if not isinstance(group, KVGroup):
                raise ConfigError(f"groups[{i}]", f"must be a KVGroup, got {group!r}")
            if self.boundary_tokens % group.block_tokens:
                raise ConfigError(
                    "boundary_tokens",
                    f"{self.boundary_tokens} is not a multiple of the block size "
                    f"{group.block_tokens} of KV-cache group {i}",
                )
        if not self.full_groups and not self.tail_groups:
            raise ConfigError(
                "groups",
                "no group stores anything (no full-attention group, and every window is no "
                "larger than its compression ratio): a hit would be proven by nothing",
            )

    @property
    def full_groups(self) -> tuple[int, ...]:
        """Indices of the full-attention groups."""
        return tuple(i for i, g in enumerate(self.groups) if g.kind == FULL)

    @property
    def window_groups(self) -> tuple[int, ...]:
        """Indices of the window groups (including those with nothing to store)."""
        return tuple(i for i, g in enumerate(self.groups) if g.kind == WINDOW)

    @property
    def tail_groups(self) -> tuple[int, ...]:
        """Indices of the window groups with ``tail_blocks > 0``: those looked up and stored."""
        return tuple(i for i, g in enumerate(self.groups) if g.kind == WINDOW and g.tail_blocks)

    @property
    def tail_blocks(self) -> tuple[int | None, ...]:
        """``tail_blocks`` of every group (None for full groups), for logs."""
        return tuple(g.tail_blocks for g in self.groups)

    def blocks_per_boundary(self, group: int) -> int:
        """Engine blocks of ``group`` per canonical store block."""
        return self.boundary_tokens // self.groups[group].block_tokens


def tail_range(layout: HybridLayout, group: int, boundary: int) -> range:
    """Engine-block indices of window ``group`` holding its tail at ``boundary``.

    The last ``tail_blocks`` engine blocks before ``boundary * T``, cut at block 0 near the
    start of the prompt (so a tail at a small boundary may be shorter); empty when the group
    needs no tail.
    """
    g = layout.groups[group]
    if g.kind != WINDOW:
        raise ValueError(f"group {group} is a full-attention group: it has no tail")
    check_int("boundary", boundary, 0)
    end = boundary * layout.boundary_tokens // g.block_tokens
    return range(max(0, end - (g.tail_blocks or 0)), end)


def wa_lookup_boundaries(layout: HybridLayout, fa_prefix: int, floor: int = 0) -> range:
    """Boundaries whose window tails are worth looking up, ascending: ``floor < b <= fa_prefix``.

    ``floor`` is what the engine holds itself, in boundaries (``local_tokens // T``): a hit
    at or below it loads nothing.  Empty when no window group stores a tail.
    """
    check_int("fa_prefix", fa_prefix, 0)
    check_int("floor", floor, 0)
    if not layout.tail_groups:
        return range(0)
    return range(floor + 1, fa_prefix + 1)


def usable_hit(
    layout: HybridLayout,
    fa_prefix: int,
    wa_stored: Mapping[int, Sequence[bool]],
    *,
    floor: int = 0,
) -> int:
    """The largest boundary ``b`` in ``(floor, fa_prefix]`` where every group agrees, else 0.

    ``fa_prefix``: the longest prefix (in canonical blocks) stored for every full group (the
    chain length, for a layout without full groups); cap it *before* calling (e.g. so that the
    engine still computes a token of the prompt), as the tail must exist at the final boundary.
    ``wa_stored[g][b - 1]``: whether window group ``g``'s tail at boundary ``b`` is stored;
    entries at or below ``floor`` are not read, a short sequence means not stored beyond it.
    Groups that need no tail need no entry.
    """
    check_int("fa_prefix", fa_prefix, 0)
    check_int("floor", floor, 0)
    flags = []
    for g in layout.tail_groups:
        if g not in wa_stored:
            raise ValueError(f"wa_stored has no entry for window group {g}")
        flags.append(wa_stored[g])
    for b in range(fa_prefix, floor, -1):
        if all(b <= len(f) and f[b - 1] for f in flags):
            return b
    return 0


@attrs.frozen
class BlockRef:
    """One stored block of one group: its chain key and the engine blocks forming its payload.

    ``key``: index into the request's token chain (canonical block ``s`` for a full group;
    ``b - 1`` for a window tail at boundary ``b``).  ``engine_blocks``: the payload, in order.
    ``held``: for loads, how many leading ``engine_blocks`` the engine already holds (they may
    be shared with running requests: read past, never written); :attr:`fill` is the rest.
    """

    group: int
    key: int
    engine_blocks: range
    held: int = 0

    @property
    def fill(self) -> range:
        """The engine blocks a load writes."""
        return self.engine_blocks[self.held :]


def _held(engine_blocks: range, local_blocks: int) -> int:
    return max(0, min(len(engine_blocks), local_blocks - engine_blocks.start))


@attrs.frozen
class LoadPlan:
    """What to load for a hit at boundary ``hit`` when the engine holds ``local_tokens``.

    ``full``: every canonical block from ``local_tokens // T`` to ``hit - 1`` of every full
    group (group-major); ``window``: the tail at ``hit`` of every window group storing one.
    """

    hit: int
    local_tokens: int
    tokens: int  # tokens the load adds to what the engine holds
    full: tuple[BlockRef, ...]
    window: tuple[BlockRef, ...]

    @property
    def blocks(self) -> tuple[BlockRef, ...]:
        return self.full + self.window


def plan_load(layout: HybridLayout, local_tokens: int, hit: int) -> LoadPlan:
    """The blocks to load for a usable hit (from :func:`usable_hit`); nothing if the engine
    already holds ``hit * T`` tokens."""
    check_int("local_tokens", local_tokens, 0)
    check_int("hit", hit, 0)
    bt = layout.boundary_tokens
    if hit * bt <= local_tokens:
        return LoadPlan(hit, local_tokens, 0, (), ())
    full = []
    for g in layout.full_groups:
        k = layout.blocks_per_boundary(g)
        local_blocks = local_tokens // layout.groups[g].block_tokens
        for s in range(local_tokens // bt, hit):
            blocks = range(s * k, (s + 1) * k)
            full.append(BlockRef(g, s, blocks, _held(blocks, local_blocks)))
    window = []
    for g in layout.tail_groups:
        blocks = tail_range(layout, g, hit)
        local_blocks = local_tokens // layout.groups[g].block_tokens
        window.append(BlockRef(g, hit - 1, blocks, _held(blocks, local_blocks)))
    return LoadPlan(hit, local_tokens, hit * bt - local_tokens, tuple(full), tuple(window))


__all__ = [
    "FULL",
    "WINDOW",
    "BlockRef",
    "HybridLayout",
    "KVGroup",
    "LoadPlan",
    "plan_load",
    "tail_range",
    "usable_hit",
    "wa_lookup_boundaries",
]
