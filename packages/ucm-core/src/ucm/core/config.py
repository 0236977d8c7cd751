"""Configuration: what users write, in frozen attrs classes validated on construction and
built from dicts or YAML (the toolkit: :mod:`ucm.core.settings`).

The store kinds' settings live beside their stores and are gathered here under the names
users and engine adapters import; the adapters' own settings classes reuse
:func:`store_setting` and the hybrid-model settings.  :data:`DOCUMENTED_CLASSES` is the
order of the documentation's configuration reference, generated from these classes.
"""

from __future__ import annotations

from typing import Any

import attrs
from ucm.core.settings import (
    GIB,
    ConfigError,
    boolean,
    fraction,
    from_dict,
    gib_to_bytes,
    int_in_range,
    load_yaml,
    positive_number,
    setting,
    with_config_file,
)
from ucm.core.store.dram.config import DramStoreConfig, default_shared_memory_path
from ucm.core.store.kinds import (
    StoreSettings,
    builtin_settings_classes,
    for_lookups_only,
    kind_names,
    parse_store_config,
)
from ucm.core.store.mooncake.config import MooncakeStoreConfig
from ucm.core.store.posix.config import PosixStoreConfig, default_store_path
from ucm.core.store.tiered.config import TieredStoreConfig


def _is_store(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    parse_store_config(value, attribute.name)


_is_store.allowed = (  # type: ignore[attr-defined]
    "the settings of a posix, dram, tiered or mooncake store (above), or of a kind another "
    "distribution adds"
)


def store_setting() -> Any:
    """The ``store`` field, for an engine adapter's settings class to reuse."""
    return setting(
        "The store: a dict with ``kind`` (posix, dram, tiered, mooncake) and its settings.",
        factory=PosixStoreConfig,
        validator=_is_store,
        metadata={"parse": parse_store_config},
    )


# --- how blocks move between an engine's cache and the store (ucm.kernels.mover) -------------


def zero_copy_setting() -> Any:
    """The ``zero_copy`` field, for an engine adapter's settings class to reuse."""
    return setting(
        "Move blocks without a copy of UCM's own where the caches and the store allow it: "
        "a store writes and reads the cache blocks in place (CPU caches whose blocks are "
        "runs of memory, where the engine lets the store touch them until the transfer "
        "ends); GPU caches (and CPU blocks of 1 MiB or more, or runs of memory) are copied "
        "straight into and out of the memory of a store that keeps its blocks in this "
        "host's memory (dram, scope host), registered with the GPU's driver. false: every "
        "block goes through host rows, gathered and scattered by ucm.kernels.",
        default=True,
        validator=boolean,
    )


def digests_on_gpu_setting() -> Any:
    """The ``digests_on_gpu`` field, for an engine adapter's settings class to reuse."""
    return setting(
        "Where GPU caches are copied straight into and out of a store's memory (zero_copy, "
        "the dram store of scope host), the GPU digests each block as it gathers it (the "
        "store books the digest without reading the block) and checks it as it comes back "
        "(a block that fails never reaches the cache, and is a miss): no host thread reads "
        "a block's bytes, and the copies run at the link's speed. false: the store's "
        "threads digest and check every block. A store that signs (store.secret) checks "
        "its MAC on the host either way.",
        default=True,
        validator=boolean,
    )


def pipeline_chunk_mb_setting(default: int) -> Any:
    """The ``pipeline_chunk_mb`` field (its default the engine's), for an engine adapter's
    settings class to reuse."""
    return setting(
        "MiB of KV per step of a transfer (rounded to whole blocks, at least one): a read "
        "uses each step as soon as it is loaded while the next ones load; a write through "
        "host rows gathers the next step while the store writes one.",
        default=default,
        validator=int_in_range(1, 1 << 16),
    )


def pipeline_depth_setting(default: int) -> Any:
    """The ``pipeline_depth`` field (its default the engine's), for an engine adapter's
    settings class to reuse."""
    return setting(
        "Steps of one transfer in flight at once: while one step is used, the next ones "
        "load (bounds the host rows a transfer holds to about pipeline_depth x "
        "pipeline_chunk_mb; blocks moved in place need none).",
        default=default,
        validator=int_in_range(1, 64),
    )


def cancel_grace_s_setting() -> Any:
    """The ``cancel_grace_s`` field, for an engine adapter's settings class to reuse."""
    return setting(
        "Seconds a timed-out or failed transfer waits for the block I/O already started, so "
        "that it returns with the store done with the engine's caches (and, for a write, "
        "the stored prefix exact); a block write finishing later is not published. Reads "
        "into a CPU cache's own blocks that do not stop in time are not trusted again: "
        "later loads go through host rows.",
        default=2.0,
        validator=positive_number,
    )


# --- hybrid models (full-attention and window KV-cache groups; see ucm.core.hybrid) ----------


def wa_dump_block_wise_setting() -> Any:
    """The ``wa_dump_block_wise`` field, for an engine adapter's settings class to reuse."""
    return setting(
        "Hybrid models: store the window groups' tail at every canonical block boundary "
        "(true), so that any stored prefix can be resumed, or only at the last boundary each "
        "prefill chunk reaches (false: fewer writes, hits only at chunk ends).",
        default=True,
        validator=boolean,
    )


def wa_capacity_fraction_setting() -> Any:
    """The ``wa_capacity_fraction`` field, for an engine adapter's settings class to reuse."""
    return setting(
        "Hybrid models: share of the store's capacity given to the window groups' tails; "
        "the full-attention blocks get the rest (posix stores: subdirectories fa/ and wa/).",
        default=0.5,
        validator=fraction,
    )


@attrs.frozen
class HybridSettings:
    """Hybrid models: how the window groups' tails are stored (see Hybrid models)."""

    wa_dump_block_wise: bool = wa_dump_block_wise_setting()
    wa_capacity_fraction: float = wa_capacity_fraction_setting()


#: Every class documented in the configuration reference, in order.
DOCUMENTED_CLASSES: list[tuple[str, type]] = [
    *(
        (f"store (kind: {attrs.fields(cls).kind.default})", cls)  # type: ignore[arg-type]
        for cls in builtin_settings_classes()
    ),
    ("Hybrid models", HybridSettings),
]

__all__ = [
    "DOCUMENTED_CLASSES",
    "GIB",
    "default_shared_memory_path",
    "ConfigError",
    "DramStoreConfig",
    "HybridSettings",
    "MooncakeStoreConfig",
    "PosixStoreConfig",
    "StoreSettings",
    "TieredStoreConfig",
    "default_store_path",
    "digests_on_gpu_setting",
    "for_lookups_only",
    "from_dict",
    "gib_to_bytes",
    "kind_names",
    "load_yaml",
    "parse_store_config",
    "pipeline_chunk_mb_setting",
    "store_setting",
    "wa_capacity_fraction_setting",
    "wa_dump_block_wise_setting",
    "with_config_file",
    "zero_copy_setting",
]
