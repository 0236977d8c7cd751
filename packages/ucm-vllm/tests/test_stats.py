"""The connector's metrics without an engine: how the workers' and the scheduler's data
combine, and the store's gauges sampled from real stores."""

from __future__ import annotations

import time

import pytest
from ucm.core.config import PosixStoreConfig
from ucm.core.store import PosixStore
from ucm.core.store.base import StoreUsage
from ucm.vllm.counters import CAUSES, FIELDS, Counters
from ucm.vllm.gauges import GaugeSampler, sample
from ucm.vllm.stores import ConnectorStores

pytest.importorskip("vllm")


def test_counters_sum_across_sides_and_gauges_take_the_newest():
    from ucm.vllm.stats import UCMStats

    worker_a, worker_b = Counters(), Counters()
    worker_a.add(loaded_blocks=3)
    worker_a.add_cause("load_errors", "corrupt")
    worker_b.add(loaded_blocks=2, evicted_blocks=5)
    worker_b.add_cause("load_errors", "corrupt", 2)
    total = UCMStats(data=worker_a.take()).aggregate(UCMStats(data=worker_b.take()))
    total.aggregate(UCMStats(data={"store_up": 1, "store_bytes": 10}))
    total.aggregate(UCMStats(data={"store_up": 0, "store_bytes": 12}))
    assert total.data["loaded_blocks"] == 5 and total.data["evicted_blocks"] == 5
    assert total.data["load_errors:corrupt"] == 3
    assert total.data["store_up"] == 0 and total.data["store_bytes"] == 12
    logged = total.reduce()  # what vLLM logs: what moved, and the gauges
    assert logged == {
        "loaded_blocks": 5, "evicted_blocks": 5, "load_errors:corrupt": 3,
        "store_up": 0, "store_bytes": 12,
    }  # fmt: skip
    assert UCMStats(data={}).is_empty() and not UCMStats(data={"store_up": 1}).is_empty()


def test_every_cause_is_a_field():
    for name, causes in CAUSES.items():
        assert name not in FIELDS
        assert all(f"{name}:{cause}" in FIELDS for cause in causes)


def test_gauges_of_a_posix_store_with_blocks(tmp_path):
    store = PosixStore(PosixStoreConfig(path=str(tmp_path), capacity_gb=1))
    store.wait(store.dump([bytes(16), b"\1" * 16], [b"a" * 1000, b"b" * 1000]))
    values = sample(ConnectorStores(store, None))
    assert values["store_up"] == 1 and values["store_blocks"] == 2
    assert values["store_bytes"] >= 2000 and values["store_capacity_bytes"] == 2**30
    store.close()


class Unreachable(PosixStore):
    """A store whose link is down, and which knows only what it put (as Mooncake's)."""

    @property
    def reachable(self) -> bool:
        return False

    def usage(self) -> StoreUsage:
        return StoreUsage(1, 100, None, whole_store=False)


def test_a_store_down_or_without_totals_reports_what_it_knows(tmp_path):
    assert sample(None) == {"store_up": 0}  # no store: serving without one
    down = Unreachable(PosixStoreConfig(path=str(tmp_path / "a"), capacity_gb=None))
    assert sample(ConnectorStores(down, None)) == {"store_up": 0}
    # hybrid: both stores count, and one down is the store down
    up = PosixStore(PosixStoreConfig(path=str(tmp_path / "b"), capacity_gb=1))
    values = sample(ConnectorStores(up, down))
    assert values == {"store_up": 0}, values  # no total, no capacity: neither is whole
    both = sample(ConnectorStores(up, up))
    assert both["store_up"] == 1 and both["store_capacity_bytes"] == 2 * 2**30
    down.close(), up.close()


def test_the_sampler_hands_each_sample_out_once():
    sampler = GaugeSampler(None, interval_s=60)
    deadline = time.monotonic() + 5
    while (first := sampler.take()) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert first == {"store_up": 0}
    assert sampler.take() is None  # taken: none until the next sample, a minute on
    sampler.close()
