"""The posix store's directory, as every process, every host and ``ucm store`` see it.

Directory layout::

    PATH/ucm-store.json          marker: format and last configured capacity
    PATH/usage, PATH/evicting    the count of what the store holds, and its locks (.usage)
    PATH/writers/HOST~PID~RAND   a process writing blocks, locked (flock) while it lives
    PATH/blocks/ab/ab12...ef     a block: header page + payload (block_format), mode 0600
    PATH/blocks/ab/.ab12...ef~HOST~PID~RAND.tmp   a block being written by that process

A block's file name is its key in hex, or in a signed store the keyed name of its key
(:meth:`ucm.core.signing.BlockSigner.name`).  A scan lists the blocks (name, size, recency),
the foreign files, and removes temporary files whose writer is gone: one of this host
whose writer's file in ``writers/`` is gone or no longer locked, or any older than
``stale_temp_seconds``.  A lock, unlike a process id, means the same in every PID namespace
of the host (containers sharing ``/dev/shm``), and the kernel drops it with its process.
Scans never follow links, and every removal walks the folders with ``O_NOFOLLOW`` from the
store's own descriptor.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Collection

import attrs
from ucm.core.block_format import (
    HEADER_BYTES,
    MAGIC,
    BlockFormatError,
    OtherVersion,
    SigningMismatch,
    check_payload,
    decode_header,
    payload_hasher,
)
from ucm.core.signing import BlockSigner
from ucm.core.store.posix.capacity import eviction_order
from ucm.core.store.posix.fileio import (
    O_BLOCK_READ,
    O_CLOEXEC,
    open_block,
    open_dir,
    read_hashing,
    unlink_in,
)

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
    inode: int = 0


@attrs.frozen
class ScanResult:
    blocks: list[BlockFile]
    foreign: list[str]  # files that are neither blocks nor our temporary files
    temps_removed: int

    @property
    def bytes(self) -> int:
        return sum(b.size for b in self.blocks)


WRITERS_DIR = "writers"


def register_writer(root_fd: int, host: str) -> tuple[str, int]:
    """This process as a writer of the store ``root_fd``: its id (``HOST~PID~RAND``) and the
    descriptor of its file in ``writers/``, locked until it is closed."""
    try:
        os.mkdir(WRITERS_DIR, 0o700, dir_fd=root_fd)
    except FileExistsError:
        pass
    writers = open_dir(WRITERS_DIR, root_fd)
    try:
        writer = f"{host}~{os.getpid()}~{secrets.token_hex(4)}"
        # Locked before it is published under its name: a scan never finds it unlocked
        # while its process lives.
        tmp = f".{writer}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | O_CLOEXEC, 0o600, dir_fd=writers)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(tmp, writer, src_dir_fd=writers, dst_dir_fd=writers)
        except BaseException:
            os.close(fd)
            os.unlink(tmp, dir_fd=writers)
            raise
        return writer, fd
    finally:
        os.close(writers)


def unregister_writer(root_fd: int, writer: str, fd: int) -> None:
    try:
        unlink_in(root_fd, f"{WRITERS_DIR}/{writer}")
    except OSError:
        pass
    os.close(fd)


def _writer_gone(writer: str, writers_fd: int | None) -> bool:
    """Whether the process ``writer`` of this host no longer writes the store."""
    if writers_fd is None:
        return True
    try:
        fd = os.open(writer, O_BLOCK_READ, dir_fd=writers_fd)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # held: the writer is alive (or locks are not supported here)
    finally:
        os.close(fd)
    return True


def _temp_is_stale(
    name: str, age: float, host: str, stale_seconds: float, writers_fd: int | None
) -> bool:
    """A temporary file is stale when it is older than ``stale_seconds``, or when its writer
    was a process of this host that is gone."""
    if age > stale_seconds:
        return True
    parts = name[1:-4].split("~")  # block name, host, pid, random
    return len(parts) == 4 and parts[1] == host and _writer_gone("~".join(parts[1:]), writers_fd)


def block_relative(name: str) -> str:
    """A block file's path within the store's folder."""
    return f"{BLOCKS_DIR}/{name[:2]}/{name}"


def scan_store(
    root: str,
    *,
    stale_temp_seconds: float = 3600.0,
    remove_temps: bool = True,
    folders: Collection[str] | None = None,
    blocks: bool = True,
) -> ScanResult:
    """Every block file under ``root``, or in the block folders named ``folders`` (``ab``
    of ``blocks/ab``: a sample of the store); removes stale temporary files on the way
    (unless ``remove_temps`` is false: a read-only store).  ``blocks`` false: only the
    temporary files are looked at (no block is stat'ed or listed in the result: a start-up
    that need not count the store lists its folders and nothing more)."""
    try:
        root_fd = open_dir(root)
    except (FileNotFoundError, NotADirectoryError):
        return ScanResult([], [], 0)
    try:
        return _scan(root, root_fd, stale_temp_seconds, remove_temps, folders, blocks)
    finally:
        os.close(root_fd)


def block_folders(root_fd: int) -> list[str]:
    """The names of the store's block folders (``ab`` of ``blocks/ab``), sorted."""
    try:
        blocks_fd = open_dir(BLOCKS_DIR, root_fd)
    except (FileNotFoundError, NotADirectoryError):
        return []
    try:
        return sorted(
            e.name
            for e in os.scandir(blocks_fd)
            if len(e.name) == 2 and _HEX.issuperset(e.name) and e.is_dir(follow_symlinks=False)
        )
    finally:
        os.close(blocks_fd)


def _scan(
    root: str,
    root_fd: int,
    stale_temp_seconds: float,
    remove_temps: bool,
    folders: Collection[str] | None = None,
    want_blocks: bool = True,
) -> ScanResult:
    blocks: list[BlockFile] = []
    foreign: list[str] = []
    removed = 0
    now = time.time()
    host = host_tag()
    for entry in os.scandir(root_fd):
        # a marker temp file of a writer killed mid-write
        if (
            remove_temps
            and entry.name.startswith(f".{MARKER}~")
            and now - entry.stat(follow_symlinks=False).st_mtime > 60
        ):
            try:
                os.unlink(entry.name, dir_fd=root_fd)
                removed += 1
            except FileNotFoundError:
                pass
    blocks_path = os.path.join(root, BLOCKS_DIR)
    try:
        blocks_fd = open_dir(BLOCKS_DIR, root_fd)
    except (FileNotFoundError, NotADirectoryError):
        return ScanResult([], [], 0)
    try:
        writers_fd: int | None = open_dir(WRITERS_DIR, root_fd)
    except (FileNotFoundError, NotADirectoryError):
        writers_fd = None
    try:
        if remove_temps and writers_fd is not None:
            _remove_gone_writers(writers_fd, host)
        subdirs = sorted(os.scandir(blocks_fd), key=lambda e: e.name)
        if folders is not None:
            subdirs = [e for e in subdirs if e.name in folders]
        for sub in subdirs:
            sub_path = f"{blocks_path}/{sub.name}"
            if not sub.is_dir(follow_symlinks=False) or len(sub.name) != 2:
                foreign.append(sub_path)
                continue
            try:
                sub_fd = open_dir(sub.name, blocks_fd)
            except FileNotFoundError:
                continue
            try:
                removed += _scan_folder(
                    sub_fd, sub.name, sub_path, blocks if want_blocks else None, foreign,
                    now, host, stale_temp_seconds, remove_temps, writers_fd,
                )  # fmt: skip
            finally:
                os.close(sub_fd)
    finally:
        os.close(blocks_fd)
        if writers_fd is not None:
            os.close(writers_fd)
    return ScanResult(blocks, foreign, removed)


def _remove_gone_writers(writers_fd: int, host: str) -> None:
    """Remove the files of this host's writers that are gone."""
    for entry in list(os.scandir(writers_fd)):
        parts = entry.name.split("~")
        if len(parts) == 3 and parts[0] == host and _writer_gone(entry.name, writers_fd):
            try:
                os.unlink(entry.name, dir_fd=writers_fd)
            except FileNotFoundError:
                pass


def _scan_folder(
    sub_fd: int,
    sub_name: str,
    sub_path: str,
    blocks: list[BlockFile] | None,
    foreign: list[str],
    now: float,
    host: str,
    stale_temp_seconds: float,
    remove_temps: bool,
    writers_fd: int | None,
) -> int:
    removed = 0
    for entry in list(os.scandir(sub_fd)):
        name = entry.name
        if blocks is None and not name.startswith("."):
            continue  # a block (or foreign) file, and no count wanted: not even stat'ed
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue  # evicted or renamed meanwhile
        if name.startswith(".") and name.endswith(".tmp"):
            if remove_temps and _temp_is_stale(
                name, now - st.st_mtime, host, stale_temp_seconds, writers_fd
            ):
                try:
                    os.unlink(name, dir_fd=sub_fd)
                    removed += 1
                except FileNotFoundError:
                    pass
            continue
        path = f"{sub_path}/{name}"
        if blocks is None:
            continue
        if is_block_name(name) and name[:2] == sub_name and entry.is_file(follow_symlinks=False):
            blocks.append(BlockFile(name, path, st.st_size, st.st_mtime_ns, st.st_ino))
        else:
            foreign.append(path)
    return removed


#: what :func:`verify_block_file` says of a signed block it was given no secret for
NEEDS_SECRET = "signed: give the store's secret (--secret) to check it"
#: the start of what it says of a block of another format version (not corrupt)
OTHER_VERSION = "format version"


def verify_block_file(path: str, signer: BlockSigner | None = None) -> str | None:
    """``None`` if the block file at ``path`` is whole and matches its name, else the problem
    (:data:`NEEDS_SECRET` for a signed block without ``signer``: not known to be bad).

    Reads the header page, then the payload in pieces: never more than the header says,
    never a buffer sized from the file."""
    name = os.path.basename(path)
    try:
        fd, st = open_block(path)
    except BlockFormatError as exc:
        return str(exc)
    except OSError as exc:
        return f"unreadable: {exc.strerror}"
    try:
        page = os.pread(fd, HEADER_BYTES, 0)
        if len(page) < HEADER_BYTES:
            raise BlockFormatError(
                f"file truncated: {len(page)} bytes, header alone is {HEADER_BYTES}"
            )
        try:
            header = decode_header(page, signer=signer)
        except SigningMismatch:
            if signer is None:
                return NEEDS_SECRET
            raise
        except OtherVersion as exc:
            return str(exc)  # starts with OTHER_VERSION
        named = header.key if signer is None else signer.name(header.key)
        if named.hex() != name:
            raise BlockFormatError(f"header names key {header.key.hex()}, not this file's")
        if st.st_size < HEADER_BYTES + header.payload_len:
            raise BlockFormatError(f"file truncated: payload of {header.payload_len} bytes")
        hasher = payload_hasher(header, signer)
        piece = memoryview(bytearray(min(header.payload_len, 4 << 20)))
        done = 0
        while done < header.payload_len:
            part = piece[: min(piece.nbytes, header.payload_len - done)]
            read_hashing(fd, [part], HEADER_BYTES + done, hasher)
            done += part.nbytes
        check_payload(header, hasher)
    except BlockFormatError as exc:
        return str(exc)
    except OSError as exc:
        return f"unreadable: {exc.strerror}"
    finally:
        os.close(fd)
    return None


def block_version(path: str) -> int | None:
    """The format version a block file's header names (``None``: not a UCM block)."""
    try:
        fd, _ = open_block(path)
    except (OSError, BlockFormatError):
        return None
    try:
        head = os.pread(fd, 6, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(head) < 6 or head[:4] != MAGIC:
        return None
    return int.from_bytes(head[4:6], "little")


#: a marker is a few dozen bytes; more is not one of ours
_MARKER_MAX_BYTES = 4096


def read_marker(root: str) -> dict[str, object]:
    """The marker's settings, ``{}`` if it is missing or not a marker UCM wrote."""
    try:
        fd, _ = open_block(os.path.join(root, MARKER))
    except (OSError, BlockFormatError):
        return {}
    try:
        text = os.read(fd, _MARKER_MAX_BYTES + 1)
    except OSError:
        return {}
    finally:
        os.close(fd)
    if len(text) > _MARKER_MAX_BYTES:
        return {}
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
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
    scan: ScanResult,
    target_bytes: int,
    root_fd: int,
    *,
    skip: frozenset[str] | set[str] = frozenset(),
    dry_run: bool = False,
    stop: Callable[[], bool] | None = None,
    gone: Callable[[int, int], None] | None = None,
    names: list[str] | None = None,
) -> tuple[int, int]:
    """Delete least recently used blocks of the store ``root_fd`` (a descriptor of its
    folder) until at most ``target_bytes`` remain (``dry_run``: only count them; ``stop``:
    asked before each removal, true ends the pass at once, as when the store closes;
    ``gone(bytes, blocks)``: told what was removed every :data:`GONE_EVERY` blocks and at
    the end, so that writers waiting for room need not wait for the whole pass; ``names``:
    given the name of each block removed).

    Returns (bytes remaining, blocks remaining): what the scan found, less what this pass
    removed (a block another process removed meanwhile is that process's to count)."""
    total = scan.bytes
    count = len(scan.blocks)
    pending = [0, 0]
    folders = _PassFolders(root_fd)
    try:
        for block in eviction_order(scan.blocks, skip):
            if total <= target_bytes or (stop is not None and stop()):
                break
            try:
                if not dry_run and not folders.unlink(block.name, block.inode or None):
                    # gone since the scan (another process removed it, and counted that)
                    # or replaced by a new file: not this pass's removal to count
                    continue
            except OSError as exc:
                log.warning("ucm posix store: cannot evict %s: %s", block.path, exc.strerror)
                continue
            total -= block.size
            count -= 1
            if names is not None:
                names.append(block.name)
            pending[0] += block.size
            pending[1] += 1
            if gone is not None and pending[1] >= GONE_EVERY:
                gone(*pending)
                pending = [0, 0]
    finally:
        folders.close()
    if gone is not None and pending[1]:
        gone(*pending)
    return total, count


class _PassFolders:
    """The block folders one eviction pass removes from, each opened once (without following
    a link) at its first removal: a removal is then a stat and an unlink relative to it,
    not a walk of the path (six calls a block before)."""

    def __init__(self, root_fd: int) -> None:
        self._root_fd = root_fd
        self._blocks = -1
        self._open: dict[str, int] = {}

    def unlink(self, name: str, inode: int | None) -> bool:
        """Remove block ``name`` if it is still the file ``inode`` (None: whatever it is)."""
        try:
            folder = self._open.get(name[:2])
            if folder is None:
                if self._blocks < 0:
                    self._blocks = open_dir(BLOCKS_DIR, self._root_fd)
                folder = self._open[name[:2]] = open_dir(name[:2], self._blocks)
            if (
                inode is not None
                and os.stat(name, dir_fd=folder, follow_symlinks=False).st_ino != inode
            ):
                return False
            os.unlink(name, dir_fd=folder)
            return True
        except FileNotFoundError:
            return False

    def close(self) -> None:
        for fd in self._open.values():
            os.close(fd)
        if self._blocks >= 0:
            os.close(self._blocks)
        self._open.clear()
        self._blocks = -1


#: blocks an eviction pass removes between two reports of what it freed
GONE_EVERY = 32
