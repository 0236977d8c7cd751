"""Helpers shared by ucm-core's tests (a plain module: conftest puts this folder on sys.path)."""

import os
import secrets

import numpy as np
import pytest
import xxhash


def key(i: int, salt: bytes = b"") -> bytes:
    return xxhash.xxh3_128_digest(salt + i.to_bytes(8, "little"))


def blob(i: int, size: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


def mooncake_available() -> str | None:
    """Why the mooncake tests cannot run here, or None when they can.

    CI sets ``UCM_REQUIRE_MOONCAKE=1``: there a missing client is a failure, not a skip."""
    try:
        import mooncake.store  # noqa: F401
        from ucm.core.store.mooncake_master import master_binary

        master_binary()
    except (ImportError, OSError) as exc:
        reason = f"Mooncake's client is not installed (pip install 'ucm-core[mooncake]'): {exc}"
        if os.environ.get("UCM_REQUIRE_MOONCAKE") == "1":
            pytest.fail(reason)
        return reason
    return None


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
