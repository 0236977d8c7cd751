"""Where a host-scope dram store may live: on a memory filesystem (tmpfs, ramfs) large
enough for its capacity, found from the mount table (a folder on a disk would make every
block a disk write, and a container's 64 MiB ``/dev/shm`` fails as soon as it fills)."""

from __future__ import annotations

import os

from ucm.core.settings import GIB, ConfigError
from ucm.core.store.folder import nearest_existing

#: filesystems whose files live in RAM
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})
MOUNTINFO = "/proc/self/mountinfo"


def check_memory_filesystem(path: str, capacity_bytes: int) -> None:
    """Raise a ``ConfigError`` unless ``path`` lies on a memory filesystem that can hold
    ``capacity_bytes``."""
    # a dangling link at the path: judged by where it points (check_store_folder refuses it)
    existing = nearest_existing(os.path.realpath(nearest_existing(path)))
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
