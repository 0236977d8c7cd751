"""What a posix store holds, counted once for every process that uses it.

Each process counting only what it wrote let four processes on a 4 MiB store hold 16 MiB:
on ``/dev/shm`` that is memory NCCL and the engines' queues need.  So the count lives in the
store, in the file ``PATH/usage`` (bytes and blocks published, two little-endian int64),
read and changed under a POSIX record lock: a lock the kernel drops with its process, so a
process killed at any moment leaves no lock held.  Reads and writes go through the file
(never a shared mapping): on a shared mount, taking the lock is what makes another host's
last write visible.

The count drifts only by what a process killed between publishing a block and counting it
leaves out, or by files removed by hand.  Every eviction pass, which scans the directory
anyway, sets it from what it found (:meth:`SharedUsage.resync`); the byte at offset 16 of
the same file is the lock that lets one pass run at a time across processes.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ucm.core.store.posix.fileio import O_CLOEXEC

USAGE_FILE = "usage"
EVICTING_FILE = "evicting"
_COUNT = struct.Struct("<qq")
#: Seconds a process waits for another's hold on the count before its write fails.
LOCK_WAIT_S = 10.0
_FLAGS = os.O_RDWR | os.O_CREAT | O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)


def peek(root: str) -> tuple[int, int]:
    """The count of the store at ``root`` read without its lock, ``(0, 0)`` where there is
    none: an estimate, for sizing (a torn read misjudges it, nothing more)."""
    try:
        with open(os.path.join(root, USAGE_FILE), "rb") as f:
            data = f.read(_COUNT.size)
    except OSError:
        return 0, 0
    if len(data) < _COUNT.size:
        return 0, 0
    used, blocks = _COUNT.unpack(data)
    return max(0, used), max(0, blocks)


class SharedUsage:
    """The shared count of one store (opened in the store's folder ``root_fd``).

    Each thread takes the count's ``flock`` through a descriptor of its own (an ``flock``
    excludes other open files, not the threads sharing one), so the kernel orders this
    process's threads as it orders other processes, and no thread waits for the lock while
    holding one of this process's: a holder stopped (SIGSTOP, a frozen container) costs one
    wait of :data:`LOCK_WAIT_S`, after which every call fails at once until the count is
    had again, instead of each key of a dump waiting its turn to wait."""

    def __init__(self, root_fd: int) -> None:
        self._fd = os.open(USAGE_FILE, _FLAGS, 0o600, dir_fd=root_fd)
        try:
            self._evicting = os.open(EVICTING_FILE, _FLAGS, 0o600, dir_fd=root_fd)
        except BaseException:
            os.close(self._fd)
            raise
        self._root_fd = root_fd
        self._local = threading.local()
        self._thread_fds: list[int] = []
        self._fds_lock = threading.Condition()
        self._closed = False
        self._active = 0  # threads inside _locked: close() waits for them (bounded)
        #: a wait for the count ran out: later calls try once, without waiting, until one
        #: has it (a stopped holder would otherwise cost every call the whole wait)
        self._stuck = False
        self._evict_lock = threading.Lock()
        #: whether no process has counted the store yet (a new file, or one cut short)
        self.fresh = False
        try:
            with self._locked():
                self.fresh = os.fstat(self._fd).st_size < _COUNT.size
                if self.fresh:
                    os.pwrite(self._fd, _COUNT.pack(0, 0), 0)
        except TimeoutError:  # start anyway: dumps fail, with this reason, until it is had
            pass

    def _thread_fd(self) -> int:
        fd: int | None = getattr(self._local, "fd", None)
        if fd is None:
            with self._fds_lock:
                fd = os.open(USAGE_FILE, _FLAGS, 0o600, dir_fd=self._root_fd)
                if os.fstat(fd).st_ino != os.fstat(self._fd).st_ino:
                    os.close(fd)  # replaced since the store opened it: not our count
                    raise OSError(errno.ESTALE, "the store's usage file was replaced")
                self._thread_fds.append(fd)
            self._local.fd = fd
        return fd

    @contextmanager
    def _locked(self) -> Iterator[None]:
        # Held for a read and a write of 16 bytes: microseconds.  Still bounded: a holder
        # stopped (SIGSTOP, a frozen container) must not stop every writer of the store.
        with self._fds_lock:
            if self._closed:
                raise ValueError("the store's usage count is closed")
            self._active += 1  # its descriptor stays open until this section ends
        try:
            fd = self._thread_fd()
            wait = 0.0 if self._stuck else LOCK_WAIT_S
            try:
                _lock_within(fd, wait, "the store's usage count", self)
            except TimeoutError:
                self._stuck = True
                raise
            self._stuck = False
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            with self._fds_lock:
                self._active -= 1
                self._fds_lock.notify_all()

    def _read(self) -> tuple[int, int]:
        data = os.pread(self._fd, _COUNT.size, 0)
        if len(data) < _COUNT.size:
            return 0, 0
        used, blocks = _COUNT.unpack(data)
        return max(0, used), max(0, blocks)

    def read(self) -> tuple[int, int]:
        """(bytes, blocks) the store holds."""
        with self._locked():
            return self._read()

    def add(self, nbytes: int, blocks: int) -> tuple[int, int]:
        """Count ``nbytes`` in ``blocks`` more (negative: fewer); returns the new count."""
        with self._locked():
            used, count = self._read()
            new = (max(0, used + nbytes), max(0, count + blocks))
            os.pwrite(self._fd, _COUNT.pack(*new), 0)
            return new

    def resync(
        self,
        found: tuple[int, int],
        before: tuple[int, int],
        removed: tuple[int, int] | None = None,
    ) -> tuple[int, int]:
        """Set the count from a scan: ``found`` on disk (after the pass's own removals), plus
        what other processes changed since ``before`` was read (when the scan began).

        That overcounts blocks published while the scan ran and also seen by it, so after
        an eviction pass that ``removed`` (bytes, blocks) the count is the smaller of it and
        the count less what was removed: exact unless the count had drifted up (files
        removed by hand), which the scan then corrects."""
        with self._locked():
            now = self._read()
            new = (
                max(0, found[0] + now[0] - before[0]),
                max(0, found[1] + now[1] - before[1]),
            )
            if removed is not None:
                new = (
                    max(0, min(new[0], now[0] - removed[0])),
                    max(0, min(new[1], now[1] - removed[1])),
                )
            os.pwrite(self._fd, _COUNT.pack(*new), 0)
            self.fresh = False
            return new

    @contextmanager
    def eviction(self, timeout: float) -> Iterator[bool]:
        """The right to run an eviction pass, waited for up to ``timeout`` seconds (another
        process's pass makes room too); yields whether it was had."""
        deadline = time.monotonic() + timeout
        if not self._evict_lock.acquire(timeout=timeout):
            yield False
            return
        try:
            try:
                _lock_within(self._evicting, deadline - time.monotonic(), "an eviction pass", None)
            except TimeoutError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(self._evicting, fcntl.LOCK_UN)
        finally:
            self._evict_lock.release()

    def close(self) -> None:
        with self._fds_lock:
            if self._closed:
                return
            self._closed = True
            # a section in progress ends within its wait: its descriptor is not closed
            # (and its number not reused) under it
            self._fds_lock.wait_for(lambda: self._active == 0, LOCK_WAIT_S + 1.0)
            for fd in (self._fd, self._evicting, *self._thread_fds):
                os.close(fd)
            self._thread_fds = []


def _lock_within(fd: int, seconds: float, what: str, usage: SharedUsage | None) -> None:
    """``flock`` ``fd`` exclusively, waiting at most ``seconds`` (``TimeoutError``), or
    until another thread's wait on ``usage`` ran out."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
        if time.monotonic() >= deadline or (usage is not None and usage._stuck):
            raise TimeoutError(
                f"{what} stayed locked by another process past {LOCK_WAIT_S:g} s (a process "
                "stopped while holding it, or a slow shared mount); nothing is stored "
                "until it is free"
            )
        time.sleep(0.001)
