"""The dram store's settings (both scopes: host shared memory and one process's own)."""

from __future__ import annotations

import os

import attrs
from ucm.core.settings import (
    GIB,
    ConfigError,
    boolean,
    int_in_range,
    non_empty_str,
    one_of,
    setting,
    size_gib,
)
from ucm.core.signing import secret_reference
from ucm.core.store.kinds import StoreSettings
from ucm.core.store.split import in_subfolders, split_gb


def default_shared_memory_path() -> str:
    """Where a host-scope dram store lives unless told: ``/dev/shm/ucm-<uid>``, in the shared
    memory every Linux host mounts, one folder per user (a folder of one name for all would
    be open to whoever made it first)."""
    return f"/dev/shm/ucm-{os.geteuid()}"


@attrs.frozen
class DramStoreConfig(StoreSettings):
    """Host memory, least recently used blocks evicted beyond the capacity.  By default
    shared memory (a folder on a memory filesystem, ``/dev/shm``): every process on the host
    that opens the same path shares the blocks (vLLM's scheduler and its workers, engines
    side by side, the next engine after a restart), with the posix store's promises."""

    STORE = "ucm.core.store.dram:open_store"
    FOLDER = "ucm.core.store.dram.folder_tools:ArenaFolder"

    kind: str = setting("Store kind.", default="dram", validator=one_of("dram"))
    capacity_gb: float = setting("Size limit in GiB (2^30 bytes).", default=4.0, validator=size_gib)
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
        "missing, and refused if another user can write it.  Give each set of engines that "
        "must not share blocks its own. Default: ``/dev/shm/ucm-<uid>``.",
        factory=default_shared_memory_path,
        validator=non_empty_str,
    )
    preallocate: bool = setting(
        "Map and fault in the whole capacity at start-up, so that no dump pays for fresh "
        "pages (costs start-up time and commits the memory at once). Process scope only.",
        default=False,
        validator=boolean,
    )

    threads: int = setting(
        "Threads that copy blocks into and out of shared memory, each taking whole blocks "
        "of a batch (copies and checksums release the GIL, so they overlap across cores). "
        "On a GPU host with cores to spare, 4 lets the checksums keep up with the GPU's "
        "copies (FastDeploy's 4 MiB blocks: 14-17 GB/s with 2, 20-21 with 4, on an H100). "
        "Host scope only.",
        default=2,
        validator=int_in_range(1, 64),
    )
    secret: str | None = setting(
        "Sign every block with a deployment secret (``env:NAME`` or ``file:PATH``), as the "
        "posix store's ``secret``. Host scope only.",
        default=None,
        validator=secret_reference,
    )

    def __attrs_post_init__(self) -> None:
        if self.preallocate and self.scope == "host":
            raise ConfigError(
                "preallocate", "applies to scope 'process' only (shared memory is the tmpfs's)"
            )
        if self.scope == "process":
            if self.path != default_shared_memory_path():
                raise ConfigError("path", "applies to scope 'host' only (process memory has none)")
            if self.threads != attrs.fields(DramStoreConfig).threads.default:
                raise ConfigError("threads", "applies to scope 'host' only")
            if self.secret is not None:
                raise ConfigError(
                    "secret", "applies to scope 'host' only (no other process sees this memory)"
                )

    @property
    def capacity_bytes(self) -> int:
        return int(self.capacity_gb * GIB)

    def split(self, wa_fraction: float) -> tuple[DramStoreConfig, DramStoreConfig]:
        """Hybrid models: the capacity split (and, in shared memory, the path)."""
        fa_gb, wa_gb = split_gb(self.capacity_gb, wa_fraction)
        if self.scope == "process":
            return attrs.evolve(self, capacity_gb=fa_gb), attrs.evolve(self, capacity_gb=wa_gb)
        return in_subfolders(self, fa_gb, wa_gb)

    def summary(self) -> str:
        signed = ", signed" if self.secret else ""
        return f"dram at {self.path} (capacity {self.capacity_gb:g} GiB{signed})"

    @property
    def in_host_memory(self) -> bool:
        return True
