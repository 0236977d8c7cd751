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
    import os
    import struct

    from ucm.core.store.dram.arena import ARENA_FILE, Arena

    arena = Arena.attach(str(folder), capacity_bytes=1 << 62, data=False)
    assert arena is not None, f"no arena in {folder}"
    try:
        (pin,) = arena.pin([struct.unpack("<QQ", key)])
        assert pin is not None, f"{key.hex()} is not stored in {folder}"
        arena.unpin([pin])
        at = arena.geometry.meta_bytes + pin.slot * arena.geometry.slot_bytes
        at += offset % pin.length
    finally:
        arena.close()
    fd = os.open(os.path.join(str(folder), ARENA_FILE), os.O_RDWR)
    try:
        byte = os.pread(fd, 1, at)[0]
        os.pwrite(fd, bytes([byte ^ 0xFF]), at)
    finally:
        os.close(fd)
