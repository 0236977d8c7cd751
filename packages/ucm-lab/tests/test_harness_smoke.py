"""Smoke tests for the standalone vLLM scheduler harness (needs vllm installed)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from ucm.lab.testing.vllm.scheduler import (  # noqa: E402
    FakeHitConnector,
    SchedulerHarness,
    hybrid_kv_cache_config,
)
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402


@pytest.fixture(autouse=True)
def _reset_fake():
    FakeHitConnector.reset()
    yield
    FakeHitConnector.reset()


def _fake_cfg(**extra):
    return {
        "kv_connector": "FakeHitConnector",
        "kv_connector_module_path": FakeHitConnector.__module__,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def test_no_connector_local_prefix_hit(tmp_path):
    h = SchedulerHarness.create(tmp_path)
    r0 = h.add_request(list(range(100)), max_tokens=3)
    so, _ = h.step()
    assert so.num_scheduled_tokens == {r0.request_id: 100}
    assert so.scheduled_new_reqs[0].block_ids == ([1, 2, 3, 4],)
    assert len(r0.block_hashes) == 3  # only full 32-token blocks are hashed
    h.run_until_idle()
    out = h.finished_outputs()[r0.request_id]
    assert out.finish_reason is not None
    h.add_request(list(range(100)) + [5], max_tokens=2)
    so, _ = h.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 96  # local hit, 3 blocks


def test_chunked_prefill(tmp_path):
    h = SchedulerHarness.create(tmp_path, max_num_batched_tokens=256)
    r = h.add_request(list(range(600)), max_tokens=2)
    steps = h.run_until_idle()
    sizes = [s.num_scheduled_tokens.get(r.request_id, 0) for s in steps]
    assert sizes[:3] == [256, 256, 88]
    assert sum(sizes) == 600 + 1  # prefill plus one decode step


def test_example_connector_loads(tmp_path):
    cfg = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "kv")},
    }
    # ExampleConnector lacks SupportsHMA, so the hybrid manager must be off.
    h = SchedulerHarness.create(
        tmp_path, kv_transfer_config=cfg, disable_hybrid_kv_cache_manager=True
    )
    assert type(h.connector).__name__ == "ExampleConnector"
    r = h.add_request(list(range(70)), max_tokens=2)
    so, _ = h.step()
    assert so.kv_connector_metadata is not None
    assert len(so.kv_connector_metadata.requests) == 1  # a store planned
    h.run_until_idle()
    assert r.request_id in h.finished_outputs()


def test_fake_connector_sync_external_hit(tmp_path):
    h = SchedulerHarness.create(tmp_path, kv_transfer_config=_fake_cfg())
    FakeHitConnector.hits["a"] = 64
    h.add_request(list(range(100)), request_id="a", max_tokens=2)
    so, _ = h.step()
    new = so.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 64
    assert so.num_scheduled_tokens == {"a": 36}
    assert so.has_sync_kv_loads
    assert so.kv_connector_metadata.loads["a"][1] == 64
    h.run_until_idle()
    names = [c[0] for c in FakeHitConnector.calls]
    assert names.count("request_finished_all_groups") == 1


def test_fake_connector_async_load_then_finish(tmp_path):
    h = SchedulerHarness.create(tmp_path, kv_transfer_config=_fake_cfg())
    FakeHitConnector.hits["b"] = 64
    FakeHitConnector.load_async = True
    h.add_request(list(range(100)), request_id="b", max_tokens=2)
    so, _ = h.step()
    assert so.num_scheduled_tokens == {}  # waiting for remote KV
    so, _ = h.step(KVConnectorOutput(finished_recving={"b"}))
    so, _ = h.step()
    assert so.num_scheduled_tokens == {"b": 36}
    h.run_until_idle()
    assert "b" in h.finished_outputs()


def test_fake_connector_async_load_failure_recompute(tmp_path):
    cfg = _fake_cfg()
    cfg["kv_load_failure_policy"] = "recompute"
    h = SchedulerHarness.create(tmp_path, kv_transfer_config=cfg)
    FakeHitConnector.hits["c"] = 64
    FakeHitConnector.load_async = True
    h.add_request(list(range(100)), request_id="c", max_tokens=2)
    h.step()
    FakeHitConnector.hits["c"] = 0  # the retry lookup finds nothing
    h.step(KVConnectorOutput(finished_recving={"c"}, failed_recving={"c"}))
    so, _ = h.step()
    assert so.num_scheduled_tokens == {"c": 100}  # recomputed from scratch
    h.run_until_idle()
    assert "c" in h.finished_outputs()


def test_hybrid_groups_different_block_sizes(tmp_path):
    kvc = hybrid_kv_cache_config(num_blocks=512, full_block_size=32, sliding_block_sizes=(64,))
    h = SchedulerHarness.create(
        tmp_path, hybrid=True, kv_cache_config=kvc, kv_transfer_config=_fake_cfg()
    )
    assert h.hash_block_size == 32 and h.scheduler.block_size == 64
    r = h.add_request(list(range(300)), max_tokens=2)
    steps = h.run_until_idle()
    sw_ids, full_ids = steps[0].scheduled_new_reqs[0].block_ids
    assert len(sw_ids) == 4 and len(full_ids) == 8  # 256 tokens: 64- and 32-token blocks
    fin = [c[1] for c in FakeHitConnector.calls if c[0] == "request_finished_all_groups"]
    ((rid, block_ids),) = fin
    assert rid == r.request_id and len(block_ids) == 2
    assert 0 in block_ids[0]  # sliding group: out-of-window blocks are null (0)
    assert 0 not in block_ids[1]
