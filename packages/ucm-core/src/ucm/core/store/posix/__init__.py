"""The posix store: one file per block in a directory shared by processes and hosts.

- :mod:`.layout`: the directory as every process and ``ucm store`` see it (block names,
  the marker, scans, verification, LRU eviction on disk);
- :mod:`.capacity`: the capacity policy, pure (what fits, how far eviction goes, in which
  order);
- :mod:`.fileio`: vectored and O_DIRECT reads and writes, hashed on the way;
- :mod:`.store`: :class:`PosixStore`, the store itself.
"""

from ucm.core.store.posix.layout import (
    BLOCKS_DIR,
    MARKER,
    BlockFile,
    ScanResult,
    evict_lru,
    host_tag,
    pid_alive,
    read_marker,
    scan_store,
    verify_block_file,
)
from ucm.core.store.posix.store import PosixStore

__all__ = [
    "BLOCKS_DIR",
    "MARKER",
    "BlockFile",
    "PosixStore",
    "ScanResult",
    "evict_lru",
    "host_tag",
    "pid_alive",
    "read_marker",
    "scan_store",
    "verify_block_file",
]
