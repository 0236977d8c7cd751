"""Reads in place: the host dram store lends its blocks where they lie, checked, so that a
caller (a GPU's DMA engine) copies them out itself (``Store.open_reads``).

What a reader relies on must not change: a lent block is used only once its seal matched,
one that fails it is dropped, and a slot lent is neither evicted nor reused until it is
given back.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from ucm.core import address_of
from ucm.core.digest import block_digest
from ucm.core.store import SharedMemoryStore, Status, create_store
from ucm.core.store.dram import shared
from ucm.core.store.dram.arena import PinnedRows
from ucm.core.store.reads import SlotReads
from ucm.lab.testing.core import blob, dram_store, flip_shared_block_byte, key, lock_held_elsewhere

SIZE = 40_000


def _dumped(store, ids, layout=b"tag"):
    assert all(
        r.ok
        for r in store.wait(store.dump([key(i) for i in ids], [blob(i, SIZE) for i in ids], layout))
    )


@pytest.mark.parametrize("signed", [False, True])
def test_lent_blocks_are_the_blocks_dumped(shm_dir, monkeypatch, signed):
    monkeypatch.setenv("UCM_TEST_SECRET", "a-test-secret-of-some-length-0123456789")
    store = dram_store(shm_dir, **({"secret": "env:UCM_TEST_SECRET"} if signed else {}))
    ids = list(range(80))  # more than a chunk per copy thread
    _dumped(store, ids)
    reads = store.open_reads([key(i) for i in ids], SIZE, b"tag")
    assert reads is not None
    assert all(r.ok for r in reads.task.wait(10))
    for i, view in zip(ids, reads.views):
        np.testing.assert_array_equal(np.frombuffer(view, np.uint8), blob(i, SIZE))
    assert reads.release() == [True] * len(ids)
    with pytest.raises(RuntimeError):
        reads.release()  # once
    assert store._arena.stats()["pinned"] == 0
    store.close()


def test_misses_and_other_blocks_are_not_lent(shm_dir):
    store = dram_store(shm_dir)
    _dumped(store, [1])
    _dumped(store, [2], layout=b"other")
    reads = store.open_reads([key(1), key(2), key(3)], SIZE, b"tag")
    assert reads is not None
    assert [r.status for r in reads.task.wait(10)] == [Status.OK, Status.ERROR, Status.MISS]
    assert reads.views[0] is not None and reads.views[1] is None and reads.views[2] is None
    # the views as one table of addresses (a GPU's copy takes them at once), 0 for none
    assert reads.addresses().tolist() == [address_of(reads.views[0]), 0, 0]
    assert reads.addresses().tolist() == SlotReads.addresses(reads).tolist()
    assert reads.view_bytes().tolist() == [SIZE, 0, 0]
    assert reads.release() == [True, False, False]
    # another size is not lent either
    other = store.open_reads([key(1)], SIZE - 1, b"tag")
    assert other.task.wait(10)[0].status is Status.ERROR and other.views == [None]
    other.release()
    store.close()


def test_a_lent_block_that_fails_its_seal_is_refused_and_dropped(shm_dir):
    store = dram_store(shm_dir)
    _dumped(store, [1, 2])
    flip_shared_block_byte(shm_dir, key(2))
    reads = store.open_reads([key(1), key(2)], SIZE, b"tag")
    assert [r.status for r in reads.task.wait(10)] == [Status.OK, Status.CORRUPT]
    assert reads.release() == [True, False]
    assert store.lookup([key(1), key(2)]) == [True, False]  # dropped when given back
    store.close()


@pytest.mark.parametrize("signed", [False, True])
def test_blocks_lent_unchecked_come_with_their_digests_and_the_caller_drops_the_bad(
    shm_dir, monkeypatch, signed
):
    # a GPU checks what it copies out: the store only pins, and hands out the digests the
    # blocks were sealed with; a signed store checks its MAC whatever is asked
    monkeypatch.setenv("UCM_TEST_SECRET", "a-test-secret-of-some-length-0123456789")
    store = dram_store(shm_dir, **({"secret": "env:UCM_TEST_SECRET"} if signed else {}))
    _dumped(store, [1, 2])
    reads = store.open_reads([key(1), key(2), key(3)], SIZE, b"tag", check=False)
    assert [r.status for r in reads.task.wait(10)] == [Status.OK, Status.OK, Status.MISS]
    if signed:
        assert reads.digests is None
        assert reads.release() == [True, True, False]
        store.close()
        return
    assert reads.digests == [block_digest(blob(1, SIZE)), block_digest(blob(2, SIZE)), None]
    reads.drop([1])  # block 2 failed the caller's check
    assert reads.release() == [True, True, False]
    assert store.lookup([key(1), key(2)]) == [True, False]  # dropped when given back
    assert store._arena.stats()["pinned"] == 0
    store.close()


def test_a_large_batch_lent_unchecked_is_lent_as_key_by_key(shm_dir, monkeypatch):
    # from 64 keys the pins stay the compiled call's rows (no object a key): what is lent,
    # settled, handed out and given back comes out as it does key by key, misses, blocks of
    # another layout, a dropped block and the books included
    from ucm.core.store.dram import arena as arena_module

    if arena_module._LIBRARY is None:
        pytest.skip("the library was not built here (no C compiler)")
    outcomes = {}
    for way in ("rows", "pins"):
        if way == "pins":
            monkeypatch.setattr(shared, "vectorised", lambda n: False)
        store = dram_store(shm_dir / way)
        _dumped(store, list(range(70)))
        _dumped(store, [80], layout=b"other")
        ids = [*range(70), 80, 81]  # 70 stored, one of another layout, one missing
        reads = store.open_reads([key(i) for i in ids], SIZE, b"tag", check=False)
        assert isinstance(reads.pinned, PinnedRows) is (way == "rows")
        results = reads.task.wait(10)
        for i, view in zip(ids[:70], reads.views):
            np.testing.assert_array_equal(np.frombuffer(view, np.uint8), blob(i, SIZE))
        places = [0 if v is None else address_of(v) for v in reads.views]
        reads.drop([5])
        outcomes[way] = (
            [(r.status, r.detail) for r in results],
            reads.digests,
            [v is None for v in reads.views],
            reads.addresses().tolist() == places,
            reads.view_bytes().tolist(),
            reads.release(),
            store.lookup([key(i) for i in ids]),
            store._arena.stats()["pinned"],
        )
        store.close()
    assert outcomes["rows"] == outcomes["pins"]
    statuses, digests, _, addressed, sizes, held, present, pinned = outcomes["rows"]
    assert addressed and sizes == [SIZE] * 70 + [0, 0]
    assert [s for s, _ in statuses] == [Status.OK] * 70 + [Status.ERROR, Status.MISS]
    assert digests == [block_digest(blob(i, SIZE)) for i in range(70)] + [None, None]
    assert held == [True] * 70 + [False, False] and pinned == 0  # lent and held to the end
    assert present == [i != 5 for i in range(70)] + [True, False]  # 5 dropped


def test_a_large_batch_given_back_while_the_lock_is_held_is_owed_then_paid(shm_dir):
    from ucm.core.store.dram import arena as arena_module

    store = dram_store(shm_dir)
    _dumped(store, list(range(70)))
    reads = store.open_reads([key(i) for i in range(70)], SIZE, b"tag", check=False)
    arena = store._arena
    assert arena.stats()["pinned"] == 70
    with lock_held_elsewhere(arena):
        started = time.monotonic()
        assert reads.release() == [False] * 70  # not had: none said to have held
        assert time.monotonic() - started < arena_module.LOCK_WAIT_S + 2
    with arena.locked():  # pays back the pins owed
        pass
    assert arena.stats()["pinned"] == 0 and all(store.lookup([key(i) for i in range(70)]))
    store.close()


def test_a_lent_block_is_not_evicted_until_given_back(shm_dir):
    store = dram_store(shm_dir, capacity_gb=4 * SIZE / 2**30)  # room for a few blocks
    _dumped(store, [0])
    reads = store.open_reads([key(0)], SIZE, b"tag")
    assert reads.task.wait(10)[0].ok
    for i in range(1, 20):  # fill the store over and over: block 0 stays
        store.wait(store.dump([key(i)], [blob(i, SIZE)], b"tag"))
    np.testing.assert_array_equal(np.frombuffer(reads.views[0], np.uint8), blob(0, SIZE))
    assert reads.release() == [True]
    store.close()


def test_given_back_before_its_checks_end_the_blocks_go_back_once_they_do(shm_dir):
    store = dram_store(shm_dir)
    ids = list(range(200))
    _dumped(store, ids)
    reads = store.open_reads([key(i) for i in ids], SIZE, b"tag")
    held = reads.release()  # at once: most checks have not run
    if not all(held):  # else they were quicker than this thread
        assert held == [False] * len(ids)
    reads.task.wait(10)
    deadline = time.monotonic() + 10
    while store._arena.stats()["pinned"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store._arena.stats()["pinned"] == 0
    store.close()


def test_stores_without_memory_of_their_own_lend_nothing(shm_dir, tmp_path):
    with create_store({"kind": "posix", "path": str(tmp_path / "p")}) as posix:
        assert posix.open_reads([key(1)], SIZE) is None and posix.host_memory() == []
    store = dram_store(shm_dir)
    assert store.open_reads([key(1)], SIZE) is None  # no arena yet: the load reports the miss
    _dumped(store, [1])
    (region,) = store.host_memory()
    assert region.nbytes >= SIZE
    store.close()


def test_a_tiered_store_lends_only_what_its_local_tier_holds(shm_dir, tmp_path):
    from ucm.core.config import DramStoreConfig, PosixStoreConfig
    from ucm.core.store import PosixStore, TieredStore

    front = SharedMemoryStore(DramStoreConfig(path=str(shm_dir), capacity_gb=0.03125))
    backing = PosixStore(PosixStoreConfig(path=str(tmp_path / "below")))
    tiered = TieredStore(front, backing, write_behind_bytes=None)
    _dumped(tiered, [1])
    assert backing.wait(backing.dump([key(2)], [blob(2, SIZE)], b"tag"))[0].ok  # below only
    assert tiered.open_reads([key(1), key(2)], SIZE, b"tag") is None  # a load promotes key 2
    reads = tiered.open_reads([key(1)], SIZE, b"tag")
    assert reads.task.wait(10)[0].ok and reads.release() == [True]
    assert tiered.host_memory() == front.host_memory() != []
    tiered.close()
