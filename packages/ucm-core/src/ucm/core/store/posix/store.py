"""The posix store: one file per block in a directory shared by processes and hosts (its
layout: :mod:`ucm.core.store.posix.layout`).

Publishing is atomic: a writer fills a temporary file in the block's directory and renames
it over the final name, so a reader sees either no file or a whole one; a reader killed or
a writer killed at any moment leaves at worst a temporary file, which is removed once its
writer is known gone.  Every load checks the header and the payload checksum (or, in a
signed store, its MAC: :mod:`ucm.core.signing`), so a torn block after a power loss, a
foreign file or a flipped bit is a miss, never data.

What is in the folder is not trusted: the folder is refused at start-up if another user
can write it (:mod:`ucm.core.store.folder`); a block is opened without following a link or
waiting on a FIFO, and read only if it is a regular file whose header names the key and the
size asked for.

The capacity policy (:mod:`.capacity`) decides when a dump must first evict and how far;
this module scans the directory and deletes.  A block another process has open stays
readable after it is evicted (POSIX keeps the inode until it is closed).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
from collections import Counter
from collections.abc import Callable, Hashable, Sequence

from ucm.core.block_format import (
    HEADER_BYTES,
    BlockFormatError,
    OtherVersion,
    check_payload,
    decode_header,
    encode_header,
    payload_hasher,
    verify_payload,
)
from ucm.core.settings import GIB, ConfigError
from ucm.core.signing import signer_for
from ucm.core.store.base import Store, StoreUsage, check_batch, check_keys
from ucm.core.store.evictions import EvictionWatch
from ucm.core.store.folder import check_before_creating, check_store_folder
from ucm.core.store.payload import Payload, copy_parts, fill_parts
from ucm.core.store.posix.capacity import Capacity
from ucm.core.store.posix.config import AUTO, PosixStoreConfig
from ucm.core.store.posix.fileio import (
    O_CLOEXEC,
    O_DIRECT,
    Bounce,
    NotABlock,
    open_block_folder,
    open_block_reading,
    open_dir,
    pread_into,
    pwrite_all,
    quick_read_flags,
    read_block,
    read_hashing,
    round_up,
    unlink_in,
)
from ucm.core.store.posix.layout import (
    BLOCKS_DIR,
    block_folders,
    block_relative,
    host_tag,
    register_writer,
    scan_store,
    unregister_writer,
    write_marker,
)
from ucm.core.store.posix.room import Room
from ucm.core.store.posix.usage import SharedUsage
from ucm.core.store.task import CANCELLED, MISS, OK, KeyResult, Status, Task
from ucm.core.threads import store_pool, store_thread

log = logging.getLogger(__name__)

_READ_ONLY_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)


class PosixStore(Room, Store):
    def __init__(self, config: PosixStoreConfig | None = None) -> None:
        self.config = config or PosixStoreConfig()
        self._signer = signer_for(self.config.secret)
        path = os.path.abspath(os.path.expanduser(self.config.path))
        self._read_only = False
        check_before_creating(path, shared=self.config.shared)
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError as exc:
            if exc.errno not in _READ_ONLY_ERRNOS or not os.path.isdir(path):
                raise OSError(
                    exc.errno, f"cannot use {path!r} as a UCM store: {exc.strerror}"
                ) from None
            self._read_only = True
        # Before a byte is read: a folder others can write is refused (ucm.core.store.folder).
        self.root = check_store_folder(path, shared=self.config.shared)
        self._root_fd = open_dir(self.root)
        self._blocks_dir = os.path.join(self.root, BLOCKS_DIR)
        #: blocks/, opened once it is known to be a folder: every block's folder and file is
        #: reached from it with *at calls, never by a path another user could redirect
        self._blocks_fd = -1
        self._usage: SharedUsage | None = None
        self._writer: tuple[str, int] | None = None  # this process's id and lock as a writer
        self._limit = self.config.capacity_bytes  # 'auto' worked out once, here
        if self.config.capacity_gb == AUTO and self._limit is not None:
            log.info(
                "ucm posix store %s: capacity %.1f GiB (auto: half of what its filesystem "
                "has free; set store.capacity_gb to choose)",
                self.root,
                self._limit / GIB,
            )
        try:
            self._prepare()
        except BaseException:
            if self._usage is not None:
                self._usage.close()
            if self._writer is not None:
                unregister_writer(self._root_fd, *self._writer)
            if self._blocks_fd >= 0:
                os.close(self._blocks_fd)
            os.close(self._root_fd)
            raise
        if self._read_only:
            # A shared cache built elsewhere: serve hits from it, store nothing.
            log.warning(
                "ucm posix store %s is read-only: blocks are loaded, never stored", self.root
            )
        self._capacity = Capacity(self._limit, self.config.evict_fraction)
        self._direct = self.config.o_direct and bool(O_DIRECT)
        # A thread that waits for a load reads blocks too, from memory only (the page cache,
        # or tmpfs) and on a local filesystem only: nothing it does waits on a disk or a
        # server.  None: it only waits.
        self._quick_flags = None if self._direct else quick_read_flags(self._blocks_fd)
        self._pool = store_pool(self.config.io_thread_count, "ucm-posix")
        self._bounce = Bounce()
        self._lock = threading.Lock()  # guards the in-flight bytes and the counters below
        self._reading: Counter[str] = Counter()
        self._scanned_usage = (0, 0)  # a read-only store's, from its first scan
        # blocks this process published while the first scan ran: counted by their writer
        self._published_before_scan: set[str] = set()
        self._errors = 0
        self._evicted = 0  # blocks this object's eviction passes removed
        self._evictions = EvictionWatch()
        self._closed = False
        # The first scan (stale temporary files, the count checked against the disk) runs
        # beside the engine's start-up; only a dump that needs a count no process has made
        # yet waits for it.
        self._scanned = threading.Event()
        self._counted = threading.Event()
        if self._usage is not None and not self._usage.fresh:
            self._counted.set()
        # read before this process can publish a block: what it publishes from now on is
        # in the count's change, not in what the scan finds (_published_before_scan)
        try:
            before = self._usage.read() if self._usage is not None else (0, 0)
        except TimeoutError:  # held by a stopped process: the count was not fresh either
            before = (0, 0)
        store_thread(self._initial_scan, "ucm-posix-scan", args=(before,)).start()
        # Keeps room ahead of the writers, so that a dump rarely waits for an eviction pass.
        self._evictor: threading.Event | None = None
        self._evicting_thread: threading.Thread | None = None
        if self._limit is not None and not self._read_only:
            self._evictor = threading.Event()
            self._evicting_thread = store_thread(self._keep_room, "ucm-posix-evict")
            self._evicting_thread.start()

    def _prepare(self) -> None:
        """The blocks folder, the marker and the shared count; a store that cannot be
        written is read-only."""
        if not self._read_only:
            try:
                try:
                    os.mkdir(BLOCKS_DIR, 0o700, dir_fd=self._root_fd)
                except FileExistsError:
                    pass
                write_marker(self.root, self._limit)
                self._usage = SharedUsage(self._root_fd)
                self._writer = register_writer(self._root_fd, host_tag())
            except OSError as exc:
                if exc.errno not in _READ_ONLY_ERRNOS:
                    raise OSError(
                        exc.errno, f"cannot use {self.root!r} as a UCM store: {exc.strerror}"
                    ) from None
                self._read_only = True
        if self._usage is not None and not os.access(self._blocks_dir, os.W_OK):
            self._usage.close()  # e.g. a read-only mount where the marker was current
            self._usage = None
            self._read_only = True
        try:
            st = os.stat(BLOCKS_DIR, dir_fd=self._root_fd, follow_symlinks=False)
        except FileNotFoundError:
            raise ConfigError(
                "store.path", f"{self.root} is not a UCM store and cannot be made one"
            ) from None
        if not stat.S_ISDIR(st.st_mode) or (
            not self.config.shared and (st.st_uid not in (os.geteuid(), 0) or st.st_mode & 0o022)
        ):
            raise ConfigError(
                "store.path",
                f"{self._blocks_dir} (owner uid {st.st_uid}, mode "
                f"{stat.S_IMODE(st.st_mode):04o}) is not a folder that only you can write; "
                "remove it, or see docs/security.md",
            )
        self._blocks_fd = open_dir(BLOCKS_DIR, self._root_fd)
        self._read_only = self._read_only or self._usage is None

    # -- helpers --

    def _file_name(self, key: bytes) -> str:
        """A block's file name: its key, keyed by the secret in a signed store."""
        signer = self._signer
        return (key if signer is None else signer.name(key)).hex()

    def _eviction_names(self, keys: Sequence[bytes]) -> list[Hashable]:
        return [self._file_name(bytes(k)) for k in keys]

    def _relative(self, name: str) -> str:
        """A block's path under ``blocks/`` (for *at calls on ``_blocks_fd``)."""
        return f"{name[:2]}/{name}"

    def _initial_scan(self, before: tuple[int, int]) -> None:
        usage = self._usage
        # the blocks are counted only where no process has counted them yet (or nobody
        # can: a read-only store); otherwise the count stands, and the scan only removes
        # stale temporary files: a listing, no stat per block (300,000 stats beside the
        # first dumps of an engine that restarts doubled their p99)
        count = usage is None or usage.fresh
        try:
            # a folder at a time: what a million blocks' records would take stays unheld
            found, temps_removed = [0, 0], 0
            for folder in block_folders(self._root_fd):
                scan = scan_store(
                    self.root,
                    stale_temp_seconds=self.config.stale_temp_seconds,
                    remove_temps=not self._read_only,
                    folders=(folder,),
                    blocks=count,
                )
                with self._lock:
                    early = self._published_before_scan
                    counted = [b for b in scan.blocks if b.name not in early]
                found[0] += sum(b.size for b in counted)
                found[1] += len(counted)
                temps_removed += scan.temps_removed
            if usage is None:
                self._scanned_usage = (found[0], found[1])
            elif usage.fresh:  # else the count stands (an eviction pass corrects it)
                usage.resync((found[0], found[1]), before)
            if temps_removed:
                log.info(
                    "ucm posix store %s: removed %d stale temporary files",
                    self.root,
                    temps_removed,
                )
        except (OSError, ValueError) as exc:  # ValueError: closed meanwhile
            log.warning("ucm posix store %s: initial scan failed: %s", self.root, exc)
        finally:
            with self._lock:
                self._published_before_scan = set()
                self._scanned.set()
                self._counted.set()

    def _run(
        self,
        n: int,
        work: Callable[[Task, int], KeyResult],
        quick: Callable[[int], KeyResult | None] | None = None,
    ) -> Task:
        """Run ``work(task, index)`` for every index on the I/O threads.

        ``quick(index)``: the key's work for a thread that waits for the task
        (:meth:`Task.help_with`), done only where it cannot wait on a device (None: left
        to the I/O threads)."""
        task = Task(n)
        if n == 0:
            return task
        indices = iter(range(n))  # shared: each worker takes the next index (GIL-atomic)

        def worker() -> None:
            for i in indices:
                task.run_key(i, lambda i=i: work(task, i))  # type: ignore[misc]

        for _ in range(min(n, self.config.io_thread_count)):
            self._pool.submit(worker)
        if quick is not None:

            def help_once() -> bool:
                i = next(indices, None)
                if i is None:
                    return False
                if not task.try_key(i, lambda: quick(i)):  # type: ignore[misc]
                    try:
                        self._pool.submit(task.run_key, i, lambda: work(task, i))
                    except RuntimeError:  # the store closed meanwhile
                        task.set_result(i, KeyResult(Status.ERROR, "the store was closed"))
                return True

            task.help_with(help_once)
        return task

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the store at {self.root!r} is closed")

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
        name = self._file_name(key)
        if self._present(name):
            return OK  # content-addressed: the same key holds the same bytes
        try:
            # the block's folder, reached from blocks/ without following a link: a link
            # there (another user who can write a shared folder) redirects nothing
            folder = open_block_folder(self._blocks_fd, name[:2], create=True)
        except OSError as exc:
            self._count_error()
            return KeyResult(Status.ERROR, f"cannot write block {name}: {exc.strerror or exc}")
        try:
            return self._dump_into(task, key, name, folder, payload, layout)
        finally:
            os.close(folder)

    def _dump_into(
        self, task: Task, key: bytes, name: str, folder: int, payload: Payload, layout: bytes
    ) -> KeyResult:
        """Write one block into its folder (``folder``, a descriptor): a temporary file,
        then a rename over the block's name, both relative to it."""
        size = HEADER_BYTES + payload.nbytes
        if self._direct:
            size = round_up(size)
        problem = self._reserve(size)
        if problem:
            self._count_error()
            return KeyResult(Status.ERROR, problem)
        assert self._writer is not None  # a store that can be written has one
        tmp = f".{name}~{self._writer[0]}.tmp"
        published = False
        fd = -1
        try:
            parts = payload.parts  # taken once: a deferred payload makes them on each take
            header = encode_header(key, parts, layout, self._signer)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_CLOEXEC | os.O_NOFOLLOW
            if self._direct:
                flags |= O_DIRECT
            fd = os.open(tmp, flags, 0o600, dir_fd=folder)
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
            if task.cancelled:
                # The caller may have taken its buffers back while they were being written:
                # what the file holds is not known to be the payload.
                os.unlink(tmp, dir_fd=folder)
                return CANCELLED
            with self._lock:
                # Before the rename: a first scan that sees the file must know that this
                # writer counts it (after the rename would leave a window to count it twice).
                if not self._scanned.is_set():
                    self._published_before_scan.add(name)
            # Counted before it is published: a writer killed in between leaves the count
            # high, never low, and the next eviction pass brings it down (usage.resync).
            assert self._usage is not None
            stored = self._usage.add(size, 1)[0]
            try:
                os.rename(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
            except BaseException:
                self._usage.add(-size, -1)
                raise
            # (this block is still counted in flight too: not twice)
            if self._evictor is not None and self._capacity.needs_headroom(stored - size):
                self._evictor.set()
            published = True
            if self.config.fsync == "full":
                os.fsync(folder)
            return OK
        except OSError as exc:
            self._count_error()
            if not published:
                try:
                    os.unlink(tmp, dir_fd=folder)
                except OSError:
                    pass
            return KeyResult(Status.ERROR, f"cannot write block {name}: {exc.strerror or exc}")
        finally:
            if fd >= 0:
                os.close(fd)
            self._release(size)

    def _present(self, name: str) -> bool:
        """Whether a block file is at block ``name``'s path (a link or anything else there is
        not one; a hint, as a lookup is: a load walks the path again without links)."""
        try:
            return stat.S_ISREG(
                os.stat(self._relative(name), dir_fd=self._blocks_fd, follow_symlinks=False).st_mode
            )
        except OSError:
            return False

    # -- load --

    def load(self, keys: Sequence[bytes], buffers: Sequence[object], layout: bytes = b"") -> Task:
        self._check_open()
        views = check_batch(keys, buffers, writable=True)
        return self._run(
            len(keys),
            lambda task, i: self._load_one(bytes(keys[i]), views[i], layout),
            (lambda i: self._read_block(bytes(keys[i]), views[i], layout, quick=True))
            if self._quick_flags is not None
            else None,
        )

    def _load_one(self, key: bytes, out: Payload, layout: bytes) -> KeyResult:
        result = self._read_block(key, out, layout, quick=False)
        assert result is not None  # only a quick read leaves a block to another
        return result

    def _read_block(
        self, key: bytes, out: Payload, layout: bytes, *, quick: bool
    ) -> KeyResult | None:
        """Read one block into ``out``.  Nothing read from the file sizes an allocation or a
        read: reads go into ``out`` (or a bounce buffer of its size), and the block counts
        only once its header names the key and the size asked for and its payload checks.
        A signed store reads the header first and the payload only if it matches (its MAC
        is computed in Python, the block's file open in between); every other block is
        read in one compiled call and its header checked after (:func:`read_block`).

        ``quick``: read only what is in memory, else return None having changed nothing but
        (part of) ``out``, as on any error: an I/O thread then reads the block and judges
        it (for the engine's waiting thread: :meth:`_run`)."""
        flags = (self._quick_flags or 0) if quick else 0
        name = self._file_name(key)
        wanted = HEADER_BYTES + out.nbytes
        whole = not self._direct and self._signer is None
        if self._direct:
            view = memoryview(self._bounce.get(round_up(wanted)))
            page = view[:HEADER_BYTES]
        else:
            page = memoryview(self._bounce.page())
        with self._lock:
            self._reading[name] += 1
        fd = -1
        try:
            if whole:
                size, inode, got, digest = read_block(self._blocks_fd, name, page, out.parts, flags)
            else:
                fd, size, inode, got = open_block_reading(
                    self._blocks_fd, name, page, flags, direct=self._direct
                )
        except FileNotFoundError:
            self._read_done(name, fd)
            return MISS
        except NotABlock as exc:
            self._read_done(name, fd)
            self._count_error()
            self._discard(name, None)
            log.warning("ucm posix store: block %s is %s; removed", name, exc)
            return KeyResult(Status.CORRUPT, str(exc))
        except OSError as exc:  # quick: not in memory (EAGAIN), or for an I/O thread to judge
            self._read_done(name, fd)
            if quick:
                return None
            self._count_error()
            return KeyResult(Status.ERROR, f"cannot read block {name}: {exc.strerror or exc}")
        try:
            if got < HEADER_BYTES:
                if quick:  # some of it not in the page cache: an I/O thread judges
                    return None
                raise BlockFormatError(f"file truncated: {got} bytes")
            header = decode_header(page, expect_key=key, signer=self._signer)
            if header.payload_len != out.nbytes:  # the caller's mistake: the block is fine
                self._count_error()
                return KeyResult(
                    Status.ERROR,
                    f"buffer is {out.nbytes} bytes but the stored block holds {header.payload_len}",
                )
            if size < wanted:
                raise BlockFormatError(f"file truncated: payload of {out.nbytes} bytes incomplete")
            if whole:  # read, digested and its times set by the one call
                if digest is None:
                    raise BlockFormatError("file shrank while being read")
                if digest != header.payload_checksum:
                    raise BlockFormatError("payload checksum mismatch")
            elif self._direct:
                stored = view[HEADER_BYTES:wanted]
                if pread_into(fd, view[HEADER_BYTES : round_up(wanted)], HEADER_BYTES) < (
                    out.nbytes
                ):
                    raise BlockFormatError("file shrank while being read")
                verify_payload(header, stored, self._signer)  # of one contiguous run
                fill_parts(out.parts, stored)
            else:
                hasher = payload_hasher(header, self._signer)
                read_hashing(fd, out.parts, HEADER_BYTES, hasher)
                check_payload(header, hasher)
            if header.layout != layout:  # the caller's mistake: the block itself is fine
                self._count_error()
                return KeyResult(
                    Status.ERROR,
                    f"stored block has layout {header.layout!r}, asked for {layout!r}",
                )
            if not whole:
                try:
                    os.utime(fd)  # recency for the LRU, visible to every process
                except OSError:
                    pass  # a shared directory may hold files of other users
            return OK
        except OtherVersion as exc:  # another build's block: not ours to judge or delete
            return KeyResult(Status.MISS, str(exc))
        except BlockFormatError as exc:
            self._count_error()
            self._discard(name, inode)
            log.warning("ucm posix store: block %s is corrupt (%s); removed", name, exc)
            return KeyResult(Status.CORRUPT, str(exc))
        except OSError as exc:  # quick: not in memory (EAGAIN), or for an I/O thread to judge
            if quick:
                return None
            self._count_error()
            return KeyResult(Status.ERROR, f"cannot read block {name}: {exc.strerror}")
        finally:
            self._read_done(name, fd)

    def _read_done(self, name: str, fd: int) -> None:
        """The end of a read of block ``name``: its file closed (``fd`` >= 0), and no
        longer counted as being read."""
        if fd >= 0:
            os.close(fd)
        with self._lock:
            self._reading[name] -= 1
            if not self._reading[name]:
                del self._reading[name]

    def _discard(self, name: str, inode: int | None) -> None:
        """Remove a bad file at a block's name, unless a writer has replaced it with a new
        one meanwhile (``inode``: the file found bad)."""
        if self._read_only:
            return
        try:
            size = os.stat(block_relative(name), dir_fd=self._root_fd, follow_symlinks=False)
            # a file that was not a block (inode None) was never counted
            if unlink_in(self._root_fd, block_relative(name), inode) and inode is not None:
                self._uncount(size.st_size)
        except OSError:
            return

    def _count_error(self) -> None:
        with self._lock:
            self._errors += 1

    # -- the rest --

    def _exists(self, key: bytes) -> bool:
        return self._present(self._file_name(key))

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
            relative = block_relative(self._file_name(bytes(key)))
            try:
                st = os.stat(relative, dir_fd=self._root_fd, follow_symlinks=False)
                if not unlink_in(self._root_fd, relative, st.st_ino):
                    continue
            except FileNotFoundError:
                continue
            removed += 1
            self._uncount(st.st_size)
        return removed

    def usage(self) -> StoreUsage:
        self._scanned.wait()
        used, blocks = self._usage.read() if self._usage is not None else self._scanned_usage
        return StoreUsage(blocks, used, self._capacity.limit)

    @property
    def errors(self) -> int:
        return self._errors

    @property
    def evicted_blocks(self) -> int:
        return self._evicted

    def check_block_bytes(self, nbytes: int) -> None:
        stored = HEADER_BYTES + nbytes
        if self._capacity.refusal(stored):
            raise ConfigError(
                "store.capacity_gb",
                f"{self._capacity.limit} bytes ({self.config.capacity_gb}) cannot hold one "
                f"block of {stored} bytes",
            )

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=True)
            if self._evictor is not None and self._evicting_thread is not None:
                self._evictor.set()  # it sees the store closed and returns
                # a pass stops at its next block: the folder's descriptor outlives it
                self._evicting_thread.join()
            self._scanned.wait(5.0)  # a first scan still running finds the count closed
            if self._usage is not None:
                self._usage.close()
            if self._writer is not None:
                unregister_writer(self._root_fd, *self._writer)
            os.close(self._blocks_fd)
            os.close(self._root_fd)
