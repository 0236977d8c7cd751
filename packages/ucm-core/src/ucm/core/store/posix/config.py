"""The posix store's settings."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import attrs
from ucm.core.settings import (
    boolean,
    fraction,
    gib_to_bytes,
    int_in_range,
    non_empty_str,
    one_of,
    optional,
    optional_positive_number,
    positive_number,
    setting,
)
from ucm.core.store.split import in_subfolders, split_gb

if TYPE_CHECKING:
    from ucm.core.store.base import Store


def default_store_path() -> str:
    """``$XDG_CACHE_HOME/ucm``, or ``~/.cache/ucm`` when that is unset."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ucm")


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

    def open(self) -> Store:
        from ucm.core.store.posix.store import PosixStore

        return PosixStore(self)

    def split(self, wa_fraction: float) -> tuple[PosixStoreConfig, PosixStoreConfig]:
        """Hybrid models: subdirectories ``fa`` and ``wa``, the capacity split (no limit
        stays no limit)."""
        fa_gb: float | None = None
        wa_gb: float | None = None
        if self.capacity_gb is not None:
            fa_gb, wa_gb = split_gb(self.capacity_gb, wa_fraction)
        return in_subfolders(self, fa_gb, wa_gb)

    def for_lookups_only(self) -> PosixStoreConfig:
        return self
