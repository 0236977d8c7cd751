"""Configuration: frozen attrs classes, validated on construction, built from dicts or YAML.

Every setting is declared once, here, with its type, default, constraint and a one-line
``doc``; the documentation's configuration reference is generated from these classes.  A
dict with an unknown key, a value of the wrong type or out of range is refused with a
``ConfigError`` naming the key (as a dotted path) and what is allowed.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import attrs
import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """An invalid configuration: ``key`` is the dotted path of the offending setting."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}" if key else problem)
        self.key = key
        self.problem = problem

    def under(self, prefix: str) -> ConfigError:
        return ConfigError(f"{prefix}.{self.key}" if self.key else prefix, self.problem)


# --- validators: each raises ConfigError naming the attribute --------------------------------


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def optional(
    check: Callable[[object, attrs.Attribute[Any], object], None],
) -> Callable[[object, attrs.Attribute[Any], object], None]:
    """``check``, letting ``None`` (null) through."""

    def check_optional(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if value is not None:
            check(inst, attribute, value)

    return check_optional


def positive_number(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not _is_number(value) or not math.isfinite(value) or value <= 0:  # type: ignore[arg-type,operator]
        raise ConfigError(attribute.name, f"must be a positive number, got {value!r}")


optional_positive_number = optional(positive_number)


def int_in_range(low: int, high: int) -> Callable[[object, attrs.Attribute[Any], object], None]:
    def check(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ConfigError(
                attribute.name, f"must be an integer in [{low}, {high}], got {value!r}"
            )

    return check


def fraction(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not _is_number(value) or not 0 < value < 1:  # type: ignore[operator]
        raise ConfigError(attribute.name, f"must be a number between 0 and 1, got {value!r}")


def one_of(*choices: object) -> Callable[[object, attrs.Attribute[Any], object], None]:
    def check(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if value not in choices or isinstance(value, bool) != isinstance(choices[0], bool):
            allowed = ", ".join(repr(c) for c in choices)
            raise ConfigError(attribute.name, f"must be one of {allowed}, got {value!r}")

    return check


def boolean(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(attribute.name, f"must be true or false, got {value!r}")


def non_empty_str(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(attribute.name, f"must be a non-empty string, got {value!r}")


def instance_of(
    cls: type | tuple[type, ...],
) -> Callable[[object, attrs.Attribute[Any], object], None]:
    def check(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, cls):
            names = cls.__name__ if isinstance(cls, type) else " or ".join(c.__name__ for c in cls)
            raise ConfigError(attribute.name, f"must be a {names}, got {value!r}")

    return check


def setting(doc: str, **kwargs: Any) -> Any:
    """An attrs field carrying its documentation (read by the docs generator)."""
    metadata = dict(kwargs.pop("metadata", {}))
    metadata["doc"] = doc
    return attrs.field(metadata=metadata, **kwargs)


# --- generic construction from plain data ---------------------------------------------------


def from_dict(cls: type[T], data: object, where: str = "") -> T:
    """Build ``cls`` from a mapping, refusing unknown keys; nested settings recurse.

    A field whose metadata holds ``parse`` is built with ``parse(value, dotted_path)``.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(where, f"expected a mapping of settings, got {type(data).__name__}")
    fields = attrs.fields_dict(cls)  # type: ignore[arg-type]
    unknown = [k for k in data if k not in fields]
    if unknown:
        allowed = ", ".join(sorted(fields))
        key = f"{where}.{unknown[0]}" if where else str(unknown[0])
        raise ConfigError(key, f"unknown setting; allowed: {allowed}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        parse = fields[name].metadata.get("parse")
        kwargs[name] = parse(value, f"{where}.{name}" if where else name) if parse else value
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise exc.under(where) if where else exc from None


def load_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A YAML configuration file as a dict; a missing, unreadable or non-mapping file is refused."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError("config_file", f"cannot read {str(path)!r}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("config_file", f"{str(path)!r} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("config_file", f"{str(path)!r} must hold a mapping of settings")
    return data


def with_config_file(data: Mapping[str, Any]) -> dict[str, Any]:
    """Resolve ``config_file``: the file's settings, overridden key by key by the others."""
    merged = dict(data)
    path = merged.pop("config_file", None)
    if path is None:
        return merged
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError("config_file", f"must be a path to a YAML file, got {path!r}")
    loaded = load_yaml(path)
    if "config_file" in loaded:
        raise ConfigError("config_file", f"{str(path)!r} may not name another config_file")
    loaded.update(merged)
    return loaded


# --- stores -----------------------------------------------------------------------------------

GIB = 1 << 30


def default_store_path() -> str:
    """``$XDG_CACHE_HOME/ucm``, or ``~/.cache/ucm`` when that is unset."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ucm")


def gib_to_bytes(gb: float | None) -> int | None:
    return None if gb is None else int(gb * GIB)


@attrs.frozen
class PosixStoreConfig:
    """A directory on a local disk or a shared mount (NFS, 3FS, ...): the embedded default."""

    kind: str = setting("Store kind.", default="posix", validator=one_of("posix"))
    path: str = setting(
        "Directory of the store; created (mode 0700) if missing. Several processes and hosts "
        "may share it.",
        factory=default_store_path,
        validator=non_empty_str,
    )
    capacity_gb: float | None = setting(
        "Size limit in GiB (2^30 bytes); least recently used blocks are evicted beyond it. "
        "null: no limit.",
        default=None,
        validator=optional_positive_number,
    )
    fsync: str = setting(
        "When to force data to stable storage: 'never' (a crash may lose recent blocks, "
        "never expose a torn one: every load verifies a checksum), 'data' (each block before "
        "it is published), 'full' (each block and its directory entry).",
        default="never",
        validator=one_of("never", "data", "full"),
    )
    io_threads: int | None = setting(
        "Threads doing file I/O (the GIL is released in reads and writes). null: one per "
        "CPU core this process may run on, at least 2 and at most 8: a block served from "
        "the page cache is a copy that keeps a core busy, so more threads than cores only "
        "contend for them (measured 10-20% slower reads and writes with 4 threads on 2 "
        "cores); a slow disk or shared mount may want more in flight.",
        default=None,
        validator=optional(int_in_range(1, 256)),
    )
    o_direct: bool = setting(
        "Bypass the page cache with O_DIRECT (through aligned bounce buffers).",
        default=False,
        validator=boolean,
    )
    evict_fraction: float = setting(
        "Share of the capacity freed by one eviction pass, so that passes are rare.",
        default=0.1,
        validator=fraction,
    )
    stale_temp_seconds: float = setting(
        "Age after which a temporary file left by a writer on another host is removed.",
        default=3600.0,
        validator=positive_number,
    )

    @property
    def capacity_bytes(self) -> int | None:
        return gib_to_bytes(self.capacity_gb)

    @property
    def io_thread_count(self) -> int:
        """``io_threads``, or the number it stands for when null."""
        if self.io_threads is not None:
            return self.io_threads
        return min(8, max(2, len(os.sched_getaffinity(0))))


#: where a host-scope dram store lives unless told: the shared memory every Linux host mounts
SHARED_MEMORY_PATH = "/dev/shm/ucm"


@attrs.frozen
class DramStoreConfig:
    """Host memory, least recently used blocks evicted beyond the capacity.  By default
    shared memory (a folder on a memory filesystem, ``/dev/shm``): every process on the host
    that opens the same path shares the blocks (vLLM's scheduler and its workers, engines
    side by side, the next engine after a restart), with the posix store's promises."""

    kind: str = setting("Store kind.", default="dram", validator=one_of("dram"))
    capacity_gb: float = setting(
        "Size limit in GiB (2^30 bytes).", default=4.0, validator=positive_number
    )
    scope: str = setting(
        "Who shares the blocks. ``host``: every process on the host that opens ``path`` "
        "(shared memory, kept across engine restarts until the host reboots); ``process``: "
        "this process alone (private memory, gone with it; no engine whose lookups and "
        "loads run in different processes, such as vLLM, can hit in it).",
        default="host",
        validator=one_of("host", "process"),
    )
    path: str = setting(
        "The folder of a host-scope store, on a memory filesystem (tmpfs); created if "
        "missing.  Give each set of engines that must not share blocks its own.",
        default=SHARED_MEMORY_PATH,
        validator=non_empty_str,
    )
    preallocate: bool = setting(
        "Map and fault in the whole capacity at start-up, so that no dump pays for fresh "
        "pages (costs start-up time and commits the memory at once). Process scope only.",
        default=False,
        validator=boolean,
    )

    def __attrs_post_init__(self) -> None:
        if self.preallocate and self.scope == "host":
            raise ConfigError(
                "preallocate", "applies to scope 'process' only (shared memory is the tmpfs's)"
            )
        if self.path != SHARED_MEMORY_PATH and self.scope == "process":
            raise ConfigError("path", "applies to scope 'host' only (process memory has none)")

    @property
    def capacity_bytes(self) -> int:
        return int(self.capacity_gb * GIB)


def _host_port(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str) or not _parse_host_port(value):
        raise ConfigError(attribute.name, f"must be HOST:PORT (port 1-65535), got {value!r}")


def _parse_host_port(value: str) -> tuple[str, int] | None:
    host, sep, port = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    if any(c.isspace() for c in host) or "/" in host:
        return None
    return host, int(port)


_host_port.allowed = "`HOST:PORT` (an IPv6 host in brackets)"  # type: ignore[attr-defined]


def _metadata_server(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value == "P2PHANDSHAKE":
        return
    if isinstance(value, str):
        scheme, sep, rest = value.partition("://")
        if (
            sep
            and scheme in ("http", "etcd", "redis")
            and rest
            and not any(c.isspace() for c in rest)
        ):
            return
    raise ConfigError(
        attribute.name,
        "must be 'P2PHANDSHAKE' (no metadata server) or a URL: http://HOST:PORT/metadata, "
        f"etcd://HOST:PORT or redis://HOST:PORT; got {value!r}",
    )


_metadata_server.allowed = (  # type: ignore[attr-defined]
    "`P2PHANDSHAKE`, or an `http://`, `etcd://` or `redis://` URL"
)


def _key_prefix(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if (
        not isinstance(value, str)
        or len(value) > 128
        or any(c.isspace() or not c.isprintable() for c in value)
    ):
        raise ConfigError(
            attribute.name,
            f"must be a string of at most 128 printable characters, no spaces; got {value!r}",
        )


_key_prefix.allowed = "at most 128 printable characters, no spaces"  # type: ignore[attr-defined]


def _protocol(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value == "rdma":
        raise ConfigError(
            attribute.name,
            "'rdma' is not supported yet: RDMA moves only memory registered with the NIC, "
            "and UCM does not register the engine's buffers; use 'tcp'",
        )
    if value != "tcp":
        raise ConfigError(attribute.name, f"must be 'tcp', got {value!r}")


_protocol.allowed = "`tcp`"  # type: ignore[attr-defined]


def non_negative_number(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not _is_number(value) or not math.isfinite(value) or value < 0:  # type: ignore[arg-type,operator]
        raise ConfigError(attribute.name, f"must be a number >= 0, got {value!r}")


@attrs.frozen
class MooncakeStoreConfig:
    """A Mooncake Store cluster: blocks in the DRAM that its clients contribute, shared by
    every host that reaches its master (see Running across machines)."""

    kind: str = setting("Store kind.", default="mooncake", validator=one_of("mooncake"))
    master: str = setting(
        "The master's RPC address, HOST:PORT (mooncake_master --rpc_port).",
        default="127.0.0.1:50051",
        validator=_host_port,
    )
    metadata_server: str = setting(
        "Where transfer endpoints are published: 'P2PHANDSHAKE' (none: peers exchange them "
        "directly), or the master's HTTP metadata server (http://HOST:PORT/metadata), or "
        "etcd://HOST:PORT / redis://HOST:PORT.",
        default="P2PHANDSHAKE",
        validator=_metadata_server,
    )
    protocol: str = setting(
        "Transfer protocol: 'tcp'. ('rdma' is refused for now: RDMA moves only memory "
        "registered with the NIC, and UCM does not register the engine's buffers yet.)",
        default="tcp",
        validator=_protocol,
    )
    device: str = setting(
        "RDMA device names, comma-separated (e.g. 'mlx5_0'), handed to Mooncake; '' with tcp.",
        default="",
        validator=instance_of(str),
    )
    local_hostname: str | None = setting(
        "The address other hosts reach this one at. null: the address of the interface that "
        "routes to the master (never a loopback address unless the master is on loopback).",
        default=None,
        validator=optional(non_empty_str),
    )
    global_segment_gb: float = setting(
        "GiB of this process's DRAM given to the cluster's pool (other hosts' blocks may "
        "land in it). 0: contribute none and only use the others' (a pure client).",
        default=1.0,
        validator=non_negative_number,
    )
    local_buffer_mb: float = setting(
        "MiB of registered memory the Mooncake client keeps for its own transfers.",
        default=16.0,
        validator=positive_number,
    )
    replicas: int = setting(
        "Copies of each block, on distinct segments.", default=1, validator=int_in_range(1, 16)
    )
    key_prefix: str = setting(
        "Prepended to every object key, so that deployments sharing one cluster stay apart.",
        default="ucm/",
        validator=_key_prefix,
    )
    timeout_s: float = setting(
        "Seconds a lookup waits for the master before it answers miss and the master is "
        "taken as down (then lookups miss and dumps are dropped at once, until the "
        "background probe hears from it again); also how long start-up waits for it.",
        default=2.0,
        validator=positive_number,
    )
    probe_interval_s: float = setting(
        "Seconds between probes of a master that is down.",
        default=0.5,
        validator=positive_number,
    )
    io_threads: int | None = setting(
        "Threads issuing transfers, each moving up to 128 blocks per call. null: one per two "
        "CPU cores this process may run on, at least 1 and at most 8 (each transfer keeps a "
        "core busy copying, and so does the peer it talks to).",
        default=None,
        validator=optional(int_in_range(1, 64)),
    )

    @property
    def io_thread_count(self) -> int:
        if self.io_threads is not None:
            return self.io_threads
        return min(8, max(1, len(os.sched_getaffinity(0)) // 2))

    @property
    def master_host_port(self) -> tuple[str, int]:
        parsed = _parse_host_port(self.master)
        assert parsed is not None  # validated
        return parsed

    @property
    def global_segment_bytes(self) -> int:
        return int(self.global_segment_gb * GIB)

    @property
    def local_buffer_bytes(self) -> int:
        return int(self.local_buffer_mb * (1 << 20))


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


def _parse_backing(
    value: object, where: str
) -> PosixStoreConfig | DramStoreConfig | MooncakeStoreConfig:
    config = parse_store_config(value, where)
    if isinstance(config, TieredStoreConfig):
        raise ConfigError(f"{where}.kind", "a tiered store cannot back another tiered store")
    return config


@attrs.frozen
class TieredStoreConfig:
    """A local tier over another store: writes go to both, reads are served by the local tier
    where it holds the block, else by the one below and then promoted into the local tier."""

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
    backing: PosixStoreConfig | DramStoreConfig | MooncakeStoreConfig = setting(
        "The store under the local tier (the settings of a posix, dram or mooncake store, "
        "with its kind; posix when the kind is left out).",
        factory=PosixStoreConfig,
        validator=instance_of((PosixStoreConfig, DramStoreConfig, MooncakeStoreConfig)),
        metadata={"parse": _parse_backing},
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


StoreConfig = PosixStoreConfig | DramStoreConfig | TieredStoreConfig | MooncakeStoreConfig
STORE_KINDS: dict[str, type[StoreConfig]] = {
    "posix": PosixStoreConfig,
    "dram": DramStoreConfig,
    "tiered": TieredStoreConfig,
    "mooncake": MooncakeStoreConfig,
}


def parse_store_config(data: object, where: str = "store") -> StoreConfig:
    """The ``store`` dict: ``{"kind": "posix"|"dram"|"tiered"|"mooncake", ...}`` (kind
    defaults to posix)."""
    if data is None:
        return PosixStoreConfig()
    if isinstance(
        data, (PosixStoreConfig, DramStoreConfig, TieredStoreConfig, MooncakeStoreConfig)
    ):
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
    if isinstance(config, MooncakeStoreConfig):
        return attrs.evolve(config, global_segment_gb=0.0)
    if isinstance(config, TieredStoreConfig) and isinstance(config.backing, MooncakeStoreConfig):
        return attrs.evolve(config, backing=attrs.evolve(config.backing, global_segment_gb=0.0))
    return config


def _is_store(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    parse_store_config(value, attribute.name)


_is_store.allowed = "the settings of a posix, dram, tiered or mooncake store (above)"  # type: ignore[attr-defined]


def store_setting() -> Any:
    """The ``store`` field, for an engine adapter's settings class to reuse."""
    return setting(
        "The store: a dict with ``kind`` (posix, dram, tiered, mooncake) and its settings.",
        factory=PosixStoreConfig,
        validator=_is_store,
        metadata={"parse": parse_store_config},
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
    ("store (kind: posix)", PosixStoreConfig),
    ("store (kind: dram)", DramStoreConfig),
    ("store (kind: tiered)", TieredStoreConfig),
    ("store (kind: mooncake)", MooncakeStoreConfig),
    ("Hybrid models", HybridSettings),
]
