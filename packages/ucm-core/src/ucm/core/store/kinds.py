"""The store kinds a configuration may name: a registry keyed by strings, loaded lazily.

A kind is a settings class (attrs, frozen: pure data, validated on construction) that names
in strings, ``"module:attribute"``, the callable opening its store from those settings and,
for a kind whose blocks lie in a folder, what ``ucm store stats|verify|gc`` calls on one.
Nothing is imported until a configuration names the kind, and no settings module imports
its store.  UCM's kinds are listed in :data:`BUILTIN_KINDS`; a distribution adds one through
the ``ucm.stores`` entry points (name: the kind, value: its settings class), and a
configuration then names it as it names ``posix``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, ClassVar

from ucm.core.settings import ConfigError, from_dict

if TYPE_CHECKING:
    from ucm.core.store.base import Store

#: the entry-point group through which other distributions add store kinds
ENTRY_POINT_GROUP = "ucm.stores"
#: UCM's own kinds, in the order the documentation lists them: kind -> its settings class
BUILTIN_KINDS = {
    "posix": "ucm.core.store.posix.config:PosixStoreConfig",
    "dram": "ucm.core.store.dram.config:DramStoreConfig",
    "tiered": "ucm.core.store.tiered.config:TieredStoreConfig",
    "mooncake": "ucm.core.store.mooncake.config:MooncakeStoreConfig",
}


class StoreSettings:
    """What every kind's settings class is: an attrs class whose ``kind`` field defaults to
    its kind's name, deriving from this one for the names below."""

    __slots__ = ()
    kind: str
    #: ``"module:callable"``: opens the store from these settings
    STORE: ClassVar[str]
    #: ``"module:Class"`` of :class:`ucm.core.store.folders.StoreFolder`, for a kind whose
    #: blocks lie in a folder that ``ucm store`` can inspect; None for the others
    FOLDER: ClassVar[str | None] = None

    def split(self, wa_fraction: float) -> tuple[StoreSettings, StoreSettings]:
        """A hybrid model's two stores (full-attention, window), the window's share
        ``wa_fraction`` of the capacity; the two never hold more than this one."""
        raise ConfigError("kind", f"a {self.kind} store cannot hold a hybrid model's blocks")

    def for_lookups_only(self) -> StoreSettings:
        """The settings for a process that only looks blocks up (vLLM's scheduler)."""
        return self

    def summary(self) -> str:
        """One phrase naming the store: its kind, where it is, its size."""
        return self.kind

    @property
    def in_host_memory(self) -> bool:
        """Whether a block lands first in this host's memory (else on storage)."""
        return False


def load(reference: str) -> Any:
    """The object ``"module:attribute.attribute"`` names."""
    module, _, name = reference.partition(":")
    found: Any = importlib.import_module(module)
    for part in name.split("."):
        found = getattr(found, part)
    return found


def kind_names() -> list[str]:
    """Every kind a configuration may name: UCM's, then those of installed distributions."""
    added = sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
    return [*BUILTIN_KINDS, *(k for k in added if k not in BUILTIN_KINDS)]


def settings_class(kind: str) -> type[StoreSettings] | None:
    """The settings class of ``kind`` (None for a kind nobody registered)."""
    reference = BUILTIN_KINDS.get(kind)
    if reference is None:
        found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == kind]
        if not found:
            return None
        reference = found[0].value
    cls = load(reference)
    if not (isinstance(cls, type) and issubclass(cls, StoreSettings)):
        raise ConfigError(
            "store.kind", f"{kind!r} names {reference}, which is not a StoreSettings class"
        )
    return cls


def builtin_settings_classes() -> list[type[StoreSettings]]:
    """UCM's own kinds' settings classes, in the documentation's order."""
    return [load(reference) for reference in BUILTIN_KINDS.values()]


def parse_store_config(data: object, where: str = "store") -> StoreSettings:
    """A ``store`` mapping (``{"kind": ..., ...}``; posix when the kind is left out) as its
    kind's settings; settings already built pass as they are."""
    if data is None:
        data = {}
    if isinstance(data, StoreSettings):
        return data
    if not isinstance(data, Mapping):
        raise ConfigError(where, f"expected a mapping of settings, got {type(data).__name__}")
    kind = data.get("kind", "posix")
    cls = settings_class(kind) if isinstance(kind, str) else None
    if cls is None:
        allowed = ", ".join(sorted(kind_names()))
        raise ConfigError(
            f"{where}.kind",
            f"must be one of {allowed}, got {kind!r} (a kind another distribution adds, "
            f"through the {ENTRY_POINT_GROUP} entry points, is known once it is installed)",
        )
    return from_dict(cls, {**data, "kind": kind}, where)


def for_lookups_only(config: StoreSettings) -> StoreSettings:
    """The settings for a process that only looks blocks up (vLLM's scheduler): it gives a
    Mooncake cluster no memory, since nothing it writes would need it."""
    return config.for_lookups_only()


def create_store(config: StoreSettings | Mapping[str, Any] | None = None) -> Store:
    """The store a configuration describes (``None``: the default posix store)."""
    if config is None or isinstance(config, Mapping):
        config = parse_store_config(config)
    if not isinstance(config, StoreSettings):
        raise TypeError(f"not a store configuration: {config!r}")
    store: Store = load(config.STORE)(config)
    return store
