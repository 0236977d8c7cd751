"""Who may still write a slot: one lock per writer, which the kernel drops with its holder.

A slot being written belongs to its writer until the writer publishes it, gives it back, or
dies: a copy into it (a GPU's DMA, a CPU copy on another thread) may land at any moment
before that, so handing the slot to anybody else while its writer lives would let the late
bytes be sealed under another key.  Time cannot tell a slow writer from a dead one, and a
pid cannot either (a pid means another process, or nothing, in another PID namespace: two
containers sharing ``/dev/shm`` is the common deployment).  A lock can: each writer holds
an exclusive open-file-description lock on one byte of ``arena.writers`` (its writer
number) for as long as it lives, and the kernel releases it when the last descriptor of
that open file goes, however the process ended.  Whoever wants to know whether writer ``n``
lives asks the kernel whether byte ``n`` is locked (``F_OFD_GETLK``), through a
descriptor of its own (a lock never conflicts with its own holder).

A process that inherits a writer's descriptor across ``fork`` shares its lock, so the
writer counts as alive while either lives: never too early, which is the side to err on.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import threading

from ucm.core.store.dram.files import ArenaBusy, open_own, open_own_or_create

WRITERS_FILE = "arena.writers"
#: writer numbers: processes (and stores) of one host writing one arena at once
MAX_WRITERS = 4096
#: ``struct flock`` on Linux (x86_64, aarch64): type, whence, start, len, pid, padding
_FLOCK = struct.Struct("hhqqi4x")
_BUSY = (errno.EAGAIN, errno.EACCES)


class NoWriterNumber(ArenaBusy):
    """Every writer number is held by a live writer: no slot can be reserved now."""


def _lock_byte(fd: int, n: int, kind: int) -> bool:
    """Set (or clear) an OFD lock on byte ``n`` without waiting: whether it was had."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, n, 1, 0))
    except OSError as exc:
        if exc.errno in _BUSY:
            return False
        raise
    return True


class WriterLocks:
    """The writer locks of one arena folder: this object's own writer number, taken on
    first use (and again in a child after ``fork``), and the liveness of any number."""

    def __init__(self, folder: str) -> None:
        self._path = os.path.join(folder, WRITERS_FILE)
        self._probe = open_own_or_create(self._path)  # asks about others' locks only
        self._mine: tuple[int, int, int] | None = None  # (pid, fd, number)
        self._lock = threading.Lock()

    def number(self) -> tuple[int, bool]:
        """This writer's number, and whether it was taken just now (its slots from an earlier
        holder of the number, dead since, are then to be reclaimed)."""
        mine = self._mine
        pid = os.getpid()
        if mine is not None and mine[0] == pid:
            return mine[2], False
        with self._lock:
            mine = self._mine
            if mine is not None and mine[0] == pid:
                return mine[2], False
            if mine is not None:  # a child after fork: the parent keeps its own
                os.close(mine[1])
                self._mine = None
            fd = open_own(self._path, os.O_RDWR)
            try:
                for n in range(MAX_WRITERS):
                    if _lock_byte(fd, n, fcntl.F_WRLCK):
                        self._mine = (pid, fd, n)
                        return n, True
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
            raise NoWriterNumber(
                f"all {MAX_WRITERS} writer numbers of {self._path} are held by live processes"
            )

    def alive(self, n: int) -> bool:
        """Whether writer ``n`` holds its lock (this object's own number counts as alive)."""
        if not 0 <= n < MAX_WRITERS:
            return False
        answer = fcntl.fcntl(
            self._probe, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, n, 1, 0)
        )
        return bool(_FLOCK.unpack(answer)[0] != fcntl.F_UNLCK)

    def close(self) -> None:
        with self._lock:
            if self._mine is not None and self._mine[0] == os.getpid():
                os.close(self._mine[1])
            self._mine = None
            if self._probe >= 0:
                os.close(self._probe)
                self._probe = -1
