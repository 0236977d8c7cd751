"""What the page cache holds of a store's files, and a folder's files read into it.

A benchmark of a disk store "on a warm page cache" must see the store's files in memory
when it is timed, and the page cache does not keep them there on its own: on the
development VM, a file nobody touched lost 5 % of its cached pages within 90 seconds
with most of the memory free (the kernel's reclaim counters unchanged), and half of a
store's block files written in pass 1 were partly out of memory by pass 2. :func:`warm`
reads a folder's files into the cache before a timed run and says how much of them it
held before.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import stat

import attrs
import numpy as np

_READ_BYTES = 1 << 20  # a read's size while warming


@functools.cache
def _libc() -> ctypes.CDLL:
    """libc with mincore's signature, made once (warm asks it for every file)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def cached_pages(fd: int, size: int) -> int:
    """How many of the first ``size`` bytes' pages of the file open at ``fd`` the page
    cache holds (mincore over a mapping, which reads nothing: a probing read could start
    the kernel's readahead)."""
    if size <= 0:
        return 0
    libc = _libc()
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    try:
        at = np.frombuffer(mapped, np.uint8)
        done = libc.mincore(at.ctypes.data, size, vec)
        del at
    finally:
        mapped.close()
    if done != 0:
        raise OSError(ctypes.get_errno(), f"mincore: {os.strerror(ctypes.get_errno())}")
    return int((np.frombuffer(vec, np.uint8) & 1).sum())


@attrs.frozen
class Warmth:
    """What :func:`warm` found: the regular files it read, their bytes, and the share of
    their pages the page cache held before it read them (1.0 where there were none)."""

    files: int
    bytes: int
    cached_before: float


def warm(folder: str) -> Warmth:
    """Every regular file under ``folder`` read once, so that the page cache holds it
    (links are not followed, at any level: a link is not a store's file)."""
    files = total = pages = cached = 0
    buffer = bytearray(_READ_BYTES)
    pending = [folder]
    while pending:
        with os.scandir(pending.pop()) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    pending.append(entry.path)
                elif entry.is_file(follow_symlinks=False):
                    size, held = _read_through(entry.path, buffer)
                    files += 1
                    total += size
                    pages += -(-size // mmap.PAGESIZE)
                    cached += held
    return Warmth(files, total, cached / pages if pages else 1.0)


def _read_through(path: str, buffer: bytearray) -> tuple[int, int]:
    """The file at ``path`` read to its end as it was when opened: its size and the
    pages the cache held before (0, 0 for what is not a regular file by then)."""
    try:
        # (a FIFO put in its place meanwhile must not block the open)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:  # gone meanwhile (evicted), or a link put in its place
        return 0, 0
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return 0, 0
        held = cached_pages(fd, st.st_size)
        left = st.st_size  # a file that grows meanwhile is read as far as it was
        while left > 0:
            got = os.readv(fd, [memoryview(buffer)[: min(left, _READ_BYTES)]])
            if got == 0:
                break
            left -= got
        return st.st_size, held
    finally:
        os.close(fd)
