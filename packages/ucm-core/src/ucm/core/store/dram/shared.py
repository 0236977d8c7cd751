"""The dram store's host scope: blocks in shared memory, seen by every process on the host.

An engine's lookups and its loads may run in different processes (vLLM asks its scheduler
process what is stored and moves blocks in its worker processes), and users expect host
memory to survive an engine restart.  Memory private to one process gives neither, so the
host-scope dram store is a posix store on a memory filesystem (tmpfs, ``/dev/shm``): the same
block files with their header and checksum verified on every load, the capacity with least
recently used blocks evicted, a block published only once whole (a writer killed mid-block
leaves nothing a reader would take), sharing across processes, and ``ucm store`` to inspect
it.  What changes is the medium: reads and writes are copies from and to RAM.
"""

from __future__ import annotations

import os

from ucm.core.settings import GIB, ConfigError
from ucm.core.store.dram.config import DramStoreConfig
from ucm.core.store.folder import nearest_existing
from ucm.core.store.posix.config import PosixStoreConfig
from ucm.core.store.posix.store import PosixStore

#: filesystems whose files live in RAM
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})
MOUNTINFO = "/proc/self/mountinfo"


class SharedMemoryStore(PosixStore):
    """A ``dram`` store of scope ``host``: a posix store in ``config.path`` on a memory
    filesystem, refused at start-up where the path is on a disk or the filesystem is smaller
    than the capacity."""

    def __init__(self, config: DramStoreConfig) -> None:
        check_memory_filesystem(config.path, config.capacity_bytes)
        self.dram_config = config
        super().__init__(
            PosixStoreConfig(path=config.path, capacity_gb=config.capacity_gb, secret=config.secret)
        )

    @property
    def reads_from_memory(self) -> bool:
        return True  # files on a memory filesystem


def check_memory_filesystem(path: str, capacity_bytes: int) -> None:
    """Raise a ``ConfigError`` unless ``path`` lies on a memory filesystem that can hold
    ``capacity_bytes``."""
    existing = os.path.realpath(nearest_existing(path))
    found = mount_of(existing)
    if found is None:
        raise ConfigError(
            "store.scope",
            f"cannot tell which filesystem holds {path} (no {MOUNTINFO}): scope 'host' needs "
            "Linux shared memory; use scope 'process'",
        )
    mount_point, fstype = found
    if fstype not in MEMORY_FILESYSTEMS:
        raise ConfigError(
            "store.path",
            f"{path} is on a {fstype} filesystem ({mount_point}), not in memory: a dram store "
            "needs a memory filesystem such as /dev/shm (for a disk, use kind 'posix')",
        )
    stat = os.statvfs(existing)
    size = stat.f_blocks * stat.f_frsize
    if size < capacity_bytes:
        raise ConfigError(
            "store.capacity_gb",
            f"{capacity_bytes / GIB:g} GiB does not fit in {mount_point}, which holds "
            f"{size / GIB:.3g} GiB in all (a container's /dev/shm is 64 MiB unless it is "
            "started with a larger --shm-size): lower capacity_gb or enlarge the filesystem",
        )


def mount_of(path: str) -> tuple[str, str] | None:
    """The (mount point, filesystem type) of the mount holding the existing ``path``, or
    None where the mount table cannot be read."""
    try:
        with open(MOUNTINFO) as table:
            lines = table.read().splitlines()
    except OSError:
        return None
    best: tuple[str, str] | None = None
    for line in lines:
        fields = line.split()
        if "-" not in fields:
            continue
        mount_point = _unescape(fields[4])
        fstype = fields[fields.index("-") + 1]
        inside = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
        if inside and (best is None or len(mount_point) >= len(best[0])):
            best = (mount_point, fstype)  # the last of equal mount points is the one on top
    return best


def _unescape(field: str) -> str:
    """A mountinfo path: spaces, tabs, newlines and backslashes are written in octal."""
    for octal, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(octal, char)
    return field
