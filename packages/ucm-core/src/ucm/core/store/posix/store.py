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

import contextlib
import errno
import logging
import os
import stat
import threading
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Sequence

from ucm.core.block_format import (
    HEADER_BYTES,
    BlockFormatError,
    BlockHeader,
    OtherVersion,
    decode_header,
    encode_header,
    header_prefix,
    verify_payload,
)
from ucm.core.settings import GIB, ConfigError
from ucm.core.signing import signer_for
from ucm.core.store.base import Store, StoreUsage, check_batch, check_keys
from ucm.core.store.chunks import chunk_size
from ucm.core.store.evictions import EvictionWatch
from ucm.core.store.folder import check_before_creating, check_store_folder
from ucm.core.store.payload import Payload, copy_parts, fill_parts
from ucm.core.store.posix.capacity import Capacity
from ucm.core.store.posix.config import AUTO, PosixStoreConfig
from ucm.core.store.posix.fileio import (
    O_CLOEXEC,
    O_DIRECT,
    RWF_NOWAIT,
    Bounce,
    NotABlock,
    open_block_folder,
    open_block_reading,
    open_dir,
    pread_into,
    pwrite_all,
    quick_read_flags,
    read_blocks,
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

    @property
    def reads_from_memory(self) -> bool:
        """On a local filesystem a load writes the caller's buffers only from memory: from
        the page cache (or tmpfs), or from a block this store's thread read into its own
        buffer first (see :meth:`load`)."""
        return self._quick_flags is not None

    def load(self, keys: Sequence[bytes], buffers: Sequence[object], layout: bytes = b"") -> Task:
        """Blocks read in chunks (:func:`chunk_size`), taken by the I/O threads and by the
        thread that waits for the task (:meth:`Task.help_with`) as each comes free.

        A chunk is one compiled call (:func:`read_blocks`) that reads each block straight
        into its buffers and digests it.  On a local filesystem it reads only what is in
        memory: a block that is not is read by an I/O thread into a buffer of its own, and
        copied into the caller's only then and only if the task was not cancelled (a
        cancel waits for copies, never for a disk).  The waiting thread reads only from
        memory; what it cannot read goes to the I/O threads.  A signed store, and one read
        with O_DIRECT, read every block that way (its MAC is computed in Python; O_DIRECT
        needs an aligned buffer)."""
        self._check_open()
        views = check_batch(keys, buffers, writable=True)
        named = [bytes(k) for k in keys]
        n = len(named)
        task = Task(n)
        if n == 0:
            return task
        threads = self.config.io_thread_count
        size = chunk_size(n, views[0].nbytes, threads)
        chunks = iter([range(at, min(n, at + size)) for at in range(0, n, size)])

        def read(chunk: range, quick: bool) -> list[KeyResult | None]:
            return self._read_chunk(
                [named[i] for i in chunk], [views[i] for i in chunk], layout, quick
            )

        def staged(i: int) -> None:
            self._load_staged(task, i, named[i], views[i], layout)

        def take_all() -> None:
            for chunk in chunks:  # shared: each thread takes the next chunk (GIL-atomic)
                for i in task.try_keys(chunk, lambda chunk=chunk: read(chunk, False)):  # type: ignore[misc]
                    staged(i)

        def take_one() -> bool:
            chunk = next(chunks, None)
            if chunk is None:
                return False
            for i in task.try_keys(chunk, lambda: read(chunk, True)):
                try:
                    self._pool.submit(staged, i)
                except RuntimeError:  # the store closed meanwhile
                    task.set_result(i, KeyResult(Status.ERROR, "the store was closed"))
            return True

        for _ in range(min(threads, -(-n // size))):
            self._pool.submit(take_all)
        if self._quick_flags is not None and not (self._direct or self._signer is not None):
            task.help_with(take_one)  # (a signed or O_DIRECT store's blocks are all staged)
        return task

    def _read_chunk(
        self, keys: list[bytes], outs: list[Payload], layout: bytes, quick: bool
    ) -> list[KeyResult | None]:
        """Read blocks ``keys`` into ``outs`` in one call, then check each: its header must
        name its key and the size asked for, its payload match the digest.  None for a
        block left to :meth:`_load_staged`: not all in memory (on a local filesystem), or,
        ``quick`` (the waiting thread), failed for any cause but what its file holds; every
        block of a signed or O_DIRECT store."""
        if self._direct or self._signer is not None:
            return [None] * len(keys)
        # on a local filesystem, from memory only (a miss starts the kernel's readahead of
        # it, which the read does not wait for: a fast disk may land it before it looks again)
        flags = self._quick_flags or 0
        names = [self._file_name(key) for key in keys]
        headers = memoryview(self._bounce.pages(len(keys)))
        with self._reading_blocks(names):
            reads = read_blocks(
                self._blocks_fd,
                names,
                headers,
                [header_prefix(key, out.nbytes) for key, out in zip(keys, outs)],
                [out.parts for out in outs],
                flags,
            )
        partial = quick or bool(flags & RWF_NOWAIT)  # a read may stop at a page not in memory
        results: list[KeyResult | None] = []
        for i, (key, out, name, read) in enumerate(zip(keys, outs, names, reads)):
            if isinstance(read, Exception):
                again = not isinstance(read, (FileNotFoundError, NotABlock)) and (
                    quick or isinstance(read, BlockingIOError)
                )
                results.append(None if again else self._open_failed(name, read))
                continue
            size, inode, got, digest = read
            page = headers[i * HEADER_BYTES : (i + 1) * HEADER_BYTES]

            def check(header: BlockHeader, digest: int | None = digest) -> None:
                if digest is None:  # its header as asked, long enough when it was opened
                    raise BlockFormatError("file shrank while being read")
                if digest != header.payload_checksum:
                    raise BlockFormatError("payload checksum mismatch")

            results.append(
                self._judge(key, out, layout, name, page, size, inode, got, check, partial)
            )
        return results

    def _load_staged(self, task: Task, i: int, key: bytes, out: Payload, layout: bytes) -> None:
        """Key ``i`` of ``task``: its block read whole into this thread's buffer (the header
        checked after: nothing read sizes the read, the buffer is ``out``'s size), then,
        unless the task was cancelled meanwhile, checked and copied into ``out``.  The read
        is not counted as work on the caller's buffers: a cancel does not wait for it."""
        name = self._file_name(key)
        wanted = HEADER_BYTES + out.nbytes
        view = memoryview(self._bounce.get(round_up(wanted)))
        page = view[:HEADER_BYTES]
        read = 0
        try:
            with self._reading_blocks([name]):
                fd, size, inode, got = open_block_reading(
                    self._blocks_fd, name, page, direct=self._direct
                )
                try:
                    if got >= HEADER_BYTES and size >= wanted:
                        area = view[HEADER_BYTES : round_up(wanted) if self._direct else wanted]
                        read = pread_into(fd, area, HEADER_BYTES)
                        try:
                            os.utime(fd)  # recency for the LRU, visible to every process
                        except OSError:
                            pass  # a shared directory may hold files of other users
                finally:
                    os.close(fd)
        except (OSError, NotABlock) as exc:
            failed = exc
            task.run_key(i, lambda: self._open_failed(name, failed))
            return

        def check(header: BlockHeader) -> None:
            stored = view[HEADER_BYTES:wanted]
            if read < out.nbytes:  # long enough when it was opened
                raise BlockFormatError("file shrank while being read")
            verify_payload(header, stored, self._signer)  # of one contiguous run
            fill_parts(out.parts, stored)

        def judged() -> KeyResult:
            result = self._judge(key, out, layout, name, page, size, inode, got, check)
            assert result is not None  # None only for a partial read
            return result

        task.run_key(i, judged)

    @contextlib.contextmanager
    def _reading_blocks(self, names: list[str]) -> Iterator[None]:
        """Blocks ``names`` counted as being read by this process meanwhile (an eviction
        pass leaves them)."""
        with self._lock:
            self._reading.update(names)
        try:
            yield
        finally:
            with self._lock:
                self._reading.subtract(names)
                for name in set(names):
                    if not self._reading[name]:
                        del self._reading[name]

    def _open_failed(self, name: str, exc: Exception) -> KeyResult:
        """The result of a block whose file could not be opened or read."""
        if isinstance(exc, FileNotFoundError):
            return MISS
        if isinstance(exc, NotABlock):
            self._count_error()
            self._discard(name, None)
            log.warning("ucm posix store: block %s is %s; removed", name, exc)
            return KeyResult(Status.CORRUPT, str(exc))
        self._count_error()
        why = getattr(exc, "strerror", None) or exc
        return KeyResult(Status.ERROR, f"cannot read block {name}: {why}")

    def _judge(
        self,
        key: bytes,
        out: Payload,
        layout: bytes,
        name: str,
        page: memoryview,
        size: int,
        inode: int,
        got: int,
        payload: Callable[[BlockHeader], None],
        partial: bool = False,
    ) -> KeyResult | None:
        """A block's result from its header (``got`` bytes of it in ``page``) and the file's
        ``size``: it counts only if the header names ``key`` and the size asked for, and
        ``payload(header)`` (the check of the payload, and its copy) passes.  A corrupt
        block is removed (unless a writer replaced its file, ``inode``, meanwhile).  None:
        ``partial``, and the header was not all read (a page not in memory)."""
        try:
            if got < HEADER_BYTES:
                if partial:
                    return None
                raise BlockFormatError(f"file truncated: {got} bytes")
            header = decode_header(page, expect_key=key, signer=self._signer)
            if header.payload_len != out.nbytes:  # the caller's mistake: the block is fine
                self._count_error()
                return KeyResult(
                    Status.ERROR,
                    f"buffer is {out.nbytes} bytes but the stored block holds {header.payload_len}",
                )
            if size < HEADER_BYTES + out.nbytes:
                raise BlockFormatError(f"file truncated: payload of {out.nbytes} bytes incomplete")
            payload(header)
            if header.layout != layout:  # the caller's mistake: the block itself is fine
                self._count_error()
                return KeyResult(
                    Status.ERROR,
                    f"stored block has layout {header.layout!r}, asked for {layout!r}",
                )
            return OK
        except OtherVersion as exc:  # another build's block: not ours to judge or delete
            return KeyResult(Status.MISS, str(exc))
        except BlockFormatError as exc:
            self._count_error()
            self._discard(name, inode)
            log.warning("ucm posix store: block %s is corrupt (%s); removed", name, exc)
            return KeyResult(Status.CORRUPT, str(exc))

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
