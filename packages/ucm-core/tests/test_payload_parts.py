"""Keys whose buffer is a list of buffers (scatter-gather), and cancelling a task in flight."""

import os
import threading
import time

import numpy as np
import pytest
import xxhash
from ucm.core.block_format import HEADER_BYTES, decode_header
from ucm.core.config import DramStoreConfig, PosixStoreConfig
from ucm.core.digest import block_digest
from ucm.core.store import DramStore, Payload, PosixStore, Status, TieredStore
from ucm.core.store.posix import scan_store, verify_block_file
from ucm.core.store.posix import store as posix_store


def key(i: int) -> bytes:
    return xxhash.xxh3_128_digest(i.to_bytes(8, "little"))


def blob(i: int, size: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


def cut(data: bytes, sizes: list[int]) -> list[bytearray]:
    """``data`` as consecutive parts of ``sizes`` (the last takes the rest)."""
    parts, at = [], 0
    for n in sizes:
        parts.append(bytearray(data[at : at + n]))
        at += n
    parts.append(bytearray(data[at:]))
    return parts


@pytest.fixture(params=["posix", "posix-o_direct", "dram-process", "tiered"])
def kind(request):
    """This file's kinds of the shared ``store`` fixture (conftest.py)."""
    return request.param


# Part sizes: tiny, empty, unaligned, large.
SIZES = [1, 0, 4095, 300 << 10, 17, 0, 64 << 10]


@pytest.mark.parametrize("piece", [None, 4096, 5000], ids=["default", "page", "odd"])
def test_parts_and_one_buffer_are_the_same_block(store, piece, monkeypatch):
    if piece is not None:  # reads cut into many pieces, some parts cut, some grouped
        monkeypatch.setattr("ucm.core.store.posix.fileio.READ_PIECE", piece)
    data = [blob(i, 700 << 10) for i in range(3)]
    keys = [key(i) for i in range(3)]
    # key 0 dumped as parts and key 1 as one buffer; both read back both ways
    assert all(r.ok for r in store.wait(store.dump(keys[:1], [cut(data[0], SIZES)])))
    assert all(r.ok for r in store.wait(store.dump(keys[1:2], [data[1]])))
    for i in (0, 1):
        whole = bytearray(len(data[i]))
        parts = cut(bytes(len(data[i])), SIZES)
        assert store.wait(store.load([keys[i]], [whole]))[0].ok
        assert store.wait(store.load([keys[i]], [parts]))[0].ok
        assert bytes(whole) == data[i] and b"".join(parts) == data[i]


def test_stored_file_is_the_one_buffer_format(tmp_path):
    with PosixStore(PosixStoreConfig(path=str(tmp_path / "p"))) as s:
        data = blob(5, 100_000)
        assert s.wait(s.dump([key(5)], [cut(data, [10, 20_000, 333])]))[0].ok
        (block,) = scan_store(s.root).blocks
        assert verify_block_file(block.path) is None
        with open(block.path, "rb") as f:
            raw = f.read()
        header = decode_header(raw[:HEADER_BYTES], expect_key=key(5))
        assert header.payload_checksum == block_digest(data)
        assert raw[HEADER_BYTES:] == data


def test_more_parts_than_one_system_call_takes(store):
    n = 2500  # past IOV_MAX (1024 on Linux)
    data = blob(9, n * 8)
    parts = cut(data, [8] * (n - 1))
    assert store.wait(store.dump([key(9)], [parts]))[0].ok
    back = cut(bytes(len(data)), [8] * (n - 1))
    assert store.wait(store.load([key(9)], [back]))[0].ok
    assert b"".join(back) == data


def test_numpy_row_views_are_loaded_in_place(store):
    cache = np.zeros((4, 3, 1000), dtype=np.uint8)  # 4 blocks of 3 layers
    data = blob(3, 3000)
    assert store.wait(store.dump([key(3)], [data]))[0].ok
    assert store.wait(store.load([key(3)], [[cache[2, j] for j in range(3)]]))[0].ok
    assert cache[2].tobytes() == data and not cache[[0, 1, 3]].any()


def test_bad_parts_are_refused_before_any_io(store):
    with pytest.raises(ValueError, match=r"buffers\[0\] is an empty list"):
        store.dump([key(1)], [[]])
    with pytest.raises(TypeError, match=r"buffers\[0\]\[1\] must support the buffer protocol"):
        store.dump([key(1)], [[b"ab", 3]])
    with pytest.raises(ValueError, match=r"buffers\[0\]\[0\] is read-only"):
        store.load([key(1)], [[b"ab", bytearray(2)]])
    assert store.lookup([key(1)]) == [False]


def test_parts_of_the_wrong_total_size_are_an_error(store):
    store.wait(store.dump([key(1)], [blob(1, 5000)]))
    (result,) = store.wait(store.load([key(1)], [[bytearray(4000), bytearray(999)]]))
    assert result.status is Status.ERROR
    assert store.lookup([key(1)]) == [True]


class Views:
    """A deferred payloads' source: per block, its parts as views; counts what is made."""

    def __init__(self, blocks: list[list[bytearray]]) -> None:
        self.blocks = blocks
        self.made = 0

    def __getitem__(self, i: int) -> list[memoryview]:
        self.made += 1
        return [memoryview(p) for p in self.blocks[i]]


def test_deferred_payloads_are_made_when_moved(store):
    data = [blob(i, 333_333) for i in range(3)]
    keys = [key(i) for i in range(3)]
    src = Views([cut(d, SIZES) for d in data])
    dumps = [Payload.deferred(len(data[i]), src, i) for i in range(3)]
    assert src.made == 0  # nothing made before the store moves the block
    assert all(r.ok for r in store.wait(store.dump(keys, dumps)))
    made = src.made
    assert made >= 3  # a tiered store moves each block twice
    dst = Views([cut(bytes(len(d)), SIZES) for d in data])
    loads = [Payload.deferred(len(data[i]), dst, i) for i in (2, 0, 1)]
    assert all(r.ok for r in store.wait(store.load([keys[2], keys[0], keys[1]], loads)))
    assert [b"".join(p) for p in dst.blocks] == data
    assert dst.made >= 3


def test_a_deferred_payload_of_the_wrong_size_fails_its_key_only(store):
    src = Views([[bytearray(b"x" * 10)], [bytearray(b"y" * 20)]])
    results = store.wait(
        store.dump([key(1), key(2)], [Payload.deferred(12, src, 0), Payload.deferred(20, src, 1)])
    )
    assert [r.status for r in results] == [Status.ERROR, Status.OK]
    assert "promised 12" in results[0].detail
    assert store.lookup([key(1), key(2)]) == [False, True]


def test_corrupt_block_read_into_parts_is_a_miss(tmp_path):
    with PosixStore(PosixStoreConfig(path=str(tmp_path / "p"))) as s:
        s.wait(s.dump([key(1)], [blob(1, 50_000)]))
        (block,) = scan_store(s.root).blocks
        with open(block.path, "r+b") as f:
            f.seek(HEADER_BYTES + 40_000)
            f.write(b"\xff\x00")
        (result,) = s.wait(s.load([key(1)], [cut(bytes(50_000), [1000, 30_000])]))
        assert result.status is Status.CORRUPT
        assert s.lookup([key(1)]) == [False]


# --- cancelling -------------------------------------------------------------------------------


class Gate:
    """Holds the first call of ``where.<name>`` made by the store's threads until opened."""

    def __init__(self, monkeypatch, name: str, where=os) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()
        real = getattr(where, name)

        def held(*args, **kwargs):
            if threading.current_thread().name.startswith("ucm-posix"):
                self.entered.set()
                assert self.opened.wait(10)
            return real(*args, **kwargs)

        monkeypatch.setattr(where, name, held)


def test_a_dump_cancelled_in_progress_is_not_published(tmp_path, monkeypatch):
    with PosixStore(PosixStoreConfig(path=str(tmp_path / "p"), io_threads=1)) as s:
        gate = Gate(monkeypatch, "pwritev")
        task = s.dump([key(1), key(2)], [blob(1, 8192), blob(2, 8192)])
        assert gate.entered.wait(10)
        assert task.cancel(wait=0.05) is False  # key 1 is still being written
        gate.opened.set()
        assert task.cancel(wait=10) is True
        assert [r.status for r in s.wait(task, 0)] == [Status.CANCELLED, Status.CANCELLED]
        assert s.lookup([key(1), key(2)]) == [False, False]
        scan = scan_store(s.root)
        assert scan.blocks == [] and scan.foreign == []
        leftovers = [n for _, _, files in os.walk(s.root) for n in files if n.endswith(".tmp")]
        assert leftovers == []
        assert s.usage().bytes == 0


def test_cancel_waits_for_a_load_in_progress(tmp_path, monkeypatch):
    """A load reads a chunk of blocks at a time (here 32 and then 8): a cancel waits for the
    chunk in progress, and the next one is never read."""
    with PosixStore(PosixStoreConfig(path=str(tmp_path / "p"), io_threads=1)) as s:
        data = blob(1, 8192)
        keys = [key(i) for i in range(40)]
        s.wait(s.dump(keys, [data] * 40))
        gate = Gate(monkeypatch, "read_blocks", posix_store)
        out = [bytearray(8192) for _ in keys]
        task = s.load(keys, out)
        assert gate.entered.wait(10)
        threading.Timer(0.2, gate.opened.set).start()
        assert task.cancel(wait=10) is True
        # once cancel returned, nothing writes the buffers any more
        assert task.done()
        assert [r.status for r in task.wait(0)] == [Status.OK] * 32 + [Status.CANCELLED] * 8
        assert all(bytes(o) == data for o in out[:32])
        assert all(o == bytearray(8192) for o in out[32:])


def test_cancelling_a_tiered_load_cancels_the_backing_load(tmp_path, monkeypatch):
    dram = DramStore(DramStoreConfig(capacity_gb=1 / 1024))
    backing = PosixStore(PosixStoreConfig(path=str(tmp_path / "t"), io_threads=1))
    with TieredStore(dram, backing) as s:
        data = blob(1, 4096)
        s.wait(backing.dump([key(1), key(2)], [data, data]))
        gate = Gate(monkeypatch, "read_blocks", posix_store)
        task = s.load([key(1), key(2)], [bytearray(4096), bytearray(4096)])
        assert gate.entered.wait(10)
        threading.Timer(0.1, gate.opened.set).start()
        assert task.cancel(wait=10) is True
        assert task.done()
        assert dram.lookup([key(1), key(2)]) == [False, False]  # nothing promoted


def test_a_cancelled_tiered_load_waits_for_the_read_below_that_its_local_tier_started(
    tmp_path, monkeypatch
):
    """The local tier's answer starts the read below on the local tier's thread, from a
    callback: a cancel that comes meanwhile waits for that read too, or it would land in
    buffers the caller has taken back (an engine's KV cache, where loads read in place)."""
    front = PosixStore(PosixStoreConfig(path=str(tmp_path / "front"), io_threads=1))
    backing = PosixStore(PosixStoreConfig(path=str(tmp_path / "below"), io_threads=1))
    with TieredStore(front, backing) as s:
        data = blob(1, 8192)
        s.wait(backing.dump([key(1)], [data]))
        real_read, real_load = posix_store.read_blocks, backing.load
        returned, reading = threading.Event(), threading.Event()
        opened, cancelling = threading.Event(), threading.Event()

        def read_blocks(blocks_fd, *args, **kwargs):
            if blocks_fd == backing._blocks_fd:  # the read below, held
                reading.set()
                assert opened.wait(10)
            else:  # the local tier answers on its own thread, once the load is returned
                assert returned.wait(10)
            return real_read(blocks_fd, *args, **kwargs)

        def load(*args, **kwargs):  # the read below started: the caller cancels now
            task = real_load(*args, **kwargs)
            assert cancelling.wait(10)
            time.sleep(0.2)
            return task

        monkeypatch.setattr(posix_store, "read_blocks", read_blocks)
        monkeypatch.setattr(backing, "load", load)
        out = bytearray(8192)
        task = s.load([key(1)], [out])
        returned.set()
        assert reading.wait(10)
        quiet: list[bool] = []

        def cancel() -> None:
            cancelling.set()
            quiet.append(task.cancel(wait=1.0))

        canceller = threading.Thread(target=cancel)
        canceller.start()
        canceller.join(10)
        assert quiet == [False]  # the read below is still in progress
        opened.set()
        assert task.cancel(wait=10) is True
        assert task.done()
