"""The tiered store's settings: a local tier (dram, or posix on a local disk) over another
store."""

from __future__ import annotations

import os
from collections.abc import Mapping

import attrs
from ucm.core.settings import (
    ConfigError,
    from_dict,
    instance_of,
    one_of,
    optional,
    setting,
    size_gib,
)
from ucm.core.store.dram.config import DramStoreConfig
from ucm.core.store.kinds import StoreSettings, parse_store_config
from ucm.core.store.posix.config import PosixStoreConfig


def _parse_dram(value: object, where: str) -> DramStoreConfig:
    data = dict(value) if isinstance(value, Mapping) else value
    if isinstance(data, dict):
        data.setdefault("kind", "dram")
    return from_dict(DramStoreConfig, data, where)


def _parse_local(value: object, where: str) -> PosixStoreConfig | None:
    if value is None:
        return None
    data = dict(value) if isinstance(value, Mapping) else value
    if isinstance(data, dict):
        data.setdefault("kind", "posix")
    return from_dict(PosixStoreConfig, data, where)


def _parse_backing(value: object, where: str) -> StoreSettings:
    config = parse_store_config(value, where)
    if isinstance(config, TieredStoreConfig):
        raise ConfigError(f"{where}.kind", "a tiered store cannot back another tiered store")
    return config


def _backing(inst: object, attribute: attrs.Attribute[StoreSettings], value: object) -> None:
    if not isinstance(value, StoreSettings) or isinstance(value, TieredStoreConfig):
        raise ConfigError(attribute.name, f"must be the settings of a store, got {value!r}")


_backing.allowed = (  # type: ignore[attr-defined]
    "the settings of a posix, dram or mooncake store (above), or of a kind another "
    "distribution adds"
)


@attrs.frozen
class TieredStoreConfig(StoreSettings):
    """A local tier over another store: writes go to both (to the one below from the local
    tier's copy, behind the engine's back), reads are served by the local tier where it holds
    the block, else by the one below and then promoted into the local tier."""

    STORE = "ucm.core.store.tiered.store:open_tiered_store"

    kind: str = setting("Store kind.", default="tiered", validator=one_of("tiered"))
    dram: DramStoreConfig = setting(
        "The local tier when it is DRAM (the settings of a dram store).",
        factory=DramStoreConfig,
        validator=instance_of(DramStoreConfig),
        metadata={"parse": _parse_dram},
    )
    local: PosixStoreConfig | None = setting(
        "A posix store on a local disk as the local tier instead of DRAM (e.g. NVMe in front "
        "of a mooncake store). null: the dram tier.",
        default=None,
        validator=optional(instance_of(PosixStoreConfig)),
        metadata={"parse": _parse_local},
    )
    backing: StoreSettings = setting(
        "The store under the local tier (the settings of a posix, dram or mooncake store, "
        "with its kind; posix when the kind is left out).",
        factory=PosixStoreConfig,
        validator=_backing,
        metadata={"parse": _parse_backing},
    )

    write_behind_gb: float | None = setting(
        "GiB of blocks the local tier holds that may wait to be written to the backing store "
        "by a thread of the store's own, so that a dump costs the engine the local tier's "
        "time only; past it, dumps write through and wait for the backing store. null: "
        "always write through.",
        default=1.0,
        validator=optional(size_gib),
    )

    def __attrs_post_init__(self) -> None:
        if self.local is not None and self.dram != DramStoreConfig():
            raise ConfigError("local", "a tiered store has one local tier: give local or dram")
        if (
            isinstance(self.backing, PosixStoreConfig)
            and self.local is not None
            and os.path.realpath(self.backing.path) == os.path.realpath(self.local.path)
        ):
            raise ConfigError("local.path", "the local tier and its backing store share a path")

    @property
    def front(self) -> DramStoreConfig | PosixStoreConfig:
        """The local tier's settings."""
        return self.local if self.local is not None else self.dram

    def split(self, wa_fraction: float) -> tuple[TieredStoreConfig, TieredStoreConfig]:
        """Hybrid models: both tiers split."""
        fa_dram, wa_dram = self.dram.split(wa_fraction)
        fa_local, wa_local = self.local.split(wa_fraction) if self.local else (None, None)
        fa_back, wa_back = self.backing.split(wa_fraction)
        return (
            attrs.evolve(self, dram=fa_dram, local=fa_local, backing=fa_back),
            attrs.evolve(self, dram=wa_dram, local=wa_local, backing=wa_back),
        )

    def for_lookups_only(self) -> TieredStoreConfig:
        return attrs.evolve(self, backing=self.backing.for_lookups_only())

    def summary(self) -> str:
        return f"tiered: {self.front.summary()} -> {self.backing.summary()}"

    @property
    def in_host_memory(self) -> bool:
        return self.front.in_host_memory
