"""The posix store: one file per block in a directory shared by processes and hosts (its
layout: :mod:`ucm.core.store.posix.layout`).

Publishing is atomic: a writer fills a temporary file in the block's directory and renames
it over the final name, so a reader sees either no file or a whole one; a reader killed or
a writer killed at any moment leaves at worst a temporary file, which is removed once its
writer is known dead (same host) or it is older than ``stale_temp_seconds``.  Every load
checks the header and the payload checksum, so a torn block after a power loss, a foreign
file or a flipped bit is a miss, never data.

The capacity policy (:mod:`.capacity`) decides when a dump must first evict and how far;
this module scans the directory and deletes.  A block another process has open stays
readable after it is evicted (POSIX keeps the inode until it is closed).
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from ucm.core.block_format import (
    HEADER_BYTES,
    BlockFormatError,
    decode_header,
    encode_header,
    payload_checksum,
)
from ucm.core.settings import ConfigError
from ucm.core.store.base import Store, StoreUsage, check_batch, check_keys
from ucm.core.store.payload import Payload, copy_parts, fill_parts
from ucm.core.store.posix.capacity import Capacity
from ucm.core.store.posix.config import PosixStoreConfig
from ucm.core.store.posix.fileio import (
    O_CLOEXEC,
    O_DIRECT,
    Bounce,
    fsync_dir,
    pread_into,
    pwrite_all,
    read_hashing,
    round_up,
)
from ucm.core.store.posix.layout import BLOCKS_DIR, evict_lru, host_tag, scan_store, write_marker
from ucm.core.store.task import CANCELLED, MISS, OK, KeyResult, Status, Task

log = logging.getLogger(__name__)


class PosixStore(Store):
    def __init__(self, config: PosixStoreConfig | None = None) -> None:
        self.config = config or PosixStoreConfig()
        self.root = os.path.abspath(os.path.expanduser(self.config.path))
        self._blocks_dir = os.path.join(self.root, BLOCKS_DIR)
        self._read_only = False
        try:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
            os.makedirs(self._blocks_dir, mode=0o700, exist_ok=True)
            write_marker(self.root, self.config.capacity_bytes)
        except OSError as exc:
            if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM) or not os.path.isdir(
                self._blocks_dir
            ):
                raise OSError(
                    exc.errno, f"cannot use {self.root!r} as a UCM store: {exc.strerror}"
                ) from None
            self._read_only = True
        if not self._read_only and not os.access(self._blocks_dir, os.W_OK):
            self._read_only = True  # e.g. a read-only mount where the marker was current
        if self._read_only:
            # A shared cache built elsewhere: serve hits from it, store nothing.
            log.warning(
                "ucm posix store %s is read-only: blocks are loaded, never stored", self.root
            )
        self._capacity = Capacity(self.config.capacity_bytes, self.config.evict_fraction)
        self._direct = self.config.o_direct and bool(O_DIRECT)
        self._host = host_tag()
        self._pool = ThreadPoolExecutor(self.config.io_thread_count, thread_name_prefix="ucm-posix")
        self._bounce = Bounce()
        self._lock = threading.Lock()  # guards the capacity and the counters below
        self._evict_lock = threading.Lock()  # one eviction pass at a time
        self._reading: Counter[str] = Counter()
        self._published_before_scan: set[str] = set()
        self._errors = 0
        self._closed = False
        # The first scan (usage, stale temporary files) runs beside the engine's start-up;
        # only a dump that needs the capacity check waits for it.
        self._scanned = threading.Event()
        threading.Thread(target=self._initial_scan, name="ucm-posix-scan", daemon=True).start()

    # -- helpers --

    def _path(self, key_hex: str) -> str:
        return f"{self._blocks_dir}/{key_hex[:2]}/{key_hex}"

    def _initial_scan(self) -> None:
        try:
            scan = scan_store(
                self.root,
                stale_temp_seconds=self.config.stale_temp_seconds,
                remove_temps=not self._read_only,
            )
            with self._lock:
                early = self._published_before_scan
                for block in scan.blocks:
                    if block.name not in early:  # else already counted by its writer
                        self._capacity.add(block.size)
            if scan.temps_removed:
                log.info(
                    "ucm posix store %s: removed %d stale temporary files",
                    self.root,
                    scan.temps_removed,
                )
        except OSError as exc:
            log.warning("ucm posix store %s: initial scan failed: %s", self.root, exc)
        finally:
            with self._lock:
                self._published_before_scan = set()
                self._scanned.set()

    def _run(self, n: int, work: Callable[[Task, int], KeyResult]) -> Task:
        """Run ``work(task, index)`` for every index on the I/O threads."""
        task = Task(n)
        if n == 0:
            return task
        indices = iter(range(n))  # shared: each worker takes the next index (GIL-atomic)

        def worker() -> None:
            for i in indices:
                task.run_key(i, lambda i=i: work(task, i))  # type: ignore[misc]

        for _ in range(min(n, self.config.io_thread_count)):
            self._pool.submit(worker)
        return task

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the store at {self.root!r} is closed")

    # -- capacity --

    def _reserve(self, size: int) -> str | None:
        """Account ``size`` bytes about to be written; evict first if they would not fit."""
        capacity = self._capacity
        if capacity.limit is None:
            with self._lock:
                capacity.take(size)
            return None
        refusal = capacity.refusal(size)
        if refusal:
            return refusal
        self._scanned.wait()
        with self._evict_lock:
            with self._lock:
                if capacity.take(size):
                    return None
            self._evict(size)
            with self._lock:
                if capacity.take(size):
                    return None
            return "store is full: every block is being read or written"

    def _evict(self, size: int) -> None:
        """Delete least recently used blocks to make room for ``size`` bytes."""
        scan = scan_store(self.root, stale_temp_seconds=self.config.stale_temp_seconds)
        with self._lock:
            reading = set(self._reading)
            target = self._capacity.eviction_target(size)
        remaining, count = evict_lru(scan, target, skip=reading)
        with self._lock:
            self._capacity.counted(remaining, count)

    def _release(self, size: int, published: bool) -> None:
        with self._lock:
            self._capacity.finished(size, published)

    # -- dump --

    @property
    def read_only(self) -> bool:
        return self._read_only

    def dump(self, keys: Sequence[bytes], buffers: Sequence[object], layout: bytes = b"") -> Task:
        self._check_open()
        views = check_batch(keys, buffers, writable=False)
        if self._read_only:
            return Task.completed([KeyResult(Status.ERROR, "the store is read-only")] * len(keys))
        return self._run(
            len(keys), lambda task, i: self._dump_one(task, bytes(keys[i]), views[i], layout)
        )

    def _dump_one(self, task: Task, key: bytes, payload: Payload, layout: bytes) -> KeyResult:
        key_hex = key.hex()
        final = self._path(key_hex)
        if os.path.isfile(final):
            return OK  # content-addressed: the same key holds the same bytes
        size = HEADER_BYTES + payload.nbytes
        if self._direct:
            size = round_up(size)
        problem = self._reserve(size)
        if problem:
            self._count_error()
            return KeyResult(Status.ERROR, problem)
        directory = os.path.dirname(final)
        tmp = os.path.join(
            directory, f".{key_hex}~{self._host}~{os.getpid()}~{secrets.token_hex(4)}.tmp"
        )
        published = False
        fd = -1
        try:
            parts = payload.parts  # taken once: a deferred payload makes them on each take
            header = encode_header(key, parts, layout)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_CLOEXEC
            if self._direct:
                flags |= O_DIRECT
            try:
                fd = os.open(tmp, flags, 0o600)
            except FileNotFoundError:
                os.makedirs(directory, mode=0o700, exist_ok=True)
                fd = os.open(tmp, flags, 0o600)
            if self._direct:
                buf = self._bounce.get(size)
                buf[:HEADER_BYTES] = header
                copy_parts(parts, memoryview(buf)[HEADER_BYTES:])
                buf[HEADER_BYTES + payload.nbytes : size] = bytes(
                    size - HEADER_BYTES - payload.nbytes
                )
                pwrite_all(fd, [memoryview(buf)[:size]])
            else:
                pwrite_all(fd, [memoryview(header), *parts])
            if self.config.fsync != "never":
                os.fsync(fd)
            os.close(fd)
            fd = -1
            if task.cancelled:
                # The caller may have taken its buffers back while they were being written:
                # what the file holds is not known to be the payload.
                os.unlink(tmp)
                return CANCELLED
            with self._lock:
                # Before the rename: an initial scan that sees the file must know that
                # this writer counts it (after the rename would leave a window to count
                # it twice).
                if not self._scanned.is_set():
                    self._published_before_scan.add(key_hex)
            os.rename(tmp, final)
            published = True
            if self.config.fsync == "full":
                fsync_dir(directory)
            return OK
        except OSError as exc:
            self._count_error()
            if fd >= 0:
                os.close(fd)
            if not published:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            return KeyResult(Status.ERROR, f"cannot write block {key_hex}: {exc.strerror or exc}")
        finally:
            self._release(size, published)

    # -- load --

    def load(self, keys: Sequence[bytes], buffers: Sequence[object], layout: bytes = b"") -> Task:
        self._check_open()
        views = check_batch(keys, buffers, writable=True)
        return self._run(
            len(keys), lambda task, i: self._load_one(bytes(keys[i]), views[i], layout)
        )

    def _load_one(self, key: bytes, out: Payload, layout: bytes) -> KeyResult:
        key_hex = key.hex()
        path = self._path(key_hex)
        flags = os.O_RDONLY | O_CLOEXEC | (O_DIRECT if self._direct else 0)
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            return MISS
        except OSError as exc:
            self._count_error()
            return KeyResult(Status.ERROR, f"cannot open block {key_hex}: {exc.strerror}")
        with self._lock:
            self._reading[key_hex] += 1
        inode = None
        try:
            st = os.fstat(fd)
            inode = st.st_ino
            if st.st_size < HEADER_BYTES:
                raise BlockFormatError(f"file truncated: {st.st_size} bytes")
            if self._direct:
                buf = self._bounce.get(st.st_size)
                view = memoryview(buf)
                got = pread_into(fd, view[: round_up(st.st_size)], 0)
                header = decode_header(view[:HEADER_BYTES], expect_key=key)
                problem = _size_problem(header.payload_len, out.nbytes, got)
                if problem:
                    return self._size_mismatch(problem, header.payload_len, out.nbytes)
                stored = view[HEADER_BYTES : HEADER_BYTES + header.payload_len]
                checksum = payload_checksum(stored)  # of the bounce buffer: one contiguous run
                if checksum == header.payload_checksum:
                    fill_parts(out.parts, stored)
            elif st.st_size == HEADER_BYTES + out.nbytes:
                # The common case: the payload goes straight into ``out`` and is hashed
                # chunk by chunk while each chunk is still in the CPU cache.
                page = self._bounce.page()
                if os.preadv(fd, [page], 0) < HEADER_BYTES:
                    raise BlockFormatError("file shrank while being read")
                header = decode_header(page, expect_key=key)
                if header.payload_len != out.nbytes:
                    return self._size_mismatch("size", header.payload_len, out.nbytes)
                checksum = read_hashing(fd, out.parts, HEADER_BYTES)
            else:
                header = decode_header(os.pread(fd, HEADER_BYTES, 0), expect_key=key)
                problem = _size_problem(header.payload_len, out.nbytes, st.st_size)
                if problem:
                    return self._size_mismatch(problem, header.payload_len, out.nbytes)
                checksum = read_hashing(fd, out.parts, HEADER_BYTES)
            if header.layout != layout:  # the caller's mistake: the block itself is fine
                self._count_error()
                return KeyResult(
                    Status.ERROR,
                    f"stored block has layout {header.layout!r}, asked for {layout!r}",
                )
            if checksum != header.payload_checksum:
                raise BlockFormatError("payload checksum mismatch")
            try:
                os.utime(fd)  # recency for the LRU, visible to every process
            except OSError:
                pass  # a shared directory may hold files of other users
            return OK
        except BlockFormatError as exc:
            self._count_error()
            self._discard(path, inode)
            log.warning("ucm posix store: block %s is corrupt (%s); removed", key_hex, exc)
            return KeyResult(Status.CORRUPT, str(exc))
        except OSError as exc:
            self._count_error()
            return KeyResult(Status.ERROR, f"cannot read block {key_hex}: {exc.strerror}")
        finally:
            os.close(fd)
            with self._lock:
                self._reading[key_hex] -= 1
                if not self._reading[key_hex]:
                    del self._reading[key_hex]

    def _size_mismatch(self, problem: str, stored: int, wanted: int) -> KeyResult:
        if problem == "truncated":
            raise BlockFormatError(f"file truncated: payload of {stored} bytes incomplete")
        self._count_error()
        return KeyResult(
            Status.ERROR, f"buffer is {wanted} bytes but the stored block holds {stored}"
        )

    def _discard(self, path: str, inode: int | None) -> None:
        """Remove a corrupt block, unless a writer has replaced it with a new file meanwhile."""
        try:
            st = os.stat(path)
            if inode is None or st.st_ino == inode:
                os.unlink(path)
        except OSError:
            return
        with self._lock:
            self._capacity.remove(st.st_size)

    def _count_error(self) -> None:
        with self._lock:
            self._errors += 1

    # -- the rest --

    def _exists(self, key: bytes) -> bool:
        h = key.hex()
        try:
            os.stat(f"{self._blocks_dir}/{h[:2]}/{h}")
        except OSError:
            return False
        return True

    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        check_keys(keys)
        return [self._exists(k) for k in keys]

    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        check_keys(keys)
        for i, key in enumerate(keys):
            if not self._exists(key):
                return i
        return len(keys)

    def remove(self, keys: Sequence[bytes]) -> int:
        check_keys(keys)
        removed = 0
        for key in keys:
            path = self._path(bytes(key).hex())
            try:
                size = os.stat(path).st_size
                os.unlink(path)
            except FileNotFoundError:
                continue
            removed += 1
            with self._lock:
                self._capacity.remove(size)
        return removed

    def usage(self) -> StoreUsage:
        self._scanned.wait()
        with self._lock:
            capacity = self._capacity
            return StoreUsage(capacity.used_blocks, capacity.used_bytes, capacity.limit)

    @property
    def errors(self) -> int:
        return self._errors

    def check_block_bytes(self, nbytes: int) -> None:
        stored = HEADER_BYTES + nbytes
        if self._capacity.refusal(stored):
            raise ConfigError(
                "store.capacity_gb",
                f"{self.config.capacity_gb} GiB cannot hold one block of {stored} bytes",
            )

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=True)


def _size_problem(stored: int, wanted: int, available: int) -> str | None:
    if stored != wanted:
        return "size"
    if available < HEADER_BYTES + stored:
        return "truncated"
    return None
