"""The host dram store's arena across real processes and real failures: a writer killed at
any moment leaves nothing torn, a process killed holding the lock leaves books that the next
one mends, a stopped one stalls nobody past the lock's bound, processes sharing the arena
never see wrong bytes and never pass its capacity, eviction is least recently used and
never takes a block being read.  Children run ``ucm.lab.testing.procs``."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from ucm.core.config import DramStoreConfig
from ucm.core.settings import GIB, ConfigError
from ucm.core.store import SharedMemoryStore, Status
from ucm.core.store.dram import arena as arena_module
from ucm.lab.testing.core import blob, key, payload_of, size_of
from ucm.lab.testing.procs import (
    kill_writers_at_random,
    run_stress,
)

TIMEOUT = 120
MAX_SIZE = 48 * 1024


def ucm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ucm.core.cli", *args], capture_output=True, text=True,
        timeout=TIMEOUT,
    )  # fmt: skip


def open_store(root, capacity_gb: float = 0.0625, block: int = MAX_SIZE) -> SharedMemoryStore:
    store = SharedMemoryStore(DramStoreConfig(path=str(root), capacity_gb=capacity_gb))
    store.check_block_bytes(block)
    return store


@pytest.mark.stress
def test_a_writer_killed_at_random_moments_leaves_only_whole_blocks(shm_dir):
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    n_keys = 64
    kill_writers_at_random(
        [{"root": str(shm_dir), "dram": True, "seed": rng.getrandbits(32), "n_keys": n_keys,
          "max_size": MAX_SIZE} for _ in range(12)],
        seed,
        TIMEOUT,
    )  # fmt: skip

    store = open_store(shm_dir)
    try:
        keys = [key(j) for j in range(n_keys)]
        outs = [bytearray(size_of(k, MAX_SIZE)) for k in keys]
        results = store.wait(store.load(keys, outs), 30)
        for k, out, r in zip(keys, outs, results):
            assert r.status in (Status.OK, Status.MISS), (k.hex(), r)
            if r.ok:
                assert bytes(out) == payload_of(k, MAX_SIZE), k.hex()
        assert any(r.ok for r in results), "the children stored nothing"
        arena = store._arena
        with arena.locked():  # mends whatever a kill inside the lock left
            assert arena.check() == []
    finally:
        store.close()
    done = ucm("store", "verify", str(shm_dir))
    assert done.returncode == 0 and "OK: " in done.stdout, done.stdout + done.stderr


def lock_holder(folder, then: str) -> subprocess.Popen:
    """A process of the store at ``folder`` that takes the arena's lock, says "holding",
    and then runs ``then`` (Python, with ``arena`` and ``os`` at hand) still holding it."""
    script = (
        "import os, sys, time\n"
        "from ucm.core.config import DramStoreConfig\n"
        "from ucm.core.store import SharedMemoryStore\n"
        "store = SharedMemoryStore(DramStoreConfig(path=sys.argv[1], capacity_gb=0.0625))\n"
        "store.check_block_bytes(4096)\n"
        "arena = store._arena\n"
        "with arena.locked():\n"
        f"    {then}\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", script, str(folder)],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert holder.stdout.readline().strip() == "holding"
    return holder


# half a change: a slot taken off the free stack and nothing else yet; then killed
HALF_A_CHANGE = (
    f"arena._sb[{arena_module.SB_FREE_TOP}] -= 1; print('holding', flush=True); time.sleep(600)"
)


def test_a_process_killed_holding_the_lock_leaves_books_the_next_one_mends(shm_dir):
    store = open_store(shm_dir, block=4096)
    keys = [key(i) for i in range(20)]
    assert all(r.ok for r in store.wait(store.dump(keys, [blob(i, 4096) for i in range(20)])))
    holder = lock_holder(shm_dir, HALF_A_CHANGE)
    holder.kill()
    holder.wait()
    arena = store._arena
    out = [np.zeros(4096, np.uint8) for _ in keys]
    assert all(r.ok for r in store.wait(store.load(keys, out), 10))  # the lock is free
    assert arena.stats()["recoveries"] == 1
    with arena.locked():
        assert arena.check() == []
    for i, got in enumerate(out):
        np.testing.assert_array_equal(got, blob(i, 4096))
    store.close()


def test_a_stopped_lock_holder_stalls_nobody_past_the_bound(shm_dir):
    store = open_store(shm_dir, block=4096)
    keys = [key(i) for i in range(4)]
    assert all(r.ok for r in store.wait(store.dump(keys, [blob(i, 4096) for i in range(4)])))
    # SIGSTOP: stopped, not dead, with the lock
    holder = lock_holder(shm_dir, "print('holding', flush=True); os.kill(os.getpid(), 19)")
    try:
        arena = store._arena
        started = time.monotonic()
        with pytest.raises(arena_module.ArenaBusy), arena.locked(wait_s=0.5):
            pass
        assert time.monotonic() - started < 5  # bounded (0.5 s asked)
        # the store's calls answer within LOCK_WAIT_S (errors, not hangs), and lookups,
        # which take no lock, still hit
        loaded = store.wait(store.load(keys, [bytearray(4096) for _ in keys]), 30)
        assert all(r.status is Status.ERROR for r in loaded), loaded
        dumped = store.wait(store.dump([key(9)], [blob(9, 4096)]), 30)
        assert dumped[0].status is Status.ERROR
        assert store.lookup_prefix(keys) == 4
    finally:
        holder.send_signal(signal.SIGCONT)
        holder.kill()
        holder.wait()
    out = [bytearray(4096) for _ in keys]
    assert all(r.ok for r in store.wait(store.load(keys, out), 10))  # its death frees the lock
    store.close()


@pytest.mark.parametrize("capacity", [None, 3 << 20], ids=["roomy", "evicting"])
def test_processes_sharing_the_arena_never_see_wrong_bytes_nor_pass_its_capacity(shm_dir, capacity):
    reports = run_stress(
        [{"root": str(shm_dir), "dram": True, "seed": 1000 + i, "n_keys": 192,
          "max_size": 64 * 1024, "seconds": 3.0,
          "capacity_gb": capacity / GIB if capacity else None} for i in range(4)],
        TIMEOUT,
    )  # fmt: skip
    total: dict[str, int] = {}
    for report in reports:
        assert report["n_bad"] == 0, report["bad"]
        for name, n in report["counts"].items():
            total[name] = total.get(name, 0) + n
    assert {n for n in total if n.startswith(("dump_", "load_"))} <= {
        "dump_ok", "load_ok", "load_miss"
    }, total  # fmt: skip
    assert total.get("dump_ok", 0) > 0 and total.get("load_ok", 0) > 0, total
    store = open_store(shm_dir, capacity_gb=(capacity or 0.0625 * GIB) / GIB, block=64 * 1024)
    try:
        arena = store._arena
        with arena.locked():
            assert arena.check() == []
        stats = arena.stats()
        assert stats["writing"] == 0 and stats["pinned"] == 0  # nothing left held
        # the capacity is the arena's size: no process, however many, writes past it
        assert arena.geometry.slots * arena.geometry.slot_bytes <= (capacity or 0.0625 * GIB)
        if capacity:
            assert stats["evicted"] > 0
    finally:
        store.close()
    done = ucm("store", "verify", str(shm_dir))
    assert done.returncode == 0, done.stdout + done.stderr


def test_eviction_takes_the_least_recently_used_and_never_a_block_being_read(shm_dir):
    size = 64 * 1024
    store = open_store(shm_dir, capacity_gb=16 * size / GIB, block=size)
    arena = store._arena
    assert arena.geometry.slots == 16
    keys = [key(i) for i in range(40)]
    assert all(r.ok for r in store.wait(store.dump(keys[:16], [blob(i, size) for i in range(16)])))
    # key 0 is read again (now the most recent); key 1 is pinned by a load in progress
    assert store.wait(store.load(keys[:1], [bytearray(size)]))[0].ok
    (pin,) = arena.pin(store._words(keys[1:2]))
    try:
        for i in range(16, 30):  # 14 more, one at a time
            assert store.wait(store.dump([keys[i]], [blob(i, size)]))[0].ok, i
        present = store.lookup(keys)
        assert present[0] and present[1]  # the recent one, and the one being read
        assert not any(present[2:16])  # the others of the first fill went, oldest first
        assert all(present[16:30])
        for i in range(30, 40):  # 10 more: key 0 is now the oldest, key 1 is still read
            assert store.wait(store.dump([keys[i]], [blob(i, size)]))[0].ok, i
        present = store.lookup(keys)
        assert not present[0] and present[1]
        assert all(present[25:40]) and not any(present[16:25])
    finally:
        assert arena.unpin([pin]) == [True]  # still the block it was: never reclaimed
    out = bytearray(size)
    assert store.wait(store.load(keys[1:2], [out]))[0].ok
    assert bytes(out) == bytes(blob(1, size))
    assert store.evicted_blocks == 24
    store.close()


def _full_arena(root, size: int) -> tuple[SharedMemoryStore, list[bytes]]:
    """A store with room for about 128 blocks, filled in the order of its keys (key 0 the
    oldest), and keys for 100 more."""
    store = open_store(root, capacity_gb=128 * size / GIB, block=size)
    slots = store._arena.geometry.slots
    keys = [key(i) for i in range(slots + 100)]
    for at in range(0, slots, 32):
        part = range(at, min(at + 32, slots))
        dumped = store.dump([keys[i] for i in part], [blob(i, size) for i in part])
        assert all(r.ok for r in store.wait(dumped))
    return store, keys


def _books_way(monkeypatch, way: str) -> bool:
    """The arena's books kept ``way``: "compiled" (False where the library is not built),
    "numpy" (from 64 keys) or "loop" (key by key in Python)."""
    compiled = arena_module._LIBRARY
    if way == "compiled" and compiled is None:
        return False
    monkeypatch.setattr(arena_module, "_LIBRARY", compiled if way == "compiled" else None)
    monkeypatch.setattr(arena_module, "VECTOR_MIN_KEYS", 64 if way == "numpy" else 10**9)
    monkeypatch.setattr(arena_module, "COMPILED_MIN_KEYS", 1)  # (compiled: every batch)
    return True


def test_a_large_batch_on_a_full_arena_evicts_as_key_by_key(shm_dir, monkeypatch):
    # a busy server's arena is full: a batch evicts the least recently used in compiled
    # calls (an eviction each time the free slots run out), in one pass from 64 keys in
    # Python (numpy), as the loop does a few at a time; the blocks present, the count
    # evicted and what each key gets come out the same, and a block being read is never
    # taken
    size = 4096
    outcomes = {}
    for way in ("compiled", "numpy", "loop"):
        if not _books_way(monkeypatch, way):
            continue
        store, keys = _full_arena(shm_dir / way, size)
        slots = store._arena.geometry.slots
        again = list(range(0, 8)) + list(range(40, 44))  # read again: the most recent
        assert all(
            r.ok
            for r in store.wait(
                store.load([keys[i] for i in again], [bytearray(size) for _ in again])
            )
        )
        (pin,) = store._arena.pin(store._words(keys[8:9]))  # a load in progress
        batch = list(range(slots, slots + 60)) + list(range(40, 44))  # 60 new, 4 stored
        writes = store.open_writes([keys[i] for i in batch], size)
        assert writes is not None
        for view, i in zip(writes.views, batch):
            if view is not None:
                np.frombuffer(view, np.uint8)[:] = np.frombuffer(blob(i, size), np.uint8)
        results = store.wait(writes.commit())
        assert store._arena.unpin([pin]) == [True]  # never reclaimed while read
        outcomes[way] = (
            [r.status for r in results],
            [None if v is None else v.nbytes for v in writes.views],
            store.lookup(keys),
            store.evicted_blocks,
        )
        out = [bytearray(size) for _ in batch]
        assert all(r.ok for r in store.wait(store.load([keys[i] for i in batch], out)))
        assert [bytes(o) for o in out] == [bytes(blob(i, size)) for i in batch]
        store.close()
    want = outcomes.pop("loop")
    assert all(got == want for got in outcomes.values()), list(outcomes)
    present = want[2]
    assert all(present[i] for i in [*again, 8]) and want[3] == 60


@pytest.mark.parametrize("way", ["compiled", "numpy", "loop"])
def test_a_batch_keeps_the_blocks_it_is_told_are_stored(shm_dir, monkeypatch, way):
    # the oldest blocks of a full arena, named in a batch that must evict: they stay (the
    # batch was told they are stored), the next oldest go
    if not _books_way(monkeypatch, way):
        pytest.skip("the library was not built here (no C compiler)")
    size = 4096
    store, keys = _full_arena(shm_dir, size)
    slots = store._arena.geometry.slots
    batch = [0, 1, *range(slots, slots + 70)]
    writes = store.open_writes([keys[i] for i in batch], size)
    assert writes.views[0] is None and writes.views[1] is None
    writes.abort()
    present = store.lookup(keys)
    assert present[0] and present[1] and not any(present[2:72]) and all(present[72:slots])
    store.close()


def test_keys_chosen_to_share_their_low_bits_do_not_make_long_probes(shm_dir):
    # Block keys are hashes of prompts a client chooses: a client could search for prompts
    # whose keys share their low bits.  Were those a key's home bucket, every such key would
    # probe one run under the lock (4000 keys: 4000 probes each).  The home is a salted hash,
    # random per arena: they spread like any keys.
    size = 4096
    store = open_store(shm_dir, capacity_gb=4096 * size / GIB, block=size)
    keys = [(i << 32).to_bytes(8, "little") + i.to_bytes(8, "little") for i in range(4000)]
    assert all(r.ok for r in store.wait(store.dump(keys, [blob(i % 7, size) for i in range(4000)])))
    arena = store._arena
    homes = arena_module.homes(arena._salt, arena.np["key0"], arena.geometry.buckets)
    islot = arena.np["islot"]
    buckets = np.flatnonzero(islot < arena.geometry.slots)
    distance = (buckets - homes[islot[buckets]].astype(np.int64)) % arena.geometry.buckets
    assert distance.max() < 40, distance.max()  # a few at most, expected for any keys
    assert store.lookup(keys[::97]) == [True] * len(keys[::97])
    other = open_store(shm_dir / "other", capacity_gb=4096 * size / GIB, block=size)
    other.wait(other.dump(keys[:1], [blob(0, size)]))
    assert other._arena._salt != arena._salt  # each arena its own
    other.close()
    store.close()


def test_an_arena_of_other_blocks_in_use_is_refused_and_an_unused_one_replaced(shm_dir):
    first = open_store(shm_dir, block=4096)
    assert first.wait(first.dump([key(1)], [blob(1, 4096)]))[0].ok
    second = SharedMemoryStore(DramStoreConfig(path=str(shm_dir), capacity_gb=0.0625))
    with pytest.raises(ConfigError) as caught:
        second.check_block_bytes(8192)  # another model's blocks, while the first engine runs
    assert caught.value.key == "store.path" and "in use" in str(caught.value)
    assert second.lookup([key(1)]) == [True]  # reading the first engine's arena is fine
    # smaller blocks fit the slots: stored and loaded
    assert second.wait(second.dump([key(2)], [blob(2, 1000)]))[0].ok
    second.close()
    first.close()
    third = open_store(shm_dir, block=8192)  # nobody holds it now: replaced
    assert third._arena.geometry.slot_bytes == 8192
    assert third.lookup([key(1)]) == [False]
    third.close()


def test_a_link_where_the_arena_goes_is_refused(shm_dir, tmp_path):
    shm_dir.mkdir(mode=0o700)
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    os.symlink(target, shm_dir / "arena")
    store = SharedMemoryStore(DramStoreConfig(path=str(shm_dir), capacity_gb=0.0625))
    with pytest.raises(ConfigError) as caught:
        store.check_block_bytes(4096)
    assert caught.value.key == "store.path"
    assert store.lookup([key(1)]) == [False]  # never read through the link
    assert target.read_bytes() == b""
    store.close()


def test_a_block_that_fails_to_copy_gives_its_slot_back_at_once(shm_dir):
    from ucm.core.store.payload import Payload

    store = open_store(shm_dir, capacity_gb=4 * 4096 / GIB, block=4096)
    arena = store._arena
    # a payload whose views turn out smaller than promised: an error once it is copied
    broken = Payload.deferred(4096, [[memoryview(bytearray(100))]], 0)
    results = store.wait(store.dump([key(1), key(2)], [broken, blob(2, 4096)]), 10)
    assert results[0].status is Status.ERROR and results[1].ok
    stats = arena.stats()
    assert stats["writing"] == 0 and stats["free_slots"] == arena.geometry.slots - 1
    assert store.lookup([key(1), key(2)]) == [False, True]
    store.close()


def _arena_books(store: SharedMemoryStore) -> dict:
    """Every column and counter of the arena, the index as the set of its entries."""
    a = store._arena
    npc = a.np
    cols = {n: npc[n].copy() for n in ("state", "pins", "gen", "owner", "key0", "key1",
                                       "length", "layout", "last_used", "seal")}  # fmt: skip
    live = npc["islot"] < a.geometry.slots
    cols["index"] = sorted(
        zip(npc["ik0"][live].tolist(), npc["ik1"][live].tolist(), npc["islot"][live].tolist())
    )
    cols["counters"] = [int(a._sb[i]) for i in (5, 7, 9, 12, 14)]  # tick, free, used, tombs, bytes
    return cols


@pytest.mark.parametrize("vector", [True, False])
def test_large_batches_are_published_and_pinned_as_key_by_key(shm_dir, monkeypatch, vector):
    # numpy for the batches where nothing unusual happens, the loop otherwise, and pins and
    # unpins in one compiled call: the books must come out the same every way, the unusual
    # cases included (a key twice, one published meanwhile by another writer, a slot given
    # back unwritten, misses)
    runs = {}
    compiled = arena_module._LIBRARY
    for way in ("numpy", "booked", "compiled", "loop"):
        if way == "compiled" and compiled is None:
            continue  # a pure-Python wheel
        arrays = way in ("numpy", "booked")
        monkeypatch.setattr(arena_module, "VECTOR_MIN_KEYS", 32 if arrays else 10**9)
        monkeypatch.setattr(arena_module, "_LIBRARY", compiled if way == "compiled" else None)
        root = shm_dir / way
        store = open_store(root, block=4096)
        a = store._arena
        words = [(1000 + i, 7 * i + 1) for i in range(64)]
        r = a.reserve(words, 4)
        written = [(*got, 4096, 3, bytes([i]) * 8) for i, got in enumerate(r)]
        if not vector:  # unusual: one given back unwritten, one published meanwhile
            written[5] = (*r[5], -1, 0, b"")
            (other,) = a.reserve([words[9]], 4)  # another copy of key 9, published first
            assert a.publish([(*other, 4096, 3, b"x" * 8)], [words[9]]) == [True]
        published = None
        if way == "booked":  # the digests as arrays; anything unusual: None, then publish
            got = np.array(r, np.int64)
            sealed = np.array([int.from_bytes(bytes([i]) * 8, "little") for i in range(64)])
            published = a.publish_booked(
                got[:, 0], got[:, 1], np.array(words), 4096, 3, sealed.astype(np.uint64)
            )
            assert (published is None) is not vector
        if published is None:
            published = a.publish(written, words)
        assert published == [i != 5 or vector for i in range(64)]
        pins = a.pin(words + [(5, 5)] + ([words[0]] if not vector else []))
        assert pins[64] is None  # a miss
        held = _arena_books(store)
        a.unpin([p for p in pins if p is not None])
        runs[way] = (held, _arena_books(store), [None if p is None else p[2:] for p in pins])
        store.close()
    *want_books, want_pinned = runs.pop("loop")
    for way, (*books, pinned) in runs.items():
        assert pinned == want_pinned, way
        for when, (got, want) in enumerate(zip(books, want_books)):
            for name in want:
                np.testing.assert_array_equal(
                    np.asarray(got[name]), np.asarray(want[name]), f"{way}, {when}: {name}"
                )
