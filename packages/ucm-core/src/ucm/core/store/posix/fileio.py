"""The posix store's file I/O: opening a block without trusting what is at its path,
vectored writes and reads that fill a block's parts in place, reads hashed piece by piece
while each piece is still in the CPU cache (a chunk of blocks in one compiled call:
:func:`read_blocks`), the per-thread buffers, and removals relative to directory
descriptors."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import itertools
import mmap
import os
import stat
import threading
from collections.abc import Sequence
from typing import Any

from ucm.core.block_format import HEADER_BYTES, BlockFormatError
from ucm.core.digest import Digest
from ucm.core.native import NATIVE
from ucm.core.store.payload import address_of

ALIGN = 4096  # O_DIRECT's alignment of offsets, sizes and buffers
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_DIRECT = getattr(os, "O_DIRECT", 0)
#: How every block is opened for reading.  Whatever sits at a block's path came from a
#: folder others may have written: a link is not followed, and a FIFO or a device opens
#: without waiting for a writer (and is then refused by :func:`open_block`).
O_BLOCK_READ = os.O_RDONLY | O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
_O_DIR = os.O_RDONLY | O_CLOEXEC | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)


class NotABlock(BlockFormatError):
    """What is at a block's path is not a regular file (a link, a FIFO, a device...)."""


class NotAFolder(OSError):
    """What is at a block folder's path is not a folder of the store (a link, a file)."""


def open_block(
    path: str, extra_flags: int = 0, dir_fd: int | None = None
) -> tuple[int, os.stat_result]:
    """A block file opened for reading (``path`` relative to ``dir_fd`` if given), and its
    status; ``FileNotFoundError`` if absent, :class:`NotABlock` if it is not a regular file
    (a link at the path included)."""
    try:
        # extra flags (O_DIRECT) only once it is known to be a file: a FIFO refuses them
        fd = os.open(path, O_BLOCK_READ, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link
            raise NotABlock("a symbolic link, not a block file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotABlock(f"not a regular file (mode {st.st_mode:#o})")
        if extra_flags:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | extra_flags)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def open_dir(name: str, dir_fd: int | None = None) -> int:
    """A directory opened for ``*at`` calls, never through a link."""
    return os.open(name, _O_DIR, dir_fd=dir_fd)


def open_block_folder(blocks_fd: int, name: str, *, create: bool) -> int:
    """The block folder ``name`` under ``blocks/`` (``blocks_fd``), opened for ``*at``
    calls and never through a link; made (0700) where absent if ``create``.
    ``FileNotFoundError`` where absent, :class:`NotAFolder` where something else lies
    there (another user who can write a shared folder may have put a link there: whatever
    it points at is never written)."""
    try:
        return _open_folder(blocks_fd, name)
    except FileNotFoundError:
        if not create:
            raise
    try:
        os.mkdir(name, 0o700, dir_fd=blocks_fd)
    except FileExistsError:
        pass  # made meanwhile by another writer (or something else: refused below)
    return _open_folder(blocks_fd, name)


def _open_folder(blocks_fd: int, name: str) -> int:
    try:
        return open_dir(name, blocks_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotAFolder(
                exc.errno, f"blocks/{name} is not a folder of the store (a link or a file)"
            ) from None
        raise


def unlink_in(root_fd: int, relative: str, inode: int | None = None) -> bool:
    """Remove the file ``relative`` (``dir/.../name``) under the directory ``root_fd``,
    walking each folder with ``O_NOFOLLOW``: a folder swapped for a link since it was
    scanned redirects nothing.  ``inode``: only if the file is still that one.  Returns
    whether it was removed."""
    *folders, name = relative.split("/")
    fds: list[int] = []
    try:
        at = root_fd
        for folder in folders:
            at = open_dir(folder, at)
            fds.append(at)
        if inode is not None and os.stat(name, dir_fd=at, follow_symlinks=False).st_ino != inode:
            return False
        os.unlink(name, dir_fd=at)
        return True
    except FileNotFoundError:
        return False
    finally:
        for fd in fds:
            os.close(fd)


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


class Bounce(threading.local):
    """Per-thread buffers: header pages, and a page-aligned one for O_DIRECT I/O."""

    buf: mmap.mmap | None = None
    header: bytearray | None = None

    def pages(self, n: int) -> bytearray:
        """Room for ``n`` headers (the most of a chunk of a batch: kept for the next)."""
        if self.header is None or len(self.header) < n * HEADER_BYTES:
            self.header = bytearray(n * HEADER_BYTES)
        return self.header

    def get(self, size: int) -> mmap.mmap:
        if self.buf is None or len(self.buf) < size:
            # Not closed: views of the old buffer may still be alive; it goes with the last.
            self.buf = mmap.mmap(-1, round_up(size))
        return self.buf


IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


def pwrite_all(fd: int, parts: list[memoryview]) -> None:
    offset = 0
    parts = [p for p in parts if p.nbytes]
    while parts:
        written = os.pwritev(fd, parts[:IOV_MAX], offset)
        if written <= 0:
            raise OSError(errno.EIO, "write returned no progress")
        offset += written
        done = 0
        while done < len(parts) and written >= parts[done].nbytes:
            written -= parts[done].nbytes
            done += 1
        del parts[:done]
        if parts and written:
            parts[0] = parts[0][written:]


def pread_into(fd: int, out: memoryview, offset: int) -> int:
    """Fill ``out`` from ``offset``.  Returns bytes read: fewer only at end of file.

    A regular file returns a short read only at its end, so one short read ends the loop
    (which also keeps every O_DIRECT read at an aligned offset)."""
    done = 0
    while done < out.nbytes:
        got = os.preadv(fd, [out[done:]], offset + done)
        done += got
        if got == 0 or done < out.nbytes:
            break
    return done


# Bytes per read system call at most, each piece hashed right after it is read (from the
# L3 cache, still).  Measured on the development machine (2 vCPU, two I/O threads, 1 GiB of
# 4 MiB blocks from the page cache, each case in turns with the raw read, 30 rounds):
# blocks of 32 scattered 128 KiB parts read at 0.80-0.81 of a raw read (medians) in pieces
# of 1 MiB, 0.87-0.93 in 2 MiB and 0.90-0.92 in 4 MiB; contiguous blocks at about 1.1
# either way.  Smaller pieces cost more in system calls and per-call Python than a hash
# from the L2 cache saves.
READ_PIECE = 2 << 20


def read_hashing(fd: int, parts: Sequence[memoryview], offset: int, hasher: Any) -> None:
    """Fill ``parts`` in order from ``offset``, updating ``hasher`` with what is read.

    Reads go in pieces of at most ``READ_PIECE`` bytes (small parts together, large ones
    cut), each hashed after it is read."""
    group: list[memoryview] = []
    size = 0

    def flush() -> None:
        nonlocal offset, size
        if os.preadv(fd, group, offset) < size:
            raise BlockFormatError("file shrank while being read")
        for piece in group:
            hasher.update(piece)
        offset += size
        group.clear()
        size = 0

    for part in parts:
        n = part.nbytes
        pieces = (
            (part,)  # most parts: no new view to make
            if n <= READ_PIECE
            else [part[at : at + READ_PIECE] for at in range(0, n, READ_PIECE)]
        )
        for piece in pieces:
            if size + piece.nbytes > READ_PIECE or len(group) == IOV_MAX:
                flush()
            group.append(piece)
            size += piece.nbytes
    if group:
        flush()


#: the compiled read (``native/file_reads.c``), None where the wheel has none (tests set it)
_LIBRARY = NATIVE
#: preadv2's flag for reading only what the page cache holds (Linux 4.14+)
RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)


# what ucm_open_block reports (native/file_reads.c)
_SIZE, _INODE, _MODE, _HEADER_READ, _STAGE, _PAYLOAD_READ, _FOUND = range(7)
_OPENING_FOLDER, _OPENING_FILE = 0, 1


def open_block_reading(
    blocks_fd: int, name: str, header: memoryview, flags: int = 0, *, direct: bool = False
) -> tuple[int, int, int, int]:
    """Block file ``name`` (in its folder ``name[:2]`` of ``blocks_fd``) opened for reading
    as :func:`open_block_folder` and :func:`open_block` do, and its first bytes read into
    ``header`` (preadv2's ``flags``; ``direct``: with O_DIRECT, ``header`` aligned).
    Returns the descriptor, the file's size and inode, and the header bytes read; raises as
    those two do.  One compiled call where the library is built (not ``direct``)."""
    library = _LIBRARY
    if library is None or direct:
        folder = open_block_folder(blocks_fd, name[:2], create=False)
        try:
            fd, st = open_block(name, O_DIRECT if direct else 0, dir_fd=folder)
        finally:
            os.close(folder)
        try:
            got = pread_into(fd, header, 0) if direct else os.preadv(fd, [header], 0, flags)
        except BaseException:
            os.close(fd)
            raise
        return fd, st.st_size, st.st_ino, got
    found = (ctypes.c_uint64 * _FOUND)()
    fd = library.ucm_open_block(
        blocks_fd, name[:2].encode(), name.encode(), address_of(header), header.nbytes, flags, found
    )
    if fd < 0:
        raise _open_failure(-fd, found[_STAGE], name)
    if not stat.S_ISREG(found[_MODE]):
        os.close(fd)
        raise NotABlock(f"not a regular file (mode {found[_MODE]:#o})")
    return fd, found[_SIZE], found[_INODE], found[_HEADER_READ]


#: a block read by :func:`read_blocks`: its file's size and inode, the header bytes read and
#: the payload's digest (None where the file was too short to read it whole)
BlockRead = tuple[int, int, int, "int | None"]


def read_blocks(
    blocks_fd: int,
    names: Sequence[str],
    headers: memoryview,
    expect: Sequence[bytes],
    parts: Sequence[Sequence[memoryview]],
    flags: int = 0,
) -> list[BlockRead | Exception]:
    """Blocks ``names`` (each in its folder ``name[:2]`` of ``blocks_fd``) read whole: block
    i opened as :func:`open_block_reading` does, its first bytes read into ``headers``' i-th
    :data:`HEADER_BYTES` and, where the file is long enough and its header begins with
    ``expect[i]`` (:func:`~ucm.core.block_format.header_prefix`: the key, size and format
    asked for; all of one length), the rest into ``parts[i]``, digested piece by piece while
    each is still in the CPU cache, and its times set to now (its recency, for the LRU of
    every process).

    Nothing read sizes anything (the parts are the caller's), and a block that is not the
    one asked for leaves its parts as they were.  The caller checks each whole header
    after.  Each block's :data:`BlockRead`, or the error
    :func:`open_block_reading` would raise (``BlockingIOError`` with RWF_NOWAIT in
    ``flags``: a page the page cache did not hold).  One compiled call for all where the
    library is built, which holds no GIL."""
    library = _LIBRARY
    if library is None:
        return [
            _read_block(blocks_fd, name, headers[i * HEADER_BYTES : (i + 1) * HEADER_BYTES],
                        expect[i], parts[i], flags)
            for i, name in enumerate(names)
        ]  # fmt: skip
    count = len(names)
    stride = max(len(name) for name in names) + 1 if names else 1
    packed = b"".join(name.encode().ljust(stride, b"\0") for name in names)
    flat = [part for block in parts for part in block]
    starts = (ctypes.c_uint64 * (count + 1))(0, *itertools.accumulate(len(b) for b in parts))
    addrs = (ctypes.c_uint64 * len(flat))(*[address_of(p) for p in flat])
    lens = (ctypes.c_uint64 * len(flat))(*[p.nbytes for p in flat])
    found = (ctypes.c_uint64 * (_FOUND * count))()
    digests = (ctypes.c_uint64 * count)()
    results = (ctypes.c_int64 * count)()
    expected = b"".join(expect)
    library.ucm_read_blocks(
        blocks_fd, count, packed, stride, address_of(headers), HEADER_BYTES, expected,
        len(expect[0]) if expect else 0, addrs, lens, starts, READ_PIECE, flags, found,
        digests, results,
    )  # fmt: skip
    reads: list[BlockRead | Exception] = []
    for i, name in enumerate(names):
        at = _FOUND * i
        if results[i]:
            reads.append(_open_failure(-results[i], found[at + _STAGE], name))
        elif not stat.S_ISREG(found[at + _MODE]):
            reads.append(NotABlock(f"not a regular file (mode {found[at + _MODE]:#o})"))
        else:
            read = found[at + _PAYLOAD_READ] == 1  # 2: the file shrank while it was read
            size, inode, got = found[at + _SIZE], found[at + _INODE], found[at + _HEADER_READ]
            reads.append((size, inode, got, digests[i] if read else None))
    return reads


def _read_block(
    blocks_fd: int,
    name: str,
    header: memoryview,
    expect: bytes,
    parts: Sequence[memoryview],
    flags: int,
) -> BlockRead | Exception:
    """:func:`read_blocks` of one block, in Python."""
    try:
        fd, size, inode, got = open_block_reading(blocks_fd, name, header, flags)
    except (OSError, NotABlock) as exc:
        return exc
    try:
        if (
            got < HEADER_BYTES
            or size < HEADER_BYTES + sum([p.nbytes for p in parts])
            or header[: len(expect)] != expect
        ):
            return size, inode, got, None
        digest = Digest()
        try:
            read_hashing(fd, parts, HEADER_BYTES, digest)
        except BlockFormatError:  # it shrank
            return size, inode, got, None
        try:
            os.utime(fd)
        except OSError:
            pass  # a shared folder may hold files of other users
        return size, inode, got, digest.intdigest()
    except OSError as exc:
        return exc
    finally:
        os.close(fd)


def _open_failure(failed: int, stage: int, name: str) -> Exception:
    """The error of a compiled open or read of block ``name`` that failed with ``errno``
    ``failed`` at ``stage``, as the Python calls raise it."""
    if failed == errno.ENOENT:
        return FileNotFoundError(failed, os.strerror(failed))
    if stage == _OPENING_FOLDER and failed in (errno.ELOOP, errno.ENOTDIR):
        return NotAFolder(
            failed, f"blocks/{name[:2]} is not a folder of the store (a link or a file)"
        )
    if stage == _OPENING_FILE and failed == errno.ELOOP:
        return NotABlock("a symbolic link, not a block file")
    return OSError(failed, os.strerror(failed))


#: fstatfs magic numbers of filesystems whose operations on cached data end without a
#: device or a network to wait for: ext2/3/4, XFS, Btrfs, F2FS, ZFS, overlayfs.  NFS, SMB,
#: FUSE and cluster filesystems are not: an open or a read there can wait on a server.
LOCAL_DISK_FILESYSTEMS = frozenset(
    {0xEF53, 0x58465342, 0x9123683E, 0xF2F52010, 0x2FC12FC1, 0x794C7630}
)
TMPFS = 0x01021994


def quick_read_flags(fd: int) -> int | None:
    """The flags for :func:`read_blocks` with which a thread that must not wait on a
    device reads blocks from the filesystem of ``fd``: RWF_NOWAIT (the page cache only) on
    a local disk's, 0 on tmpfs (memory, which has no RWF_NOWAIT), None where it cannot:
    elsewhere, or without the compiled library."""
    library = _LIBRARY
    if library is None:
        return None
    kind = library.ucm_fs_type(fd)
    if kind == TMPFS:
        return 0
    return RWF_NOWAIT if RWF_NOWAIT and kind in LOCAL_DISK_FILESYSTEMS else None
