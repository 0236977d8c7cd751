"""The store kinds a configuration may name, in one place.

Each kind's settings class lives beside its store (``ucm.core.store.<kind>.config``) and
knows how to open its store (``open``), split it for a hybrid model's two stores
(``split``) and trim it for a process that only looks blocks up (``for_lookups_only``).  A
new kind is a package with such a class, added to :data:`STORE_CONFIGS`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
from ucm.core.settings import ConfigError, from_dict
from ucm.core.store.base import Store
from ucm.core.store.dram.config import DramStoreConfig
from ucm.core.store.mooncake.config import MooncakeStoreConfig
from ucm.core.store.posix.config import PosixStoreConfig
from ucm.core.store.tiered.config import TieredStoreConfig

StoreConfig = PosixStoreConfig | DramStoreConfig | TieredStoreConfig | MooncakeStoreConfig
#: every kind's settings class, in the order the documentation lists them
STORE_CONFIGS: tuple[type[StoreConfig], ...] = (
    PosixStoreConfig,
    DramStoreConfig,
    TieredStoreConfig,
    MooncakeStoreConfig,
)
#: ``kind`` -> settings class
STORE_KINDS: dict[str, type[StoreConfig]] = {
    attrs.fields(cls).kind.default: cls for cls in STORE_CONFIGS
}


def parse_store_config(data: object, where: str = "store") -> StoreConfig:
    """The ``store`` dict: ``{"kind": "posix"|"dram"|"tiered"|"mooncake", ...}`` (kind
    defaults to posix)."""
    if data is None:
        return PosixStoreConfig()
    if isinstance(data, STORE_CONFIGS):
        return data
    if not isinstance(data, Mapping):
        raise ConfigError(where, f"expected a mapping of settings, got {type(data).__name__}")
    kind = data.get("kind", "posix")
    cls = STORE_KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        allowed = ", ".join(sorted(STORE_KINDS))
        raise ConfigError(f"{where}.kind", f"must be one of {allowed}, got {kind!r}")
    return from_dict(cls, data, where)


def for_lookups_only(config: StoreConfig) -> StoreConfig:
    """The settings for a process that only looks blocks up (vLLM's scheduler): it gives a
    Mooncake cluster no memory, since nothing it writes would need it."""
    return config.for_lookups_only()


def create_store(config: StoreConfig | Mapping[str, Any] | None = None) -> Store:
    """The store a configuration describes (``None``: the default posix store)."""
    if config is None or isinstance(config, Mapping):
        config = parse_store_config(config)
    if not isinstance(config, STORE_CONFIGS):
        raise TypeError(f"not a store configuration: {config!r}")
    return config.open()
