"""The mover: its route rule, its rows, and batches and runs of blocks moved between plain
torch caches and real stores, on the CPU and, where there is one, on a GPU."""

import time

import attrs
import pytest
import torch
from ucm.core.store import Status, create_store, verified_prefix
from ucm.lab.testing.core import flip_shared_block_byte
from ucm.lab.testing.kernels import GatedLayers

from ucm.kernels import IN_PLACE_MIN_BYTES, block_segments
from ucm.kernels.mover import (
    Ahead,
    Batch,
    Caches,
    Mover,
    MoverSettings,
    Route,
    RouteAsk,
    RowPool,
    choose_route,
    deferred_payloads,
    read_run,
    row_buffers,
    write_run,
)
from ucm.kernels.row_table import RowTable


def test_rows_given_back_are_taken_again_from_one_allocation():
    pool = RowPool(keep_bytes=1 << 20)
    rows = pool.take(4096, 4, pin=False)
    assert [r.numel() for r in rows] == [4096] * 4
    pool.give(rows)
    assert pool.free_bytes == 4 * 4096
    again = pool.take(4096, 3, pin=False)
    assert [r.data_ptr() for r in again] == [r.data_ptr() for r in rows[:3]]
    spacing = {b.data_ptr() - a.data_ptr() for a, b in zip(again, again[1:])}
    assert spacing == {4096}  # evenly spaced: the kernels move them in one operation
    assert pool.free_bytes == 4096
    assert pool.take(4096, 1, pin=False)[0].data_ptr() == rows[3].data_ptr()


def test_rows_of_other_sizes_are_kept_apart_and_new_ones_made_when_short():
    pool = RowPool(keep_bytes=1 << 20)
    small, large = pool.take(1024, 2, pin=False), pool.take(2048, 1, pin=False)
    pool.give([*small, *large])  # mixed sizes in one call
    got = pool.take(2048, 2, pin=False)
    assert got[0].data_ptr() == large[0].data_ptr() and got[1].numel() == 2048
    assert pool.free_bytes == 2 * 1024


def test_no_more_than_keep_bytes_are_kept():
    pool = RowPool(keep_bytes=3 * 1000)
    pool.give(pool.take(1000, 5, pin=False))
    assert pool.free_bytes == 3000
    pool.reserve(1000, 2, pin=False)
    assert pool.free_bytes == 3000


def test_rows_and_cache_blocks_as_store_buffers():
    row = torch.arange(8, dtype=torch.uint8)
    (view,) = row_buffers([row])
    view[0] = 99  # the store writes the row itself
    assert row[0] == 99
    cache = torch.arange(4 * 2 * 8, dtype=torch.float32).reshape(4, 2, 8)  # [B, N, C]
    segments = block_segments([cache], [[1], [3]])
    payloads = deferred_payloads(segments, [1])
    assert len(payloads) == 1 and payloads[0].nbytes == 2 * 8 * 4
    data = b"".join(bytes(p) for p in payloads[0].parts)
    assert data == cache[3].numpy().tobytes()


# -- the route rule ------------------------------------------------------------------------

BIG = IN_PLACE_MIN_BYTES


@pytest.mark.parametrize(
    "device, nbytes, contiguous, cache_lent, registered, zero_copy, route",
    [
        ("cpu", 4096, True, True, False, True, Route.IN_PLACE),
        ("cpu", 4096, True, False, False, True, Route.STORE_MEMORY),  # held by the engine
        ("cpu", BIG, False, True, False, True, Route.STORE_MEMORY),  # large: as fast
        ("cpu", BIG - 1, False, True, False, True, Route.ROWS),  # small, gathered: rows
        ("cpu", BIG, True, True, False, False, Route.ROWS),  # zero_copy off
        ("cuda", 4096, False, False, True, True, Route.STORE_MEMORY),
        ("cuda", BIG, True, True, False, True, Route.ROWS),  # not registered: rows
        ("cuda", BIG, False, False, True, False, Route.ROWS),
    ],
)
def test_the_route_rule(device, nbytes, contiguous, cache_lent, registered, zero_copy, route):
    ask = RouteAsk(device, nbytes, contiguous, cache_lent, registered, zero_copy)
    assert choose_route(ask) is route


# -- batches and runs between plain torch caches and real stores ---------------------------

BLOCKS, TOKENS, DIM, LAYERS = 24, 16, 64, 2
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def _caches(device: str, heads: int, seed: int) -> Caches:
    """K and V of each layer, ``[blocks, heads, tokens, dim]``; with several heads, views of
    head-major tensors, so that a block is not one run of memory (it is gathered)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (heads, BLOCKS, TOKENS, DIM)
    made = [torch.randn(shape, generator=gen).to(device) for _ in range(2 * LAYERS)]
    return Caches(tuple(t.transpose(0, 1) for t in made))


def _store(kind: str, tmp_path, shm_dir, nbytes: int | None = None):
    """A store; with ``nbytes``, one that knows its blocks' size, as an engine's worker
    announces it at start-up (the dram store's memory then exists before the first batch,
    and a GPU's first batch can be routed through it)."""
    if kind == "posix":
        return create_store({"kind": "posix", "path": str(tmp_path / "posix")})
    store = create_store({"kind": "dram", "path": str(shm_dir), "capacity_gb": 0.03125})
    if nbytes is not None:
        store.check_block_bytes(nbytes)
    return store


def _block(caches: Caches, block: int) -> list[torch.Tensor]:
    return [t[block].cpu() for t in caches.tensors]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "kind, heads, zero_copy, lent, dump_route, read_route",
    [
        ("dram", 1, True, True, Route.STORE_MEMORY, Route.IN_PLACE),
        ("dram", 1, True, False, Route.STORE_MEMORY, Route.STORE_MEMORY),
        ("dram", 4, True, False, Route.ROWS, Route.ROWS),  # 64 KiB, gathered: rows
        ("posix", 1, True, True, Route.STORE_MEMORY, Route.IN_PLACE),  # no room: rows
        ("dram", 1, False, True, Route.ROWS, Route.ROWS),
    ],
)
def test_a_batch_moves_by_its_route_and_lands_where_it_belongs(
    device, kind, heads, zero_copy, lent, dump_route, read_route, tmp_path, shm_dir
):
    if device == "cuda":  # registered host memory or pinned rows: never in place
        in_memory = kind == "dram" and zero_copy
        dump_route = read_route = Route.STORE_MEMORY if in_memory else Route.ROWS
    source, target = _caches(device, heads, 1), _caches(device, heads, 2)
    nbytes = source.payload_nbytes()
    keys = [bytes([i]) * 16 for i in range(6)]
    ids, into = [3, 7, 1, 20, 11, 5], [0, 2, 4, 6, 8, 10]
    mover = Mover(MoverSettings(zero_copy=zero_copy))
    with _store(kind, tmp_path, shm_dir, nbytes) as store:
        dump = Batch(source, ids, keys, store, b"t", nbytes)
        assert mover.route(dump, cache_lent=False)[0] is dump_route
        task = mover.dump(dump)
        assert all(r.ok for r in task.wait(10))
        read = mover.start_read(Batch(target, into, keys, store, b"t", nbytes), cache_lent=lent)
        if kind == "dram" or read_route is not Route.STORE_MEMORY:
            assert read.route is read_route
        read.task.wait(10)
        assert all(r is not None and r.ok for r in mover.settle_read(read))
        mover.complete_read(read, [True] * len(keys))
        mover.close()
    for block, at in zip(ids, into):
        for got, want in zip(_block(target, at), _block(source, block)):
            assert torch.equal(got, want)
    untouched = [b for b in range(BLOCKS) if b not in into]
    fresh = _caches(device, heads, 2)
    for got, want in zip(target.tensors, fresh.tensors):
        assert torch.equal(got[untouched].cpu(), want[untouched].cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_the_caller_decides_which_loaded_blocks_count_and_rows_go_back(device, shm_dir):
    source, target = _caches(device, 4, 3), _caches(device, 4, 4)
    before = [t.clone() for t in target.tensors]
    nbytes = source.payload_nbytes()
    keys = [bytes([40 + i]) * 16 for i in range(4)]
    writer, mover = Mover(), Mover(MoverSettings(staging_bytes=1 << 20, zero_copy=False))
    with _store("dram", None, shm_dir) as store:
        dumped = writer.dump(Batch(source, [0, 1, 2, 3], keys, store, b"t", nbytes))
        assert all(r.ok for r in dumped.wait(10))
        flip_shared_block_byte(shm_dir, keys[1])
        read = mover.start_read(Batch(target, [4, 5, 6, 7], keys, store, b"t", nbytes))
        assert read.route is Route.ROWS and len(read.rows) == 4
        read.task.wait(10)
        results = mover.settle_read(read)
        assert [r.status for r in results] == [Status.OK, Status.CORRUPT, Status.OK, Status.OK]
        prefix = verified_prefix(results)
        mover.complete_read(read, [i < prefix for i in range(4)])
        assert mover.pool.free_bytes == 4 * nbytes  # every row back to this reader's pool
        writer.close()  # the store's memory unregistered (a GPU) before the store unmaps it
        mover.close()
    for got, src, old in zip(target.tensors, source.tensors, before):
        assert torch.equal(got[4].cpu(), src[0].cpu())
        assert torch.equal(got[5:8].cpu(), old[5:8].cpu())  # not used: not scattered


def _as_registered(mover: Mover, store) -> None:
    """On the CPU, the store's memory taken as a GPU host's registered memory (there is no
    driver to register it with): the mover hands its stager row tables, the GPU's way,
    through a scratch of the CPU's."""
    for region in store.host_memory():
        mover.pinned._regions.append(torch.frombuffer(region, dtype=torch.uint8))


TABLES = ["rows", "tables"] if not torch.cuda.is_available() else ["rows"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("host", TABLES)
def test_blocks_digested_by_the_copy_are_sealed_with_it_and_checked_on_the_way_back(
    device, host, shm_dir, monkeypatch
):
    # what a GPU does (device_digests defaults to on there; here the CPU plays the device):
    # the store books the digests the copy computed without reading a byte, lends its
    # blocks unchecked, and a block changed in shared memory fails on its way into the
    # cache, never reaches it, and is dropped from the store
    from ucm.core.store.dram import shared

    source, target = _caches(device, 1, 7), _caches(device, 1, 8)
    before = [t.clone() for t in target.tensors]
    nbytes = source.payload_nbytes()
    keys = [bytes([120 + i]) * 16 for i in range(4)]
    mover = Mover(MoverSettings(device_digests=True))
    with _store("dram", None, shm_dir, nbytes) as store:
        if host == "tables":
            _as_registered(mover, store)
            monkeypatch.setattr(RowTable, "of", _counted(RowTable.of, made := []))
        with monkeypatch.context() as patch:
            patch.setattr(shared, "move_sealed_batch", _never_called)
            dumped = mover.dump(Batch(source, [0, 1, 2, 3], keys, store, b"t", nbytes))
            assert all(r.ok for r in dumped.wait(10))
        flip_shared_block_byte(shm_dir, keys[1])
        # the booked digests are the blocks' own: the store's own check agrees
        back = [torch.zeros(nbytes, dtype=torch.uint8) for _ in keys]
        checked = store.wait(store.load(keys, [b.numpy() for b in back], b"t"))
        assert [r.status for r in checked] == [Status.OK, Status.CORRUPT, Status.OK, Status.OK]
        _dump_again(mover, source, keys[1], store, nbytes)
        flip_shared_block_byte(shm_dir, keys[1])
        with monkeypatch.context() as patch:
            patch.setattr(shared, "move_sealed_batch", _never_called)
            read = mover.start_read(Batch(target, [4, 5, 6, 7], keys, store, b"t", nbytes))
            assert read.route is Route.STORE_MEMORY and read.lent.digests is not None
            read.task.wait(10)
            results = mover.settle_read(read)
        assert [r.status for r in results] == [Status.OK, Status.CORRUPT, Status.OK, Status.OK]
        assert store.lookup(keys) == [True, False, True, True]  # dropped when given back
        mover.close()
    if host == "tables":
        assert made  # the dumps and the checked loads went by row tables
    for got, src, old in zip(target.tensors, source.tensors, before):
        assert torch.equal(got[[4, 6, 7]].cpu(), src[[0, 2, 3]].cpu())
        assert torch.equal(got[5].cpu(), old[5].cpu())  # failed on the way: not scattered


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("host", TABLES)
def test_a_run_stops_at_a_block_that_fails_its_digest_on_the_way(
    device, host, shm_dir, monkeypatch
):
    # blocks of 1 MiB gathered from 8 heads: through the store's memory on the CPU too, each
    # step's copy queued before the one before it is settled
    source, target = _big_caches(device, 9), _big_caches(device, 10)
    nbytes = source.payload_nbytes()
    n = 12
    keys = [bytes([160 + i]) * 16 for i in range(n)]
    mover = Mover(MoverSettings(step_bytes=3 * nbytes, depth=2, device_digests=True))
    deadline = time.monotonic() + 30
    ids = list(range(n))
    with _store("dram", None, shm_dir, nbytes) as store:
        if host == "tables":
            _as_registered(mover, store)
            monkeypatch.setattr(RowTable, "of", _counted(RowTable.of, made := []))
        batch = Batch(source, ids, keys, store, b"t", nbytes)
        assert mover.route(batch, cache_lent=True)[0] is Route.STORE_MEMORY
        assert write_run(mover, batch, deadline, "t") == n
        flip_shared_block_byte(shm_dir, keys[7])
        assert read_run(mover, Batch(target, ids, keys, store, b"t", nbytes), deadline, "t") == 7
        assert not store.lookup([keys[7]])[0]
        mover.close()
    if host == "tables":
        assert len(made) >= 8  # every step each way went by a row table
    for at in range(7):
        for got, want in zip(_block(target, at), _block(source, at)):
            assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_a_run_gathers_the_next_runs_first_step_before_committing_its_last(device, shm_dir):
    # a sliced write (FastDeploy's) through the store's memory: the first step of the next
    # slice is copied into room reserved for it before this slice's last step is committed
    # (on a GPU the link does not idle between slices), and used by the next run as it is
    source, target = _big_caches(device, 11), _big_caches(device, 12)
    nbytes = source.payload_nbytes()
    keys = [bytes([200 + i]) * 16 for i in range(8)]
    mover = Mover(MoverSettings(step_bytes=2 * nbytes, device_digests=True))
    deadline = time.monotonic() + 30
    with _store("dram", None, shm_dir, nbytes) as store:
        events: list[tuple[str, tuple[bytes, ...]]] = []
        open_writes = store.open_writes

        def spied(keys_, *args, **kwargs):
            writes = open_writes(keys_, *args, **kwargs)
            events.append(("open", tuple(keys_)))
            commit = writes.commit

            def committed(*a, **k):
                events.append(("commit", tuple(keys_)))
                return commit(*a, **k)

            writes.commit = committed
            return writes

        store.open_writes = spied
        ahead = Ahead(mover.pool)
        first = Batch(source, [0, 1, 2, 3], keys[:4], store, b"t", nbytes)
        assert mover.route(first, cache_lent=True)[0] is Route.STORE_MEMORY
        assert write_run(mover, first, deadline, "t", ahead, [4, 5, 6, 7], keys[4:]) == 4
        assert (
            events
            == [
                ("open", tuple(keys[0:2])),
                ("open", tuple(keys[2:4])),
                ("commit", tuple(keys[0:2])),
                ("open", tuple(keys[4:6])),  # the next run's first step, before the last commit
                ("commit", tuple(keys[2:4])),
            ]
        )
        assert store.lookup(keys[4:6]) == [False, False]  # gathered, not committed
        second = Batch(source, [4, 5, 6, 7], keys[4:], store, b"t", nbytes)
        assert write_run(mover, second, deadline, "t", ahead) == 4
        assert ("open", tuple(keys[4:6])) not in events[5:]  # its room taken from ahead
        assert not ahead.rooms
        ids = list(range(8))
        assert read_run(mover, Batch(target, ids, keys, store, b"t", nbytes), deadline, "t") == 8
        mover.close()
    for at in range(8):
        for got, want in zip(_block(target, at), _block(source, at)):
            assert torch.equal(got, want)


def test_a_next_run_that_never_comes_gives_its_room_back_unwritten(shm_dir):
    source = _big_caches("cpu", 13)
    nbytes = source.payload_nbytes()
    keys = [bytes([220 + i]) * 16 for i in range(6)]
    mover = Mover(MoverSettings(step_bytes=2 * nbytes, device_digests=True))
    deadline = time.monotonic() + 30
    with _store("dram", None, shm_dir, nbytes) as store:
        ahead = Ahead(mover.pool)
        first = Batch(source, [0, 1], keys[:2], store, b"t", nbytes)
        assert write_run(mover, first, deadline, "t", ahead, [2, 3], keys[2:4]) == 2
        assert len(ahead.rooms) == 1
        ahead.release()  # the caller's next slice is not written (this one fell short)
        assert not ahead.rooms
        assert store.lookup(keys[:4]) == [True, True, False, False]
        # the room is free again: the same keys are written anew, and stored
        again = Batch(source, [2, 3], keys[2:4], store, b"t", nbytes)
        assert write_run(mover, again, deadline, "t") == 2
        assert store.lookup(keys[2:4]) == [True, True]
        # a run that stops short (its deadline passed) begins no next run
        late = Batch(source, [4, 5], keys[4:6], store, b"t", nbytes)
        assert write_run(mover, late, time.monotonic() - 1, "t", ahead, [0], keys[:1]) == 0
        assert not ahead.rooms
        mover.close()


def _counted(make, made: list):
    def counted(*args, **kwargs):
        made.append(1)
        return make(*args, **kwargs)

    return counted


def _big_caches(device: str, seed: int) -> Caches:
    gen = torch.Generator().manual_seed(seed)
    made = [torch.randn((8, 16, 64, 128), generator=gen).to(device) for _ in range(2 * LAYERS)]
    return Caches(tuple(t.transpose(0, 1) for t in made))


def _never_called(*args, **kwargs):
    raise AssertionError("the store read the blocks' bytes")


def _dump_again(mover: Mover, source: Caches, key: bytes, store, nbytes: int) -> None:
    store.remove([key])
    assert mover.dump(Batch(source, [1], [key], store, b"t", nbytes)).wait(10)[0].ok


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads", [1, 4])
def test_a_run_in_steps_keeps_the_stored_prefix_whole(device, heads, tmp_path):
    source, target = _caches(device, heads, 5), _caches(device, heads, 6)
    nbytes = source.payload_nbytes()
    keys = [bytes([80 + i]) * 16 for i in range(BLOCKS)]
    mover = Mover(MoverSettings(step_bytes=3 * nbytes, depth=2))
    ids = list(range(BLOCKS))[::-1]
    deadline = time.monotonic() + 30
    with _store("posix", tmp_path, None) as store:
        assert (
            write_run(mover, Batch(source, ids, keys, store, b"t", nbytes), deadline, "t") == BLOCKS
        )
        store.remove([keys[13]])  # a gap: the read stops there
        into = list(range(BLOCKS))
        assert read_run(mover, Batch(target, into, keys, store, b"t", nbytes), deadline, "t") == 13
    for at in range(13):
        for got, want in zip(_block(target, at), _block(source, ids[at])):
            assert torch.equal(got, want)


def test_a_read_a_layer_at_a_time_lands_layer_by_layer_and_is_checked_once_whole(
    shm_dir, monkeypatch
):
    # vLLM's forward pass waits for each layer right before reading it: layer 0 of every
    # block is there while the others are still being copied, and each block is checked
    # once its last layer landed, over what landed (a corrupt one is dropped)
    gated = GatedLayers().install(monkeypatch)
    source, target = _caches("cpu", 1, 5), _caches("cpu", 1, 6)
    before = [t.clone() for t in target.tensors]
    nbytes = source.payload_nbytes()
    keys = [bytes([60 + i]) * 16 for i in range(6)]
    ids, into = [3, 7, 1, 20, 11, 5], [0, 2, 4, 6, 8, 10]
    mover = Mover()
    with _store("dram", None, shm_dir, nbytes) as store:
        assert all(r.ok for r in mover.dump(Batch(source, ids, keys, store, b"t", nbytes)).wait(10))
        flip_shared_block_byte(shm_dir, keys[2], offset=5)  # in its first layer
        read = mover.start_layered_read(Batch(target, into, keys, store, b"t", nbytes))
        assert read is not None and read.route is Route.IN_PLACE
        assert read.layers.layers == len(target.tensors)
        assert read.layers.wait_layer(0, 10)
        assert not read.layers.wait_layer(1, 0.05) and not read.done()
        for block, at in zip(ids, into):  # the first cache tensor is in, the next not yet
            if block != 1:  # (the damaged one: its flipped byte landed too)
                assert torch.equal(target.tensors[0][at], source.tensors[0][block])
            assert torch.equal(target.tensors[1][at], before[1][at])
        gated.gate.set()
        assert all(read.layers.wait_layer(n, 10) for n in range(len(target.tensors)))
        read.task.wait(10)
        results = mover.settle_read(read)
        assert [r.status for r in results] == [Status.OK] * 2 + [Status.CORRUPT] + [Status.OK] * 3
        assert store.lookup(keys) == [True, True, False, True, True, True]  # dropped
        mover.close()
    for n, (got, src) in enumerate(zip(target.tensors, source.tensors)):
        for block, at in zip(ids, into):
            if block != 1 or n:  # the damaged block landed as stored, its byte flipped
                assert torch.equal(got[at], src[block])


def test_a_read_a_layer_at_a_time_stops_between_layers_and_none_of_it_counts(shm_dir, monkeypatch):
    import threading

    gated = GatedLayers().install(monkeypatch)
    source, target = _caches("cpu", 1, 7), _caches("cpu", 1, 8)
    before = [t.clone() for t in target.tensors]
    nbytes = source.payload_nbytes()
    keys = [bytes([70 + i]) * 16 for i in range(4)]
    mover = Mover()
    with _store("dram", None, shm_dir, nbytes) as store:
        dumped = mover.dump(Batch(source, [0, 1, 2, 3], keys, store, b"t", nbytes))
        assert all(r.ok for r in dumped.wait(10))
        read = mover.start_layered_read(Batch(target, [4, 5, 6, 7], keys, store, b"t", nbytes))
        assert read.layers.wait_layer(0, 10)
        threading.Timer(0.2, gated.gate.set).start()  # the copy of layer 1 is under way
        assert mover.stop_read(read, 5.0)  # quiet: the copy stopped before layer 2
        assert mover.settle_read(read) == [None] * 4
        assert gated.calls == 2
        assert all(store.lookup(keys))  # the loans ended: the blocks are there to read again
        mover.close()
    for got, old in zip(target.tensors[2:], before[2:]):
        assert torch.equal(got, old)


def test_a_read_a_layer_at_a_time_is_whole_where_the_store_lends_none(
    shm_dir, tmp_path, monkeypatch
):
    # a dram store that lends none of the batch after all (here: none unchecked, as a
    # signed one): the mover's thread has it read them in place, every layer at once.  A
    # store that never lends (posix), blocks that are not runs of the cache, or copies that
    # would hold the GIL are not read a layer at a time at all
    from ucm.core import digest

    source, target = _caches("cpu", 1, 9), _caches("cpu", 1, 10)
    nbytes = source.payload_nbytes()
    keys = [bytes([80 + i]) * 16 for i in range(2)]
    mover = Mover()
    with _store("posix", tmp_path, shm_dir, nbytes) as store:
        assert not store.lends_blocks
        assert mover.start_layered_read(Batch(target, [2, 3], keys, store, b"t", nbytes)) is None
    with _store("dram", tmp_path, shm_dir, nbytes) as store:
        dumped = mover.dump(Batch(source, [0, 1], keys, store, b"t", nbytes))
        assert all(r.ok for r in dumped.wait(10))
        batch = Batch(target, [2, 3], keys, store, b"t", nbytes)
        gathered = attrs.evolve(batch, caches=_caches("cpu", 4, 1))  # blocks not runs
        assert mover.start_layered_read(gathered) is None
        odd = Caches((torch.zeros(BLOCKS, 1, 3, 5, dtype=torch.uint8),))  # 15-byte parts
        assert mover.start_layered_read(attrs.evolve(batch, caches=odd, nbytes=15)) is None
        with monkeypatch.context() as patch:
            patch.setattr(digest, "_LIBRARY", None)
            assert mover.start_layered_read(batch) is None
        opened = store.open_reads
        monkeypatch.setattr(store, "open_reads", lambda *a, **k: opened(*a, check=True))
        read = mover.start_layered_read(batch)
        assert read.layers.wait_layer(len(target.tensors) - 1, 10)
        read.task.wait(10)
        assert all(r.ok for r in mover.settle_read(read))
        for got, want in zip(target.tensors, source.tensors):
            assert torch.equal(got[2:4], want[0:2])
    mover.close()
