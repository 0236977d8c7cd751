"""The posix store's directory, as every process, every host and ``ucm store`` see it.

Directory layout::

    PATH/ucm-store.json          marker: format and last configured capacity
    PATH/blocks/ab/ab12...ef     a block: header page + payload (block_format), mode 0600
    PATH/blocks/ab/.ab12...ef~HOST~PID~RAND.tmp   a block being written

A scan lists the blocks (name, size, recency), the foreign files, and removes temporary
files whose writer is dead (same host) or that are older than ``stale_temp_seconds``.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import time

import attrs
from ucm.core.block_format import HEADER_BYTES, BlockFormatError, decode_header, verify_payload
from ucm.core.store.posix.capacity import eviction_order
from ucm.core.store.posix.fileio import O_CLOEXEC

log = logging.getLogger(__name__)

MARKER = "ucm-store.json"
BLOCKS_DIR = "blocks"
_HEX = frozenset("0123456789abcdef")


def is_block_name(name: str) -> bool:
    return len(name) == 32 and _HEX.issuperset(name)


def host_tag() -> str:
    return socket.gethostname().replace("~", "-").replace("/", "-") or "localhost"


@attrs.frozen
class BlockFile:
    name: str  # the key in hex
    path: str
    size: int
    mtime_ns: int


@attrs.frozen
class ScanResult:
    blocks: list[BlockFile]
    foreign: list[str]  # files that are neither blocks nor our temporary files
    temps_removed: int

    @property
    def bytes(self) -> int:
        return sum(b.size for b in self.blocks)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _temp_is_stale(name: str, mtime: float, now: float, host: str, stale_seconds: float) -> bool:
    """A temporary file is stale when its writer is dead (same host) or it is too old."""
    if now - mtime > stale_seconds:
        return True
    parts = name[1:].split("~")
    if len(parts) == 4 and parts[1] == host and parts[2].isdigit():
        return int(parts[2]) != os.getpid() and not pid_alive(int(parts[2]))
    return False


def scan_store(
    root: str, *, stale_temp_seconds: float = 3600.0, remove_temps: bool = True
) -> ScanResult:
    """Every block file under ``root``; removes stale temporary files on the way (unless
    ``remove_temps`` is false: a read-only store)."""
    blocks_dir = os.path.join(root, BLOCKS_DIR)
    blocks: list[BlockFile] = []
    foreign: list[str] = []
    removed = 0
    now = time.time()
    host = host_tag()
    for entry in os.scandir(root) if os.path.isdir(root) else ():
        # a marker temp file of a writer killed mid-write
        if (
            remove_temps
            and entry.name.startswith(f".{MARKER}~")
            and now - entry.stat().st_mtime > 60
        ):
            try:
                os.unlink(entry.path)
                removed += 1
            except FileNotFoundError:
                pass
    try:
        subdirs = sorted(os.scandir(blocks_dir), key=lambda e: e.name)
    except FileNotFoundError:
        return ScanResult([], [], 0)
    for sub in subdirs:
        if not sub.is_dir(follow_symlinks=False) or len(sub.name) != 2:
            foreign.append(sub.path)
            continue
        try:
            entries = list(os.scandir(sub.path))
        except FileNotFoundError:
            continue
        for entry in entries:
            name = entry.name
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # evicted or renamed meanwhile
            if name.startswith(".") and name.endswith(".tmp"):
                if remove_temps and _temp_is_stale(
                    name, st.st_mtime, now, host, stale_temp_seconds
                ):
                    try:
                        os.unlink(entry.path)
                        removed += 1
                    except FileNotFoundError:
                        pass
                continue
            if (
                is_block_name(name)
                and name[:2] == sub.name
                and entry.is_file(follow_symlinks=False)
            ):
                blocks.append(BlockFile(name, entry.path, st.st_size, st.st_mtime_ns))
            else:
                foreign.append(entry.path)
    return ScanResult(blocks, foreign, removed)


def verify_block_file(path: str) -> str | None:
    """``None`` if the block file at ``path`` is whole and matches its name, else the problem."""
    name = os.path.basename(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        return f"unreadable: {exc.strerror}"
    try:
        if len(data) < HEADER_BYTES:
            raise BlockFormatError(
                f"file truncated: {len(data)} bytes, header alone is {HEADER_BYTES}"
            )
        header = decode_header(data[:HEADER_BYTES], expect_key=bytes.fromhex(name))
        payload = memoryview(data)[HEADER_BYTES : HEADER_BYTES + header.payload_len]
        verify_payload(header, payload)
    except BlockFormatError as exc:
        return str(exc)
    return None


def read_marker(root: str) -> dict[str, object]:
    try:
        with open(os.path.join(root, MARKER), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_marker(root: str, capacity_bytes: int | None) -> None:
    data = read_marker(root)
    # The capacity last configured, for `ucm store stats`; None: no limit.
    wanted = {"format": "ucm-posix-store", "version": 1, "capacity_bytes": capacity_bytes}
    if all(data.get(k) == v for k, v in wanted.items()):
        return
    data.update(wanted)
    tmp = os.path.join(root, f".{MARKER}~{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, os.path.join(root, MARKER))
    except BaseException:
        os.unlink(tmp)
        raise


def evict_lru(
    scan: ScanResult, target_bytes: int, *, skip: frozenset[str] | set[str] = frozenset()
) -> tuple[int, int]:
    """Delete least recently used blocks until at most ``target_bytes`` remain.

    Returns (bytes remaining, blocks remaining)."""
    total = scan.bytes
    count = len(scan.blocks)
    for block in eviction_order(scan.blocks, skip):
        if total <= target_bytes:
            break
        try:
            os.unlink(block.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("ucm posix store: cannot evict %s: %s", block.path, exc.strerror)
            continue
        total -= block.size
        count -= 1
    return total, count
