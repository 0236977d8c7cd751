"""The posix store: one file per block in a directory shared by processes and hosts.

- :mod:`.layout`: the directory as every process and ``ucm store`` see it (block names,
  the marker, scans, verification, LRU eviction on disk);
- :mod:`.capacity`: the capacity policy, pure (what fits, how far eviction goes, in which
  order);
- :mod:`.usage`: the count of what the store holds, shared by every process using it;
- :mod:`.fileio`: opening blocks safely, vectored and O_DIRECT reads and writes, hashed on
  the way, removals relative to folder descriptors;
- :mod:`.store`: :class:`PosixStore`, the store itself.
"""

from ucm.core.store.posix.layout import (
    BLOCKS_DIR,
    MARKER,
    NEEDS_SECRET,
    BlockFile,
    ScanResult,
    evict_lru,
    host_tag,
    read_marker,
    scan_store,
    verify_block_file,
)
from ucm.core.store.posix.store import PosixStore

__all__ = [
    "BLOCKS_DIR",
    "MARKER",
    "NEEDS_SECRET",
    "BlockFile",
    "PosixStore",
    "ScanResult",
    "evict_lru",
    "host_tag",
    "read_marker",
    "scan_store",
    "verify_block_file",
]
