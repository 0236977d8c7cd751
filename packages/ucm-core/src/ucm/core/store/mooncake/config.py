"""The mooncake store's settings."""

from __future__ import annotations

import os
from typing import Any

import attrs
from ucm.core.settings import (
    GIB,
    MAX_GIB,
    MAX_SECONDS,
    ConfigError,
    instance_of,
    int_in_range,
    non_empty_str,
    number_up_to,
    one_of,
    optional,
    seconds,
    setting,
)
from ucm.core.signing import secret_reference
from ucm.core.store.kinds import StoreSettings
from ucm.core.store.split import FA_SUBDIR, WA_SUBDIR, split_gb

#: What a master setting of highly available masters starts with.
ETCD_SCHEME = "etcd://"


def _master(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, str) and _parse_master(value):
        return
    raise ConfigError(
        attribute.name,
        "must be HOST:PORT (one master), or etcd://HOST:PORT[;HOST:PORT...] (the etcd "
        f"endpoints of highly available masters), ports 1-65535; got {value!r}",
    )


def _parse_master(value: str) -> list[tuple[str, int]] | None:
    """The master's address, or etcd's endpoints for ``etcd://``; None if malformed."""
    if not value.startswith(ETCD_SCHEME):
        one = parse_host_port(value)
        return None if one is None else [one]
    endpoints = [parse_host_port(e) for e in value[len(ETCD_SCHEME) :].split(";")]
    if not endpoints or None in endpoints:
        return None
    return endpoints  # type: ignore[return-value]


def parse_host_port(value: str) -> tuple[str, int] | None:
    host, sep, port = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    if any(c.isspace() for c in host) or "/" in host:
        return None
    return host, int(port)


_master.allowed = (  # type: ignore[attr-defined]
    "`HOST:PORT` (an IPv6 host in brackets), or `etcd://HOST:PORT[;HOST:PORT...]`"
)


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


@attrs.frozen
class MooncakeStoreConfig(StoreSettings):
    """A Mooncake Store cluster: blocks in the DRAM that its clients contribute, shared by
    every host that reaches its master (see Running across machines)."""

    STORE = "ucm.core.store.mooncake.store:MooncakeStore"  # imports Mooncake's client

    kind: str = setting("Store kind.", default="mooncake", validator=one_of("mooncake"))
    master: str = setting(
        "The master's RPC address, HOST:PORT (mooncake_master --rpc_port); or, for highly "
        "available masters (mooncake_master --enable_ha), etcd://HOST:PORT[;HOST:PORT...]: "
        "the etcd endpoints they elect their leader through (the client follows the leader).",
        default="127.0.0.1:50051",
        validator=_master,
    )
    cluster_id: str = setting(
        "The highly available masters' cluster (mooncake_master --cluster_id): which leader "
        "an etcd:// master setting follows.  Unused with a HOST:PORT master.",
        default="mooncake_cluster",
        validator=_key_prefix,
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
        validator=number_up_to(MAX_GIB, zero=True, unit="GiB"),
    )
    local_buffer_mb: float = setting(
        "MiB of registered memory the Mooncake client keeps for its own transfers.",
        default=16.0,
        validator=number_up_to(MAX_GIB, unit="MiB"),
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
        validator=seconds,
    )
    probe_interval_s: float = setting(
        "Seconds between probes of a master that is down.",
        default=0.5,
        validator=number_up_to(MAX_SECONDS, unit="s"),
    )
    io_threads: int | None = setting(
        "Threads issuing transfers, each moving up to 128 blocks per call. null: one per two "
        "CPU cores this process may run on, at least 1 and at most 8 (each transfer keeps a "
        "core busy copying, and so does the peer it talks to).",
        default=None,
        validator=optional(int_in_range(1, 64)),
    )

    secret: str | None = setting(
        "Sign every block with a deployment secret (``env:NAME`` or ``file:PATH``): object "
        "names are keyed by it and a block without a valid MAC is a miss, so a client of "
        "the master without the secret can neither read a prompt's block by name nor plant "
        "one. Set it wherever clients you do not control reach the master (see Security).",
        default=None,
        validator=secret_reference,
    )
    tenant_id: str | None = setting(
        "Mooncake tenant of this client (masters started with --enable_multi_tenants keep "
        "each tenant's keys and quota apart). Any client may claim any tenant: it separates "
        "deployments, it does not authenticate them. null: Mooncake's default tenant.",
        default=None,
        validator=optional(_key_prefix),
    )

    @property
    def io_thread_count(self) -> int:
        if self.io_threads is not None:
            return self.io_threads
        return min(8, max(1, len(os.sched_getaffinity(0)) // 2))

    @property
    def highly_available(self) -> bool:
        """Whether ``master`` names etcd's endpoints rather than one master."""
        return self.master.startswith(ETCD_SCHEME)

    @property
    def master_endpoints(self) -> list[tuple[str, int]]:
        """The master's (host, port), or etcd's endpoints when ``highly_available``."""
        parsed = _parse_master(self.master)
        assert parsed is not None  # validated
        return parsed

    @property
    def master_view_key(self) -> str:
        """etcd's key holding the leader's HOST:PORT (Mooncake's ``MasterViewHelper``)."""
        return f"mooncake-store/{self.cluster_id}/master_view"

    @property
    def global_segment_bytes(self) -> int:
        return int(self.global_segment_gb * GIB)

    @property
    def local_buffer_bytes(self) -> int:
        return int(self.local_buffer_mb * (1 << 20))

    def split(self, wa_fraction: float) -> tuple[MooncakeStoreConfig, MooncakeStoreConfig]:
        """Hybrid models: key prefixes ``fa/`` and ``wa/``.  Mooncake evicts over the whole
        pool, so the split is by key prefix; the segment this process gives the pool is
        split like a capacity (0 stays 0: a pure client)."""
        fa_gb, wa_gb = (0.0, 0.0)
        if self.global_segment_gb:
            fa_gb, wa_gb = split_gb(self.global_segment_gb, wa_fraction)
        return (
            attrs.evolve(
                self, key_prefix=f"{self.key_prefix}{FA_SUBDIR}/", global_segment_gb=fa_gb
            ),
            attrs.evolve(
                self, key_prefix=f"{self.key_prefix}{WA_SUBDIR}/", global_segment_gb=wa_gb
            ),
        )

    def for_lookups_only(self) -> MooncakeStoreConfig:
        """A process that only looks blocks up (vLLM's scheduler) gives the cluster no
        memory: nothing it writes would need it."""
        return attrs.evolve(self, global_segment_gb=0.0)

    def summary(self) -> str:
        signed = ", signed" if self.secret else ""
        pool = f"{self.global_segment_gb:g} GiB given to the pool"
        return f"mooncake at {self.master} ({pool}{signed})"
