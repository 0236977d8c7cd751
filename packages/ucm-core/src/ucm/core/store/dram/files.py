"""The arena folder's files: opened only as this user's own, never through a link, and
locked only within a deadline.

A block in the arena decides what a model says, so the folder and every file in it must be
this user's and closed to others; a link planted where a file goes is refused, not
followed.  And every wait for a lock on the engine's path is bounded: a holder stopped (not
killed: SIGSTOP, a frozen container, a debugger) keeps its ``flock``, and would otherwise
stall every engine of the host.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import stat
import time

#: the arena's lock: creation, replacement and every change of its books
LOCK_FILE = "arena.lock"


#: libc's ``flock`` and ``lseek`` called holding the GIL.  The arena's lock is taken and let
#: go twice a chunk of a batch, and its file's size checked each time: Python's own calls
#: let go of the GIL for each of these microsecond calls, handing it to another copy thread
#: that then waits for the arena's lock (loads of 4 KiB blocks, two copy threads and a
#: waiter on two cores: 6.1 us a block through Python's calls, 5.6-5.7 holding the GIL)
_LIBC = ctypes.PyDLL(None, use_errno=True)
_LIBC.flock.argtypes = [ctypes.c_int, ctypes.c_int]
_LIBC.flock.restype = ctypes.c_int
_LIBC.lseek.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int]
_LIBC.lseek.restype = ctypes.c_int64


def try_flock(fd: int, kind: int) -> bool:
    """``flock(fd, kind | LOCK_NB)`` without letting go of the GIL: whether it was had
    (``OSError`` for anything but a lock held elsewhere)."""
    if _LIBC.flock(fd, kind | fcntl.LOCK_NB) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EINTR):  # EINTR: the loop asks again
        return False
    raise OSError(err, os.strerror(err))


def unlock(fd: int) -> None:
    """``flock(fd, LOCK_UN)`` without letting go of the GIL."""
    if _LIBC.flock(fd, fcntl.LOCK_UN) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def file_size(fd: int) -> int:
    """The size of the file open at ``fd`` (an ``lseek`` to its end, holding the GIL: an
    fstat costs several times more in Python); nothing may read ``fd`` at its offset."""
    size = _LIBC.lseek(fd, 0, os.SEEK_END)
    if size < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(size)


class ArenaBusy(Exception):
    """A lock was not had within its wait (a holder stopped, not dead), or the arena cannot
    be used at the moment; a call on the engine's path answers it as a miss or an error."""


def check_folder(folder: str) -> None:
    """Refuse ``folder`` unless it is a real folder of this user that nobody else can write
    (a block decides what the model says; the store checks the whole path at start-up)."""
    st = os.stat(folder, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise PermissionError(
            f"{folder} must be a folder (not a link) of uid {os.geteuid()} that no one else "
            f"can write (it is {stat.filemode(st.st_mode)}, uid {st.st_uid})"
        )


def open_own(path: str, flags: int) -> int:
    """Open a regular file of this user's that nobody else can use, never through a link."""
    fd = os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        os.close(fd)
        raise PermissionError(f"{path} is not a file of uid {os.geteuid()} closed to others")
    return fd


def open_own_or_create(path: str) -> int:
    """:func:`open_own` for reading and writing, made empty (mode 0600) where absent;
    ``PermissionError`` naming the path where something else lies there."""
    try:
        try:
            return open_own(path, os.O_RDWR)
        except FileNotFoundError:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            os.close(fd)
            return open_own(path, os.O_RDWR)
    except PermissionError:
        raise
    except OSError as exc:  # ELOOP: a link planted where the file goes
        raise PermissionError(f"{path} cannot be opened as a file of ours: {exc}") from None


def flock_until(fd: int, deadline: float, what: str, kind: int = fcntl.LOCK_EX) -> None:
    """``flock`` within the deadline (``time.monotonic``): at once when free, else polled;
    :class:`ArenaBusy` naming ``what`` once the deadline passes."""
    pause = 20e-6
    while not try_flock(fd, kind):
        if time.monotonic() >= deadline:
            raise ArenaBusy(
                f"{what} stayed locked past its wait (a process of this user holds it "
                "stopped: SIGSTOP, a frozen container or a debugger)"
            )
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)
