"""The arena file's format: its geometry, sections and superblock, made and recognised.

File layout (``<folder>/arena``; sections page-aligned; integers little-endian)::

    superblock   one page: magic, version, geometry, counters
    columns      one array per slot field (numpy scans a dense array):
                 state u32, pins u32, gen u32, owner u32, key0 u64, key1 u64, length u64,
                 layout u64, last_used u64, lease i64, seal 32 bytes
    free stack   u32 per slot: the FREE slot numbers (its top is a superblock word)
    index        open addressing, linear probing, a power of two >= 2 buckets per slot:
                 key0 u64, key1 u64, slot u32 (EMPTY, or TOMB for a deleted entry); a
                 key's home bucket is a hash of key0 salted by a random superblock word
    data         slots x slot_bytes, 2 MiB-aligned (huge pages where the mount has them)

A slot's ``owner`` is its writer's number plus one (:mod:`.writers`), 0 when it has none.

Nothing read from the file sizes an allocation or a mapping without a check: a process
that attaches takes the geometry from the superblock only where it is an arena of this
version whose size on disk agrees with it, and within its own configured capacity.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import time

import attrs
import numpy as np
from ucm.core.store.dram.files import ArenaBusy, flock_until, open_own
from ucm.core.store.dram.index import EMPTY

MAGIC = int.from_bytes(b"UCMARNA1", "little")
#: 2: a key's home bucket is a salted hash of it; 3: a slot's owner is a writer number;
#: 4: a seal is the block's digest (:mod:`ucm.core.digest`), not its xxh3-64
VERSION = 4
PAGE = 4096
DATA_ALIGN = 2 << 20
SEAL_BYTES = 32
#: a slot's start and size are multiples of this (copies of aligned memory are fastest)
SLOT_ALIGN = 64
ARENA_FILE = "arena"

FREE, WRITING, READY = 0, 1, 2

# superblock words (u64 index into the first page)
SB_MAGIC, SB_VERSION, SB_SLOT_BYTES, SB_SLOTS, SB_BUCKETS = 0, 1, 2, 3, 4
SB_TICK, SB_DIRTY, SB_FREE_TOP, SB_SEQ, SB_USED, SB_EVICTED, SB_RECOVERIES = 5, 6, 7, 8, 9, 10, 11
SB_TOMBS, SB_REBUILDS, SB_BYTES, SB_SALT = 12, 13, 14, 15

_WORDS = struct.Struct("<5Q")
COLUMNS = (  # name, bytes per slot, numpy dtype
    ("state", 4, "<u4"), ("pins", 4, "<u4"), ("gen", 4, "<u4"), ("owner", 4, "<u4"),
    ("key0", 8, "<u8"), ("key1", 8, "<u8"), ("length", 8, "<u8"), ("layout", 8, "<u8"),
    ("last_used", 8, "<u8"), ("lease", 8, "<i8"), ("seal", SEAL_BYTES, "V32"),
    ("free", 4, "<u4"),
)  # fmt: skip
INDEX_COLUMNS = (("ik0", 8, "<u8"), ("ik1", 8, "<u8"), ("islot", 4, "<u4"))


def _round(n: int, align: int) -> int:
    return (n + align - 1) // align * align


@attrs.frozen
class Geometry:
    """An arena's shape, fixed when its file is made."""

    slot_bytes: int
    slots: int

    @classmethod
    def for_blocks(cls, block_bytes: int, capacity_bytes: int) -> Geometry:
        slot = _round(max(block_bytes, 1), SLOT_ALIGN)
        return cls(slot, capacity_bytes // slot)

    @property
    def buckets(self) -> int:
        b = 1
        while b < 2 * self.slots:  # load factor <= 0.5: short probes, fast misses
            b <<= 1
        return b

    def sections(self) -> dict[str, tuple[int, int]]:
        """name -> (offset, bytes) of every section of the file."""
        out: dict[str, tuple[int, int]] = {}
        at = PAGE  # the superblock
        n, b = self.slots, self.buckets
        for name, width, _ in COLUMNS:
            out[name] = (at, width * n)
            at = _round(at + width * n, PAGE)
        for name, width, _ in INDEX_COLUMNS:
            out[name] = (at, width * b)
            at = _round(at + width * b, PAGE)
        out["data"] = (_round(at, DATA_ALIGN), self.slot_bytes * n)
        return out

    @property
    def meta_bytes(self) -> int:
        return self.sections()["data"][0]

    @property
    def file_bytes(self) -> int:
        off, size = self.sections()["data"]
        return off + size


def attach_fd(path: str, deadline: float) -> int | None:
    """The arena file, opened and marked in use (a shared ``flock`` held while it is open:
    a replacement needs nobody to hold one), or None where absent."""
    try:
        fd = open_own(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    except PermissionError:
        raise
    except OSError as exc:  # ELOOP: a link planted where the arena goes
        raise PermissionError(f"{path} cannot be opened as a file of ours: {exc}") from None
    try:
        flock_until(fd, deadline, path, fcntl.LOCK_SH)
    except ArenaBusy:
        os.close(fd)
        raise
    return fd


def unused(fd: int) -> bool:
    """Whether no other process holds the arena open (our shared lock becomes exclusive)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def file_geometry(fd: int) -> Geometry | None:
    """The geometry the file's superblock names, if it is an arena of this version whose
    size agrees with it."""
    head = os.pread(fd, _WORDS.size, 0)
    if len(head) != _WORDS.size:
        return None
    magic, version, slot_bytes, slots, buckets = _WORDS.unpack(head)
    if magic != MAGIC or version != VERSION or not slots or slot_bytes % SLOT_ALIGN:
        return None
    geometry = Geometry(slot_bytes, slots)
    if geometry.buckets != buckets or os.fstat(fd).st_size != geometry.file_bytes:
        return None
    return geometry


def create(path: str, geometry: Geometry) -> int:
    """A fresh arena file, published by rename (a process killed while making it leaves
    only a temporary file).  Caller holds the creation lock."""
    g = geometry
    tmp = f"{path}.tmp.{os.getpid()}.{time.monotonic_ns()}"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        # every page now: a write into a hole of a full tmpfs would be a SIGBUS
        os.posix_fallocate(fd, 0, g.file_bytes)
        meta = mmap.mmap(fd, g.meta_bytes, mmap.MAP_SHARED)
        try:
            sections = g.sections()
            off, size = sections["islot"]
            np.frombuffer(meta, "<u4", count=size // 4, offset=off)[:] = EMPTY
            off, size = sections["free"]
            # the free stack: slot n-1 at the bottom, so that slot 0 is handed out first
            free = np.frombuffer(meta, "<u4", count=size // 4, offset=off)
            free[:] = np.arange(g.slots - 1, -1, -1, dtype=np.uint32)
            del free
            sb = memoryview(meta)[:PAGE].cast("Q")
            sb[SB_SLOT_BYTES], sb[SB_SLOTS], sb[SB_BUCKETS] = g.slot_bytes, g.slots, g.buckets
            sb[SB_FREE_TOP] = g.slots
            sb[SB_SALT] = int.from_bytes(os.urandom(8), "little")
            sb[SB_VERSION] = VERSION
            sb[SB_MAGIC] = MAGIC  # last: a file without it is not an arena
            sb.release()
        finally:
            meta.close()
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.rename(tmp, path)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    return fd
