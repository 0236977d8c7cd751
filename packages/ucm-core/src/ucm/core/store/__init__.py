"""Stores: where KV blocks live outside the accelerator."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ucm.core.config import (
    DramStoreConfig,
    MooncakeStoreConfig,
    PosixStoreConfig,
    StoreConfig,
    TieredStoreConfig,
    parse_store_config,
)
from ucm.core.store.base import Store, StoreUsage
from ucm.core.store.dram import DramStore
from ucm.core.store.payload import Payload
from ucm.core.store.posix import PosixStore
from ucm.core.store.shm import SharedMemoryStore
from ucm.core.store.task import KeyResult, Status, Task
from ucm.core.store.tiered import TieredStore


def create_store(config: StoreConfig | Mapping[str, Any] | None = None) -> Store:
    """The store a configuration describes (``None``: the default posix store)."""
    if config is None or isinstance(config, Mapping):
        config = parse_store_config(config)
    if isinstance(config, PosixStoreConfig):
        return PosixStore(config)
    if isinstance(config, DramStoreConfig):
        return DramStore(config) if config.scope == "process" else SharedMemoryStore(config)
    if isinstance(config, MooncakeStoreConfig):
        from ucm.core.store.mooncake import MooncakeStore  # imports Mooncake's client

        return MooncakeStore(config)
    if isinstance(config, TieredStoreConfig):
        backing = create_store(config.backing)
        front = create_store(config.front)
        return TieredStore(front, backing)
    raise TypeError(f"not a store configuration: {config!r}")


__all__ = [
    "DramStore",
    "KeyResult",
    "Payload",
    "PosixStore",
    "SharedMemoryStore",
    "Status",
    "Store",
    "StoreUsage",
    "Task",
    "TieredStore",
    "create_store",
]
