"""Writes in place: an engine copies its blocks straight into the host dram store's slots,
and the store seals and publishes them (``Store.open_writes``).

What a reader sees must not change: a block is there only once committed and sealed, it is
checked on every load, and room not committed goes back.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from ucm.core import address_of
from ucm.core.digest import block_digest
from ucm.core.store import SharedMemoryStore, Status, create_store
from ucm.core.store.dram import arena as arena_module
from ucm.core.store.dram.arena import Arena
from ucm.core.store.writes import SlotWrites
from ucm.lab.testing.core import blob, dram_store, flip_shared_block_byte, key

SIZE = 40_000


def _fill(writes: SlotWrites, ids) -> None:
    for view, i in zip(writes.views, ids):
        if view is not None:
            np.frombuffer(view, np.uint8)[:] = blob(i, SIZE)


def _loaded(store, ids):
    out = [np.zeros(SIZE, np.uint8) for _ in ids]
    results = store.wait(store.load([key(i) for i in ids], out, b"tag"))
    return results, out


@pytest.mark.parametrize("signed", [False, True])
def test_blocks_written_in_place_load_as_if_dumped(shm_dir, monkeypatch, signed):
    monkeypatch.setenv("UCM_TEST_SECRET", "a-test-secret-of-some-length-0123456789")
    store = dram_store(shm_dir, **({"secret": "env:UCM_TEST_SECRET"} if signed else {}))
    ids = list(range(80))  # more than a chunk per copy thread
    writes = store.open_writes([key(i) for i in ids], SIZE, b"tag")
    assert writes is not None and all(v is not None and v.nbytes == SIZE for v in writes.views)
    assert store.lookup_prefix([key(i) for i in ids]) == 0  # nothing before the commit
    _fill(writes, ids)
    assert all(r.ok for r in store.wait(writes.commit()))
    results, out = _loaded(store, ids)
    assert all(r.ok for r in results)
    for i, got in zip(ids, out):
        np.testing.assert_array_equal(got, blob(i, SIZE))
    # the layout is sealed with the block, as a dump's
    assert store.wait(store.load([key(0)], [np.zeros(SIZE, np.uint8)], b"other"))[0].status is (
        Status.ERROR
    )
    store.close()


@pytest.mark.parametrize("way", ["compiled", "python"])
@pytest.mark.parametrize("more", [0, 67])  # a large batch's digests are booked as arrays
@pytest.mark.parametrize("signed", [False, True])
def test_digests_computed_by_the_copy_seal_the_blocks_without_the_store_reading_them(
    shm_dir, monkeypatch, signed, more, way
):
    # a GPU's kernels digest the blocks as they gather them: the store books what it is
    # given (a wrong digest is a block that fails its check at load: proof that the store
    # never read it), except a signed store, whose MAC needs the bytes; as arrays, any
    # batch where the books are compiled, from 64 keys in Python (numpy)
    if way == "compiled" and arena_module._LIBRARY is None:
        pytest.skip("the library was not built here (no C compiler)")
    if way == "python":
        monkeypatch.setattr(arena_module, "_LIBRARY", None)
    monkeypatch.setattr(arena_module, "COMPILED_MIN_KEYS", 1)  # (compiled: every batch)
    monkeypatch.setenv("UCM_TEST_SECRET", "a-test-secret-of-some-length-0123456789")
    booked = []
    as_arrays = Arena.publish_booked
    monkeypatch.setattr(
        Arena, "publish_booked", lambda *a, **k: booked.append(as_arrays(*a, **k)) or booked[-1]
    )
    store = dram_store(shm_dir, **({"secret": "env:UCM_TEST_SECRET"} if signed else {}))
    assert store.wait(store.dump([key(0)], [blob(0, SIZE)], b"tag"))[0].ok
    ids = [0, 1, 2, *range(10, 10 + more)]
    writes = store.open_writes([key(i) for i in ids], SIZE, b"tag")
    assert writes.takes_digests is not signed and writes.views[0] is None
    _fill(writes, ids)
    digests = [None, block_digest(blob(1, SIZE)), block_digest(blob(2, SIZE)) ^ 1]
    digests += [block_digest(blob(i, SIZE)) for i in ids[3:]]
    assert all(r.ok for r in store.wait(writes.commit(digests)))
    results, out = _loaded(store, ids)
    if signed:
        assert all(r.ok for r in results)
    else:
        bad = [Status.CORRUPT if i == 2 else Status.OK for i in ids]
        assert [r.status for r in results] == bad
    np.testing.assert_array_equal(out[1], blob(1, SIZE))
    as_one = (more or way == "compiled") and not signed
    assert len(booked) == (1 if as_one else 0) and None not in booked
    if more:  # every key new and given its digest (the whole batch at once)
        fresh = list(range(100, 100 + more))
        writes = store.open_writes([key(i) for i in fresh], SIZE, b"tag")
        _fill(writes, fresh)
        booked = writes.commit(np.array([block_digest(blob(i, SIZE)) for i in fresh], np.uint64))
        assert all(r.ok for r in store.wait(booked))
        results, out = _loaded(store, fresh)
        assert all(r.ok for r in results) and all(
            np.array_equal(got, blob(i, SIZE)) for i, got in zip(fresh, out)
        )
    with pytest.raises(ValueError, match="2 digests for 3 keys"):  # the room goes back
        store.open_writes([key(i) for i in (5, 6, 7)], SIZE, b"tag").commit([1, 2])
    assert store._arena.stats()["writing"] == 0
    store.close()


def test_the_rooms_addresses_are_its_views_as_one_table(shm_dir, tmp_path):
    # a GPU's copy takes every row's address at once: each the view's own, 0 for none
    store = dram_store(shm_dir)
    assert store.wait(store.dump([key(1)], [blob(1, SIZE)], b"tag"))[0].ok
    ids = [0, 1, 2, 3]
    writes = store.open_writes([key(i) for i in ids], SIZE, b"tag")
    assert writes is not None and writes.views[1] is None
    want = [0 if v is None else address_of(v) for v in writes.views]
    got = writes.addresses()
    assert got.dtype == np.uint64 and got.tolist() == want
    assert got.tolist() == SlotWrites.addresses(writes).tolist()  # the interface's own way
    # and their lengths, the views made only when asked for (a GPU's copy asks for none)
    assert writes.view_bytes().tolist() == [SIZE, 0, SIZE, SIZE]
    assert writes.view_bytes().tolist() == SlotWrites.view_bytes(writes).tolist()
    assert [v is None for v in writes.views] == [False, True, False, False]
    with pytest.raises(IndexError):
        writes.views[4]
    assert writes.views[-1] is not None and address_of(writes.views[-1]) == want[-1]
    writes.abort()
    store.close()
    tiered = _tiered(shm_dir, tmp_path, write_behind_bytes=1 << 20)
    writes = tiered.open_writes([key(i) for i in (20, 21)], SIZE, b"tag")
    assert writes.addresses().tolist() == [address_of(v) for v in writes.views]
    assert writes.view_bytes().tolist() == [SIZE, SIZE]
    writes.abort()
    tiered.close()


def test_keys_stored_already_get_no_room_and_count_as_stored(shm_dir):
    store = dram_store(shm_dir)
    assert store.wait(store.dump([key(1)], [blob(1, SIZE)], b"tag"))[0].ok
    writes = store.open_writes([key(1), key(2), key(2)], SIZE, b"tag")
    assert writes is not None
    assert writes.views[0] is None and writes.views[1] is not None and writes.views[2] is None
    _fill(writes, [1, 2, 2])
    assert [r.status for r in store.wait(writes.commit())] == [Status.OK] * 3
    results, out = _loaded(store, [1, 2])
    assert all(r.ok for r in results)
    np.testing.assert_array_equal(out[1], blob(2, SIZE))
    with pytest.raises(RuntimeError):
        writes.commit()  # once
    store.close()


def test_aborted_writes_leave_nothing_and_give_their_room_back(shm_dir):
    store = dram_store(shm_dir)
    free = store._arena_for(SIZE).stats()["free_slots"]
    writes = store.open_writes([key(i) for i in range(5)], SIZE, b"tag")
    assert writes is not None
    assert store._arena.stats()["free_slots"] == free - 5
    _fill(writes, range(5))
    writes.abort()
    assert store._arena.stats()["free_slots"] == free
    assert store.lookup([key(i) for i in range(5)]) == [False] * 5
    store.close()


def test_a_cancelled_commit_publishes_nothing_it_had_not_sealed(shm_dir):
    store = dram_store(shm_dir)
    ids = list(range(256))  # several chunks a copy thread: the later ones never start
    writes = store.open_writes([key(i) for i in ids], SIZE, b"tag")
    _fill(writes, ids)
    task = writes.commit()
    task.cancel(wait=None)
    results = store.wait(task)
    stored = store.lookup([key(i) for i in ids])
    assert [r.ok for r in results] == stored  # what it says is what a reader finds
    assert all(r.ok or r.status is Status.CANCELLED for r in results)
    assert store._arena.stats()["writing"] == 0  # the rest went back
    store.close()


def test_a_block_changed_after_its_commit_fails_its_check(shm_dir):
    store = dram_store(shm_dir)
    writes = store.open_writes([key(1)], SIZE, b"tag")
    _fill(writes, [1])
    assert store.wait(writes.commit())[0].ok
    flip_shared_block_byte(shm_dir, key(1))
    assert _loaded(store, [1])[0][0].status is Status.CORRUPT
    store.close()


def test_more_blocks_than_room_are_refused_per_key(shm_dir):
    store = dram_store(shm_dir, capacity_gb=4 * SIZE / 2**30)  # room for a few blocks
    ids = list(range(40))
    writes = store.open_writes([key(i) for i in ids], SIZE, b"tag")
    assert writes is not None
    _fill(writes, ids)  # a batch larger than the room evicts its own first blocks
    results = store.wait(writes.commit())
    assert any(r.ok for r in results)
    loaded, out = _loaded(store, [i for i, r in zip(ids, results) if r.ok])
    for i, got, r in zip(ids, out, loaded):
        assert not r.ok or np.array_equal(got, blob(i, SIZE))
    store.close()


def test_a_block_too_large_for_the_slots_gets_no_room(shm_dir):
    store = dram_store(shm_dir)
    assert store.wait(store.dump([key(1)], [blob(1, SIZE)]))[0].ok  # slots of SIZE bytes
    assert store.open_writes([key(2)], 4 * SIZE) is None  # the dump path reports why
    store.close()


KILLED = """
import os, sys
import numpy as np
from ucm.core.store import create_store
from ucm.lab.testing.core import blob, key

store = create_store({"kind": "dram", "path": sys.argv[1], "capacity_gb": 0.03125})
writes = store.open_writes([key(i) for i in range(4)], 40_000, b"tag")
for i, view in enumerate(writes.views):
    np.frombuffer(view, np.uint8)[:] = blob(i, 40_000)
os._exit(0)  # killed before its commit
"""


def test_a_writer_killed_before_its_commit_leaves_nothing_a_reader_takes(shm_dir):
    store = dram_store(shm_dir)
    done = subprocess.run([sys.executable, "-c", KILLED, str(shm_dir)], capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    assert store.lookup([key(i) for i in range(4)]) == [False] * 4
    results, _ = _loaded(store, range(4))
    assert all(r.status is Status.MISS for r in results)
    store.close()


def test_stores_without_memory_of_their_own_offer_no_room(tmp_path):
    with create_store({"kind": "posix", "path": str(tmp_path / "p")}) as posix:
        assert posix.open_writes([key(1)], SIZE) is None


def _tiered(shm_dir, tmp_path, write_behind_bytes):
    from ucm.core.config import DramStoreConfig, PosixStoreConfig
    from ucm.core.store import PosixStore, TieredStore

    front = SharedMemoryStore(DramStoreConfig(path=str(shm_dir), capacity_gb=0.03125))
    backing = PosixStore(PosixStoreConfig(path=str(tmp_path / "below")))
    return TieredStore(front, backing, write_behind_bytes=write_behind_bytes)


def test_a_tiered_store_takes_writes_in_place_and_they_go_below_behind(shm_dir, tmp_path):
    tiered = _tiered(shm_dir, tmp_path, write_behind_bytes=1 << 20)
    ids = list(range(6))
    writes = tiered.open_writes([key(i) for i in ids], SIZE, b"tag")
    assert writes is not None
    _fill(writes, ids)
    assert all(r.ok for r in tiered.wait(writes.commit(), 10))
    assert tiered.front.lookup([key(i) for i in ids]) == [True] * 6
    assert tiered.behind.drain(10)
    results, out = _loaded(tiered.backing, ids)  # the backing store's own copies
    assert all(r.ok for r in results)
    for i, got in zip(ids, out):
        np.testing.assert_array_equal(got, blob(i, SIZE))
    tiered.close()


def test_past_the_write_behind_budget_a_commit_waits_for_the_copy_below(shm_dir, tmp_path):
    tiered = _tiered(shm_dir, tmp_path, write_behind_bytes=SIZE)  # room for one block behind
    ids = list(range(5))
    writes = tiered.open_writes([key(i) for i in ids], SIZE, b"tag")
    _fill(writes, ids)
    assert all(r.ok for r in tiered.wait(writes.commit(), 10))
    # done only once the backing store holds them: read back from the local tier
    assert tiered.backing.lookup([key(i) for i in ids]) == [True] * 5
    results, out = _loaded(tiered.backing, ids)
    assert all(r.ok for r in results)
    np.testing.assert_array_equal(out[4], blob(4, SIZE))
    tiered.close()


def test_a_tiered_store_without_write_behind_offers_no_room(shm_dir, tmp_path):
    tiered = _tiered(shm_dir, tmp_path, write_behind_bytes=None)  # every dump written through
    assert tiered.open_writes([key(1)], SIZE) is None
    tiered.close()


@pytest.mark.parametrize("way", ["compiled", "python"])
def test_a_key_twice_in_a_batch_gets_one_slot_and_both_count_as_stored(shm_dir, monkeypatch, way):
    # the rows' way (compiled) hands a batch with a key twice to the loop, which gives the
    # second no room and calls it stored, as a dump does; every other key as usual
    if way == "compiled" and arena_module._LIBRARY is None:
        pytest.skip("the library was not built here (no C compiler)")
    if way == "python":
        monkeypatch.setattr(arena_module, "_LIBRARY", None)
    monkeypatch.setattr(arena_module, "COMPILED_MIN_KEYS", 1)  # (compiled: every batch)
    store = dram_store(shm_dir)
    ids = [1, 2, 1, 3]
    writes = store.open_writes([key(i) for i in ids], SIZE, b"tag")
    assert [v is None for v in writes.views] == [False, False, True, False]
    assert writes.view_bytes().tolist() == [SIZE, SIZE, 0, SIZE]
    _fill(writes, ids)
    digests = [block_digest(blob(i, SIZE)) for i in ids]
    digests[2] = None
    assert all(r.ok for r in store.wait(writes.commit(digests)))
    results, out = _loaded(store, [1, 2, 3])
    assert all(r.ok for r in results)
    assert all((o == blob(i, SIZE)).all() for i, o in zip([1, 2, 3], out))
    assert store._arena.stats()["writing"] == 0
    store.close()
