"""Helpers of ucm-core's tests: keys and payloads that depend on an index alone, Mooncake."""

import secrets

import numpy as np
import xxhash


def key(i: int, salt: bytes = b"") -> bytes:
    return xxhash.xxh3_128_digest(salt + i.to_bytes(8, "little"))


def blob(i: int, size: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


def mooncake_config(master, **overrides):
    """Settings of a mooncake store on ``master``, with a key prefix of its own: the
    session's tests share one master."""
    from ucm.core.config import MooncakeStoreConfig

    settings = {
        "master": master.address,
        "global_segment_gb": 0.0625,
        "key_prefix": f"test-{secrets.token_hex(4)}/",
    }
    settings.update(overrides)
    return MooncakeStoreConfig(**settings)


def flip_shared_block_byte(folder, key: bytes, offset: int = -1) -> None:
    """Flip one byte of ``key``'s block in the host dram store of ``folder`` (``offset``
    into its payload; -1 the last), writing the arena file as any other writer of it could."""
    import struct

    _flip_in_arena(folder, lambda arena: [arena.pin([struct.unpack("<QQ", key)])[0]], offset)


def flip_shared_bytes(folder, every: int = 1, offset: int = -100) -> int:
    """Flip one payload byte (``offset`` from its start, or from its end when negative) of
    every ``every``-th block stored in the host dram store of ``folder``; how many."""

    def pins(arena):
        npc = arena.np
        words = [(int(npc["key0"][s]), int(npc["key1"][s])) for s in arena.ready_slots()]
        return arena.pin(words[::every])

    return _flip_in_arena(folder, pins, offset)


def _flip_in_arena(folder, pin, offset: int) -> int:
    import os

    from ucm.core.store.dram.arena import ARENA_FILE, Arena

    arena = Arena.attach(str(folder), capacity_bytes=1 << 62, data=False)
    assert arena is not None, f"no arena in {folder}"
    try:
        pinned = pin(arena)
        assert pinned and all(p is not None for p in pinned), f"not stored in {folder}"
        arena.unpin(pinned)
        g = arena.geometry
        places = [g.meta_bytes + p.slot * g.slot_bytes + offset % p.length for p in pinned]
    finally:
        arena.close()
    fd = os.open(os.path.join(str(folder), ARENA_FILE), os.O_RDWR)
    try:
        for at in places:
            byte = os.pread(fd, 1, at)[0]
            os.pwrite(fd, bytes([byte ^ 0xFF]), at)
    finally:
        os.close(fd)
    return len(places)
