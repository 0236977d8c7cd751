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
