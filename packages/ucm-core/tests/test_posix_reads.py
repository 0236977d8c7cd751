"""The posix store's reads of blocks (``read_blocks``, compiled and in Python) and the reads
a thread that waits for a load does itself: from memory only, on local filesystems only."""

import os
import threading
import time

import numpy as np
import pytest
from ucm.core.block_format import HEADER_BYTES
from ucm.core.config import PosixStoreConfig
from ucm.core.digest import block_digest
from ucm.core.native import NATIVE
from ucm.core.store import PosixStore, Status
from ucm.core.store.posix import fileio
from ucm.core.store.posix import store as posix_store
from ucm.core.store.posix.fileio import (
    RWF_NOWAIT,
    NotABlock,
    NotAFolder,
    quick_read_flags,
    read_blocks,
)
from ucm.lab.page_cache import cached_pages

needs_library = pytest.mark.skipif(NATIVE is None, reason="ucm-core built without its library")


@pytest.fixture(params=["compiled", "python"])
def library(request, monkeypatch):
    if request.param == "compiled":
        if NATIVE is None:
            pytest.skip("ucm-core built without its library")
    else:
        monkeypatch.setattr(fileio, "_LIBRARY", None)
    return request.param


def blocks_folder(tmp_path) -> int:
    (tmp_path / "blocks").mkdir()
    return os.open(tmp_path / "blocks", os.O_RDONLY | os.O_DIRECTORY)


def written(tmp_path, name: str, payload: bytes) -> str:
    folder = tmp_path / "blocks" / name[:2]
    folder.mkdir(exist_ok=True)
    (folder / name).write_bytes(b"h" * HEADER_BYTES + payload)
    return str(folder / name)


def parts_of(sizes):
    return [memoryview(bytearray(n)) for n in sizes]


def headers_for(n: int) -> memoryview:
    return memoryview(bytearray(n * HEADER_BYTES))


@pytest.mark.parametrize("piece", [64, 1000, 2 << 20])
def test_a_chunk_of_blocks_is_read_into_parts_of_any_size_and_digested(
    tmp_path, library, monkeypatch, piece
):
    """Parts empty, shorter than a word, not a whole number of words, more than one read's
    vector, and larger than a read: each block's bytes land in order, its digest is the one
    of their concatenation, and its header and size come back beside it."""
    monkeypatch.setattr(fileio, "READ_PIECE", piece)
    blocks_fd = blocks_folder(tmp_path)
    try:
        sizes = [[0, 3, 8, 4096, 0, 13, 5000, 7, *[24] * 150, 0], [1 << 20], [8, 8]]
        rng = np.random.default_rng(piece)
        payloads = [rng.bytes(sum(s)) for s in sizes]
        names = [f"{i:02x}{'ab' * 15}" for i in range(len(sizes))]
        for name, payload in zip(names, payloads):
            written(tmp_path, name, payload)
        parts = [parts_of(s) for s in sizes]
        headers = headers_for(3)
        reads = read_blocks(blocks_fd, names, headers, [b"hhhh"] * 3, parts)
        for i, (read, payload) in enumerate(zip(reads, payloads)):
            size, inode, got, digest = read
            assert (size, got, digest) == (
                HEADER_BYTES + len(payload),
                HEADER_BYTES,
                block_digest(payload),
            )
            assert b"".join(bytes(p) for p in parts[i]) == payload
            assert bytes(headers[i * HEADER_BYTES : (i + 1) * HEADER_BYTES]) == b"h" * HEADER_BYTES
    finally:
        os.close(blocks_fd)


def test_what_is_not_a_whole_block_file_is_told_apart(tmp_path, library):
    """Absent, a link (never followed), a FIFO (not waited on), a folder that is a link, a
    file too short for the parts asked, a header that is not the one asked for (its parts
    left as they were): each block's own answer, the others read."""
    blocks_fd = blocks_folder(tmp_path)
    try:
        names = [
            "00" + "a" * 30,
            "01" + "b" * 30,
            "02" + "c" * 30,
            "03" + "d" * 30,
            "04" + "e" * 30,
            "05" + "f" * 30,
        ]
        written(tmp_path, names[0], b"x" * 1000)  # too short for 1200 bytes
        secret = tmp_path / "secret"
        secret.write_bytes(b"s" * (HEADER_BYTES + 1200))
        (tmp_path / "blocks" / "01").mkdir()
        os.symlink(secret, tmp_path / "blocks" / "01" / names[1])
        (tmp_path / "blocks" / "02").mkdir()
        os.mkfifo(tmp_path / "blocks" / "02" / names[2])
        os.symlink(tmp_path / "elsewhere", tmp_path / "blocks" / "03")
        written(tmp_path, names[5], b"y" * 1200)
        names.append("06" + "0" * 30)  # a header other than the one asked for
        written(tmp_path, names[6], b"z" * 1200)
        parts = [parts_of([600, 600]) for _ in names]
        reads = read_blocks(blocks_fd, names, headers_for(7), [b"hhhh"] * 6 + [b"UCMB"], parts)
        assert reads[6][3] is None and bytes(parts[6][0]) == bytes(600)  # its parts untouched
        assert reads[0][3] is None and reads[0][2] == HEADER_BYTES
        assert isinstance(reads[1], NotABlock) and "link" in str(reads[1])
        assert isinstance(reads[2], NotABlock) and "regular" in str(reads[2])
        assert isinstance(reads[3], NotAFolder)
        assert isinstance(reads[4], FileNotFoundError)
        assert reads[5][3] == block_digest(b"y" * 1200)
    finally:
        os.close(blocks_fd)


def page_cache_dropped(path) -> None:
    """The file's pages out of the page cache (the kernel may keep some through a drop,
    under writeback or memory pressure: a few tries, then the test is skipped rather than
    pass through the cache)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        for _ in range(50):
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if not cached_pages(fd, size):
                return
            time.sleep(0.02)
        pytest.skip("the page cache kept the test's block through every drop")
    finally:
        os.close(fd)


@needs_library
def test_a_read_from_memory_only_stops_at_a_page_the_cache_does_not_hold(tmp_path):
    blocks_fd = blocks_folder(tmp_path)
    try:
        if quick_read_flags(blocks_fd) != RWF_NOWAIT:
            pytest.skip("the test folder is not on a local disk's filesystem")
        name = "7f" + "0" * 30
        path = written(tmp_path, name, b"y" * (1 << 20))
        want = block_digest(b"y" * (1 << 20))
        [read] = read_blocks(
            blocks_fd, [name], headers_for(1), [b""], [parts_of([1 << 20])], RWF_NOWAIT
        )
        assert read[3] == want
        page_cache_dropped(path)
        [read] = read_blocks(
            blocks_fd, [name], headers_for(1), [b""], [parts_of([1 << 20])], RWF_NOWAIT
        )
        assert isinstance(read, BlockingIOError)
        [read] = read_blocks(blocks_fd, [name], headers_for(1), [b""], [parts_of([1 << 20])])
        assert read[3] == want
    finally:
        os.close(blocks_fd)


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
    """The waiting thread reads only what the page cache holds when it asks: a block it
    does not hold goes back to an I/O thread (held here until the waiting thread has tried
    every block), which reads it into a buffer of its own and copies it.  (A read from
    memory only starts the kernel's readahead of what it misses, and a fast disk can land
    it before the read looks again: then the block comes back from that read, whole.  Such
    a round shows no hand-off, and is run again, a bounded number of times.)"""
    store = PosixStore(PosixStoreConfig(path=str(tmp_path / "s"), io_threads=1, capacity_gb=None))
    try:
        if store._quick_flags != RWF_NOWAIT:
            pytest.skip("the test folder is not on a local disk's filesystem")
        keys, data = blocks(6, 100_000)
        assert all(r.ok for r in store.wait(store.dump(keys, data), 10))
        paths = [os.path.join(store.root, "blocks", store._relative(name))
                 for name in store._eviction_names(keys)]  # fmt: skip
        tried: list[tuple[bool, list]] = []
        read_chunk = store._read_chunk

        def spied(keys, outs, layout, quick):
            results = read_chunk(keys, outs, layout, quick)
            tried.append((quick, results))
            return results

        store._read_chunk = spied
        for _ in range(10):
            for path in paths:  # every block's pages out of the cache
                page_cache_dropped(path)
            tried.clear()
            held = threading.Event()
            store._pool.submit(held.wait, 30)
            threading.Timer(0.5, held.set).start()  # the I/O thread comes back after the tries
            out = [bytearray(len(d)) for d in data]
            assert all(r.ok for r in store.wait(store.load(keys, out), 10))
            assert [bytes(o) for o in out] == data
            quick = [r for is_quick, rs in tried if is_quick for r in rs]
            # what the waiting thread read came back whole, or was left over: none failed
            assert all(r is None or r.ok for r in quick)
            if len(quick) == 6 and None in quick:
                return  # left over, then read by the I/O thread: the data above
        pytest.skip("the disk landed every readahead before the read from memory looked again")
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


def test_a_batch_that_names_a_block_twice_fills_both_buffers(tmp_path, library):
    store = PosixStore(PosixStoreConfig(path=str(tmp_path / "s"), capacity_gb=None))
    try:
        keys, data = blocks(2, 10_000)
        assert all(r.ok for r in store.wait(store.dump(keys, data), 10))
        out = [bytearray(10_000) for _ in range(3)]
        assert all(r.ok for r in store.wait(store.load([keys[0], keys[1], keys[0]], out), 10))
        assert [bytes(o) for o in out] == [data[0], data[1], data[0]]
        assert not store._reading
    finally:
        store.close()


@needs_library
def test_a_cancel_never_waits_for_a_disk_and_nothing_lands_after_it(tmp_path, monkeypatch):
    """On a local filesystem a load writes the caller's buffers only from memory
    (``reads_from_memory``): a block not in the page cache is read into the I/O thread's
    own buffer first, a read a cancel does not wait for (held here, as a slow or failing
    disk would), and once cancelled, the block is not copied."""
    store = PosixStore(PosixStoreConfig(path=str(tmp_path / "s"), io_threads=1, capacity_gb=None))
    try:
        if store._quick_flags != RWF_NOWAIT:
            pytest.skip("the test folder is not on a local disk's filesystem")
        assert store.reads_from_memory
        keys, data = blocks(1, 100_000)
        assert all(r.ok for r in store.wait(store.dump(keys, data), 10))
        page_cache_dropped(
            os.path.join(store.root, "blocks", store._relative(store._file_name(keys[0])))
        )
        entered, opened = threading.Event(), threading.Event()
        real = posix_store.open_block_reading

        def held(*args, **kwargs):
            entered.set()
            assert opened.wait(10)
            return real(*args, **kwargs)

        monkeypatch.setattr(posix_store, "open_block_reading", held)
        out = [bytearray(100_000)]
        task = store.load(keys, out)
        assert entered.wait(10)
        assert task.cancel(wait=1) is True  # the disk read holds nothing of the caller's
        opened.set()
        assert [r.status for r in store.wait(task, 10)] == [Status.CANCELLED]
        assert out[0] == bytearray(100_000)
    finally:
        store.close()
