"""Hybrid models in a real vLLM Scheduler: a KV-cache config shaped like seed 001's
DeepSeek-V4 run (one full-attention group of 256-token blocks, window groups of 64, 64, 4 and
8-token blocks with their compression ratios), driven step by step.  The planned loads and
dumps must be exactly what the rules of ucm.core.hybrid say."""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from ucm.core.config import PosixStoreConfig  # noqa: E402
from ucm.core.keys import block_keys, scoped_keys  # noqa: E402
from ucm.core.store import PosixStore  # noqa: E402
from ucm.lab.testing.vllm.models import tiny_llama_config  # noqa: E402
from ucm.lab.testing.vllm.scheduler import SchedulerHarness, layer_name, ucm_transfer  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

T = 256  # store block tokens: the full-attention group's block size
# (block size, window, compression ratio) of the window groups, in group order 1..4
WINDOWS = [(64, 128, 1), (64, 132, 4), (4, 8, 4), (8, 128, 128)]
RATIOS = [1, 1, 1] + [r for _, _, r in WINDOWS[1:]]  # per layer: 0-1 full, 2-5 windows


def dsv4_like_config(num_blocks: int = 4096) -> KVCacheConfig:
    spec = dict(num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    full = KVCacheGroupSpec([layer_name(0), layer_name(1)], FullAttentionSpec(block_size=T, **spec))
    windows = [
        KVCacheGroupSpec(
            [layer_name(2 + k)], SlidingWindowSpec(block_size=bs, sliding_window=w, **spec)
        )
        for k, (bs, w, _) in enumerate(WINDOWS)
    ]
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[full, *windows]
    )


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


@pytest.fixture
def harness(tmp_path):
    def make(block_wise: bool = True, **kw):
        model = tmp_path / "harness_llama_hybrid"
        model.mkdir(exist_ok=True)
        cfg = tiny_llama_config()
        cfg.update(num_hidden_layers=6, compress_ratios=RATIOS)
        (model / "config.json").write_text(json.dumps(cfg))
        transfer = ucm_transfer(tmp_path / "store", wa_dump_block_wise=block_wise)
        return SchedulerHarness.create(
            tmp_path,
            hybrid=True,
            kv_cache_config=dsv4_like_config(),
            kv_transfer_config=transfer,
            block_size=4,
            max_model_len=4096,
            **kw,
        )

    return make


def meta(so):
    return so.kv_connector_metadata


def planned(transfers) -> dict[int, list[int]]:
    """group -> chain keys of the planned blocks."""
    out: dict[int, list[int]] = {}
    for t in transfers:
        for item in t.items:
            out.setdefault(item.group, []).append(item.key)
    return out


def test_layout_reads_groups_and_ratios_from_vllm(harness):
    h = harness()
    layout = h.connector.scheduler.layout
    assert [g.kind for g in layout.groups] == ["full"] + ["window"] * 4
    assert layout.hybrid.tail_blocks == (None, 2, 2, 1, 0)
    assert [g.compress_ratio for g in layout.groups] == [1, 1, 4, 4, 128]


@pytest.mark.parametrize("block_wise", [True, False])
def test_chunked_prefill_dumps_full_blocks_and_window_tails(harness, block_wise):
    h = harness(block_wise=block_wise, max_num_batched_tokens=512)
    req = h.add_request(prompt(1100), max_tokens=1)
    steps, tables = [], []
    for _ in range(3):
        so, _ = h.step()
        steps.append(meta(so).dumps)
        # the block table as the step saw it: vLLM frees window blocks in later steps
        tables.append(h.scheduler.kv_cache_manager.get_block_ids(req.request_id))
    # step 1 computes tokens 0..511 (boundaries 1, 2), step 2 512..1023 (3, 4), step 3 the rest
    tails = [[0, 1], [2, 3]] if block_wise else [[1], [3]]  # chain keys b - 1
    for step, table, keys, fa in zip(steps, tables, tails, [[0, 1], [2, 3]]):
        assert planned(step) == {0: fa, 1: keys, 2: keys, 3: keys}  # group 4 needs no tail
        for item in step[0].items:
            b = item.key + 1
            if item.group == 0:
                assert item.block_ids == [table[0][item.key]]
            else:
                bs, w, r = WINDOWS[item.group - 1]
                n = -(-(w if r == 1 else w - r) // bs)
                end = b * T // bs
                assert item.block_ids == list(table[item.group][end - n : end])
                assert 0 not in item.block_ids  # the tail is still held by vLLM
    assert steps[2] == []


def store_hit(h, tokens, full: int, tails: list[int]) -> None:
    """Store full-attention blocks 0..full-1 and window tails at the given boundaries."""
    layout = h.connector.scheduler.layout
    chain = block_keys(layout.chain_namespace(None), tokens, T)
    root = h.connector.config.store.path
    fa = PosixStore(PosixStoreConfig(path=f"{root}/fa"))
    wa = PosixStore(PosixStoreConfig(path=f"{root}/wa"))
    for group in layout.stored_groups:
        if group.kind == "full":
            store, keys = fa, chain[:full]
        else:
            store, keys = wa, [chain[b - 1] for b in tails]
        keys = scoped_keys(keys, layout.scope(group, 0))
        assert all(r.ok for r in store.wait(store.dump(keys, [b"x"] * len(keys))))
    fa.close()
    wa.close()


def test_hit_is_the_largest_boundary_every_group_agrees_on(harness):
    h = harness(max_num_batched_tokens=2048)
    tokens = prompt(1100)
    store_hit(h, tokens, full=4, tails=[2, 3])  # no tail at boundary 4
    req = h.add_request(tokens, max_tokens=1)
    so, _ = h.step()
    # several KV-cache groups: loaded asynchronously (failures are reported per request)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (load,) = meta(so).loads
    # every full-attention block of the hit, and only the tail at boundary 3
    assert planned([load]) == {0: [0, 1, 2], 1: [2], 2: [2], 3: [2]}
    table = h.scheduler.kv_cache_manager.get_block_ids(req.request_id)
    for item in load.items:
        if item.group:
            bs = WINDOWS[item.group - 1][0]
            n = {1: 2, 2: 2, 3: 1}[item.group]
            assert item.block_ids == list(table[item.group][768 // bs - n : 768 // bs])
            assert 0 not in item.block_ids
    h.step(KVConnectorOutput(finished_recving={req.request_id}))
    assert req.num_computed_tokens == 768
    so, _ = h.step()
    # dumps resume at the hit: block 3 and the tail at boundary 4 that was missing
    assert planned(meta(so).dumps) == {0: [3], 1: [3], 2: [3], 3: [3]}


def test_no_hit_without_the_window_tails(harness):
    h = harness()
    tokens = prompt(1100)
    store_hit(h, tokens, full=4, tails=[])
    req = h.add_request(tokens, max_tokens=1)
    so, _ = h.step()
    assert meta(so).loads == []
    assert req.num_computed_tokens == so.num_scheduled_tokens[req.request_id]  # all computed


def test_failed_hybrid_load_recomputes_the_request(harness):
    h = harness(max_num_batched_tokens=2048)
    tokens = prompt(1100)
    store_hit(h, tokens, full=4, tails=[4])
    req = h.add_request(tokens, max_tokens=1)
    h.step()
    h.step(KVConnectorOutput(finished_recving={req.request_id}, failed_recving={req.request_id}))
    so, _ = h.step()
    assert so.num_scheduled_tokens[req.request_id] == 1100  # recomputed from the start
    # and its blocks are dumped again from the start
    assert planned(meta(so).dumps)[0] == [0, 1, 2, 3]


def test_dumps_planned_at_finish_skip_window_blocks_vllm_let_go(harness, monkeypatch):
    # Dumps held back through a request's last steps (as a sync load's step holds them) are
    # planned in request_finished, from the block table vLLM passes then: window blocks it
    # has already let go of (remove_skipped_blocks) are the null block there.  Their tails
    # must not be stored: the payload would be the null block's bytes under a valid key.
    h = harness(max_num_batched_tokens=512)
    side = h.connector.scheduler
    planner = side.build_connector_meta

    def hold_dumps(scheduler_output):
        for state in side.requests.values():
            state.load_step = True
        return planner(scheduler_output)

    monkeypatch.setattr(side, "build_connector_meta", hold_dumps)
    h.add_request(prompt(1100), max_tokens=1)
    for _ in range(3):
        so, _ = h.step()
        assert meta(so).dumps == []
    so, _ = h.step()
    (finished,) = meta(so).dumps
    items = finished.items
    assert all(0 not in item.block_ids for item in items)
    assert planned([finished])[0] == [0, 1, 2, 3]  # every full-attention block
