"""The posix store's settings."""

from __future__ import annotations

import os
from typing import Any

import attrs
from ucm.core.settings import (
    GIB,
    MAX_SECONDS,
    ConfigError,
    boolean,
    fraction,
    gib_to_bytes,
    int_in_range,
    non_empty_str,
    number_up_to,
    one_of,
    optional,
    setting,
    size_gib,
)
from ucm.core.signing import secret_reference
from ucm.core.store.kinds import StoreSettings
from ucm.core.store.split import in_subfolders, split_gb


def default_store_path() -> str:
    """``$XDG_CACHE_HOME/ucm``, or ``~/.cache/ucm`` when that is unset."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ucm")


#: ``capacity_gb`` that sizes the store from its filesystem's free space
AUTO = "auto"
#: the share of the free space (its own blocks included) an ``auto`` store takes
AUTO_SHARE = 0.5


def _capacity(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None or value == AUTO:
        return
    size_gib(inst, attribute, value)


_capacity.allowed = "`auto`, null, or a number in (0, 1.07374e+09] GiB"  # type: ignore[attr-defined]


def auto_capacity_bytes(path: str) -> int:
    """Half of what the filesystem holding ``path`` has free, counting the blocks of a store
    already at ``path`` as free (so that the capacity does not shrink as the store fills)."""
    # here, not at the top: the posix package imports this module first
    from ucm.core.store.folder import nearest_existing
    from ucm.core.store.posix.usage import peek

    st = os.statvfs(nearest_existing(path))
    own, _ = peek(path)
    return int(AUTO_SHARE * (st.f_bavail * st.f_frsize + own))


@attrs.frozen
class PosixStoreConfig(StoreSettings):
    """A directory on a local disk or a shared mount (NFS, 3FS, ...): the embedded default."""

    STORE = "ucm.core.store.posix.store:PosixStore"
    FOLDER = "ucm.core.store.posix.folder_tools:PosixFolder"

    kind: str = setting("Store kind.", default="posix", validator=one_of("posix"))
    path: str = setting(
        "Directory of the store; created (mode 0700) if missing. Several processes may share "
        "it; it must be writable by its user alone unless ``shared`` (see Security).",
        factory=default_store_path,
        validator=non_empty_str,
    )
    capacity_gb: float | str | None = setting(
        "Size limit in GiB (2^30 bytes); least recently used blocks are evicted beyond it. "
        "'auto': half of what the filesystem has free for the store when it opens (its own "
        "blocks counted as free), logged, so that a store nobody sized never fills its disk. "
        "null: no limit.",
        default=AUTO,
        validator=_capacity,
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
        "Share of the capacity that one eviction pass frees beyond what is over the limit; "
        "a pass runs in the background once less than this is free, and lists a sample of "
        "the store four times as large (its oldest blocks go), so its cost follows this, "
        "not the store's size.",
        default=0.01,
        validator=fraction,
    )
    stale_temp_seconds: float = setting(
        "Age after which a temporary file left by a writer on another host is removed "
        "(on this host, a writer's file goes once its lock is free).",
        default=3600.0,
        validator=number_up_to(MAX_SECONDS, low=60.0, zero=True, unit="s"),
    )
    shared: bool = setting(
        "The folder is meant to be written by other users or hosts (a team's shared mount): "
        "its owner and mode are not checked, and ``secret`` is required so that only blocks "
        "written with the secret are loaded.",
        default=False,
        validator=boolean,
    )
    secret: str | None = setting(
        "Sign every block with a deployment secret, read from ``env:NAME`` (an environment "
        "variable) or ``file:PATH`` (a file readable by its owner only): block names are "
        "keyed by it and a block without a valid MAC is a miss. null: blocks are checked by "
        "checksum only (see Security).",
        default=None,
        validator=secret_reference,
    )

    def __attrs_post_init__(self) -> None:
        if self.shared and self.secret is None:
            raise ConfigError(
                "secret",
                "a shared store needs a secret (env:NAME or file:PATH): without one, anyone "
                "who can write the folder decides what your engine loads",
            )

    @property
    def capacity_bytes(self) -> int | None:
        """The limit in bytes (``auto``: worked out from the filesystem now)."""
        if self.capacity_gb == AUTO:
            return auto_capacity_bytes(os.path.expanduser(self.path))
        return gib_to_bytes(self.capacity_gb)  # type: ignore[arg-type]

    @property
    def io_thread_count(self) -> int:
        """``io_threads``, or the number it stands for when null."""
        if self.io_threads is not None:
            return self.io_threads
        return min(8, max(2, len(os.sched_getaffinity(0))))

    def split(self, wa_fraction: float) -> tuple[PosixStoreConfig, PosixStoreConfig]:
        """Hybrid models: subdirectories ``fa`` and ``wa``, the capacity split (no limit
        stays no limit)."""
        fa_gb: float | None = None
        wa_gb: float | None = None
        capacity = self.capacity_bytes  # 'auto' is worked out once, for both
        if capacity is not None:
            fa_gb, wa_gb = split_gb(capacity / GIB, wa_fraction)
        return in_subfolders(self, fa_gb, wa_gb)

    def summary(self) -> str:
        size = self.capacity_gb
        limit = (
            "no capacity limit"
            if size is None
            else "capacity auto"
            if size == AUTO
            else f"capacity {size:g} GiB"
        )
        return f"posix at {self.path} ({limit}{', signed' if self.secret else ''})"
