"""The host tier's rules under faults, one test per rule, each with real processes where a
process is what fails: no walk of the index outlasts its bound, no wait for a lock outlasts
its deadline (opening included), a slot being written is never handed to another writer
while its writer lives (whatever its pid means where the question is asked), a load serves
a block only from the slot holding its key, a busy store answers lookups with misses, and
a file cut short by another process is refused, not a SIGBUS."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from ucm.core.config import DramStoreConfig, PosixStoreConfig, TieredStoreConfig
from ucm.core.settings import GIB, ConfigError
from ucm.core.store import PosixStore, SharedMemoryStore, Status, create_store
from ucm.core.store.dram import arena as arena_module
from ucm.core.store.dram.index import EMPTY, TOMB
from ucm.lab.testing.core import blob, key, lock_held_elsewhere

CHILD_TIMEOUT = 60
BLOCK = 4096
CAP = (1 << 20) / GIB  # the children's stores: 1 MiB, 256 slots of 4 KiB


def open_store(root, capacity_bytes: int = 1 << 20, block: int = BLOCK) -> SharedMemoryStore:
    store = SharedMemoryStore(DramStoreConfig(path=str(root), capacity_gb=capacity_bytes / GIB))
    store.check_block_bytes(block)
    return store


#: what every child starts with: ``store``, the host store of the folder ``sys.argv[1]``
#: (of ``sys.argv[2]`` GiB), and the tests' keys and payloads
CHILD_PREAMBLE = """\
import os, sys, time
from ucm.core.config import DramStoreConfig
from ucm.core.store import SharedMemoryStore
from ucm.lab.testing.core import blob, key
store = SharedMemoryStore(DramStoreConfig(path=sys.argv[1], capacity_gb=float(sys.argv[2])))
"""


def child_command(script: str, folder, capacity_gb: float = CAP) -> list[str]:
    """``python -c`` of :data:`CHILD_PREAMBLE` then ``script``, on the store at ``folder``."""
    code = CHILD_PREAMBLE + textwrap.dedent(script)
    return [sys.executable, "-c", code, str(folder), repr(capacity_gb)]


def run_child(script: str, folder, *, capacity_gb: float = CAP, prefix=()):
    """Run ``script`` (Python, with ``store`` at hand) in a fresh interpreter; its completed
    process (a hang past :data:`CHILD_TIMEOUT` fails the test)."""
    try:
        return subprocess.run(
            [*prefix, *child_command(script, folder, capacity_gb)],
            capture_output=True, text=True, timeout=CHILD_TIMEOUT,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"the child did not finish within {CHILD_TIMEOUT} s: a wait without a bound")


def holder(folder, then: str) -> subprocess.Popen:
    """A process of the store at ``folder`` that takes the arena's lock, says "holding",
    then runs ``then`` (Python, with ``arena``, ``os`` and ``time`` at hand) holding it."""
    script = f"""
        store.check_block_bytes({BLOCK})
        arena = store._arena
        with arena.locked():
            {then}
        """
    proc = subprocess.Popen(child_command(script, folder), stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "holding"
    return proc


def end(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGCONT)
    proc.kill()
    proc.wait()


def flip_every_stored_block(arena) -> None:
    """One payload byte of every stored block flipped where it lies (as a co-tenant's bug,
    a late copy or a bit flip would)."""
    arena.map_data()
    for s in arena.ready_slots():
        view = arena.slot(s, 1)
        view[0] ^= 0xFF


# -- every walk of the index has a bound, and tombstones never pile up --


def test_corrupt_blocks_dropped_round_after_round_leave_the_index_its_empty_buckets(shm_dir):
    # 1 MiB of 4 KiB blocks: 256 slots, 512 buckets.  Each round stores 200 blocks, damages
    # them and loads them: each load drops its block (a tombstone).  Without a rebuild where
    # they are dropped, the tombstones eat the EMPTY buckets where probes stop, until a dump
    # walks the index for ever holding the lock (24-40 rounds).
    store = open_store(shm_dir)
    arena = store._arena
    buckets = arena.geometry.buckets
    try:
        for r in range(40):
            keys = [key(i, salt=b"round%d" % r) for i in range(200)]
            dumped = store.wait(store.dump(keys, [blob(i, BLOCK) for i in range(200)]), 30)
            assert all(d.ok for d in dumped), (r, dumped[0])
            flip_every_stored_block(arena)
            loaded = store.wait(store.load(keys, [bytearray(BLOCK) for _ in keys]), 30)
            assert {d.status for d in loaded} == {Status.CORRUPT}, r
            empty = int((arena.np["islot"] == EMPTY).sum())
            assert empty >= buckets // 4, f"round {r}: {empty} of {buckets} buckets EMPTY"
        with arena.locked():
            assert arena.check() == []
    finally:
        store.close()


def test_an_index_without_an_empty_bucket_is_walked_within_its_bound_and_rebuilt(shm_dir):
    # Another process's bug (or a bit flip) can leave no EMPTY bucket at all: every call must
    # still return, and the first holder of the lock rebuilds the index from the slots.
    store = open_store(shm_dir)
    keys = [key(i) for i in range(10)]
    assert all(d.ok for d in store.wait(store.dump(keys, [blob(i, BLOCK) for i in range(10)])))
    store.close()
    done = run_child(
        f"""
        store.check_block_bytes({BLOCK})
        store._arena.np["islot"][:] = {TOMB}  # every bucket a tombstone
        print(store.lookup([key(0), key(99)]))
        print([r.status.name for r in store.wait(store.dump([key(99)], [blob(99, {BLOCK})]), 30)])
        out = [bytearray({BLOCK}) for _ in range(11)]
        got = store.wait(store.load([key(i) for i in range(10)] + [key(99)], out), 30)
        print([r.status.name for r in got])
        print(all(bytes(o) == blob(i, {BLOCK}).tobytes() for i, o in enumerate(out[:10])))
        store.close()
        """,
        shm_dir,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "[False, False]"  # the damaged index finds nothing: misses
    # the dump's hold of the lock rebuilt it from the slots: every block is found again
    assert lines[1:] == ["['OK']", str(["OK"] * 11), "True"]


# -- every wait for a lock has a deadline, opening included --


def test_a_new_engine_starts_while_a_stopped_process_holds_the_lock(shm_dir):
    store = open_store(shm_dir)
    assert store.wait(store.dump([key(1)], [blob(1, BLOCK)]))[0].ok
    store.close()
    stopped = holder(shm_dir, "print('holding', flush=True); os.kill(os.getpid(), 19)")
    try:
        started = time.monotonic()
        done = run_child(
            f"""
            store.check_block_bytes({BLOCK})  # an engine's start-up
            print(store.wait(store.dump([key(2)], [blob(2, {BLOCK})]), 30)[0].status.name)
            print(store.lookup([key(1), key(2)]))
            store.close()
            """,
            shm_dir,
        )
        took = time.monotonic() - started
    finally:
        end(stopped)
    assert done.returncode == 0, done.stderr
    assert "cannot open the arena yet" in done.stderr and "stopped" in done.stderr
    assert done.stdout.splitlines() == ["ERROR", "[True, False]"]
    assert took < 30, took  # the bounds (2 s each), not the holder, decide


def test_a_busy_host_tier_answers_a_tiered_lookup_with_the_disk_s_hits(shm_dir, tmp_path):
    # A process stopped in the middle of changing the index (its sequence word odd): the
    # front answers "not here" within a lookup's short wait, and the disk's hits still count.
    keys = [key(i) for i in range(4)]
    disk = PosixStore(PosixStoreConfig(path=str(tmp_path / "disk")))
    assert all(r.ok for r in disk.wait(disk.dump(keys, [blob(i, BLOCK) for i in range(4)]), 30))
    disk.close()
    config = TieredStoreConfig(
        dram=DramStoreConfig(path=str(shm_dir), capacity_gb=(1 << 20) / GIB),
        backing=PosixStoreConfig(path=str(tmp_path / "disk")),
    )
    tiered = create_store(config)
    try:
        tiered.check_block_bytes(BLOCK)
        stopped = holder(
            shm_dir,
            f"arena._sb[{arena_module.SB_SEQ}] += 1; print('holding', flush=True); "
            "os.kill(os.getpid(), 19)",
        )
        try:
            started = time.monotonic()
            assert tiered.lookup_prefix(keys) == 4
            assert tiered.lookup(keys) == [True] * 4
            assert time.monotonic() - started < 1.5  # two lookups, not two lock waits
        finally:
            end(stopped)
    finally:
        tiered.close()


# -- a slot being written is its writer's until it ends or dies --


def test_a_copy_that_lands_late_is_never_sealed_under_another_key(shm_dir):
    # Writer A reserves slots and its copy is late (a stuck DMA, a stopped process); long
    # past any lease, writer B needs room.  B must not get A's slots: A's late bytes would
    # be sealed and published under B's keys, and load as OK on every engine of the host.
    slots = 16
    a = open_store(shm_dir, capacity_bytes=slots * BLOCK)
    b = open_store(shm_dir, capacity_bytes=slots * BLOCK)
    try:
        late = a.open_writes([key(i, b"a") for i in range(4)], BLOCK)
        assert all(v is not None for v in late.views)
        arena = a._arena
        taken = np.flatnonzero(arena.np["state"] == arena_module.WRITING)
        arena.np["lease"][taken] = 1  # long ago, as far as any clock is concerned
        mine = [key(i, b"b") for i in range(slots)]
        writes = b.open_writes(mine, BLOCK)
        for i, view in enumerate(writes.views):
            if view is not None:
                view[:] = blob(100 + i, BLOCK).tobytes()
        for view in late.views:  # A's copy lands now
            view[:] = b"\xaa" * BLOCK
        results = b.wait(writes.commit(), 30)
        out = [bytearray(BLOCK) for _ in mine]
        loaded = b.wait(b.load(mine, out), 30)
        for i, (r, got) in enumerate(zip(loaded, out)):
            if r.ok:
                assert bytes(got) == blob(100 + i, BLOCK).tobytes(), f"key {i} holds A's bytes"
        assert sum(r.ok for r in results) == slots - 4  # A's four slots stayed A's
        assert all(r.ok for r in a.wait(late.commit(), 30))
        out = [bytearray(BLOCK) for _ in range(4)]
        assert all(r.ok for r in a.wait(a.load([key(i, b"a") for i in range(4)], out), 30))
        assert all(bytes(o) == b"\xaa" * BLOCK for o in out)
    finally:
        a.close()
        b.close()


def test_a_dead_writers_slots_are_reclaimed_without_waiting_for_any_lease(shm_dir):
    slots = 16
    open_store(shm_dir, capacity_bytes=slots * BLOCK).close()
    done = run_child(
        f"""
        writes = store.open_writes([key(i, b"dead") for i in range({slots})], {BLOCK})
        assert all(v is not None for v in writes.views)
        os.kill(os.getpid(), 9)  # killed mid-copy: every slot of the arena reserved
        """,
        shm_dir,
        capacity_gb=slots * BLOCK / GIB,
    )
    assert done.returncode == -9, done.stderr
    store = open_store(shm_dir, capacity_bytes=slots * BLOCK)
    try:
        assert store._arena.stats()["writing"] == slots
        keys = [key(i) for i in range(slots)]
        results = store.wait(store.dump(keys, [blob(i, BLOCK) for i in range(slots)]), 30)
        assert all(r.ok for r in results), results[0]
        assert store._arena.stats()["writing"] == 0
    finally:
        store.close()


def _unshare_works() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    done = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True)
    return done.returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="needs root and unshare --pid")
def test_a_live_writer_keeps_its_slots_through_a_recovery_in_another_pid_namespace(shm_dir):
    # Two containers share /dev/shm.  Our writer (this process) has slots reserved when a
    # process dies inside the lock; the next holder, in another PID namespace, mends the
    # books.  Our pid means nothing there: the writer's lock must decide, and it is held.
    store = open_store(shm_dir)
    try:
        mine = [key(i, b"live") for i in range(4)]
        writes = store.open_writes(mine, BLOCK)
        killed = holder(shm_dir, f"arena._sb[{arena_module.SB_FREE_TOP}] -= 1; "
                                 "print('holding', flush=True); time.sleep(600)")  # fmt: skip
        killed.kill()
        killed.wait()
        done = run_child(
            f"""
            keys = [key(i, b"other") for i in range(200)]
            got = store.wait(store.dump(keys, [blob(i, {BLOCK}) for i in range(200)]), 30)
            assert all(r.ok for r in got), got[0]
            print(os.getpid(), store._arena.stats()["recoveries"])
            store.close()
            """,
            shm_dir,
            prefix=("unshare", "--pid", "--fork"),
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["1", "1"]  # pid 1 of its namespace; it recovered
        for i, view in enumerate(writes.views):
            view[:] = blob(50 + i, BLOCK).tobytes()
        assert all(r.ok for r in store.wait(writes.commit(), 30))
        out = [bytearray(BLOCK) for _ in mine]
        assert all(r.ok for r in store.wait(store.load(mine, out), 30))
        assert all(bytes(o) == blob(50 + i, BLOCK).tobytes() for i, o in enumerate(out))
    finally:
        store.close()


# -- a load checks the key in the slot, signed or not --


@pytest.fixture(params=["compiled", "python"])
def pins(request, monkeypatch):
    """The arena's books (pins, reservations, publications) in one compiled call each, or
    key by key in Python."""
    if request.param == "compiled" and arena_module._LIBRARY is None:
        pytest.skip("the library was not built here (no C compiler)")
    if request.param == "python":
        monkeypatch.setattr(arena_module, "_LIBRARY", None)
    else:  # every batch, however small
        monkeypatch.setattr(arena_module, "COMPILED_MIN_KEYS", 1)
    return request.param


def test_an_index_entry_pointing_at_another_block_serves_nothing(shm_dir, pins):
    store = open_store(shm_dir)
    try:
        keys = [key(1), key(2), key(3)]
        blobs = [blob(i, BLOCK) for i in (1, 2, 3)]
        assert all(r.ok for r in store.wait(store.dump(keys, blobs)))
        arena = store._arena
        w1, w2, w3 = store._words(keys)
        with arena.locked():  # a same-user bug redirects key 1's entry to key 2's slot
            b1, b2, b3 = (arena._index.find(*w) for w in (w1, w2, w3))
            arena._islot[b1] = arena._islot[b2]
            arena._islot[b3] = arena.geometry.slots + 5  # and key 3's past the arena
        out = [bytearray(BLOCK) for _ in keys]
        got = store.wait(store.load(keys, out))
        assert [r.status for r in got] == [Status.MISS, Status.OK, Status.MISS]
        assert [bytes(o) for o in out] == [bytes(BLOCK), blobs[1].tobytes(), bytes(BLOCK)]
        assert store.lookup(keys) == [False, True, False]
        with arena.locked():
            assert int(arena.np["pins"].sum()) == 0  # the one pin taken was let go
    finally:
        store.close()


def test_pins_walk_an_index_without_an_empty_bucket_within_its_bound(shm_dir, pins):
    # every bucket a tombstone (the compiled walk too): misses, and the index rebuilt on
    # the way out of the lock, so the next load finds every block again
    store = open_store(shm_dir)
    try:
        keys = [key(i) for i in range(40)]
        assert all(r.ok for r in store.wait(store.dump(keys, [blob(i, BLOCK) for i in range(40)])))
        arena = store._arena
        with arena.locked():
            arena.np["islot"][:] = TOMB
        assert [p is None for p in arena.pin(store._words(keys))] == [True] * 40
        out = [bytearray(BLOCK) for _ in keys]
        assert all(r.ok for r in store.wait(store.load(keys, out), 30))
        assert all(bytes(o) == blob(i, BLOCK).tobytes() for i, o in enumerate(out))
    finally:
        store.close()


# -- damaged write books stop a batch, never write over a block, and are mended --


@pytest.mark.parametrize("damage", ["a slot in use", "a slot past the arena", "too long"])
def test_a_damaged_free_stack_writes_over_no_block_and_is_mended(shm_dir, pins, damage):
    # a same-user bug leaves the free stack naming a stored block's slot, a slot past the
    # arena, or more slots than the arena has: the reservation stops (a slot taken from it
    # would be written over, or out of the arena), and the next hold of the lock rebuilds
    # the books from the columns, after which blocks are stored again
    store = open_store(shm_dir)
    try:
        assert store.wait(store.dump([key(1)], [blob(1, BLOCK)]))[0].ok
        arena = store._arena
        slots = arena.geometry.slots
        (stored,) = arena.ready_slots()
        with arena.locked():
            top = arena._sb[arena_module.SB_FREE_TOP]
            if damage == "too long":
                arena._sb[arena_module.SB_FREE_TOP] = slots + 1
            else:
                arena._free[top - 1] = stored if damage == "a slot in use" else slots + 5
        recoveries = arena.stats()["recoveries"]
        with pytest.raises(RuntimeError, match="corrupt free stack"):
            arena.reserve(store._words([key(2)]), 4)
        assert store.wait(store.dump([key(2)], [blob(2, BLOCK)]))[0].ok  # mended first
        assert arena.stats()["recoveries"] == recoveries + 1
        out = [bytearray(BLOCK) for _ in range(2)]
        assert all(r.ok for r in store.wait(store.load([key(1), key(2)], out)))
        assert [bytes(o) for o in out] == [blob(1, BLOCK).tobytes(), blob(2, BLOCK).tobytes()]
        with arena.locked():
            assert arena.check() == []
    finally:
        store.close()


def _stored_and_reserved(shm_dir) -> tuple[SharedMemoryStore, list, tuple[int, int]]:
    """A store holding key 1's block, and a slot reserved for key 2 (its words, the slot)."""
    store = open_store(shm_dir)
    assert store.wait(store.dump([key(1)], [blob(1, BLOCK)]))[0].ok
    words = store._words([key(2)])
    (reserved,) = store._arena.reserve(words, 4)
    return store, words, reserved


def test_a_block_published_into_an_index_without_a_free_bucket_gives_its_slot_back(shm_dir, pins):
    # every bucket holds an entry (a same-user bug: no EMPTY bucket, no tombstone): the
    # publication walks the index within its bound, finds no bucket, gives the slot back
    # (the block is not stored) and the index is rebuilt from the slots on the way out of
    # the lock: the stored block is found again, the next dump is stored
    store, words, reserved = _stored_and_reserved(shm_dir)
    arena, slots = store._arena, store._arena.geometry.slots
    try:
        with arena.locked():
            arena.np["islot"][:] = slots + 1  # an entry in every bucket, for no key
        assert arena.publish([(*reserved, BLOCK, 0, b"s" * 8)], words) == [False]
        stats = arena.stats()
        assert stats["free_slots"] == slots - 1 and stats["writing"] == 0
        assert stats["index_rebuilds"] >= 1 and store.lookup([key(1), key(2)]) == [True, False]
        assert store.wait(store.dump([key(2)], [blob(2, BLOCK)]))[0].ok
        assert store.lookup([key(1), key(2)]) == [True, True]
        with arena.locked():
            assert arena.check() == []
    finally:
        store.close()


def test_a_slot_given_back_onto_a_full_free_stack_is_mended_not_written_past_it(shm_dir, pins):
    # the free stack says every slot is free while a batch holds one (a same-user bug):
    # giving the slot back would push it past the stack's end; the call stops instead,
    # and the next hold of the lock rebuilds the books (the slot free again)
    store, words, reserved = _stored_and_reserved(shm_dir)
    arena, slots = store._arena, store._arena.geometry.slots
    try:
        with arena.locked():
            arena._sb[arena_module.SB_FREE_TOP] = slots
        with pytest.raises((RuntimeError, IndexError)):  # (Python's: the stack's own bound)
            arena.publish([(*reserved, -1, 0, b"")], words)
        with arena.locked():  # mended on entry
            assert arena.check() == []
            assert arena.stats()["free_slots"] == slots - 1  # key 1's slot alone is used
        assert store.lookup([key(1), key(2)]) == [True, False]
    finally:
        store.close()


def test_a_stored_length_past_its_slot_lends_no_view_past_it(shm_dir, pins):
    # a same-user bug writes a length longer than a slot, and a reader asks for blocks of
    # that length: nothing is lent (no view nor address past the slot, no pin left held),
    # and a load of it is a failed block, not a read past the slot
    store = open_store(shm_dir)
    try:
        assert store.wait(store.dump([key(1)], [blob(1, BLOCK)]))[0].ok
        arena = store._arena
        (slot,) = arena.ready_slots()
        big = arena.geometry.slot_bytes + BLOCK
        with arena.locked():
            arena.np["length"][slot] = big
        assert store.open_reads([key(1)], big, check=False) is None
        assert arena.stats()["pinned"] == 0
        (got,) = store.wait(store.load([key(1)], [bytearray(big)]), 30)
        assert not got.ok
    finally:
        store.close()


# -- a file cut short is refused, not a SIGBUS --


def test_an_arena_cut_short_by_another_process_fails_loudly_not_with_sigbus(shm_dir):
    store = open_store(shm_dir)
    keys = [key(i) for i in range(8)]
    assert all(r.ok for r in store.wait(store.dump(keys, [blob(i, BLOCK) for i in range(8)])))
    store.close()
    done = run_child(
        f"""
        store.check_block_bytes({BLOCK})
        arena = store._arena
        os.truncate(os.path.join(sys.argv[1], "arena"), arena.geometry.meta_bytes)
        keys = [key(i) for i in range(8)]
        print(store.lookup(keys))
        got = store.wait(store.load(keys, [bytearray({BLOCK}) for _ in keys]), 30)
        print(sorted({{r.status.name for r in got}}), got[0].detail)
        print(store.wait(store.dump([key(9)], [blob(9, {BLOCK})]), 30)[0].status.name)
        """,
        shm_dir,
    )
    assert done.returncode == 0, (done.returncode, done.stderr)  # -7 were a SIGBUS
    lines = done.stdout.splitlines()
    assert lines[0] == str([False] * 8)
    assert lines[1].startswith("['ERROR']") and "shorter than its geometry" in lines[1]
    assert lines[2] == "ERROR"


# -- what lies at the store's path --


@pytest.mark.parametrize("what", ["file", "fifo", "dangling link"])
def test_something_else_at_the_store_path_is_refused_with_what_it_is_and_the_fix(shm_dir, what):
    if what == "file":
        shm_dir.write_bytes(b"")
    elif what == "fifo":
        os.mkfifo(shm_dir)
    else:
        os.symlink(str(shm_dir) + "-nowhere", shm_dir)
    try:
        with pytest.raises(ConfigError) as caught:
            SharedMemoryStore(DramStoreConfig(path=str(shm_dir), capacity_gb=0.001))
        assert caught.value.key == "store.path"
        message = str(caught.value)
        assert str(shm_dir) in message and "remove it" in message, message
    finally:
        os.unlink(shm_dir)


def test_a_large_booked_commit_that_cannot_get_the_lock_loses_its_blocks_not_its_room(shm_dir):
    # a GPU's batch of digests, published as arrays, while another thread holds the lock
    # past the wait: every key an error, in bounded time, and the room owed back at the
    # next hold (none left WRITING); the next batch commits
    from ucm.core.digest import block_digest

    block = 4096
    store = open_store(shm_dir, capacity_bytes=1 << 20, block=block)
    try:
        keys = [key(i) for i in range(80)]
        writes = store.open_writes(keys, block, b"t")
        for i, view in enumerate(writes.views):
            view[:] = blob(i, block).tobytes()
        digests = [block_digest(blob(i, block)) for i in range(80)]
        arena = store._arena
        with lock_held_elsewhere(arena):
            started = time.monotonic()
            results = store.wait(writes.commit(digests), 30)
            assert time.monotonic() - started < arena_module.LOCK_WAIT_S + 2
        assert not any(r.ok for r in results)
        with arena.locked():  # gives back what the commit owes
            pass
        assert arena.stats()["writing"] == 0 and store.lookup(keys) == [False] * 80
        again = store.open_writes(keys, block, b"t")
        for i, view in enumerate(again.views):
            view[:] = blob(i, block).tobytes()
        assert all(r.ok for r in store.wait(again.commit(digests)))
        assert store.lookup(keys) == [True] * 80
    finally:
        store.close()


# -- a load copied without the GIL: its two holds of the lock, and a close meanwhile --


def test_loads_racing_a_holder_of_the_lock_end_ok_or_busy_and_leave_whole_books(shm_dir):
    # Another thread takes the arena's lock for longer than the loads wait, again and
    # again: a load's first hold or its second (letting go of its pins) may miss it.  Every
    # block still comes back whole or as an error, and once the lock is free the pins owed
    # are let go: the books balance.
    if arena_module._LIBRARY is None:
        pytest.skip("the library was not built here (no C compiler)")
    block = 256 << 10
    store = SharedMemoryStore(DramStoreConfig(path=str(shm_dir), capacity_gb=0.0625))
    try:
        keys = [key(i) for i in range(64)]
        assert all(r.ok for r in store.wait(store.dump(keys, [blob(i, block) for i in range(64)])))
        arena = store._arena
        stop = threading.Event()

        def hold_again_and_again():
            while not stop.is_set():
                with arena.locked():
                    time.sleep(0.03)
                time.sleep(0.001)

        holder = threading.Thread(target=hold_again_and_again)
        holder.start()
        seen = set()
        words = store._words(keys)

        def load(round_):
            out = [bytearray(block) for _ in keys]
            try:
                got = arena.load_compiled(
                    words, [block] * len(keys), [[memoryview(o)] for o in out], 0, wait_s=0.02
                )
            except arena_module.ArenaBusy:
                seen.add("busy")
                return
            if got is None:  # pins still owed (paid back at the holder's next hold)
                seen.add("owed")
                return
            codes = got.codes
            assert codes == [arena_module.LOADED] * len(keys), round_
            assert all(bytes(o) == blob(i, block).tobytes() for i, o in enumerate(out))
            seen.add("loaded")

        try:
            for round_ in range(40):
                load(round_)
        finally:
            stop.set()
            holder.join()
        for _ in range(10):  # (a loaded host: no round found the lock free twice)
            if "loaded" in seen:
                break
            with arena.locked():  # pays back what the racing loads owe: a load may lend again
                pass
            load("after")  # the lock free: whatever the races left, a load ends whole
        assert "loaded" in seen, seen
        with arena.locked():  # pays back what the busy loads owe
            assert arena.check() == []
            assert int(arena.np["pins"].sum()) == 0
    finally:
        store.close()


def test_a_store_closed_while_loads_copy_without_the_gil_ends_them_without_a_crash(shm_dir):
    # loads of 2 MiB blocks on other threads while the store closes: each ends (loaded,
    # missed or an error), none touches an unmapped page (the process would die)
    done = run_child(
        """
        import threading
        store.check_block_bytes(2 << 20)
        keys = [key(i) for i in range(24)]
        store.wait(store.dump(keys, [blob(i, 2 << 20) for i in range(24)]), 30)
        outcomes = []

        def load_again_and_again():
            for _ in range(50):
                try:
                    got = store.wait(store.load(keys, [bytearray(2 << 20) for _ in keys]), 30)
                    outcomes.extend(r.status.name for r in got)
                except Exception as exc:  # a closed store may refuse: never a crash
                    outcomes.append(type(exc).__name__)

        threads = [threading.Thread(target=load_again_and_again) for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        store.close()
        for t in threads:
            t.join(60)
        print(sorted(set(outcomes)))
        print(any(t.is_alive() for t in threads))
        """,
        shm_dir,
        capacity_gb=0.0625,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "OK" in lines[0], lines
    assert lines[1] == "False"
