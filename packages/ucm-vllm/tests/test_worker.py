"""The worker side of UCMConnector on real torch caches and real stores, without an engine
and without vLLM: what it does with the plan the scheduler side sends.  On a machine with a
GPU the round trips run on its caches too (``-k cuda``)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch
from ucm.core.config import PosixStoreConfig
from ucm.core.keys import block_keys
from ucm.core.store import KeyResult, PosixStore, Status, Task
from ucm.lab.testing.kernels import GatedLayers
from ucm.vllm.layout import GroupLayout, ModelLayout
from ucm.vllm.loads import blocks_used
from ucm.vllm.plan import Item, StepPlan, Transfer
from ucm.vllm.stores import ConnectorStores
from ucm.vllm.worker import WorkerSide

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]

LAYER = "model.layers.0.self_attn.attn"
GROUP = GroupLayout(
    index=0,
    layer_names=(LAYER,),
    engine_block_tokens=32,
    kind="full",
    replicated=False,
    descriptor="test",
)
LAYOUT = ModelLayout(fingerprint="m", block_tokens=256, rank=0, world_size=1, groups=(GROUP,))


class GatedStore:
    """A posix store whose dumps and loads start only once ``gate`` is set (a slow or
    stalled store)."""

    def __init__(self, inner: PosixStore, gate: threading.Event) -> None:
        self.inner = inner
        self.gate = gate
        self.read_only = False

    def _gated(self, op, keys, buffers, layout):
        task = Task(len(keys))

        def one(key, buffer):
            return self.inner.wait(op([key], [buffer], layout))[0]

        def run() -> None:
            self.gate.wait()
            for i, (key, buffer) in enumerate(zip(keys, buffers)):
                # a key of a cancelled task is not started: it finishes CANCELLED
                task.run_key(i, lambda k=key, b=buffer: one(k, b))

        threading.Thread(target=run, daemon=True).start()
        return task

    def dump(self, keys, buffers, layout=b""):
        return self._gated(self.inner.dump, keys, buffers, layout)

    def load(self, keys, buffers, layout=b""):
        return self._gated(self.inner.load, keys, buffers, layout)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def chain_items(n: int) -> list[Item]:
    """Items of the first ``n`` store blocks of a 1024-token prompt, engine blocks from 1."""
    chain = block_keys(LAYOUT.chain_namespace(None), list(range(1024)), 256)
    return [Item(0, k, chain[k], list(range(1 + 8 * k, 9 + 8 * k))) for k in range(n)]


def worker_on(store, seed=0, device="cpu", layout=LAYOUT, **kw) -> tuple[WorkerSide, torch.Tensor]:
    worker = WorkerSide(layout, ConnectorStores(store, None), num_groups=1, **kw)
    torch.manual_seed(seed)
    cache = torch.randn(40, 2, 32, 128).to(torch.bfloat16).to(device)
    worker.register_kv_caches({LAYER: cache})
    return worker, cache


def test_the_worker_side_runs_without_vllm():
    # GPU machines may have torch and Triton but no vLLM: the data path (register the caches,
    # dump, finish, load) must not need it, so the round trips below run again in a process
    # where any import of vllm fails
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "import pytest\n"
        "sys.exit(pytest.main([sys.argv[1], '-q', '-p', 'no:cacheprovider', '-p', 'no:xdist',"
        " '--import-mode=importlib', '-k', 'dumped_blocks_load']))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, __file__], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert f"{2 * len(DEVICES)} passed" in done.stdout, done.stdout[-2000:]


def test_loaded_blocks_count_as_a_prefix_over_groups_and_tails_only_when_all_loaded():
    ok, miss = KeyResult(Status.OK), KeyResult(Status.MISS)
    # two groups' full blocks for keys 0..2, then a window tail: key 1 failed in group 1
    full = [True, True, True, True, True, True, False]
    keys = [0, 1, 2, 0, 1, 2, 2]
    results = [ok, ok, ok, ok, miss, ok, ok]
    assert blocks_used(full, keys, results) == [True, False, False, True, False, False, False]
    assert blocks_used(full, keys, [ok] * 7) == [True] * 7
    # no answer is no block: nothing from that key on, and the tail goes with it
    assert blocks_used([True, True, False], [0, 1, 1], [ok, None, ok]) == [True, False, False]


class RemotePosixStore(PosixStore):
    """A posix store as on a network filesystem: its loads may wait on a server, so they
    are read into rows in pieces, never into the cache in place."""

    reads_from_memory = False


def test_a_sync_load_keeps_pipeline_depth_pieces_in_flight(tmp_path):
    config = PosixStoreConfig(path=str(tmp_path / "store"))
    items = chain_items(4)
    writer, cache = worker_on(PosixStore(config))
    writer.wait_for_save(StepPlan(dumps=[Transfer("cold", items)], delayed=["cold"]))
    finish_dumps(writer, "cold")
    block = writer.blocks.item_bytes(items[0])
    for depth in (1, 3):
        reader, into = worker_on(RemotePosixStore(config), seed=1, sync_loads=True,
                                 piece_bytes=block, pipeline_depth=depth)  # fmt: skip
        in_flight, most = [0], [0]
        start, finish = reader.loads._submit, reader.loads._finish

        def submit(transfer, start=start, in_flight=in_flight, most=most):
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
            return start(transfer)

        def done(job, finish=finish, in_flight=in_flight):
            in_flight[0] -= 1
            return finish(job)

        reader.loads._submit, reader.loads._finish = submit, done
        reader.start_load_kv(StepPlan(loads=[Transfer("warm", items)]))
        assert most[0] == depth and in_flight[0] == 0
        assert reader.take_load_errors() == set()
        assert torch.equal(into[1:33], cache[1:33])
        reader.shutdown()
    writer.shutdown()


@pytest.mark.parametrize("sync_loads", [False, True], ids=["async", "sync"])
@pytest.mark.parametrize("device", DEVICES)
def test_dumped_blocks_load_into_another_workers_cache(tmp_path, device, sync_loads):
    # register the caches, dump, finish; a fresh worker on other caches loads them back
    config = PosixStoreConfig(path=str(tmp_path / "store"))
    items = chain_items(3)
    writer, stored = worker_on(PosixStore(config), seed=0, device=device)
    writer.wait_for_save(StepPlan(dumps=[Transfer("cold", items)], delayed=["cold"]))
    deadline = time.monotonic() + 30
    sending: set[str] = set()
    while "cold" not in sending and time.monotonic() < deadline:
        sending |= writer.get_transfer_results(set())[0]
        time.sleep(0.01)
    assert sending == {"cold"} and writer.tracker.counts.ok == 3
    writer.shutdown()

    reader, cache = worker_on(PosixStore(config), seed=1, device=device, sync_loads=sync_loads)
    before = cache.clone()
    targets = [Item(0, it.key, it.chain_key, [b + 12 for b in it.block_ids]) for it in items]
    reader.start_load_kv(StepPlan(loads=[Transfer("warm", targets)]))
    recving: set[str] = set()
    while not sync_loads and "warm" not in recving and time.monotonic() < deadline:
        _, got, failed = reader.get_transfer_results(set())
        assert not failed
        recving |= got
        time.sleep(0.01)
    assert reader.take_load_errors() == set()
    assert torch.equal(cache[13:37], stored[1:25])  # the three stored blocks, 8 engine each
    assert torch.equal(cache[:13], before[:13]) and torch.equal(cache[37:], before[37:])
    assert reader.stats.data["loaded_blocks"] == 3
    reader.shutdown()


@pytest.fixture
def shm_path():
    """A fresh folder path in /dev/shm for a host dram store, removed afterwards."""
    import shutil
    import uuid
    from pathlib import Path

    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    path = f"/dev/shm/ucm-test-{uuid.uuid4().hex[:12]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def finish_dumps(worker: WorkerSide, req_id: str) -> None:
    deadline = time.monotonic() + 30
    sending: set[str] = set()
    while req_id not in sending and time.monotonic() < deadline:
        sending |= worker.get_transfer_results(set())[0]
        time.sleep(0.01)
    assert req_id in sending


def test_evictions_and_load_errors_are_counted_by_cause(tmp_path):
    # what an operator alerts on: blocks evicted for room, and why blocks failed to load
    block = 8 * 2 * 32 * 128 * 2  # 8 engine blocks of bf16 K and V
    config = PosixStoreConfig(path=str(tmp_path / "store"), capacity_gb=3.5 * block / 2**30)
    writer, _ = worker_on(PosixStore(config))
    items = chain_items(4)
    for k, item in enumerate(items):  # one at a time: block 0 is the least recently used
        writer.wait_for_save(StepPlan(dumps=[Transfer(f"r{k}", [item])], delayed=[f"r{k}"]))
        finish_dumps(writer, f"r{k}")
    counts = writer.stats.take()
    assert counts["dumped_blocks"] == 4 and counts["evicted_blocks"] >= 1, counts
    assert not any(v for k, v in counts.items() if k.startswith("dump_errors")), counts
    writer.shutdown()

    store = PosixStore(config)
    present = store.lookup(writer.blocks.keys(items))
    assert present[0] is False and present[3] is True, present  # block 0 went first
    reader, _ = worker_on(store, seed=1)
    reader.start_load_kv(StepPlan(loads=[Transfer("warm", items)]))
    deadline = time.monotonic() + 30
    while "warm" not in reader.get_transfer_results(set())[1] and time.monotonic() < deadline:
        time.sleep(0.01)
    counts = reader.stats.take()
    # block 0 is missing (the pass may take block 1 too), and what follows a missing block
    # cannot be used (a hit is a prefix)
    misses, after = counts["load_errors:miss"], counts["load_errors:after_failed"]
    assert misses >= 1 and misses + after == 4, counts
    assert counts["loaded_blocks"] == 0
    reader.shutdown()


def test_preemption_does_not_wait_for_dumps(tmp_path):
    # The blocks are copied to host rows when the dump is planned, so the engine may reuse
    # them at once: a preemption has nothing to wait for, and must neither stall the step
    # on a slow store nor cancel dumps that are fine.
    gate = threading.Event()
    inner = PosixStore(PosixStoreConfig(path=str(tmp_path / "store")))
    worker, _ = worker_on(GatedStore(inner, gate))
    items = chain_items(2)
    worker.wait_for_save(StepPlan(dumps=[Transfer("a", items)]))
    worker.handle_preemptions(StepPlan(preempted=["a"]))
    assert not gate.is_set()  # returned with the store still stalled
    gate.set()
    deadline = time.monotonic() + 30
    while len(worker.tracker) and time.monotonic() < deadline:
        worker.get_transfer_results(set())
        time.sleep(0.01)
    assert worker.tracker.counts.ok == 2 and worker.tracker.counts.failed == 0
    assert inner.lookup_prefix(worker.blocks.keys(items)) == 2
    worker.shutdown()


def loading_from_a_gated_store(tmp_path, **kw):
    """Two blocks stored, and a fresh worker (``kw``: its settings) whose async load of them
    has started on a store that answers once the returned gate is set: (worker, its cache,
    a copy of the cache before the load, the items, the gate)."""
    inner = PosixStore(PosixStoreConfig(path=str(tmp_path / "store")))
    items = chain_items(2)
    writer, _ = worker_on(inner)
    writer.wait_for_save(StepPlan(dumps=[Transfer("cold", items)]))
    writer.shutdown()  # waits the dumps
    gate = threading.Event()
    worker, cache = worker_on(GatedStore(PosixStore(inner.config), gate), **kw)
    before = cache.clone()
    worker.start_load_kv(StepPlan(loads=[Transfer("a", items)]))
    return worker, cache, before, items, gate


def test_request_aborted_while_loading_is_reported_and_its_blocks_untouched(tmp_path):
    # vLLM keeps a request aborted in WAITING_FOR_REMOTE_KVS, and its blocks, until the
    # workers report it finished receiving: the worker must report it (it never scatters
    # a cancelled load, so the blocks are free to go at once).
    worker, cache, before, items, gate = loading_from_a_gated_store(tmp_path)
    _, recving, failed = worker.get_transfer_results(set())
    assert recving == set()  # still loading
    _, recving, failed = worker.get_transfer_results({"a"})  # aborted by the client
    assert recving == {"a"}
    gate.set()  # the store answers late
    for _ in range(20):
        _, recving, _ = worker.get_transfer_results(set())
        assert recving == set()  # reported once
        time.sleep(0.01)
    assert torch.equal(cache, before)  # nothing scattered for the aborted request
    assert worker.loads.jobs == {}
    worker.shutdown()


def test_an_async_load_the_store_does_not_answer_fails_after_load_timeout_s(tmp_path):
    # A stalled store (a transfer stuck on the network, a hung filesystem) holds the request
    # in WAITING_FOR_REMOTE_KVS only for load_timeout_s: then its blocks are load errors,
    # vLLM recomputes them, and what the store answers later is never scattered.
    worker, cache, before, items, gate = loading_from_a_gated_store(tmp_path, load_timeout_s=0.3)
    assert worker.get_transfer_results(set())[1] == set()  # still loading
    deadline = time.monotonic() + 5
    recving: set[str] = set()
    while not recving and time.monotonic() < deadline:
        time.sleep(0.05)
        _, recving, failed = worker.get_transfer_results(set())
    assert recving == {"a"} and failed == set()  # one group: its blocks are load errors
    assert worker.take_load_errors() == {b for it in items for b in it.block_ids}
    assert worker.stats.take()["load_errors:no_answer"] == 2
    gate.set()  # the store answers late
    time.sleep(0.2)
    assert worker.get_transfer_results(set())[1] == set()  # reported once
    assert torch.equal(cache, before)  # nothing scattered
    worker.shutdown()


@pytest.mark.parametrize("why", ["reset", "sleep"])
def test_an_async_load_stopped_by_a_reset_or_sleep_fails_and_never_scatters(tmp_path, why):
    # reset: what it reads may be KV of the old weights; sleep (vLLM 0.33 unregisters the
    # caches before freeing them): nothing may land in them.  vLLM recomputes the blocks.
    worker, cache, before, items, gate = loading_from_a_gated_store(tmp_path)
    if why == "reset":
        worker.start_load_kv(StepPlan(reset="forget", reset_loads=["a"]))
    else:
        worker.release_caches()
    gate.set()  # the store answers after
    _, recving, failed = worker.get_transfer_results(set())
    assert recving == {"a"} and failed == set()  # one group: its blocks are load errors
    assert worker.take_load_errors() == {b for it in items for b in it.block_ids}
    assert torch.equal(cache, before)
    assert worker.stats.take()["load_errors:reset"] == 2
    worker.shutdown()


def test_on_reset_remove_removes_what_this_rank_stored_once_its_dumps_end(tmp_path):
    config = PosixStoreConfig(path=str(tmp_path / "store"))
    other = chain_items(4)[3:]  # stored by another engine: stays
    keep, _ = worker_on(PosixStore(config))
    keep.wait_for_save(StepPlan(dumps=[Transfer("other", other)]))
    keep.shutdown()
    worker, _ = worker_on(PosixStore(config), remember_stored=True)
    items = chain_items(3)
    worker.wait_for_save(StepPlan(dumps=[Transfer("cold", items)]))
    worker.start_load_kv(StepPlan(reset="remove"))
    store = PosixStore(config)
    deadline = time.monotonic() + 30
    while any(store.lookup(worker.blocks.keys(items))) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.lookup(worker.blocks.keys(items + other)) == [False] * 3 + [True]
    assert worker.stored == {}
    worker.shutdown()
    store.close()


def test_a_store_that_cannot_hold_one_block_is_refused_at_registration():
    # A 256-token store block of this cache is 8 engine blocks x 2 x 32 x 128 x 2 bytes
    # = 128 KiB: a 64 KiB DRAM store could never hit, and the engine must not start on it.
    from ucm.core.config import DramStoreConfig
    from ucm.core.settings import ConfigError
    from ucm.core.store import DramStore

    with pytest.raises(ConfigError) as caught:
        worker_on(DramStore(DramStoreConfig(capacity_gb=64 / (1 << 20))))
    assert caught.value.key == "store.capacity_gb"
    worker, _ = worker_on(DramStore(DramStoreConfig(capacity_gb=1 / 1024)))  # 1 MiB: fine
    worker.shutdown()


def test_sync_loads_from_host_memory_go_straight_into_the_cache(tmp_path):
    # A dram store only copies from memory, and a 32-token block is one engine block of a
    # CPU cache: the load reads into the engine's blocks themselves (no host row, no
    # scatter).  A corrupt block and every block after it are load errors, recomputed by
    # vLLM over whatever the read left; the blocks before it are the stored KV.
    import shutil
    import uuid
    from pathlib import Path

    from ucm.core.config import DramStoreConfig
    from ucm.core.store import SharedMemoryStore
    from ucm.lab.testing.core import flip_shared_block_byte

    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    layout = ModelLayout(fingerprint="m", block_tokens=32, rank=0, world_size=1, groups=(GROUP,))
    chain = block_keys(layout.chain_namespace(None), list(range(128)), 32)
    path = f"/dev/shm/ucm-test-{uuid.uuid4().hex[:12]}"
    config = DramStoreConfig(path=path, capacity_gb=0.01)

    def worker_of(store, seed):
        return worker_on(store, seed, layout=layout, sync_loads=True)

    try:
        writer, stored = worker_of(SharedMemoryStore(config), 0)
        written = [Item(0, k, chain[k], [1 + k]) for k in range(4)]
        writer.wait_for_save(StepPlan(dumps=[Transfer("cold", written)]))
        writer.shutdown()
        # a payload byte of the third block: its checksum no longer matches
        flip_shared_block_byte(path, writer.blocks.keys(written[2:3])[0])

        reader, cache = worker_of(SharedMemoryStore(config), 1)
        assert reader.loads.in_place
        before = cache.clone()
        free = reader.mover.pool.free_bytes
        reader._scatter = None  # nothing may go through host rows
        loads = [Item(0, k, chain[k], [11 + k]) for k in range(4)]
        reader.start_load_kv(StepPlan(loads=[Transfer("warm", loads)]))
        assert torch.equal(cache[11:13], stored[1:3])  # the two blocks before the bad one
        assert reader.take_load_errors() == {13, 14}
        assert torch.equal(cache[15:], before[15:]) and torch.equal(cache[:11], before[:11])
        assert reader.mover.pool.free_bytes == free
        reader.shutdown()

        # a posix store on a local filesystem writes the cache only from memory (the page
        # cache, or its own buffer once the disk read ended): in place; on a network
        # filesystem (a mount may hang) reads go through rows
        local = PosixStoreConfig(path=str(tmp_path / "s"))
        on_disk, _ = worker_of(PosixStore(local), 2)
        assert on_disk.loads.in_place == on_disk.stores.full.reads_from_memory
        on_disk.shutdown()
        remote, _ = worker_of(RemotePosixStore(local), 3)
        assert not remote.loads.in_place
        remote.shutdown()
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_a_tiered_store_loads_in_place_from_either_tier_where_both_read_from_memory(
    tmp_path, shm_path
):
    # host memory over a posix store on a local filesystem: a sync load reads straight into
    # the engine's blocks whichever tier holds them, and a block found only below is
    # promoted; over a network filesystem (a mount may hang) it goes through rows
    from ucm.core.config import DramStoreConfig
    from ucm.core.store import SharedMemoryStore, TieredStore

    layout = ModelLayout(fingerprint="m", block_tokens=32, rank=0, world_size=1, groups=(GROUP,))
    chain = block_keys(layout.chain_namespace(None), list(range(128)), 32)
    host = DramStoreConfig(path=shm_path, capacity_gb=0.01)
    below = PosixStoreConfig(path=str(tmp_path / "below"))
    writer, stored = worker_on(PosixStore(below), 0, layout=layout)
    written = [Item(0, k, chain[k], [1 + k]) for k in range(4)]
    writer.wait_for_save(StepPlan(dumps=[Transfer("cold", written)], delayed=["cold"]))
    finish_dumps(writer, "cold")
    writer.shutdown()

    tiered = TieredStore(SharedMemoryStore(host), PosixStore(below))
    if not tiered.backing.reads_from_memory:
        tiered.close()
        pytest.skip("the test's folder is not on a filesystem known to be local")
    reader, cache = worker_on(tiered, 1, layout=layout, sync_loads=True)
    assert reader.loads.in_place
    reader._scatter = None  # nothing may go through host rows
    for step, at in enumerate((11, 21)):  # from below (and promoted), then from host memory
        loads = [Item(0, k, chain[k], [at + k]) for k in range(4)]
        reader.start_load_kv(StepPlan(loads=[Transfer(f"warm{step}", loads)]))
        assert reader.take_load_errors() == set()
        assert torch.equal(cache[at : at + 4], stored[1:5])
        if step == 0:
            assert tiered.front.lookup(reader.blocks.keys(loads)) == [True] * 4
    reader.shutdown()
    remote, _ = worker_on(
        TieredStore(SharedMemoryStore(host), RemotePosixStore(below)), 2, layout=layout,
        sync_loads=True,
    )  # fmt: skip
    assert not remote.loads.in_place
    remote.shutdown()


@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero-copy", "rows-only"])
@pytest.mark.parametrize("engine_blocks", [1, 8], ids=["one-engine-block", "eight-small"])
def test_dumps_to_host_memory_are_gathered_straight_into_the_store(
    shm_path, engine_blocks, zero_copy
):
    # A dram store hands out its slots (Store.open_writes): the blocks of a CPU cache are
    # gathered there and sealed by the store, with no host row, where each block is a run of
    # the cache's memory (one engine block).  Small blocks of several engine blocks go
    # through rows of one allocation instead (one kernel call a step, not one a block).
    # Loads likewise: another worker (async) scatters the blocks the store lends, checked,
    # straight from its memory, or reads small ones into rows.  Either way it loads them
    # as they were dumped, and a corrupt block and every block after it are load errors.
    # With zero_copy false every block goes through rows, and loads the same.
    from ucm.core.config import DramStoreConfig
    from ucm.core.store import SharedMemoryStore
    from ucm.lab.testing.core import flip_shared_block_byte

    layout = ModelLayout(
        fingerprint="m", block_tokens=32 * engine_blocks, rank=0, world_size=1, groups=(GROUP,)
    )
    chain = block_keys(layout.chain_namespace(None), list(range(1024)), 32 * engine_blocks)
    items = [
        Item(0, k, chain[k], list(range(1 + engine_blocks * k, 1 + engine_blocks * (k + 1))))
        for k in range(3)
    ]
    config = DramStoreConfig(path=shm_path, capacity_gb=0.01)

    def worker(seed):
        return worker_on(SharedMemoryStore(config), seed, layout=layout, zero_copy=zero_copy)

    through_rows = engine_blocks > 1 or not zero_copy
    writer, stored = worker(0)
    taken = []
    take = writer.mover.pool.take
    writer.mover.pool.take = lambda *a, **kw: taken.append(a) or take(*a, **kw)
    writer.wait_for_save(StepPlan(dumps=[Transfer("cold", items)], delayed=["cold"]))
    finish_dumps(writer, "cold")
    assert writer.tracker.counts.ok == 3
    assert bool(taken) is through_rows
    # dumped again (another request with the same prefix): stored already, nothing written
    writer.wait_for_save(StepPlan(dumps=[Transfer("again", items)], delayed=["again"]))
    finish_dumps(writer, "again")
    assert writer.tracker.counts.ok == 6 and not writer.tracker.counts.failed_by_status
    assert writer.stores.full.usage().blocks == 3
    writer.shutdown()
    flip_shared_block_byte(shm_path, writer.blocks.keys(items[2:3])[0])

    reader, cache = worker(1)
    taken = []
    take = reader.mover.pool.take
    reader.mover.pool.take = lambda *a, **kw: taken.append(a) or take(*a, **kw)
    targets = [Item(0, it.key, it.chain_key, [b + 12 for b in it.block_ids]) for it in items]
    reader.start_load_kv(StepPlan(loads=[Transfer("warm", targets)]))
    deadline = time.monotonic() + 30
    recving: set[str] = set()
    while "warm" not in recving and time.monotonic() < deadline:
        recving |= reader.get_transfer_results(set())[1]
        time.sleep(0.01)
    assert bool(taken) is through_rows
    n = 2 * engine_blocks
    assert reader.take_load_errors() == {13 + n + b for b in range(engine_blocks)}
    assert torch.equal(cache[13 : 13 + n], stored[1 : 1 + n])
    assert reader.stores.full._arena.stats()["pinned"] == 0  # every loan given back
    reader.shutdown()


@pytest.mark.parametrize("sync_loads", [False, True], ids=["async", "sync"])
@pytest.mark.parametrize("device", DEVICES)
def test_on_a_gpu_blocks_move_straight_between_the_device_and_the_host_tier(
    shm_path, device, sync_loads
):
    # On a GPU the host dram store's memory is registered with the CUDA driver, so that
    # dumps gather straight into its slots and loads scatter from the blocks it lends where
    # they lie, checked first: no pinned row either way.  A corrupt block and every block
    # after it are load errors; the blocks before it are the stored KV.  (On the CPU
    # nothing is registered: a CPU cache needs no pinning.)
    from ucm.core.config import DramStoreConfig
    from ucm.core.store import SharedMemoryStore
    from ucm.lab.testing.core import flip_shared_block_byte

    config = DramStoreConfig(path=shm_path, capacity_gb=0.01)
    items = chain_items(4)

    def worker(seed, **kw):
        side, cache = worker_on(SharedMemoryStore(config), seed=seed, device=device, **kw)
        taken = []
        take = side.mover.pool.take
        side.mover.pool.take = lambda *a, **k: taken.append(a) or take(*a, **k)
        return side, cache, taken

    writer, stored, taken = worker(0)
    assert bool(writer.mover.pinned) is (device == "cuda")
    writer.wait_for_save(StepPlan(dumps=[Transfer("cold", items)], delayed=["cold"]))
    finish_dumps(writer, "cold")
    assert writer.tracker.counts.ok == 4
    assert bool(taken) is (device == "cpu")  # eight small engine blocks a block: rows on a CPU
    writer.shutdown()
    assert not writer.mover.pinned  # unregistered before the store unmaps its memory
    flip_shared_block_byte(shm_path, writer.blocks.keys(items[2:3])[0])

    reader, cache, taken = worker(1, sync_loads=sync_loads)
    before = cache.clone()
    targets = [Item(0, it.key, it.chain_key, [b + 6 for b in it.block_ids]) for it in items]
    reader.start_load_kv(StepPlan(loads=[Transfer("warm", targets)]))
    deadline = time.monotonic() + 30
    recving: set[str] = set()
    while not sync_loads and "warm" not in recving and time.monotonic() < deadline:
        recving |= reader.get_transfer_results(set())[1]
        time.sleep(0.01)
    assert bool(taken) is (device == "cpu")
    assert reader.take_load_errors() == set(range(23, 39))  # blocks 2 and 3, 8 engine each
    assert torch.equal(cache[7:23], stored[1:17])
    assert torch.equal(cache[:7], before[:7]) and torch.equal(cache[39:], before[39:])
    assert reader.stats.data["loaded_blocks"] == 2
    store = reader.stores.full
    assert store._arena.stats()["pinned"] == 0  # every loan given back
    # the bad one dropped
    assert store.lookup(writer.blocks.keys(items)) == [True, True, False, True]
    reader.shutdown()


def test_a_copy_out_of_lent_blocks_that_is_refused_is_a_miss_and_rows_take_over(shm_path):
    # Should the copy refuse the store's memory (on a GPU: a registration the driver took
    # but a copy does not see as pinned), the blocks are load errors that vLLM recomputes,
    # the loans end, and later loads go through rows: the engine keeps serving.
    from ucm.core.config import DramStoreConfig
    from ucm.core.store import SharedMemoryStore

    layout = ModelLayout(fingerprint="m", block_tokens=32, rank=0, world_size=1, groups=(GROUP,))
    chain = block_keys(layout.chain_namespace(None), list(range(128)), 32)
    config = DramStoreConfig(path=shm_path, capacity_gb=0.01)

    def worker(seed):
        return worker_on(SharedMemoryStore(config), seed, layout=layout)

    writer, stored = worker(0)
    written = [Item(0, k, chain[k], [1 + k]) for k in range(3)]
    writer.wait_for_save(StepPlan(dumps=[Transfer("cold", written)]))
    writer.shutdown()

    reader, cache = worker(1)
    stager = reader.mover.stager(cache.device)  # this thread's: it scatters the loads
    load = stager.load

    def refused(*args, **kwargs):
        raise ValueError("host_buffers[0] is not pinned")

    stager.load = refused
    loads = [Item(0, k, chain[k], [11 + k]) for k in range(3)]

    def load_all(req_id):
        reader.start_load_kv(StepPlan(loads=[Transfer(req_id, loads)]))
        deadline = time.monotonic() + 30
        while req_id not in reader.get_transfer_results(set())[1]:
            assert time.monotonic() < deadline
            time.sleep(0.01)

    load_all("a")
    assert reader.take_load_errors() == {11, 12, 13} and reader.mover.refused
    assert reader.stores.full._arena.stats()["pinned"] == 0
    stager.load = load
    load_all("b")  # through rows now
    assert reader.take_load_errors() == set()
    assert torch.equal(cache[11:14], stored[1:4])
    reader.shutdown()


def test_a_stuck_read_into_the_cache_holds_the_step_for_a_bounded_time(tmp_path):
    """An in-place load whose read never finishes (memory swapped out, a stuck kernel):
    the step waits ``load_timeout_s`` for the answer and ``cancel_grace_s`` for the read
    to stop, then reports the blocks as errors and stops reading into the engine's blocks."""
    import shutil
    import uuid
    from pathlib import Path

    from ucm.core.config import DramStoreConfig
    from ucm.core.store import SharedMemoryStore

    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")

    class StuckStore(SharedMemoryStore):
        """A shared-memory store whose reads hang until released (a real store below)."""

        release = threading.Event()

        def _load_chunk(self, *args):
            self.release.wait(30)
            return super()._load_chunk(*args)

    layout = ModelLayout(fingerprint="m", block_tokens=32, rank=0, world_size=1, groups=(GROUP,))
    chain = block_keys(layout.chain_namespace(None), list(range(64)), 32)
    path = f"/dev/shm/ucm-test-{uuid.uuid4().hex[:12]}"
    config = DramStoreConfig(path=path, capacity_gb=0.01)
    cache = torch.randn(40, 2, 32, 128).to(torch.bfloat16)
    try:
        writer = WorkerSide(layout, ConnectorStores(SharedMemoryStore(config), None), 1)
        writer.register_kv_caches({LAYER: cache})
        written = [Item(0, k, chain[k], [1 + k]) for k in range(2)]
        writer.wait_for_save(StepPlan(dumps=[Transfer("cold", written)]))
        writer.shutdown()

        store = StuckStore(config)
        reader = WorkerSide(
            layout,
            ConnectorStores(store, None),
            1,
            sync_loads=True,
            load_timeout_s=0.5,
            cancel_grace_s=0.5,
        )
        reader.register_kv_caches({LAYER: cache})
        assert reader.loads.in_place
        started = time.monotonic()
        loads = [Item(0, k, chain[k], [11 + k]) for k in range(2)]
        reader.start_load_kv(StepPlan(loads=[Transfer("warm", loads)]))
        assert time.monotonic() - started < 3  # 0.5 s for the answer, 0.5 s for the stop
        assert reader.take_load_errors() == {11, 12}
        assert not reader.loads.in_place  # the next loads go through host rows
        StuckStore.release.set()
        reader.shutdown()
    finally:
        StuckStore.release.set()
        shutil.rmtree(path, ignore_errors=True)


def test_a_replicated_cache_is_written_once_across_ranks_and_read_by_every_rank(tmp_path):
    """An MLA cache: every rank of a tensor-parallel engine holds the same latent cache
    ([blocks, 16 tokens, 576]).  vLLM CPU's MLA backend cannot prefill on cached KV, so an
    engine there loads nothing (test_mla_e2e.py); the workers are driven here instead: two
    ranks dump four blocks between them, each block once, and a fresh worker of either rank
    loads all four."""
    mla = GroupLayout(
        index=0, layer_names=(LAYER,), engine_block_tokens=16, kind="full", replicated=True,
        descriptor="mla",
    )  # fmt: skip
    layouts = [
        ModelLayout(fingerprint="m", block_tokens=256, rank=r, world_size=2, groups=(mla,))
        for r in (0, 1)
    ]
    config = PosixStoreConfig(path=str(tmp_path / "store"))
    chain = block_keys(layouts[0].chain_namespace(None), list(range(1024)), 256)
    items = [Item(0, k, chain[k], list(range(1 + 16 * k, 17 + 16 * k))) for k in range(4)]
    torch.manual_seed(0)
    latent = torch.randn(140, 16, 576).to(torch.bfloat16)  # the same on every rank

    def worker(rank: int, cache: torch.Tensor) -> WorkerSide:
        side = WorkerSide(layouts[rank], ConnectorStores(PosixStore(config), None), num_groups=1)
        side.register_kv_caches({LAYER: cache})
        return side

    for rank in (0, 1):
        writer = worker(rank, latent.clone())
        writer.wait_for_save(StepPlan(dumps=[Transfer("cold", items)], delayed=["cold"]))
        finish_dumps(writer, "cold")
        assert writer.tracker.counts.ok == 2  # keys 0 and 2 on rank 0, 1 and 3 on rank 1
        writer.shutdown()
    assert len([f for f in (tmp_path / "store" / "blocks").rglob("*") if f.is_file()]) == 4

    targets = [Item(0, it.key, it.chain_key, [b + 70 for b in it.block_ids]) for it in items]
    for rank in (0, 1):
        cache = torch.zeros_like(latent)
        reader = worker(rank, cache)
        reader.start_load_kv(StepPlan(loads=[Transfer("warm", targets)]))
        deadline, recving = time.monotonic() + 30, set()
        while "warm" not in recving and time.monotonic() < deadline:
            _, got, failed = reader.get_transfer_results(set())
            assert not failed
            recving |= got
            time.sleep(0.01)
        assert reader.take_load_errors() == set()
        assert torch.equal(cache[71:135], latent[1:65]), rank  # all four, from both writers
        assert reader.stats.data["loaded_blocks"] == 4
        reader.shutdown()


LAYERS2 = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
GROUP2 = GroupLayout(
    index=0,
    layer_names=LAYERS2,
    engine_block_tokens=32,
    kind="full",
    replicated=False,
    descriptor="test",
)
LAYOUT2 = ModelLayout(fingerprint="m", block_tokens=32, rank=0, world_size=1, groups=(GROUP2,))


def _two_layer_workers(shm_path, **kw):
    """A worker that stored 4 blocks of a two-layer model in a dram store (its caches) and a
    fresh worker on the same store, sync loads in place (its caches), and the blocks."""
    from ucm.core.config import DramStoreConfig
    from ucm.core.store import SharedMemoryStore

    chain = block_keys(LAYOUT2.chain_namespace(None), list(range(128)), 32)
    config = DramStoreConfig(path=shm_path, capacity_gb=0.01)

    def worker(seed, **options):
        side = WorkerSide(LAYOUT2, ConnectorStores(SharedMemoryStore(config), None), 1, **options)
        torch.manual_seed(seed)
        caches = {name: torch.randn(40, 2, 32, 128).to(torch.bfloat16) for name in LAYERS2}
        side.register_kv_caches(caches)
        return side, caches

    writer, stored = worker(0)
    written = [Item(0, k, chain[k], [1 + k]) for k in range(4)]
    writer.wait_for_save(StepPlan(dumps=[Transfer("cold", written)]))
    writer.shutdown()
    reader, caches = worker(1, sync_loads=True, **kw)
    assert reader.loads.in_place
    loads = [Item(0, k, chain[k], [11 + k]) for k in range(4)]
    return reader, caches, stored, writer.blocks.keys(written), loads


def _step(worker: WorkerSide, loads: list[Item] | None, layers=LAYERS2) -> set[int]:
    """One engine step as vLLM's model runner drives the worker: loads before the forward
    pass, a wait for each attention layer's KV, the load errors after it."""
    worker.start_load_kv(StepPlan(loads=[Transfer("warm", loads)] if loads else []))
    for name in layers:
        worker.wait_layer(name)
    return worker.take_load_errors()


def test_sync_loads_go_a_layer_at_a_time_once_vllm_is_seen_waiting_for_every_layer(
    shm_path, monkeypatch
):
    # The forward pass starts as soon as the loads are under way and waits for each layer
    # right before reading it; the blocks are checked once they all landed.  Only after a
    # step in which vLLM waited for every layer: until then a load is whole.
    reader, caches, stored, _, loads = _two_layer_workers(shm_path)
    assert not reader.loads.layered
    assert _step(reader, None) == set()  # a step of other requests: vLLM waits for both
    assert reader.loads.layered
    gated = GatedLayers().install(monkeypatch)
    first, second = (caches[name] for name in LAYERS2)
    before = second.clone()
    reader.start_load_kv(StepPlan(loads=[Transfer("warm", loads)]))  # returns at once
    reader.wait_layer(LAYERS2[0])
    assert torch.equal(first[11:15], stored[LAYERS2[0]][1:5])
    assert torch.equal(second, before)  # the second layer is still on its way
    gated.gate.set()
    reader.wait_layer(LAYERS2[1])
    assert torch.equal(second[11:15], stored[LAYERS2[1]][1:5])
    assert reader.take_load_errors() == set()
    counts = reader.stats.take()
    assert counts["layered_loads"] == 1 and counts["loaded_blocks"] == 4, counts
    # the forward pass waited for the held-back layer, not for the whole load up front
    assert counts["load_wait_seconds"] > 0, counts
    reader.shutdown()


def test_a_layered_load_fails_where_a_block_is_corrupt_or_a_layer_was_not_waited_for(shm_path):
    from ucm.lab.testing.core import flip_shared_block_byte

    reader, caches, stored, keys, loads = _two_layer_workers(shm_path)
    _step(reader, None)
    flip_shared_block_byte(shm_path, keys[2])  # in its last layer
    assert _step(reader, loads) == {13, 14}  # the corrupt block and the one after it
    assert torch.equal(caches[LAYERS2[1]][11:13], stored[LAYERS2[1]][1:3])
    counts = reader.stats.take()
    assert counts["load_errors:corrupt"] == 1 and counts["load_errors:after_failed"] == 1
    # a forward pass that reads a layer without waiting for it may have read it before it
    # landed: every block of the load fails (vLLM recomputes them), and loads are whole
    # from then on
    assert _step(reader, loads[:2], layers=LAYERS2[:1]) == {11, 12}
    assert reader.stats.take()["load_errors:not_awaited"] == 2
    assert _step(reader, loads[:2]) == set()
    assert not reader.loads.layered and reader.stats.take()["layered_loads"] == 0
    reader.shutdown()


def test_a_layered_load_that_does_not_land_holds_the_forward_pass_for_a_bounded_time(
    shm_path, monkeypatch
):
    # the layer a forward pass waits for never lands (a copy stalled): it waits until
    # load_timeout_s, the copy stops, and the blocks fail
    reader, caches, _, _, loads = _two_layer_workers(
        shm_path, load_timeout_s=0.5, cancel_grace_s=5.0
    )
    _step(reader, None)
    gated = GatedLayers().install(monkeypatch)
    threading.Timer(2.0, gated.gate.set).start()  # the stalled copy ends after 2 s
    before = caches[LAYERS2[1]].clone()
    started = time.monotonic()
    reader.start_load_kv(StepPlan(loads=[Transfer("warm", loads)]))
    reader.wait_layer(LAYERS2[0])
    reader.wait_layer(LAYERS2[1])  # 0.5 s for the layer, then up to 5 s for the copy to stop
    assert time.monotonic() - started < 4
    assert reader.take_load_errors() == {11, 12, 13, 14}
    assert reader.stats.take()["load_errors:no_answer"] == 4
    # the stalled copy stopped within cancel_grace_s, before the step ended: nothing writes
    # the cache after it, and loads still read in place
    assert reader.loads.in_place
    assert torch.equal(caches[LAYERS2[1]][:11], before[:11])  # only the load's blocks written
    reader.shutdown()


def test_with_layer_wise_loads_off_a_load_ends_before_the_forward_pass(shm_path):
    reader, caches, stored, _, loads = _two_layer_workers(shm_path, layer_wise=False)
    assert _step(reader, None) == set() and not reader.loads.layered
    reader.start_load_kv(StepPlan(loads=[Transfer("warm", loads)]))
    for name in LAYERS2:  # every layer is in before the forward pass waits for any
        assert torch.equal(caches[name][11:15], stored[name][1:5])
    assert _step(reader, None) == set()
    assert reader.stats.take()["layered_loads"] == 0
    reader.shutdown()


def test_a_layered_load_still_copying_when_the_caches_go_away_stops_first_and_fails(
    shm_path, monkeypatch
):
    # vLLM's sleep releases the caches (and a shutdown drops them) between steps: a layered
    # load still copying stops before they go, within cancel_grace_s, and fails
    reader, _, _, _, loads = _two_layer_workers(shm_path)
    _step(reader, None)
    gated = GatedLayers().install(monkeypatch)
    threading.Timer(0.3, gated.gate.set).start()  # the second layer's copy is held back
    reader.start_load_kv(StepPlan(loads=[Transfer("warm", loads)]))
    reader.release_caches()
    assert not reader.loads.pending and reader.loads.in_place  # stopped within the grace
    assert reader.take_load_errors() == {11, 12, 13, 14}
    assert reader.stats.take()["load_errors:reset"] == 4
    reader.shutdown()
