"""KV events for routers: the connector's ``BlockStored`` events, counted across ranks, its
``BlockRemoved`` events for blocks found corrupt, and both seen by a ZMQ subscriber of
``vllm serve --kv-events-config`` as a router sees them."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("vllm")

from ucm.vllm.events import StoredBlocks, StoredReport, medium_of  # noqa: E402
from ucm.vllm.plan import DROPPED, STORED  # noqa: E402
from ucm.vllm.reports import RankReports, dropped_name  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402


def stored(i: int) -> BlockStored:
    return BlockStored(
        block_hashes=[i], parent_block_hash=None, token_ids=[i], block_size=1, lora_id=None,
        medium="STORAGE", lora_name=None,
    )  # fmt: skip


def removed(i: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=[i], medium="STORAGE", ownership="ucm")


def test_a_block_is_announced_once_every_rank_that_writes_it_stored_it():
    # group 0: each of two ranks writes its own shard; group 1 (MLA): one rank a block
    blocks = StoredBlocks({0: 2, 1: 1})
    blocks.expect((0, b"a"), stored(1), removed(1))
    blocks.expect((0, b"a"), stored(99), removed(99))  # planned twice: announced once
    blocks.expect((1, b"a"), stored(2), removed(2))
    blocks.expect((2, b"a"), stored(3), removed(3))  # a group without events (window tails)
    blocks.report([(STORED, 0, b"a"), (STORED, 1, b"a")])
    assert blocks.take() == [stored(2)]
    blocks.report([(STORED, 0, b"b")])  # never planned (a dump of before a restart)
    assert blocks.take() == []
    blocks.report([(STORED, 0, b"a")])
    assert blocks.take() == [stored(1)] and blocks.take() == []
    blocks.report([(STORED, 0, b"a")])  # a late report of a block already announced
    assert blocks.take() == [] and blocks.pending == 0


def test_a_stored_block_later_evicted_is_announced_removed():
    blocks = StoredBlocks({0: 2})
    blocks.expect((0, b"a"), stored(1), removed(1))
    blocks.report([(DROPPED, 0, b"a")])  # not yet announced stored: nothing to take back
    assert blocks.take() == []
    blocks.report([(STORED, 0, b"a")] * 2)
    assert blocks.take() == [stored(1)]
    blocks.report([(DROPPED, 0, b"a")])  # one rank's store evicted its shard
    assert blocks.take() == [removed(1)]


def test_an_eviction_during_the_blocks_own_dump_follows_its_stored_report():
    # a dump larger than the store's room evicts the oldest blocks of its own batch
    reports = RankReports()
    a, b, c = (dropped_name(0, k) for k in (b"a", b"b", b"c"))
    reports.dumping([a, b])
    reports.dropped([a])  # evicted while the batch is written
    assert reports.take() == []
    reports.dumped([a, b], [True, True])
    assert reports.take() == [(STORED, 0, b"a"), a, (STORED, 0, b"b")]
    reports.dropped([b])  # evicted later
    assert reports.take() == [b]
    reports.dumping([c])
    reports.dropped([c])
    reports.dumped([c], [False])  # never stored: nothing to take back
    assert reports.take() == []


def test_a_block_one_rank_found_corrupt_is_announced_removed_once():
    blocks = StoredBlocks({0: 2})
    blocks.removable((0, b"a"), removed(7))  # a load of it is planned
    blocks.report([(DROPPED, 0, b"b")])  # never loaded here: nothing names it
    assert blocks.take() == []
    blocks.report([(DROPPED, 0, b"a"), (DROPPED, 0, b"a")])  # both ranks found it bad
    assert blocks.take() == [removed(7)]
    blocks.report([(DROPPED, 0, b"a")])
    assert blocks.take() == []


def test_blocks_whose_reports_never_come_are_forgotten_oldest_first():
    blocks = StoredBlocks({0: 2}, limit=3)
    for i in range(5):
        blocks.expect((0, bytes([i])), stored(i), removed(i))
    assert blocks.pending == 3
    blocks.report([(STORED, 0, bytes([0]))] * 2 + [(STORED, 0, bytes([4]))] * 2)
    assert blocks.take() == [stored(4)]


def test_reports_gather_across_ranks_as_vllm_aggregates_worker_metadata():
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    first, second = StoredReport([(STORED, 0, b"a")]), StoredReport([(DROPPED, 0, b"b")])
    assert first and not StoredReport()  # an empty one is left out
    outputs = [
        ModelRunnerOutput(req_ids=[], req_id_to_index={},
                          kv_connector_output=KVConnectorOutput(kv_connector_worker_meta=m))
        for m in (first, StoredReport(), second)
    ]  # fmt: skip
    gathered = KVOutputAggregator(expected_finished_count=3).aggregate(outputs)
    meta = gathered.kv_connector_output.kv_connector_worker_meta
    assert meta.reports == [(STORED, 0, b"a"), (DROPPED, 0, b"b")]


def test_the_medium_names_the_tier_a_block_lands_in_first():
    from ucm.core.config import parse_store_config

    def medium(store):
        return medium_of(parse_store_config(store))

    assert medium({"kind": "dram"}) == "CPU"
    assert medium({"kind": "posix", "path": "/x"}) == "STORAGE"
    assert medium({"kind": "mooncake", "master": "127.0.0.1:1"}) == "STORAGE"
    tiered = {
        "kind": "tiered",
        "dram": {"kind": "dram"},
        "backing": {"kind": "posix", "path": "/x"},
    }
    assert medium(tiered) == "CPU"
    on_disk = {"kind": "tiered", "local": {"path": "/nvme"}, "backing": {"kind": "mooncake"}}
    assert medium(on_disk) == "STORAGE"  # the local tier is a disk


# -- against vllm serve --


@pytest.mark.engine
def test_a_router_subscribed_to_vllm_serve_sees_each_stored_block_once(tiny_model, tmp_path):
    from ucm.lab.testing.vllm.engine import shared_prefix_prompts
    from ucm.lab.testing.vllm.events import Subscriber
    from ucm.lab.testing.vllm.models import make_word_tokenizer
    from ucm.lab.testing.vllm.serve import Server, complete

    # 1100-token prompts sharing 1000: four 256-token blocks each, the first three shared;
    # then one of eight blocks of its own, through a store that holds six
    prompts = shared_prefix_prompts(2, prefix=1000, tail=100, seed=8)
    longer = shared_prefix_prompts(1, prefix=2048, tail=52, seed=9)[0]
    block_file = 4096 + 2 * 2 * 256 * 2 * 64 * 2  # header; 2 layers of K and V, bf16
    subscriber = Subscriber()
    config = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://127.0.0.1:{subscriber.port}"}  # fmt: skip
    server = Server(
        tiny_model,
        str(make_word_tokenizer(tmp_path / "tokenizer")),
        tmp_path / "serve.log",
        store={
            "kind": "posix",
            "path": str(tmp_path / "store"),
            "capacity_gb": 6.5 * block_file / (1 << 30),
        },  # fmt: skip
        args=["--kv-events-config", json.dumps(config)],
        env={"VLLM_SERVER_DEV_MODE": "1"},  # for /reset_prefix_cache
    ).wait_ready()
    try:
        client = server.client()
        complete(client, prompts[0], max_tokens=2)
        first = subscriber.wait_for(4)
        complete(client, prompts[1], max_tokens=2)
        both = subscriber.wait_for(5)
        time.sleep(2)  # nothing more comes: a block is announced once
        both = subscriber.ucm()
        # every stored block damaged: the next load of the first prompt finds its four
        # blocks corrupt, drops them (BlockRemoved), recomputes and stores them again
        for block in (tmp_path / "store" / "blocks").rglob("*"):
            if block.is_file():
                data = bytearray(block.read_bytes())
                data[-100] ^= 0xFF
                block.write_bytes(bytes(data))
        server.reset_prefix_cache()
        complete(client, prompts[0], max_tokens=2)
        removed = subscriber.wait_for(4, BlockRemoved)
        again = subscriber.wait_for(9)
        # eight new blocks in a store of six: this engine's dumps evict, and say so
        complete(client, longer, max_tokens=2)
        subscriber.wait_for(17)
        subscriber.wait_for(4 + 7, BlockRemoved)
        time.sleep(2)
        # one more step, storing nothing, reports what a late pass evicted meanwhile
        complete(client, shared_prefix_prompts(1, prefix=40, tail=10, seed=10)[0], max_tokens=2)
        time.sleep(1)
        left = [b for b in (tmp_path / "store" / "blocks").rglob("*") if b.is_file()]
    finally:
        server.stop()
        subscriber.close()
    assert len(first) == 4 and len(both) == 5
    for event in both:
        assert event.medium == "STORAGE" and event.block_size == 32 and event.group_idx == 0
        assert len(event.block_hashes) == 8 and len(event.token_ids) == 256
    # named as vLLM names its own blocks: a router matches them to what engines hold
    own = {
        h for e in subscriber.events if getattr(e, "medium", None) == "GPU" for h in e.block_hashes
    }
    assert {h for e in both for h in e.block_hashes} <= own
    # a chain: each block's parent is the last hash of the block before it (the events
    # come as the dumps finish, in any order)
    blocks = {tuple(e.token_ids): e for e in both}
    chain = [blocks[tuple(prompts[0][i * 256 : (i + 1) * 256])] for i in range(4)]
    assert chain[0].parent_block_hash is None
    for before, after in zip(chain, chain[1:]):
        assert after.parent_block_hash == before.block_hashes[-1]
    new = blocks[tuple(prompts[1][768:1024])]
    assert new.parent_block_hash == chain[2].block_hashes[-1]
    # the corrupt blocks, named as they were stored, went; then they were stored again
    assert len(removed) == 4 and all(e.medium == "STORAGE" for e in removed)
    assert sorted(e.block_hashes for e in removed) == sorted(e.block_hashes for e in chain)
    assert len(again) == 9
    assert sorted(e.block_hashes for e in again[5:]) == sorted(e.block_hashes for e in chain)
    # A router that adds what is stored and takes away what is removed holds what the
    # store holds: evicted blocks were announced removed, and only those.
    view: set[tuple[int, ...]] = set()
    for event in subscriber.ucm(BlockStored | BlockRemoved):
        if isinstance(event, BlockStored):
            view.add(tuple(event.block_hashes))
        else:
            assert tuple(event.block_hashes) in view  # only what was announced stored
            view.remove(tuple(event.block_hashes))
    evicted = len(subscriber.ucm(BlockRemoved)) - 4
    print(f"{len(subscriber.ucm())} stored, {evicted} evicted, {len(left)} left in the store")
    assert evicted >= 7 and len(view) == len(left) <= 6
