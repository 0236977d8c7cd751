"""The scheduler side of UCMConnector inside a real vLLM Scheduler, step by step."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

from ucm.core.config import PosixStoreConfig  # noqa: E402
from ucm.core.keys import block_keys, scoped_keys  # noqa: E402
from ucm.core.store import PosixStore  # noqa: E402
from ucm.lab.testing.vllm.scheduler import SchedulerHarness, ucm_transfer  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

BT = 256  # store block tokens
EB = 32  # engine block tokens


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


@pytest.fixture
def harness(tmp_path):
    def make(load_mode: str = "auto", **kw):
        transfer = ucm_transfer(tmp_path / "store", load_mode=load_mode)
        return SchedulerHarness.create(tmp_path, kv_transfer_config=transfer, **kw)

    return make


def store_chain(h, chain: list[bytes]) -> None:
    """Store the blocks of ``chain`` for every group (the scheduler never reads payloads)."""
    layout = h.connector.scheduler.layout
    store = PosixStore(PosixStoreConfig(path=str(h.connector.config.store.path)))
    for group in layout.stored_groups:
        keys = scoped_keys(chain, layout.scope(group, 0))
        assert all(r.ok for r in store.wait(store.dump(keys, [b"x"] * len(keys))))
    store.close()


def store_blocks(h, tokens: list[int], n: int) -> None:
    """Store the first ``n`` store blocks of ``tokens``."""
    layout = h.connector.scheduler.layout
    store_chain(h, block_keys(layout.chain_namespace(None), tokens, BT)[:n])


def store_request(h, req, n: int) -> None:
    """Store the first ``n`` blocks of ``req``'s own chain (its adapter and images included)."""
    side = h.connector.scheduler
    store_chain(h, side._state(req).chain[:n])
    del side.requests[req.request_id]


def meta(so):
    return so.kv_connector_metadata


def span(t, group: int = 0) -> tuple[int, int]:
    """(first key, number of keys) of a transfer's blocks of ``group``."""
    keys = t.keys(group)
    assert keys == list(range(keys[0], keys[0] + len(keys)))
    return keys[0], len(keys)


def ids(t, group: int = 0) -> list[list[int]]:
    return [it.block_ids for it in t.items if it.group == group]


def drain(h, max_steps: int = 2000) -> None:
    """Step to idle, answering as the workers would: dumps done, loads done."""
    reply = None
    for _ in range(max_steps):
        if not h.scheduler.has_requests():
            return
        so, _ = h.step(reply)
        m = meta(so)
        reply = KVConnectorOutput(
            finished_sending=set(m.delayed), finished_recving={t.req_id for t in m.loads}
        )
    raise AssertionError("scheduler did not go idle")


def test_cold_chunked_prefill_plans_each_store_block_once(harness):
    h = harness(max_num_batched_tokens=256)
    req = h.add_request(prompt(600), max_tokens=2)
    plans = []
    for _ in range(3):
        so, _ = h.step()
        plans.append([(*span(t), ids(t)) for t in meta(so).dumps])
    assert [[(f, n) for f, n, _ in p] for p in plans] == [[(0, 1)], [(1, 1)], []]
    engine = h.scheduler.kv_cache_manager.get_block_ids(req.request_id)[0]
    assert plans[0][0][2] == [engine[:8]] and plans[1][0][2] == [engine[8:16]]


def test_finished_request_keeps_blocks_until_dumps_are_reported(harness):
    h = harness()
    pool = h.scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    req = h.add_request(prompt(300), max_tokens=1)
    so, _ = h.step()
    assert [span(t)[0] for t in meta(so).dumps] == [0]
    delayed = []
    while not delayed:
        so, _ = h.step()
        delayed = meta(so).delayed
    assert req.is_finished() and delayed == [req.request_id]
    assert pool.get_num_free_blocks() < free_before  # held for the dump
    h.step(KVConnectorOutput(finished_sending={req.request_id}))
    assert pool.get_num_free_blocks() == free_before


def test_request_without_dumps_is_freed_at_once(harness):
    h = harness()
    pool = h.scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    h.add_request(prompt(100), max_tokens=1)  # shorter than one store block: nothing to dump
    h.step()
    h.step()
    assert pool.get_num_free_blocks() == free_before


@pytest.mark.parametrize("stored, expect", [(2, 512), (1, 256), (0, 0)])
def test_hits_are_whole_store_blocks_loaded_async(harness, stored, expect):
    h = harness(load_mode="async")
    tokens = prompt(700)
    store_blocks(h, tokens, stored)
    req = h.add_request(tokens, max_tokens=1)
    so, _ = h.step()
    loads = meta(so).loads
    if not expect:
        assert loads == [] and req.num_computed_tokens == so.num_scheduled_tokens[req.request_id]
        return
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert req.request_id not in so.num_scheduled_tokens
    assert [span(t) for t in loads] == [(0, stored)]
    engine = h.scheduler.kv_cache_manager.get_block_ids(req.request_id)[0]
    assert ids(loads[0]) == [engine[s * 8 : (s + 1) * 8] for s in range(stored)]
    h.step(KVConnectorOutput(finished_recving={req.request_id}))
    assert req.num_computed_tokens == expect  # rescheduled from the end of the hit


def test_blocks_vllm_holds_and_the_store_has_are_not_dumped_again(harness):
    h = harness()
    tokens = prompt(800)

    def run(req) -> list[tuple[int, int]]:
        dumps, reply = [], None
        while not req.is_finished():
            so, _ = h.step(reply)
            dumps += [span(t) for t in meta(so).dumps]
            reply = KVConnectorOutput(
                finished_sending=set(meta(so).delayed),
                finished_recving={t.req_id for t in meta(so).loads},
            )
        drain(h)
        return dumps

    assert run(h.add_request(tokens, max_tokens=1)) == [(0, 1), (1, 1), (2, 1)]
    store_blocks(h, tokens, 3)  # what the workers would have written
    # vLLM's prefix cache holds the first 768 tokens: the lookup finds them stored too
    again = h.add_request(tokens + prompt(300, seed=1), max_tokens=1)
    assert run(again) == [(3, 1)]


def test_an_engine_that_cannot_take_loads_computes_all_and_dumps_only_what_is_new(harness):
    # vLLM CPU's MLA backend (support.loads_refused): found blocks are neither loaded nor
    # dumped again
    h = harness(load_mode="async")
    h.connector.scheduler.loads = False
    tokens = prompt(800)
    store_blocks(h, tokens, 2)
    req = h.add_request(tokens, max_tokens=1)
    dumps = []
    for _ in range(4):  # 800 tokens in chunks of 256, from token 0
        so, _ = h.step()
        assert meta(so).loads == [] and req.status != RequestStatus.WAITING_FOR_REMOTE_KVS
        dumps += [span(t) for t in meta(so).dumps]
    assert req.num_computed_tokens == 800 and dumps == [(2, 1)]


@pytest.mark.parametrize("stored", [2, 1, 0])
def test_sync_hits_load_in_the_step_that_schedules_them(harness, stored):
    h = harness(max_num_batched_tokens=1024)  # one KV-cache group: "auto" loads sync
    tokens = prompt(700)
    store_blocks(h, tokens, stored)
    req = h.add_request(tokens, max_tokens=4)
    so, _ = h.step()
    # scheduled at once, from the end of the hit, with the load in the same step
    assert so.num_scheduled_tokens[req.request_id] == 700 - 256 * stored
    loads = meta(so).loads
    if not stored:
        assert loads == []
        return
    assert [span(t) for t in loads] == [(0, stored)]
    engine = h.scheduler.kv_cache_manager.get_block_ids(req.request_id)[0]
    assert ids(loads[0]) == [engine[s * 8 : (s + 1) * 8] for s in range(stored)]
    assert so.has_sync_kv_loads


def test_dumps_after_a_sync_load_wait_for_the_next_step(harness):
    # The load step's forward may have run on blocks that failed to load (on any rank),
    # so what it computes is dumped one step later, once vLLM kept it.
    h = harness(max_num_batched_tokens=1024)
    tokens = prompt(900)
    store_blocks(h, tokens, 1)
    req = h.add_request(tokens, max_tokens=4)
    so, _ = h.step()
    assert meta(so).loads and meta(so).dumps == []
    so, _ = h.step()
    assert [span(t) for t in meta(so).dumps] == [(1, 2)]
    assert req.num_computed_tokens >= 900


def test_finished_in_its_load_step_still_dumps_what_it_computed(harness):
    h = harness(max_num_batched_tokens=1024)
    pool = h.scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    tokens = prompt(900)
    store_blocks(h, tokens, 1)
    req = h.add_request(tokens, max_tokens=1)
    so, _ = h.step()
    assert meta(so).dumps == [] and req.is_finished()
    so, _ = h.step()
    assert [span(t) for t in meta(so).dumps] == [(1, 2)]
    assert meta(so).delayed == [req.request_id]
    assert pool.get_num_free_blocks() < free_before  # held until the dump is reported
    h.step(KVConnectorOutput(finished_sending={req.request_id}))
    assert pool.get_num_free_blocks() == free_before


@pytest.mark.parametrize("load_mode", ["sync", "async"])
def test_full_hit_recomputes_the_last_token(harness, load_mode):
    h = harness(load_mode=load_mode)
    tokens = prompt(512)
    store_blocks(h, tokens, 2)
    req = h.add_request(tokens, max_tokens=1)
    so, _ = h.step()
    assert [span(t) for t in meta(so).loads] == [(0, 2)]  # whole blocks
    if load_mode == "async":
        h.step(KVConnectorOutput(finished_recving={req.request_id}))
        so, _ = h.step()
    assert so.num_scheduled_tokens[req.request_id] == 1


def test_local_hit_blocks_are_not_overwritten(harness):
    h = harness()
    tokens = prompt(800)
    first = h.add_request(tokens[:300], max_tokens=1)
    drain(h)
    store_blocks(h, tokens, 3)
    req = h.add_request(tokens, max_tokens=1)
    so, _ = h.step()
    (load,) = meta(so).loads
    # vLLM holds 9 engine blocks (288 tokens) of the first request: the load starts at
    # store block 1 (tokens 256..511), whose first engine block (8) is one of them
    assert span(load) == (1, 2)
    flat = [b for block in ids(load) for b in block]
    assert flat[0] == 0  # never written: it may be shared with other requests
    assert all(flat[1:])
    held = set(h.scheduler.kv_cache_manager.get_block_ids(req.request_id)[0][:9])
    assert held.isdisjoint(flat[1:])
    assert first.request_id != req.request_id


def test_async_load_failure_is_recomputed(harness):
    h = harness(load_mode="async")
    tokens = prompt(600)
    store_blocks(h, tokens, 2)
    req = h.add_request(tokens, max_tokens=1)
    so, _ = h.step()
    failing = ids(meta(so).loads[0])
    # the worker reports the second store block's engine blocks as failed
    h.step(KVConnectorOutput(finished_recving={req.request_id}, invalid_block_ids=set(failing[1])))
    # recomputation starts at the first failed block, not at the end of the hit
    assert req.num_computed_tokens == 256
    so, _ = h.step()
    # the recomputed block is dumped again (the store dropped the corrupt one)
    assert [span(t) for t in meta(so).dumps] == [(1, 1)]
    drain(h)
    assert req.is_finished()


def test_sync_load_failure_is_recomputed_and_dumped_again(harness):
    h = harness(max_num_batched_tokens=1024)
    tokens = prompt(900)
    store_blocks(h, tokens, 3)
    req = h.add_request(tokens, max_tokens=2)
    so = h.scheduler.schedule()
    failing = ids(meta(so).loads[0])
    # the workers report the second store block's engine blocks as failed in the load
    # step: vLLM discards the step's output for the request and recomputes from there
    failed = KVConnectorOutput(invalid_block_ids=set(failing[1]))
    h.scheduler.update_from_output(so, h.fake_runner_output(so, failed))
    assert req.num_computed_tokens == 256
    so, _ = h.step()
    assert so.num_scheduled_tokens[req.request_id] == 900 - 256
    # blocks 1 and 2, computed again, are dumped again (the store dropped the bad ones)
    assert [span(t) for t in meta(so).dumps] == [(1, 2)]
    drain(h)
    assert req.is_finished()


def test_aborted_request_with_dumps_is_delayed_then_released(harness):
    h = harness(max_num_batched_tokens=256)
    pool = h.scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    req = h.add_request(prompt(900), max_tokens=4)
    h.step()
    h.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    so, _ = h.step()
    assert meta(so).delayed == [req.request_id]
    h.step(KVConnectorOutput(finished_sending={req.request_id}))
    assert pool.get_num_free_blocks() == free_before
    assert h.connector.scheduler.requests == {}


def test_preempted_request_is_announced_and_resumes(harness):
    h = harness(num_blocks=40, max_num_batched_tokens=512)
    a = h.add_request(prompt(600, seed=1), max_tokens=100)
    b = h.add_request(prompt(600, seed=2), max_tokens=100)
    preempted = set()
    for _ in range(2000):
        if not h.scheduler.has_requests():
            break
        so, _ = h.step()
        preempted |= set(meta(so).preempted)
        for req_id in meta(so).delayed:
            h.step(KVConnectorOutput(finished_sending={req_id}))
    assert preempted
    assert a.is_finished() and b.is_finished()


def test_preempted_after_its_sync_load_loads_again_and_dumps_once(harness):
    # A request preempted after its sync load step, before a step of its own settled the
    # load, resumes with a fresh lookup: its load is not taken as failed (it loads again)
    # and the blocks it dumped are not planned again.
    import time

    h = harness(max_num_batched_tokens=1024)
    tokens = prompt(1100)
    store_blocks(h, tokens, 2)
    req = h.add_request(tokens, max_tokens=8)
    so, _ = h.step()
    assert [span(t) for t in meta(so).loads] == [(0, 2)]
    assert meta(so).dumps == []  # held back in the load step
    # preempted before it runs again, and vLLM's own cache of its blocks is gone
    h.scheduler.running.remove(req)
    h.scheduler._preempt_request(req, time.monotonic())
    assert h.scheduler.reset_prefix_cache()
    so, _ = h.step()
    assert [span(t) for t in meta(so).loads] == [(0, 2)]  # loaded again from the store
    assert so.num_scheduled_tokens[req.request_id] == 1101 - 512  # with its first output
    dumps = []
    for _ in range(100):
        if req.is_finished():
            break
        so, _ = h.step()
        dumps += [span(t) for t in meta(so).dumps]
    assert req.is_finished()
    assert dumps == [(2, 2)]  # blocks 2 and 3, once


def adapter(tmp_path, name: str, seed: int):
    """A LoRA adapter folder (weights and config) and its request."""
    from vllm.lora.request import LoRARequest

    folder = tmp_path / name
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"r": 8, "target_modules": ["q_proj"]}')
    (folder / "adapter_model.safetensors").write_bytes(random.Random(seed).randbytes(4096))
    return LoRARequest(lora_name=name, lora_int_id=seed, lora_path=str(folder))


def test_lora_requests_hit_their_own_adapters_blocks_only(harness, tmp_path):
    h = harness(max_num_batched_tokens=1024)
    tokens = prompt(700)
    a, b = adapter(tmp_path, "a", 1), adapter(tmp_path, "b", 2)
    store_request(h, h.make_request(tokens, lora_request=a), 2)
    hits = {}
    for name, lora in [("a", a), ("b", b), ("base", None)]:
        req = h.make_request(tokens, lora_request=lora)
        hits[name] = h.connector.get_num_new_matched_tokens(req, 0)[0]
    assert hits == {"a": 512, "b": 0, "base": 0}
    # the same adapter name with other weights is another adapter, in a new engine ...
    (tmp_path / "a" / "adapter_model.safetensors").write_bytes(b"retrained" * 500)
    h2 = harness(max_num_batched_tokens=1024)
    req = h2.make_request(tokens, lora_request=a)
    assert h2.connector.get_num_new_matched_tokens(req, 0)[0] == 0
    # ... and in the engine that served the old weights, reloaded under the same name
    req = h.make_request(tokens, lora_request=a)
    assert h.connector.get_num_new_matched_tokens(req, 0)[0] == 0


def test_lora_request_loads_and_dumps_in_the_engine(harness, tmp_path):
    h = harness(max_num_batched_tokens=1024)
    tokens = prompt(900)
    lora = adapter(tmp_path, "a", 1)
    store_request(h, h.make_request(tokens, lora_request=lora), 2)
    h.add_request(tokens, lora_request=lora, max_tokens=2)
    so, _ = h.step()
    assert [span(t) for t in meta(so).loads] == [(0, 2)]
    so, _ = h.step()
    assert [span(t) for t in meta(so).dumps] == [(2, 1)]


def image(identifier: str, offset: int, length: int):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier=identifier,
        mm_position=PlaceholderRange(offset=offset, length=length),
    )


def test_multimodal_requests_hit_the_same_image_at_the_same_place_only(harness):
    h = harness()
    tokens = prompt(1100)
    tokens[300:500] = [5] * 200  # the image's placeholder tokens
    store_request(h, h.make_request(tokens, mm_features=[image("img-a", 300, 200)]), 4)
    hits = {}
    for name, features in [
        ("same", [image("img-a", 300, 200)]),
        ("other image", [image("img-b", 300, 200)]),
        ("no image", None),
    ]:
        req = h.make_request(tokens, mm_features=features)
        hits[name] = h.connector.get_num_new_matched_tokens(req, 0)[0]
    # another image shares the block before its placeholders only
    assert hits == {"same": 1024, "other image": 256, "no image": 256}


def test_prompt_embeddings_are_not_stored(harness):
    import torch

    h = harness()
    req = h.make_request(prompt(600), prompt_embeds=torch.zeros(600, 8))
    assert h.connector.get_num_new_matched_tokens(req, 0) == (0, False)
    assert h.connector.scheduler._state(req).chain == []


def test_after_a_reset_with_the_connectors_no_block_stored_before_is_looked_up(harness):
    # weights updated in place keep the identity computed at start-up: the reset moves this
    # engine's keys to a new epoch, so the prompt stored before is a miss, and what the
    # engine computes now is dumped under the new keys and hits
    h = harness(max_num_batched_tokens=2048)
    tokens = prompt(1100)
    store_blocks(h, tokens, 4)
    assert h.scheduler.reset_prefix_cache(reset_connector=True)
    first = h.add_request(tokens, max_tokens=1)
    so, _ = h.step()
    assert meta(so).loads == [] and meta(so).reset == "forget"
    assert [span(t) for t in meta(so).dumps] == [(0, 4)]
    epoch = h.connector.scheduler.epoch
    assert (
        epoch
        and h.connector.scheduler._state(first).chain[0]
        != block_keys(h.connector.scheduler.layout.chain_namespace(None), tokens, BT)[0]
    )
    drain(h)
    store_request(h, h.make_request(tokens), 4)  # the new epoch's blocks, as the workers write
    h.scheduler.reset_prefix_cache()  # vLLM's own cache only: ours still holds them
    h.add_request(tokens, max_tokens=1)
    so, _ = h.step()
    assert [span(t) for t in meta(so).loads] == [(0, 4)] and meta(so).reset == ""


def test_a_request_computed_before_a_reset_dumps_nothing_after_it(harness):
    h = harness(max_num_batched_tokens=256)
    req = h.add_request(prompt(1100), max_tokens=2)
    so, _ = h.step()
    assert [span(t) for t in meta(so).dumps] == [(0, 1)]
    h.connector.reset_cache()  # as vLLM calls it, with the request running
    dumps = []
    for _ in range(50):
        if req.is_finished():
            break
        so, _ = h.step()
        dumps += meta(so).dumps
    assert req.is_finished() and dumps == []  # its KV may be of the old weights


def test_an_async_load_in_flight_at_a_reset_is_failed_by_the_workers(harness):
    h = harness(load_mode="async")
    tokens = prompt(1100)
    store_blocks(h, tokens, 4)
    req = h.add_request(tokens, max_tokens=1)
    so, _ = h.step()
    assert [span(t) for t in meta(so).loads] == [(0, 4)]
    h.connector.reset_cache()
    so, _ = h.step()
    assert meta(so).reset == "forget" and meta(so).reset_loads == [req.request_id]


@pytest.mark.parametrize("on_reset", ["keep", "remove"])
def test_on_reset_keep_changes_nothing_and_remove_tells_the_workers(tmp_path, on_reset):
    transfer = ucm_transfer(tmp_path / "store", on_reset=on_reset)
    h = SchedulerHarness.create(tmp_path, kv_transfer_config=transfer)
    tokens = prompt(1100)
    store_blocks(h, tokens, 4)
    assert h.scheduler.reset_prefix_cache(reset_connector=True)
    h.add_request(tokens, max_tokens=1)
    so, _ = h.step()
    if on_reset == "keep":
        assert [span(t) for t in meta(so).loads] == [(0, 4)] and meta(so).reset == ""
    else:
        assert meta(so).loads == [] and meta(so).reset == "remove"


def test_each_hit_is_counted_by_the_tier_that_serves_it(tmp_path, shm_dir):
    # vllm:prompt_tokens_cached_by_source: a tiered store's blocks in host memory are host
    # hits, those only on its disk are disk hits
    from ucm.core.config import DramStoreConfig
    from ucm.core.store import SharedMemoryStore

    CacheHitSource = pytest.importorskip("vllm.v1.metrics.cache_hit_source").CacheHitSource

    transfer = ucm_transfer(tmp_path / "disk")
    transfer["kv_connector_extra_config"]["store"] = {
        "kind": "tiered",
        "dram": {"capacity_gb": 0.0625, "path": str(shm_dir)},
        "backing": {"kind": "posix", "path": str(tmp_path / "disk")},
    }
    h = SchedulerHarness.create(tmp_path, kv_transfer_config=transfer)
    tokens = prompt(1100)
    layout = h.connector.scheduler.layout
    keys = scoped_keys(block_keys(layout.chain_namespace(None), tokens, BT)[:4],
                       layout.scope(layout.groups[0], 0))  # fmt: skip
    disk = PosixStore(PosixStoreConfig(path=str(tmp_path / "disk")))
    memory = SharedMemoryStore(DramStoreConfig(capacity_gb=0.0625, path=str(shm_dir)))
    assert all(r.ok for r in disk.wait(disk.dump(keys, [b"x"] * 4)))
    assert all(r.ok for r in memory.wait(memory.dump(keys[:2], [b"x"] * 2)))
    req = h.add_request(tokens, max_tokens=4)
    so, _ = h.step()
    assert [span(t) for t in meta(so).loads] == [(0, 4)]
    assert h.connector.get_external_cache_hit_sources(req, 1024) == {
        CacheHitSource.HOST: 512,
        CacheHitSource.DISK: 512,
    }
    disk.close()
    memory.close()


def test_a_posix_stores_hits_are_disk_hits(harness):
    CacheHitSource = pytest.importorskip("vllm.v1.metrics.cache_hit_source").CacheHitSource

    h = harness(max_num_batched_tokens=2048)
    tokens = prompt(1100)
    store_blocks(h, tokens, 3)
    req = h.add_request(tokens, max_tokens=4)
    h.step()
    assert h.connector.get_external_cache_hit_sources(req, 768) == {CacheHitSource.DISK: 768}


@pytest.mark.parametrize("hook", [True, False], ids=["ucm", "without-the-hook"])
def test_vllm_waits_for_blocks_held_for_dumps_rather_than_preempting(harness, hook):
    # A finished request's blocks come back once its dumps are reported done: with the
    # cache full, vLLM waits a step for them (has_pending_block_frees) instead of
    # preempting a running request, which would recompute it
    h = harness(num_blocks=40, max_num_batched_tokens=2048)
    if not hook:
        h.connector.has_pending_block_frees = lambda: False
    a = h.add_request(prompt(512, seed=1), max_tokens=1)
    h.step()
    assert a.is_finished() and h.connector.has_pending_block_frees() == hook
    assert h.connector.has_pending_push_work()  # an idle engine steps until they are back
    running = [h.add_request(prompt(300, seed=s), max_tokens=300) for s in (2, 3)]
    preempted, pressed, reply = [], 0, None
    for _ in range(2000):
        if all(r.is_finished() for r in running):
            break
        so, _ = h.step(reply)
        reply = None
        preempted += meta(so).preempted
        waiting = [r for r in running if not r.is_finished()
                   and r.request_id not in so.num_scheduled_tokens]  # fmt: skip
        pressed += bool(waiting or meta(so).preempted)
        if pressed == 3:  # the dumps end a few steps after the cache filled up
            reply = KVConnectorOutput(finished_sending={a.request_id})
    assert all(r.is_finished() for r in running) and pressed >= 3
    assert a.request_id not in h.connector.scheduler.held
    assert (preempted == []) == hook, preempted


def test_a_full_prompt_hit_ends_on_a_block_boundary_where_vllm_requires_it():
    from ucm.vllm.scheduler import external_hit

    # a 1024-token prompt stored whole: vLLM computes its last token
    assert external_hit(1024, 1024, 0) == 1023
    # with 0.33's routed-experts output vLLM drops a hit that ends mid-block: it ends on
    # the last 32-token block boundary instead of being lost
    assert external_hit(1024, 1024, 0, aligned_to=32) == 992
    assert external_hit(768, 1100, 256, aligned_to=32) == 512  # a prefix hit: unchanged
    assert external_hit(256, 1100, 256) == 0 and external_hit(1024, 20, 0, aligned_to=32) == 0
    # vLLM CPU has no routed-experts output (it needs the V2 model runner): the switch is
    # read from the config as 0.33 holds it
    from types import SimpleNamespace as NS

    from ucm.vllm.connector import _hits_aligned_to

    on = NS(aux_output_config=NS(enable_return_routed_experts=True), cache_config=NS(block_size=16))
    assert _hits_aligned_to(on) == 16
    assert _hits_aligned_to(NS(cache_config=NS(block_size=16))) == 1


def test_blocks_held_past_the_bound_neither_stall_vllm_nor_keep_it_stepping(harness):
    # a store that never ends its writes: after HOLD_S vLLM preempts and idles as usual
    from ucm.vllm.scheduler import HOLD_S

    h = harness(max_num_batched_tokens=1024)
    a = h.add_request(prompt(300), max_tokens=1)
    h.step()
    assert a.is_finished() and h.connector.has_pending_block_frees()
    h.connector.scheduler.held[a.request_id] -= HOLD_S + 1
    assert not h.connector.has_pending_block_frees()
    assert not h.connector.has_pending_push_work()
