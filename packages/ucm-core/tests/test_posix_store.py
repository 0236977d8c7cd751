import os
import stat
import time

import pytest
import xxhash
from ucm.core.config import PosixStoreConfig
from ucm.core.store import PosixStore, Status
from ucm.core.store.posix import scan_store


def key(i: int) -> bytes:
    return xxhash.xxh3_128_digest(i.to_bytes(8, "little"))


def block_path(store: PosixStore, name: str) -> str:
    return os.path.join(store.root, "blocks", name[:2], name)


def payload(i: int, size: int) -> bytes:
    return (key(i) * (size // 16 + 1))[:size]


@pytest.fixture(params=["posix", "posix-o_direct"])
def kind(request):
    """This file's kinds of the shared ``store`` fixture (conftest.py)."""
    return request.param


@pytest.mark.parametrize("size", [1, 4095, 4096, 10000, 1 << 20])
def test_round_trip(store, size):
    keys = [key(i) for i in range(5)]
    data = [payload(i, size) for i in range(5)]
    assert all(r.ok for r in store.wait(store.dump(keys, data, b"L")))
    out = [bytearray(size) for _ in keys]
    assert all(r.ok for r in store.wait(store.load(keys, out, b"L")))
    assert [bytes(o) for o in out] == data
    assert store.lookup(keys + [key(99)]) == [True] * 5 + [False]
    assert store.lookup_prefix([*keys[:3], key(99), keys[4]]) == 3


def test_miss_and_batch_results_are_per_key(store):
    store.wait(store.dump([key(1)], [payload(1, 100)]))
    out = [bytearray(100), bytearray(100)]
    results = store.wait(store.load([key(1), key(2)], out))
    assert [r.status for r in results] == [Status.OK, Status.MISS]


def test_wrong_buffer_size_is_an_error_not_corruption(store):
    store.wait(store.dump([key(1)], [payload(1, 100)]))
    (result,) = store.wait(store.load([key(1)], [bytearray(99)]))
    assert result.status is Status.ERROR and "99 bytes" in result.detail
    assert store.lookup([key(1)]) == [True]  # the block is fine and stays


def test_layout_mismatch_is_never_handed_back(store):
    store.wait(store.dump([key(1)], [payload(1, 100)], b"bf16"))
    (result,) = store.wait(store.load([key(1)], [bytearray(100)], b"fp8"))
    assert result.status is Status.ERROR and "layout" in result.detail
    assert store.lookup([key(1)]) == [True]  # a caller's mistake destroys no good block


def test_corrupt_block_leaves_usage_right(tmp_path):
    s = PosixStore(PosixStoreConfig(path=str(tmp_path / "p")))
    s.wait(s.dump([key(1), key(2)], [payload(1, 100), payload(2, 100)]))
    path = block_path(s, key(1).hex())
    with open(path, "r+b") as f:
        f.seek(4096 + 50)
        f.write(b"!")
    (result,) = s.wait(s.load([key(1)], [bytearray(100)]))
    assert result.status is Status.CORRUPT
    assert s.usage().blocks == 1 and s.usage().bytes == 4096 + 100
    s.close()


def test_dump_of_stored_key_keeps_the_file(store):
    store.wait(store.dump([key(1)], [payload(1, 100)]))
    path = block_path(store, key(1).hex())
    inode = os.stat(path).st_ino
    assert store.wait(store.dump([key(1)], [payload(1, 100)]))[0].ok
    assert os.stat(path).st_ino == inode


def test_permissions(tmp_path):
    s = PosixStore(PosixStoreConfig(path=str(tmp_path / "p"), fsync="full"))
    s.wait(s.dump([key(1)], [b"x" * 10]))
    path = block_path(s, key(1).hex())
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "p").st_mode) == 0o700
    s.close()


def test_bad_input_is_refused_before_any_io(store):
    with pytest.raises(ValueError, match="2 keys but 1 buffers"):
        store.dump([key(1), key(2)], [b"x"])
    with pytest.raises(ValueError, match="keys\\[0\\]"):
        store.dump([b"short"], [b"x"])
    with pytest.raises(ValueError, match="read-only"):
        store.load([key(1)], [b"immutable"])
    with pytest.raises(TypeError, match="buffer protocol"):
        store.dump([key(1)], [object()])
    assert scan_store(store.root).blocks == []


def test_remove_and_usage(tmp_path):
    s = PosixStore(PosixStoreConfig(path=str(tmp_path / "p")))
    s.wait(s.dump([key(i) for i in range(4)], [payload(i, 1000) for i in range(4)]))
    assert s.usage().blocks == 4 and s.usage().bytes == 4 * (4096 + 1000)
    assert s.remove([key(0), key(1), key(9)]) == 2
    assert s.usage().blocks == 2 and s.lookup([key(0), key(2)]) == [False, True]
    s.close()


def test_usage_counts_blocks_already_there(tmp_path):
    path = str(tmp_path / "p")
    with PosixStore(PosixStoreConfig(path=path)) as s:
        s.wait(s.dump([key(i) for i in range(3)], [payload(i, 10) for i in range(3)]))
    with PosixStore(PosixStoreConfig(path=path)) as s:
        assert s.usage().blocks == 3


def test_cancelled_keys_are_reported(tmp_path):
    s = PosixStore(PosixStoreConfig(path=str(tmp_path / "p"), io_threads=1))
    task = s.dump([key(i) for i in range(200)], [payload(i, 4096) for i in range(200)])
    task.cancel()
    results = s.wait(task)
    assert {r.status for r in results} <= {Status.OK, Status.CANCELLED}
    done = sum(r.ok for r in results)
    assert len(scan_store(s.root).blocks) == done
    s.close()


def test_write_failure_leaves_nothing_visible(tmp_path, monkeypatch):
    s = PosixStore(PosixStoreConfig(path=str(tmp_path / "p")))
    real = os.pwritev

    def full_disk(fd, buffers, offset):
        real(fd, [memoryview(buffers[0])[:100]], offset)  # a partial write, then ENOSPC
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full_disk)
    (result,) = s.wait(s.dump([key(1)], [payload(1, 5000)]))
    assert result.status is Status.ERROR and "No space left" in result.detail
    monkeypatch.setattr(os, "pwritev", real)
    assert s.lookup([key(1)]) == [False]
    leftovers = [n for _, _, files in os.walk(s.root) for n in files if n.endswith(".tmp")]
    assert leftovers == []
    assert s.usage().bytes == 0
    assert s.wait(s.dump([key(2)], [payload(2, 5000)]))[0].ok  # and it goes on
    s.close()


@pytest.mark.stress
def test_capacity_holds_over_10k_dumps_and_keeps_recent_reads(tmp_path):
    size = 1000
    file_size = 4096 + size
    capacity = 300 * file_size
    s = PosixStore(
        PosixStoreConfig(path=str(tmp_path / "p"), capacity_gb=capacity / (1 << 30), io_threads=4)
    )
    hot = [key(i) for i in range(5)]
    s.wait(s.dump(hot, [payload(i, size) for i in range(5)]))
    peak = 0
    for start in range(5, 10_005, 100):
        keys = [key(i) for i in range(start, start + 100)]
        results = s.wait(s.dump(keys, [payload(i, size) for i in range(start, start + 100)]))
        assert all(r.ok for r in results)
        on_disk = scan_store(s.root).bytes
        peak = max(peak, on_disk)
        # reading the hot blocks marks them recently used
        out = [bytearray(size) for _ in hot]
        assert all(r.ok for r in s.wait(s.load(hot, out)))
    in_flight = s.config.io_threads * file_size
    assert peak <= capacity + in_flight
    assert s.lookup(hot) == [True] * 5
    assert s.lookup([key(5), key(6)]) == [False, False]  # the oldest unread ones went
    assert s.lookup([key(10_004)]) == [True]
    s.close()


def test_a_large_store_evicts_the_oldest_of_a_sample_not_a_tenth_of_a_full_listing(tmp_path):
    # 3000 blocks over 256 folders: a pass lists a sample of folders, frees what is over the
    # limit and 1% of the capacity, from the sample's oldest blocks (an exact pass would
    # list every file and free evict_fraction, a tenth)
    size, n, more = 64, 3000, 80
    file_size = 4096 + size
    room = 3045  # blocks: filled to 98.5%, short of the background evictor's cue (99%)
    s = PosixStore(
        PosixStoreConfig(path=str(tmp_path / "p"), capacity_gb=room * file_size / (1 << 30))
    )
    keys = [key(i) for i in range(n + more)]
    assert all(r.ok for r in s.wait(s.dump(keys[:n], [payload(i, size) for i in range(n)])))
    old = set()
    for i, block in enumerate(sorted(scan_store(s.root).blocks, key=lambda b: b.name)):
        if i % 2 == 0:  # half the blocks were last used a day ago
            os.utime(block.path, ns=(block.mtime_ns - 86400 * 10**9,) * 2)
            old.add(block.name)
    assert s.usage().blocks == n and s.evicted_blocks == 0
    results = s.wait(s.dump(keys[n:], [payload(i, size) for i in range(n, n + more)]))
    assert all(r.ok for r in results)
    deadline = time.monotonic() + 10  # the background evictor's pass may still run
    while s.usage().blocks > room * 0.99 and time.monotonic() < deadline:
        time.sleep(0.01)
    left = {b.name for b in scan_store(s.root).blocks}
    gone = {k.hex() for k in keys[:n]} - left
    assert gone and gone <= old, f"{len(gone - old)} recently used blocks evicted"
    assert n + more - room <= len(gone) <= n + more - room + 3 * 31, len(gone)  # passes of 1%
    assert s.evicted_blocks == len(gone)
    assert (s.usage().blocks, s.usage().bytes) == (len(left), len(left) * file_size)
    s.close()


def test_closing_a_store_ends_its_eviction_pass_first(tmp_path, caplog):
    # a background pass still deleting when the store closed went on through the folder's
    # closed descriptor (EBADF), then through whatever reused its number
    size = 64
    file_size = 4096 + size
    config = PosixStoreConfig(
        path=str(tmp_path / "p"), capacity_gb=2000 * file_size / (1 << 30), evict_fraction=0.5
    )
    s = PosixStore(config)
    for start in range(0, 2000, 500):  # the last batches wake the background evictor
        keys = [key(i) for i in range(start, start + 500)]
        assert all(r.ok for r in s.wait(s.dump(keys, [payload(7, size)] * len(keys))))
    s.close()
    assert not s._evicting_thread.is_alive()
    assert "cannot evict" not in caplog.text
    after = PosixStore(config)  # what the store holds, as the next process counts it
    assert after.usage().blocks == len(scan_store(after.root).blocks) <= 2000
    after.close()


def test_block_larger_than_capacity(tmp_path):
    s = PosixStore(PosixStoreConfig(path=str(tmp_path / "p"), capacity_gb=1e-6))
    (result,) = s.wait(s.dump([key(1)], [bytes(5000)]))
    assert result.status is Status.ERROR and "larger than the capacity" in result.detail
    s.close()


def test_closed_store_refuses_work(tmp_path):
    s = PosixStore(PosixStoreConfig(path=str(tmp_path / "p")))
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.dump([key(1)], [b"x"])


def test_a_store_nobody_sized_takes_half_the_free_space_and_says_so(tmp_path, caplog):
    """The default capacity ('auto'): half of what the filesystem has free, its own blocks
    counted as free (so a filling store does not shrink its own limit), logged."""
    import logging

    from ucm.core.store.posix.config import AUTO, auto_capacity_bytes
    from ucm.core.store.posix.layout import read_marker

    config = PosixStoreConfig(path=str(tmp_path / "p"))
    assert config.capacity_gb == AUTO
    st = os.statvfs(tmp_path)
    half_free = st.f_bavail * st.f_frsize // 2
    with caplog.at_level(logging.INFO, logger="ucm.core.store.posix.store"):
        s = PosixStore(config)
    limit = s.usage().capacity_bytes
    assert abs(limit - half_free) < 64 << 20, (limit, half_free)
    assert read_marker(s.root)["capacity_bytes"] == limit
    assert any("capacity" in r.getMessage() and "auto" in r.getMessage() for r in caplog.records)
    s.wait(s.dump([key(1)], [payload(1, 1 << 20)]))
    assert auto_capacity_bytes(s.root) == pytest.approx(limit, abs=8 << 20)  # its own counted
    s.close()
    unlimited = PosixStore(PosixStoreConfig(path=str(tmp_path / "q"), capacity_gb=None))
    assert unlimited.usage().capacity_bytes is None
    unlimited.close()


def test_blocks_another_process_removes_during_a_pass_are_not_counted_twice(tmp_path):
    # A pass scans, then deletes the oldest blocks it found; another process removes some of
    # them first (and takes them off the shared count itself).  The pass must count only
    # what it removed: counting the others again left the count low, and the store then
    # held more than its capacity (seen by the fault harness).
    from ucm.core.store.posix.layout import evict_lru

    a = PosixStore(PosixStoreConfig(path=str(tmp_path / "s")))
    b = PosixStore(PosixStoreConfig(path=str(tmp_path / "s")))
    try:
        keys = [i.to_bytes(16, "little") for i in range(40)]
        for k in keys:  # one at a time: their mtimes are their order
            assert a.wait(a.dump([k], [bytes(1000)]))[0].ok
            time.sleep(0.002)
        scan = scan_store(a.root)
        size = scan.blocks[0].size
        assert b.remove(keys[:10]) == 10  # the oldest ten, gone before the pass reaches them
        gone: list[int] = []

        def given_back(nbytes: int, n: int) -> None:  # as the store's own passes do
            a._usage.add(-nbytes, -n)
            gone.append(n)

        evict_lru(scan, 25 * size, a._root_fd, gone=given_back)
        on_disk = len(scan_store(a.root).blocks)
        assert sum(gone) == 40 - 10 - on_disk  # what this pass removed, no more
        assert a.usage().blocks == on_disk  # the shared count agrees with the disk
        assert os.path.isdir(tmp_path / "s" / "blocks")
    finally:
        a.close()
        b.close()
