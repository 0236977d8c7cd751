"""KV events for routers: the connector's ``BlockStored`` events, counted across ranks, and
seen by a ZMQ subscriber of ``vllm serve --kv-events-config`` as a router sees them."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

pytest.importorskip("vllm")

from ucm.vllm.events import StoredBlocks, StoredReport, medium_of  # noqa: E402
from vllm.distributed.kv_events import BlockStored  # noqa: E402


def stored(i: int) -> BlockStored:
    return BlockStored(
        block_hashes=[i], parent_block_hash=None, token_ids=[i], block_size=1, lora_id=None,
        medium="STORAGE", lora_name=None,
    )  # fmt: skip


def test_a_block_is_announced_once_every_rank_that_writes_it_stored_it():
    # group 0: each of two ranks writes its own shard; group 1 (MLA): one rank a block
    blocks = StoredBlocks({0: 2, 1: 1})
    blocks.expect((0, b"a"), stored(1))
    blocks.expect((0, b"a"), stored(99))  # planned twice: announced once
    blocks.expect((1, b"a"), stored(2))
    blocks.expect((2, b"a"), stored(3))  # a group without events (window tails)
    blocks.report([(0, b"a"), (1, b"a")])
    assert blocks.take() == [stored(2)]
    blocks.report([(0, b"b")])  # never planned (a dump of before a restart)
    assert blocks.take() == []
    blocks.report([(0, b"a")])
    assert blocks.take() == [stored(1)] and blocks.take() == []
    blocks.report([(0, b"a")])  # a late report of a block already announced
    assert blocks.take() == [] and blocks.pending == 0


def test_blocks_whose_reports_never_come_are_forgotten_oldest_first():
    blocks = StoredBlocks({0: 2}, limit=3)
    for i in range(5):
        blocks.expect((0, bytes([i])), stored(i))
    assert blocks.pending == 3
    blocks.report([(0, bytes([0]))] * 2 + [(0, bytes([4]))] * 2)
    assert blocks.take() == [stored(4)]


def test_a_report_is_truthy_empty_and_gathers_across_ranks_as_vllm_gathers_them():
    first, second = StoredReport([(0, b"a")]), StoredReport()
    assert first and second  # vLLM counts a rank's report only when it is truthy
    first.add_events(second.get_all_events())
    first.increment_workers(1)
    assert first.aggregate().get_all_events() == [(0, b"a")]
    assert first.get_number_of_workers() == 2


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


# -- against vllm serve --


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Subscriber:
    """A router's view: a ZMQ SUB socket on loopback (the server's publisher connects to
    it), decoding each batch of events as vLLM encodes it."""

    def __init__(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.port = free_port()
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.bind(f"tcp://127.0.0.1:{self.port}")
        self.socket.setsockopt_string(zmq.SUBSCRIBE, "")
        self.socket.setsockopt(zmq.RCVTIMEO, 200)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events: list = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import zmq

        while not self.done.is_set():
            try:
                _topic, _seq, payload = self.socket.recv_multipart()
            except zmq.Again:
                continue
            self.events += self.decoder.decode(payload).events

    def ucm(self) -> list:
        return [e for e in self.events if getattr(e, "ownership", None) == "ucm"]

    def wait_for(self, count: int, timeout: float = 30) -> list:
        deadline = time.monotonic() + timeout
        while len(self.ucm()) < count and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.ucm()

    def close(self) -> None:
        self.done.set()
        self.thread.join(5)
        self.socket.close(0)


@pytest.mark.engine
def test_a_router_subscribed_to_vllm_serve_sees_each_stored_block_once(tiny_model, tmp_path):
    from ucm.lab.testing.vllm.engine import shared_prefix_prompts
    from ucm.lab.testing.vllm.models import make_word_tokenizer
    from ucm.lab.testing.vllm.serve import Server, complete

    # 1100-token prompts sharing 1000: four 256-token blocks each, the first three shared
    prompts = shared_prefix_prompts(2, prefix=1000, tail=100, seed=8)
    subscriber = Subscriber()
    config = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://127.0.0.1:{subscriber.port}"}  # fmt: skip
    server = Server(
        tiny_model,
        str(make_word_tokenizer(tmp_path / "tokenizer")),
        tmp_path / "serve.log",
        store={"kind": "posix", "path": str(tmp_path / "store")},
        args=["--kv-events-config", json.dumps(config)],
    ).wait_ready()
    try:
        client = server.client()
        complete(client, prompts[0], max_tokens=2)
        first = subscriber.wait_for(4)
        complete(client, prompts[1], max_tokens=2)
        both = subscriber.wait_for(5)
        time.sleep(2)  # nothing more comes: a block is announced once
        both = subscriber.ucm()
    finally:
        server.stop()
        subscriber.close()
    assert len(first) == 4 and len(both) == 5
    for event in both:
        assert event.medium == "STORAGE" and event.block_size == 32 and event.group_idx == 0
        assert len(event.block_hashes) == 8 and len(event.token_ids) == 256
    # named as vLLM names its own blocks: a router matches them to what engines hold
    own = {h for e in subscriber.events if e.medium == "GPU" for h in e.block_hashes}
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
