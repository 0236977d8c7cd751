"""Checking the seals of blocks where they lie: a load's verdict on one block, and every
stored block of an arena at once (``ucm store verify``)."""

from __future__ import annotations

import hmac

from ucm.core.signing import BlockSigner
from ucm.core.store.dram.arena import Arena
from ucm.core.store.dram.sealing import move_sealed


def seal_matches(seal: bytes, stored: bytes) -> bool:
    """Whether a computed seal is the stored one (zero-padded to the column's width)."""
    return hmac.compare_digest(seal.ljust(len(stored), b"\0"), stored)


def verify_arena(arena: Arena, signer: BlockSigner | None, remove: bool) -> tuple[int, int]:
    """Check every stored block's seal (``ucm store verify``); drop the bad ones if
    ``remove``.  (blocks checked, corrupt)."""
    arena.map_data()
    npc = arena.np
    checked = corrupt = 0
    for slot in arena.ready_slots():
        words = (int(npc["key0"][slot]), int(npc["key1"][slot]))
        (pin,) = arena.pin([words])
        if pin is None or pin.slot != slot:
            continue  # gone meanwhile
        checked += 1
        seal = move_sealed(signer, words, pin.layout, (), arena.slot(slot, pin.length), into=False)
        bad = not seal_matches(seal, pin.seal)
        corrupt += bad
        arena.unpin([pin], [pin] if bad and remove else ())
    return checked, corrupt
