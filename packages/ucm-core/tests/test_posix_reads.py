"""The posix store's payload reads (``read_digested``, compiled and in Python) and the reads a
thread that waits for a load does itself: from memory only, on local filesystems only."""

import os
import threading

import numpy as np
import pytest
from ucm.core.block_format import BlockFormatError
from ucm.core.config import PosixStoreConfig
from ucm.core.digest import block_digest
from ucm.core.native import NATIVE
from ucm.core.store import PosixStore
from ucm.core.store.posix import fileio
from ucm.core.store.posix.fileio import RWF_NOWAIT, quick_read_flags, read_digested

needs_library = pytest.mark.skipif(NATIVE is None, reason="ucm-core built without its library")
OFFSET = 4096  # where a block's payload starts in its file


@pytest.fixture(params=["compiled", "python"])
def library(request, monkeypatch):
    if request.param == "compiled":
        if NATIVE is None:
            pytest.skip("ucm-core built without its library")
    else:
        monkeypatch.setattr(fileio, "_LIBRARY", None)
    return request.param


def written(path, payload: bytes) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.pwrite(fd, b"h" * OFFSET + payload, 0)
    return fd


def parts_of(sizes):
    return [memoryview(bytearray(n)) for n in sizes]


@pytest.mark.parametrize("piece", [64, 1000, 2 << 20])
def test_a_read_fills_parts_of_any_size_and_digests_what_it_read(
    tmp_path, library, monkeypatch, piece
):
    """Parts empty, shorter than a word, not a whole number of words, more than one read's
    vector, and larger than a read: the bytes land in order and the digest is the one of
    their concatenation."""
    monkeypatch.setattr(fileio, "READ_PIECE", piece)
    sizes = [0, 3, 8, 4096, 0, 13, 5000, 7, *[24] * 150, 0]
    payload = np.random.default_rng(piece).bytes(sum(sizes))
    fd = written(tmp_path / "block", payload)
    try:
        parts = parts_of(sizes)
        assert read_digested(fd, parts, OFFSET) == block_digest(payload)
        assert b"".join(bytes(p) for p in parts) == payload
    finally:
        os.close(fd)


def test_a_file_that_ends_before_the_parts_are_full_is_a_format_error(tmp_path, library):
    fd = written(tmp_path / "block", b"x" * 1000)
    try:
        with pytest.raises(BlockFormatError, match="shrank"):
            read_digested(fd, parts_of([600, 600]), OFFSET)
    finally:
        os.close(fd)


def page_cache_dropped(fd: int) -> None:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


@needs_library
def test_a_read_from_memory_only_stops_at_a_page_the_cache_does_not_hold(tmp_path):
    fd = written(tmp_path / "block", b"y" * (1 << 20))
    try:
        if quick_read_flags(fd) != RWF_NOWAIT:
            pytest.skip("the test folder is not on a local disk's filesystem")
        parts = parts_of([1 << 20])
        assert read_digested(fd, parts, OFFSET, RWF_NOWAIT) == block_digest(b"y" * (1 << 20))
        page_cache_dropped(fd)
        with pytest.raises(BlockingIOError):
            read_digested(fd, parts_of([1 << 20]), OFFSET, RWF_NOWAIT)
        assert read_digested(fd, parts, OFFSET) == block_digest(b"y" * (1 << 20))
    finally:
        os.close(fd)


@needs_library
def test_a_waiting_thread_reads_only_from_local_filesystems(tmp_path, monkeypatch):
    """tmpfs: memory, read as it is; a local disk's: from its page cache only; anything
    else (here /proc, standing for NFS, SMB or FUSE, where an open can wait on a server):
    not at all, nor without the compiled library."""
    for path, flags in [("/dev/shm", 0), ("/proc", None)]:
        fd = os.open(path, os.O_RDONLY)
        try:
            assert quick_read_flags(fd) == flags, path
        finally:
            os.close(fd)
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        assert quick_read_flags(fd) in (RWF_NOWAIT, 0, None)
        monkeypatch.setattr(fileio, "_LIBRARY", None)
        assert quick_read_flags(fd) is None
    finally:
        os.close(fd)


def blocks(n: int, size: int):
    rng = np.random.default_rng(n)
    return [rng.bytes(16) for _ in range(n)], [rng.bytes(size) for _ in range(n)]


@pytest.fixture(params=["disk", "tmpfs"])
def folder(request, tmp_path):
    if request.param == "tmpfs":
        path = os.path.join("/dev/shm", f"ucm-test-{os.getpid()}-{tmp_path.name}")
        yield path
        import shutil

        shutil.rmtree(path, ignore_errors=True)
    else:
        yield str(tmp_path / "store")


@needs_library
def test_a_thread_that_waits_for_a_load_reads_it_when_the_io_threads_are_busy(folder):
    """A vLLM worker waits for a sync load with its compute core idle: it reads the blocks
    no I/O thread has taken yet.  Here the store's only I/O thread is held elsewhere, and
    the load still finishes, on the thread that waits for it."""
    store = PosixStore(PosixStoreConfig(path=folder, io_threads=1, capacity_gb=None))
    try:
        if store._quick_flags is None:
            pytest.skip("the test folder is not on a local filesystem")
        keys, data = blocks(12, 300_000)
        assert all(r.ok for r in store.wait(store.dump(keys, data), 10))
        held = threading.Event()
        store._pool.submit(held.wait, 30)  # the store's only thread, busy
        try:
            out = [bytearray(len(d)) for d in data]
            assert all(r.ok for r in store.wait(store.load(keys, out), 10))
            assert [bytes(o) for o in out] == data
        finally:
            held.set()
    finally:
        store.close()


@needs_library
def test_a_block_not_in_memory_is_left_to_an_io_thread(tmp_path):
    """The waiting thread reads nothing from the disk itself: a block the page cache does
    not hold goes back to an I/O thread (held here until the waiting thread has tried every
    block), which reads it."""
    store = PosixStore(PosixStoreConfig(path=str(tmp_path / "s"), io_threads=1, capacity_gb=None))
    try:
        if store._quick_flags != RWF_NOWAIT:
            pytest.skip("the test folder is not on a local disk's filesystem")
        keys, data = blocks(6, 100_000)
        assert all(r.ok for r in store.wait(store.dump(keys, data), 10))
        for name in store._eviction_names(keys):  # every block's pages out of the cache
            fd = os.open(os.path.join(store.root, "blocks", store._relative(name)), os.O_RDONLY)
            try:
                page_cache_dropped(fd)
            finally:
                os.close(fd)
        tried: list[tuple[bool, object]] = []
        read_block = store._read_block

        def spied(*args, quick):
            result = read_block(*args, quick=quick)
            tried.append((quick, result))
            return result

        store._read_block = spied
        held = threading.Event()
        store._pool.submit(held.wait, 30)
        threading.Timer(0.5, held.set).start()  # the I/O thread comes back after the tries
        out = [bytearray(len(d)) for d in data]
        assert all(r.ok for r in store.wait(store.load(keys, out), 10))
        assert [bytes(o) for o in out] == data
        assert [r for quick, r in tried if quick] == [None] * 6  # each left to the I/O thread
        assert sum(not quick for quick, _ in tried) == 6
    finally:
        store.close()


@pytest.mark.parametrize("library", ["compiled", "python"], indirect=True)
def test_blocks_read_alike_with_or_without_the_library(tmp_path, library):
    """The compiled open and read and their Python forms: a block comes back, a changed
    byte is a corrupt block removed, a link at a block's path is never followed."""
    store = PosixStore(PosixStoreConfig(path=str(tmp_path / "s"), capacity_gb=None))
    try:
        keys, data = blocks(3, 50_000)
        assert all(r.ok for r in store.wait(store.dump(keys, data), 10))
        out = [bytearray(len(d)) for d in data]
        assert all(r.ok for r in store.wait(store.load(keys, out), 10))
        assert [bytes(o) for o in out] == data
        names = store._eviction_names(keys)
        path = [os.path.join(store.root, "blocks", store._relative(n)) for n in names]
        with open(path[1], "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 1]))
        secret = tmp_path / "secret"
        os.rename(path[0], secret)
        os.symlink(secret, path[0])
        results = store.wait(store.load(keys, out), 10)
        assert [r.status.name for r in results] == ["CORRUPT", "CORRUPT", "OK"]
        assert "link" in results[0].detail and "checksum" in results[1].detail
        assert not os.path.lexists(path[0]) and not os.path.exists(path[1])
        assert secret.exists()
    finally:
        store.close()
